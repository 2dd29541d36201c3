"""The real vLLM generation worker on the tiny target (greedy, float32) agrees with transformers' greedy."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from distill.cli import main
from distill.data.format import load_split_dataset, manifest_path, open_topk_cache

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


def test_topk_cache_from_vllm_logprobs_matches_a_forward_pass(tiny_config_overrides, tmp_path, monkeypatch):
    """`data.logits.source: vllm` (no teacher pass) stores what `forward` stores, to fp16/kernel tolerance."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    common = [o for o in tiny_config_overrides if not o.startswith("run.dir=")]
    common += [
        "target.dtype=float32",
        "data.temperature=0",
        "data.max_new_tokens=16",
        "data.max_train_prompts=12",
        "data.max_val_prompts=4",
        "data.vllm_kvcache_gib=1",
        "data.engine=vllm",
        "data.logits.top_k=8",
    ]
    for src in ("vllm", "forward"):
        args = [*common, f"run.dir={tmp_path / src}", f"data.logits.source={src}"]
        assert main(["data", "-c", CONFIG, *args]) == 0
    a_rows = [dict(r) for r in load_split_dataset(tmp_path / "vllm", "train")]
    b_rows = [dict(r) for r in load_split_dataset(tmp_path / "forward", "train")]
    assert [r["input_ids"] for r in a_rows] == [r["input_ids"] for r in b_rows]
    a, b = open_topk_cache(tmp_path / "vllm", "train"), open_topk_cache(tmp_path / "forward", "train")
    assert a is not None and b is not None and len(a) == len(b) == len(a_rows)
    same_ids = total = 0
    for i in range(len(a)):
        (ai, al, ar), (bi, bl, br) = a.get(i), b.get(i)
        assert ai.shape == bi.shape
        torch.testing.assert_close(al[:, 0], bl[:, 0], atol=2e-3, rtol=2e-3)  # the argmax's log-prob
        torch.testing.assert_close(ar, br, atol=5e-3, rtol=5e-3)
        same_ids += int((ai == bi).sum())
        total += ai.numel()
    assert same_ids >= 0.95 * total  # near-ties may swap neighbours between the two kernels
    manifest = json.loads(manifest_path(tmp_path / "vllm").read_text())
    assert manifest["cache"]["top_k"] == 8


def test_vllm_worker_samples_seeded_responses_past_the_prefill_budget(
    tiny_config_overrides, tmp_path, monkeypatch
):
    """T=1 on the CPU: a batch whose prompts exceed vLLM's per-step token budget (4096) is prefilled in chunks
    by default, and a chunked seeded request crashed vLLM 0.32 ("CPU Generator does not use offset"). Each
    prompt's sample comes from its own seed, so the batch size does not change what is sampled."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # Unique prompts (duplicates are dropped) of ~45 tokens each: 200 of them are ~9000 prompt tokens.
    words = "explain the history of rivers maps trains coffee and the moon to a curious beginner".split()  # noqa: SIM905
    source = tmp_path / "long_prompts.jsonl"
    with source.open("w") as f:
        for i in range(300):
            text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(40))
            f.write(json.dumps({"prompt": f"{text} {i}"}) + "\n")
    common = [o for o in tiny_config_overrides if not o.startswith("run.dir=")]
    common += [
        f"data.source={source}",
        "target.dtype=float32",
        "data.temperature=1.0",
        "data.max_new_tokens=8",
        "data.max_prompt_tokens=128",
        "data.max_train_prompts=200",
        "data.max_val_prompts=4",
        "data.vllm_kvcache_gib=1",
        "data.engine=vllm",
    ]
    for batch in (200, 40):
        assert (
            main(
                [
                    "data",
                    "-c",
                    CONFIG,
                    *common,
                    f"run.dir={tmp_path / str(batch)}",
                    f"data.batch_size={batch}",
                ]
            )
            == 0
        )
    one_batch = [dict(r) for r in load_split_dataset(tmp_path / "200", "train")]
    prompt_tokens = sum(r["loss_mask"].index(1) for r in one_batch)
    assert prompt_tokens > 4096, f"the batch's prompts ({prompt_tokens} tokens) must exceed the step budget"
    five_batches = [dict(r) for r in load_split_dataset(tmp_path / "40", "train")]
    assert [r["prompt_id"] for r in one_batch] == [r["prompt_id"] for r in five_batches]
    same = sum(a["input_ids"] == b["input_ids"] for a, b in zip(one_batch, five_batches, strict=True))
    assert same >= 0.9 * len(one_batch), f"only {same}/{len(one_batch)} samples equal across batch sizes"
