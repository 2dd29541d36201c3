"""The real vLLM generation worker on the tiny target (greedy, float32) agrees with transformers' greedy."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from distill.cli import main
from distill.data.format import load_split_dataset, manifest_path

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny.yaml")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]


def test_vllm_worker_greedy_matches_hf(tiny_config_overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    common = [o for o in tiny_config_overrides if not o.startswith("run.dir=")]
    common += [
        "target.dtype=float32",
        "data.temperature=0",
        "data.max_new_tokens=24",
        "data.batch_size=16",
        "data.max_train_prompts=24",
        "data.max_val_prompts=4",
        "data.vllm_kvcache_gib=1",
    ]
    assert main(["data", "-c", CONFIG, *common, f"run.dir={tmp_path / 'vllm'}", "data.engine=vllm"]) == 0
    assert main(["data", "-c", CONFIG, *common, f"run.dir={tmp_path / 'hf'}", "data.engine=hf"]) == 0
    manifest = json.loads(manifest_path(tmp_path / "vllm").read_text())
    assert manifest["engine"] == "vllm" and manifest["engine_version"].startswith("vllm ")
    for split in ("train", "val"):
        a = [dict(r) for r in load_split_dataset(tmp_path / "vllm", split)]
        b = [dict(r) for r in load_split_dataset(tmp_path / "hf", split)]
        assert [r["prompt_id"] for r in a] == [r["prompt_id"] for r in b]
        for r in a:  # loss mask covers exactly the generated tokens, EOS kept when the target stopped
            n_prompt = r["loss_mask"].index(1)
            assert sum(r["loss_mask"]) == len(r["input_ids"]) - n_prompt <= 24
        same = sum(x["input_ids"] == y["input_ids"] for x, y in zip(a, b, strict=True))
        assert same >= 0.75 * len(a), f"{split}: only {same}/{len(a)} responses equal between vLLM and HF"
