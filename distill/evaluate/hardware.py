"""What the measurements ran on: CPU model and cores, GPU names and memory.

tokens/s and speedups mean little without the machine, so `eval/report.json` carries `hardware` (shown in
report.md and the model card). Nothing here initialises CUDA: GPU names come from NVML (`pynvml`, which vLLM
installs) or `nvidia-smi`, so the vLLM worker can describe its machine before it starts an engine.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# /proc/cpuinfo keys naming the CPU, most specific first (x86: "model name"; some ARM/RISC-V kernels: others).
_CPU_KEYS = ("model name", "Model", "cpu model", "Hardware", "Processor", "uarch")


def cpu_model(cpuinfo: str) -> str | None:
    """The CPU's name from the text of /proc/cpuinfo (None when it names none)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip(), " ".join(value.split()))
    return next((fields[k] for k in _CPU_KEYS if k in fields), None)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def load_avg() -> float | None:
    """1-minute load average before a timed pass: timings taken while other processes hold the cores are not
    comparable (the report's fallback busy-machine signal where the CPU share cannot be read)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def usable_cores() -> int:
    """Cores this process may run on (cgroup/affinity limits included), not just those the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def visible_gpu_indices(indices: list[int]) -> list[int]:
    """Apply CUDA_VISIBLE_DEVICES when it lists indices (UUIDs or unset: every GPU)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return indices
    try:
        wanted = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        return indices
    return [i for i in wanted if i in indices]


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.0f} GiB"


def nvml_each_visible(read: Callable[[Any, Any], T]) -> list[T] | None:
    """`read(pynvml, handle)` for each visible GPU, through NVML (no CUDA initialisation); None when NVML is
    missing or fails (no driver, no permission), so that the caller can try nvidia-smi."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            indices = visible_gpu_indices(list(range(pynvml.nvmlDeviceGetCount())))
            return [read(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def nvidia_smi_visible(fields: str) -> list[list[str]] | None:
    """nvidia-smi's `--query-gpu=index,<fields>` values (without the index) of each visible GPU, in index order;
    None when nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        text = subprocess.run(
            [exe, f"--query-gpu=index,{fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts[0].isdigit():
            rows[int(parts[0])] = parts[1:]
    return [rows[i] for i in visible_gpu_indices(sorted(rows))]


def _gpus_nvml() -> list[str] | None:
    def name_and_memory(nvml: Any, handle: Any) -> str:
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        return f"{name} ({_gib(nvml.nvmlDeviceGetMemoryInfo(handle).total)})"

    return nvml_each_visible(name_and_memory)


def _gpus_smi() -> list[str] | None:
    rows = nvidia_smi_visible("name,memory.total")
    if rows is None:
        return None
    out = []
    for parts in rows:
        if len(parts) == 2:
            mib = float(parts[1]) if parts[1].replace(".", "", 1).isdigit() else None
            out.append(parts[0] + (f" ({_gib(mib * 2**20)})" if mib else ""))
    return out


def gpu_names() -> list[str]:
    """'NAME (MEMORY)' of each visible NVIDIA GPU, without initialising CUDA; [] when none can be read."""
    for probe in (_gpus_nvml, _gpus_smi):
        found = probe()
        if found:
            return found
    return []


def summary(info: dict[str, Any]) -> str:
    """One line: 'CPU: <model>, 2 cores' or '1× NVIDIA H200 (140 GiB); CPU: <model>, 16 cores'."""
    total, usable = info.get("cpu_cores"), info.get("cpu_cores_usable")
    cores = f"{usable} of {total} cores usable" if usable and total and usable != total else f"{total} cores"
    cpu = f"CPU: {info.get('cpu') or 'unknown'}, {cores}"
    if info.get("device") != "cuda":
        return cpu
    gpus = info.get("gpus") or []
    shown = ", ".join(f"{n}× {name}" for name, n in Counter(gpus).items()) or "CUDA GPU (name unavailable)"
    return f"{shown}; {cpu}"


def describe(device: str) -> dict[str, Any]:
    """report.json's `hardware`: device, CPU model, cores (total and usable), GPUs when on CUDA, a summary."""
    info: dict[str, Any] = {
        "device": device,
        "cpu": cpu_model(_read("/proc/cpuinfo")) or platform.processor() or platform.machine() or None,
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable_cores(),
        "machine": platform.machine(),
    }
    if device == "cuda":
        info["gpus"] = gpu_names()
    info["summary"] = summary(info)
    return info
