"""`auto` precision: bfloat16 where this machine computes it natively, float32 where it does not.

bfloat16 halves the memory traffic of a small model, which is most of a decode step's cost, but only hardware
with bfloat16 arithmetic profits: an x86 CPU with AVX512-BF16 or AMX, an Arm CPU with the BF16 extension, a
CUDA GPU of compute capability 8.0 or later. Elsewhere every bfloat16 product is emulated: on an AVX2-only AMD
EPYC (2026-12-07) vLLM generated 35 tokens/s in bfloat16 against ~230 in float32, and a draft's training step
under bfloat16 autocast took 28x float32's (BENCHMARKS.md sections 3 and 12). `target.dtype: auto` and
`train.precision: auto` are resolved once, when the config is loaded, so the stages, the config hash and the
run folder's config.yaml all see the precision that ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distill.config import Config

# /proc/cpuinfo names of native bfloat16 arithmetic: x86 `flags`, aarch64 `Features`.
X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
ARM_BF16_FEATURE = "bf16"
MIN_BF16_COMPUTE_CAPABILITY = (8, 0)  # Ampere and later

_notes: list[str] = []


def cpu_features(cpuinfo: str) -> set[str]:
    """The feature words of /proc/cpuinfo (`flags` on x86, `Features` on Arm), from its first processor."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_has_native_bf16(cpuinfo: str) -> bool:
    features = cpu_features(cpuinfo)
    return bool(features & X86_BF16_FLAGS) or ARM_BF16_FEATURE in features


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _capabilities_nvml() -> list[tuple[int, int]] | None:
    from distill.evaluate.hardware import nvml_each_visible

    return nvml_each_visible(lambda nvml, handle: tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle)))


def _capabilities_smi() -> list[tuple[int, int]] | None:
    from distill.evaluate.hardware import nvidia_smi_visible

    rows = nvidia_smi_visible("compute_cap")
    if rows is None:
        return None
    found = []
    for parts in rows:
        major, _, minor = (parts[0] if parts else "").partition(".")
        if major.isdigit() and minor.isdigit():
            found.append((int(major), int(minor)))
    return found


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capability of each visible NVIDIA GPU, read without initialising CUDA (NVML or nvidia-smi), so
    the vLLM worker started later has the whole GPU; [] when there is none."""
    for probe in (_capabilities_nvml, _capabilities_smi):
        found = probe()
        if found:
            return found
    return []


def native_bf16(*, use_gpu: bool = True) -> tuple[bool, str]:
    """Whether the device the stages will use computes bfloat16 natively, and what decided it (for the log):
    the GPUs when one is visible and `use_gpu`, else the CPU."""
    caps = gpu_compute_capabilities() if use_gpu else []
    if caps:
        ok = all(c >= MIN_BF16_COMPUTE_CAPABILITY for c in caps)
        shown = ", ".join(f"{a}.{b}" for a, b in caps)
        return ok, f"GPU compute capability {shown} {'>=' if ok else '<'} 8.0"
    if cpu_has_native_bf16(_read_cpuinfo()):
        return True, "this CPU computes bfloat16 natively (AVX512-BF16, AMX or Arm BF16)"
    return (
        False,
        "this CPU has no AVX512-BF16, AMX or Arm BF16: bfloat16 would be emulated, many times slower",
    )


def resolve_auto(cfg: Config) -> list[str]:
    """Replace `target.dtype: auto` and `train.precision: auto` by what this machine runs best; one note per
    key resolved. Called by `load_config`; `notes()` returns them for the CLI to log once logging is set up."""
    out = []
    if cfg.target.dtype == "auto":
        ok, why = native_bf16()
        cfg.target.dtype = "bfloat16" if ok else "float32"
        out.append(f"target.dtype: auto -> {cfg.target.dtype}; {why}")
    if cfg.train.precision == "auto":
        ok, why = native_bf16(use_gpu=cfg.train.accelerator != "cpu")
        cfg.train.precision = "bf16-mixed" if ok else "32"
        out.append(f"train.precision: auto -> {cfg.train.precision}; {why}")
    _notes[:] = out
    return out


def notes() -> list[str]:
    """What the last `resolve_auto` chose, for the log."""
    return list(_notes)
