"""A parallel (PARD) draft inside real vLLM speculative decoding (`parallel_drafting`), tiny models built in code.

The draft is the tiny target itself marked as a 2-token parallel draft (`mark_parallel`, mask = an unused special
token): untrained masks, but its draft position 0 is the target's own next-token prediction. One engine
(k=2, parallel) measured at T=0 and T=1, plus no_spec: the counters must be those of k-token rounds and, at
T=0 in float32, the output must equal the target's alone.
"""

from __future__ import annotations

import pytest

from distill.evaluate import report
from distill.utils.subproc import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

K = 2


@pytest.fixture(scope="module")
def parallel_draft_dir(tiny_target_dir, tiny_tokenizer, tmp_path_factory):
    from distill.models.draft import choose_mask_token, load_causal_lm, mark_parallel, save_hf_folder

    model = load_causal_lm(tiny_target_dir)
    mark_parallel(model, K, choose_mask_token(tiny_tokenizer))
    return save_hf_folder(
        model, tiny_tokenizer, tmp_path_factory.mktemp("pard") / "draft", generation_source=tiny_target_dir
    )


@pytest.fixture(scope="module")
def worker_output(tiny_target_dir, parallel_draft_dir, tiny_tokenizer, tmp_path_factory):
    from distill.utils.subproc import run_worker

    tok = tiny_tokenizer
    texts = [
        f"Explain {w} in {n} short sentences." for w, n in [("decoding", 2), ("the moon", 3), ("maps", 1)]
    ]
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for t in texts
    ]
    spec = {"name": "pard", "method": "draft_model", "draft": str(parallel_draft_dir), "k": K}
    configs = [
        {
            "name": "no_spec",
            "method": None,
            "draft": None,
            "k": 0,
            "temperature": 0.0,
            "draft_sample_method": None,
        },
        {**spec, "temperature": 0.0, "draft_sample_method": "greedy", "parallel_drafting": True},
        {**spec, "temperature": 1.0, "draft_sample_method": "greedy", "parallel_drafting": True},
    ]
    out_dir = tmp_path_factory.mktemp("eval_vllm_parallel")
    job = {
        "kind": "speculate",
        "target": str(tiny_target_dir),
        "dtype": "float32",
        "prompts": prompts,
        "max_tokens": 24,
        "eos_token_id": tok.eos_token_id,
        "max_model_len": 256,
        "configs": configs,
        "repeats": 1,
        "seed": 0,
        "max_num_seqs": 8,
        "device": "cpu",
        "partial_path": str(out_dir / "partial.json"),
    }
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return run_worker(job, log_path=out_dir / "worker.log", timeout_s=900, env=env)


def _get(out, temp):
    return next(r for r in out["results"] if r["name"] == "pard" and r["temperature"] == temp)


def test_parallel_draft_runs_in_vllm(worker_output):
    assert worker_output["complete"] is True
    assert [r["error"] for r in worker_output["results"]] == [None] * 3
    for temp in (0.0, 1.0):
        r = _get(worker_output, temp)
        assert r["parallel_drafting"] is True and r["output_tokens"] > 0
        assert r["num_drafts"] > 0 and r["num_draft_tokens"] == K * r["num_drafts"]
        assert r["num_accepted_tokens"] <= r["num_draft_tokens"]
        assert sum(r["accepted_per_pos"]) == r["num_accepted_tokens"] and len(r["accepted_per_pos"]) == K
        assert r["accepted_per_pos"][0] >= r["accepted_per_pos"][1]


def test_parallel_draft_keeps_the_greedy_output_in_float32(worker_output):
    r = _get(worker_output, 0.0)
    agreement = report.greedy_agreement(
        r, next(x for x in worker_output["results"] if x["name"] == "no_spec")
    )
    assert agreement["greedy_match"] == 1.0
    # Draft position 0 is the target's own next token: accepted in (nearly) every round.
    assert r["accepted_per_pos"][0] / r["num_drafts"] > 0.9
