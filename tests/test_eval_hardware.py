"""The hardware description in eval/report.json: CPU model from /proc/cpuinfo, cores, GPU names without CUDA."""

from __future__ import annotations

import os
import subprocess

from distill.evaluate import hardware

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R)  Platinum 8375C CPU @ 2.90GHz
flags\t\t: fpu vme

processor\t: 1
model name\t: Intel(R) Xeon(R)  Platinum 8375C CPU @ 2.90GHz
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
CPU implementer\t: 0x41

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""


def test_cpu_model_from_cpuinfo():
    assert hardware.cpu_model(X86) == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert hardware.cpu_model(ARM) == "Raspberry Pi 4 Model B Rev 1.4"
    assert hardware.cpu_model("processor\t: 0\nBogoMIPS\t: 50.00\n") is None


def test_describe_cpu_has_model_cores_and_summary():
    info = hardware.describe("cpu")
    assert info["device"] == "cpu" and info["cpu_cores"] == os.cpu_count()
    assert 1 <= info["cpu_cores_usable"] <= (os.cpu_count() or 1) and "gpus" not in info
    assert info["summary"].startswith("CPU: ") and "cores" in info["summary"]


def test_summary_wording():
    cpu = {"device": "cpu", "cpu": "Xeon", "cpu_cores": 16, "cpu_cores_usable": 16}
    assert hardware.summary(cpu) == "CPU: Xeon, 16 cores"
    assert hardware.summary({**cpu, "cpu_cores_usable": 2}) == "CPU: Xeon, 2 of 16 cores usable"
    gpu = {**cpu, "device": "cuda", "gpus": ["NVIDIA H200 (140 GiB)"] * 2}
    assert hardware.summary(gpu) == "2× NVIDIA H200 (140 GiB); CPU: Xeon, 16 cores"
    assert hardware.summary({**gpu, "gpus": []}).startswith("CUDA GPU (name unavailable); CPU: Xeon")


def test_gpu_names_from_nvidia_smi_honour_cuda_visible_devices(monkeypatch):
    smi = "0, NVIDIA H200, 143771\n1, NVIDIA A10, 23028\n"
    monkeypatch.setattr(hardware, "_gpus_nvml", lambda: None)
    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        hardware.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=smi)
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert hardware.gpu_names() == ["NVIDIA H200 (140 GiB)", "NVIDIA A10 (22 GiB)"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert hardware.gpu_names() == ["NVIDIA A10 (22 GiB)"]
    assert hardware.describe("cuda")["summary"].startswith("1× NVIDIA A10 (22 GiB); CPU: ")
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    assert hardware.gpu_names() == []
