"""`auto` precision: bfloat16 only where the machine computes it natively, resolved when the config loads."""

from __future__ import annotations

import subprocess

import pytest

from distill import cli, precision
from distill.cli import main
from distill.config import config_hash, load_config, output_view
from distill.evaluate import hardware

REPO_CONFIG = "configs/smollm2-sharegpt.yaml"

# Abridged /proc/cpuinfo of the hosts measured here and of an Arm server.
AVX2_EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
ZEN4_EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
AVX512_ONLY = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (AVX2_EPYC, False),
        (ZEN4_EPYC, True),
        (SAPPHIRE, True),
        (AVX512_ONLY, False),
        (GRAVITON3, True),
        ("", False),
    ],
)
def test_native_bf16_cpus_are_those_with_bf16_arithmetic(cpuinfo, native):
    assert precision.cpu_has_native_bf16(cpuinfo) is native


def _machine(monkeypatch, *, cpuinfo=AVX2_EPYC, gpus=()):
    monkeypatch.setattr(precision, "_read_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(precision, "gpu_compute_capabilities", lambda: list(gpus))


def test_auto_becomes_float32_and_32_on_a_cpu_without_native_bf16(monkeypatch):
    _machine(monkeypatch, cpuinfo=AVX2_EPYC)
    cfg = load_config(REPO_CONFIG)
    assert cfg.target.dtype == "float32" and cfg.train.precision == "32"
    assert precision.notes() == [
        "target.dtype: auto -> float32; this CPU has no AVX512-BF16, AMX or Arm BF16: bfloat16 would be "
        "emulated, many times slower",
        "train.precision: auto -> 32; this CPU has no AVX512-BF16, AMX or Arm BF16: bfloat16 would be "
        "emulated, many times slower",
    ]


def test_auto_becomes_bfloat16_where_native_and_hashes_as_if_written_out(monkeypatch):
    """A run folder made with the explicit values before `auto` existed still matches on such a machine."""
    _machine(monkeypatch, cpuinfo=ZEN4_EPYC)
    auto = load_config(REPO_CONFIG)
    assert auto.target.dtype == "bfloat16" and auto.train.precision == "bf16-mixed"
    explicit = load_config(REPO_CONFIG, ["target.dtype=bfloat16", "train.precision=bf16-mixed"])
    assert precision.notes() == []  # nothing was auto
    for section in ("target", "train"):
        assert config_hash(output_view(getattr(auto, section))) == config_hash(
            output_view(getattr(explicit, section))
        )


def test_gpus_decide_when_visible_and_train_on_cpu_asks_the_cpu(monkeypatch):
    _machine(monkeypatch, cpuinfo=AVX2_EPYC, gpus=[(9, 0)])
    cfg = load_config(REPO_CONFIG)
    assert cfg.target.dtype == "bfloat16" and cfg.train.precision == "bf16-mixed"
    assert "GPU compute capability 9.0 >= 8.0" in precision.notes()[0]
    cfg = load_config(REPO_CONFIG, ["train.accelerator=cpu"])
    assert cfg.target.dtype == "bfloat16" and cfg.train.precision == "32"
    _machine(monkeypatch, cpuinfo=ZEN4_EPYC, gpus=[(9, 0), (7, 5)])  # a V100-class card among them
    cfg = load_config(REPO_CONFIG)
    assert cfg.target.dtype == "float32" and "9.0, 7.5 < 8.0" in precision.notes()[0]


def test_compute_capabilities_from_nvidia_smi_honour_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(precision, "_capabilities_nvml", lambda: None)
    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    out = "0, 9.0\n1, 7.5\n"
    monkeypatch.setattr(
        hardware.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out)
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert precision.gpu_compute_capabilities() == [(9, 0), (7, 5)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert precision.gpu_compute_capabilities() == [(9, 0)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert precision.gpu_compute_capabilities() == []


def test_validate_prints_the_resolved_values_and_logs_why(monkeypatch, capsys):
    _machine(monkeypatch, cpuinfo=AVX2_EPYC)
    logged: list[str] = []
    monkeypatch.setattr(cli.log, "info", lambda msg, *args: logged.append(msg % args if args else msg))
    assert main(["validate", "-c", REPO_CONFIG]) == 0
    out = capsys.readouterr().out
    assert "  dtype: float32" in out and "  precision: '32'" in out
    assert logged[:2] == precision.notes() and logged[0].startswith("target.dtype: auto -> float32;")


def test_a_bad_precision_still_names_the_key(capsys):
    assert main(["validate", "-c", REPO_CONFIG, "train.precision=bf16"]) == 2
    assert "precision: got 'bf16', expected one of 32, bf16-mixed, auto" in capsys.readouterr().err
