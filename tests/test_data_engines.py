"""Pure pieces of the data stage: EOS handling, vLLM output conversion, sharding, seeds, config identity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distill.cli import main
from distill.config import load_config
from distill.data.engines import cut_at_eos, from_vllm, vllm_env, vllm_job
from distill.data.format import load_split_dataset, manifest_path, open_topk_cache
from distill.data.prepare import Prompt, chunks_of, request_seed, shard_slice
from distill.data.stage import data_hash

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny.yaml")


def test_cut_at_eos_keeps_the_eos_and_marks_truncation():
    assert cut_at_eos([5, 6, 2, 2, 2], {2}, 5) == {"token_ids": [5, 6, 2], "finished": True}
    assert cut_at_eos([5, 6, 7], {2}, 3) == {"token_ids": [5, 6, 7], "finished": False}
    assert cut_at_eos([9, 1], {1, 2}, 4) == {"token_ids": [9, 1], "finished": True}


def test_from_vllm_appends_a_missing_eos_only_on_stop():
    raw = [
        [{"token_ids": [4, 2], "finish_reason": "stop"}, {"token_ids": [4, 5], "finish_reason": "stop"}],
        [{"token_ids": [4, 5, 6], "finish_reason": "length"}],
    ]
    out = from_vllm(raw, {2}, 2)
    assert out[0] == [{"token_ids": [4, 2], "finished": True}, {"token_ids": [4, 5, 2], "finished": True}]
    assert out[1] == [{"token_ids": [4, 5, 6], "finished": False}]


@pytest.mark.parametrize("n", [0, 1, 7, 100])
@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_shards_partition_the_prompts_in_order(n, shards):
    parts = [shard_slice(n, i, shards) for i in range(shards)]
    covered = [j for lo, hi in parts for j in range(lo, hi)]
    assert covered == list(range(n))


def test_chunks_and_request_seeds():
    ps = [Prompt(str(i), [i], None) for i in range(10)]
    assert [len(c) for c in chunks_of(ps, 4)] == [4, 4, 2]
    assert request_seed(0, "abc") == request_seed(0, "abc") != request_seed(1, "abc")


def _cpu_job(tmp_path, data_cfg, chunks):
    return vllm_job(
        model_dir=tmp_path,
        dtype="float32",
        trust_remote_code=False,
        cfg=data_cfg,
        run_seed=0,
        chunks=chunks,
        on_gpu=False,
    )


def test_vllm_job_and_env(tmp_path):
    cfg = load_config(
        CONFIG, ["data.temperature=0.7", "data.responses_per_prompt=3", "data.vllm_kvcache_gib=2"]
    )
    ps = [Prompt("p1", [1, 2, 3], None)]
    job = _cpu_job(tmp_path, cfg.data, [(tmp_path / "g.json", ps)])
    assert job["kind"] == "generate" and job["enforce_eager"] is True
    assert job["sampling"] == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 32, "n": 3, "logprobs": None}
    assert job["max_model_len"] == 64 + 32
    assert job["max_in_flight"] == cfg.data.batch_size
    assert job["chunks"][0]["prompts"][0] == {
        "prompt_id": "p1",
        "token_ids": [1, 2, 3],
        "seed": request_seed(0, "p1"),
    }
    json.dumps(job)  # the worker reads it as JSON
    assert vllm_env(cfg.data, on_gpu=False) == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    assert vllm_env(cfg.data, on_gpu=True) == {}
    compiled = load_config(CONFIG, ["data.vllm_enforce_eager=false"])
    assert _cpu_job(tmp_path, compiled.data, [])["enforce_eager"] is False


def test_data_hash_ignores_run_only_keys():
    a = load_config(CONFIG, [])
    same = [
        "data.overwrite=true",
        "data.shard_index=1",
        "data.num_shards=2",
        "data.worker_timeout_s=5",
        "data.logits.batch_size=2",
        "data.tensor_parallel_size=2",
        "data.vllm_enforce_eager=false",
        "data.vllm_stream=false",
    ]
    b = load_config(CONFIG, same)
    assert data_hash(a) != data_hash(b)  # num_shards changes the layout
    c = load_config(CONFIG, [s for s in same if "num_shards" not in s and "shard_index" not in s])
    assert data_hash(a) == data_hash(c)
    for changed in ("data.max_new_tokens=9", "run.seed=1", "data.logits.top_k=4", "target.dtype=bfloat16"):
        assert data_hash(load_config(CONFIG, [changed])) != data_hash(a), changed


def test_sampled_responses_per_prompt(tiny_config_overrides):
    overrides = [
        *tiny_config_overrides,
        "data.engine=hf",
        "data.temperature=1.0",
        "data.responses_per_prompt=2",
        "data.max_train_prompts=12",
        "data.max_val_prompts=2",
        "data.max_new_tokens=12",
    ]
    assert main(["data", "-c", CONFIG, *overrides]) == 0
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run.dir=")))
    rows = [dict(r) for r in load_split_dataset(run_dir, "train")]
    assert len(rows) == 24
    assert [r["response_index"] for r in rows] == [0, 1] * 12
    assert rows[0]["prompt_id"] == rows[1]["prompt_id"]
    differ = sum(rows[i]["input_ids"] != rows[i + 1]["input_ids"] for i in range(0, 24, 2))
    assert differ >= 6  # sampling at T=1 from a random model: the two responses mostly differ
    manifest = json.loads(manifest_path(run_dir).read_text())
    assert manifest["splits"]["train"]["records"] == 24 and manifest["splits"]["train"]["prompts_used"] == 12


def _hold_merge_lock(run_dir: Path) -> subprocess.Popen:
    """A process that takes `data/merge.lock` the way a merging job does, and keeps it until killed."""
    code = (
        "import sys, time; from pathlib import Path; from distill.data import lock; "
        "assert lock.try_acquire(Path(sys.argv[1]))[0]; print('held', flush=True); time.sleep(300)"
    )
    path = run_dir / "data" / "merge.lock"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _lock_run(tiny_config_overrides: list[str], num_shards: int) -> tuple[Path, list[str]]:
    run_dir = Path(next(o.split("=", 1)[1] for o in tiny_config_overrides if o.startswith("run.dir=")))
    common = [
        *tiny_config_overrides,
        "data.engine=hf",
        f"data.num_shards={num_shards}",
        "data.max_train_prompts=8",
        "data.max_val_prompts=2",
        "data.max_new_tokens=8",
    ]
    return run_dir, common


def test_merge_lock_of_a_killed_merge_does_not_block(tiny_config_overrides, capsys):
    run_dir, common = _lock_run(tiny_config_overrides, 2)
    assert main(["data", "-c", CONFIG, *common, "data.shard_index=0"]) == 0
    _kill9(_hold_merge_lock(run_dir))  # as a merge killed with -9 leaves it
    assert (run_dir / "data" / "merge.lock").exists()
    assert main(["data", "-c", CONFIG, *common, "data.shard_index=1"]) == 0
    assert "another job" not in capsys.readouterr().out
    assert manifest_path(run_dir).exists() and not (run_dir / "data" / "merge.lock").exists()
    assert len(load_split_dataset(run_dir, "train")) == 8


def test_live_merger_is_left_alone_and_data_merge_waits_for_it(tiny_config_overrides, capsys):
    run_dir, common = _lock_run(tiny_config_overrides, 2)
    assert main(["data", "-c", CONFIG, *common, "data.shard_index=0"]) == 0
    holder = _hold_merge_lock(run_dir)
    try:
        assert main(["data", "-c", CONFIG, *common, "data.shard_index=1"]) == 0
        out = capsys.readouterr().out
        assert "another job is merging" in out and f"pid {holder.pid}" in out
        assert not manifest_path(run_dir).exists()
        assert main(["data", "-c", CONFIG, *common, "data.merge=true"]) == 1
        assert "still running" in capsys.readouterr().err
    finally:
        _kill9(holder)
    assert main(["data", "-c", CONFIG, *common, "data.merge=true"]) == 0
    assert manifest_path(run_dir).exists() and not (run_dir / "data" / "merge.lock").exists()


def test_single_shard_build_never_finishes_without_a_manifest(tiny_config_overrides, capsys):
    from distill.config import load_config
    from distill.rundir import is_complete

    run_dir, common = _lock_run(tiny_config_overrides, 1)
    holder = _hold_merge_lock(run_dir)
    try:
        assert main(["data", "-c", CONFIG, *common]) == 1  # someone else holds the only merge: say so, not 0
        err = capsys.readouterr().err
        assert "cannot merge" in err and f"pid {holder.pid}" in err and "data.merge=true" in err
        assert not manifest_path(run_dir).exists()
        assert not is_complete(load_config(CONFIG, common), "data")
    finally:
        _kill9(holder)  # the merge killed with -9: the rerun takes its lock over
    assert main(["data", "-c", CONFIG, *common]) == 0
    assert manifest_path(run_dir).exists() and not (run_dir / "data" / "merge.lock").exists()
    assert is_complete(load_config(CONFIG, common), "data")


def test_merge_lock_from_another_host_is_trusted_until_data_merge(tiny_config_overrides, capsys):
    import dataclasses

    from distill.data import lock

    run_dir, common = _lock_run(tiny_config_overrides, 2)
    assert main(["data", "-c", CONFIG, *common, "data.shard_index=0"]) == 0
    other = dataclasses.replace(lock.me(), host="node-elsewhere")
    (run_dir / "data" / "merge.lock").write_text(json.dumps(dataclasses.asdict(other)))
    assert main(["data", "-c", CONFIG, *common, "data.shard_index=1"]) == 0
    out = capsys.readouterr().out
    assert "node-elsewhere" in out and "data.merge=true" in out and not manifest_path(run_dir).exists()
    assert main(["data", "-c", CONFIG, *common, "data.merge=true"]) == 0
    assert manifest_path(run_dir).exists() and not (run_dir / "data" / "merge.lock").exists()


def test_empty_val_split_still_saves_and_opens(tiny_config_overrides):
    overrides = [
        *tiny_config_overrides,
        "data.engine=hf",
        "data.val_fraction=0",
        "data.max_train_prompts=6",
        "data.max_new_tokens=6",
        "data.logits.top_k=4",
    ]
    assert main(["data", "-c", CONFIG, *overrides]) == 0
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run.dir=")))
    assert len(load_split_dataset(run_dir, "val")) == 0
    cache = open_topk_cache(run_dir, "val")
    assert cache is not None and len(cache) == 0 and cache.k == 4
    assert len(open_topk_cache(run_dir, "train")) == 6  # type: ignore[arg-type]


def test_sigterm_mid_generation_exits_130_and_resumes(tiny_config_overrides, monkeypatch):
    import distill.data.stage as stage
    from distill.errors import Interrupted

    overrides = [
        *tiny_config_overrides,
        "data.engine=hf",
        "data.batch_size=4",
        "data.max_train_prompts=12",
        "data.max_val_prompts=2",
        "data.max_new_tokens=6",
    ]
    real = stage.hf_generate
    calls = {"n": 0}

    def interrupted_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Interrupted("received signal 15; state saved, rerun the same command to resume.")
        return real(*args, **kwargs)

    monkeypatch.setattr(stage, "hf_generate", interrupted_on_third)
    assert main(["data", "-c", CONFIG, *overrides]) == 130
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run.dir=")))
    gen = sorted(p.name for p in (run_dir / "data" / "work" / "gen").iterdir())
    assert gen == ["train-00000.json", "train-00001.json"]  # whole chunks only, no temporaries
    calls["n"] = -100
    assert main(["data", "-c", CONFIG, *overrides]) == 0
    assert len(load_split_dataset(run_dir, "train")) == 12


def test_sampling_is_per_prompt_independent_of_batching(tiny_config_overrides, tmp_path):
    """At temperature 1, each prompt's samples come from its own seed: batch size (= chunking) changes nothing."""
    common = [o for o in tiny_config_overrides if not o.startswith("run.dir=")]
    common += [
        "data.engine=hf",
        "data.temperature=1.0",
        "data.top_p=0.9",
        "data.responses_per_prompt=2",
        "data.max_train_prompts=10",
        "data.max_val_prompts=3",
        "data.max_new_tokens=10",
    ]
    out = {}
    for bs in (3, 7):
        run_dir = tmp_path / f"bs{bs}"
        assert main(["data", "-c", CONFIG, *common, f"run.dir={run_dir}", f"data.batch_size={bs}"]) == 0
        out[bs] = {s: [dict(r) for r in load_split_dataset(run_dir, s)] for s in ("train", "val")}
    assert out[3] == out[7]
    rows = out[3]["train"]
    assert (
        len(rows) == 20
        and sum(rows[i]["input_ids"] != rows[i + 1]["input_ids"] for i in range(0, 20, 2)) >= 5
    )


def test_per_prompt_sampler_draws_from_the_tempered_top_p_distribution():
    import torch

    from distill.data.engines import PerPromptSampler, top_p_filter

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logp = probs.log()[None]
    assert (
        torch.isinf(top_p_filter(logp, 0.8)[0, 2:]).all()
        and torch.isfinite(top_p_filter(logp, 0.8)[0, :2]).all()
    )
    assert torch.isfinite(top_p_filter(logp, 0.85)[0, :3]).all() and torch.isinf(
        top_p_filter(logp, 0.85)[0, 3]
    )
    assert torch.isfinite(top_p_filter(logp, 0.1)[0, 0]) and torch.isinf(top_p_filter(logp, 0.1)[0, 1:]).all()
    n = 20000
    scores = (probs.log() * 2.0).expand(n, 4)  # temperature 2 undoes the factor 2
    picks = PerPromptSampler(list(range(n)), temperature=2.0, top_p=1.0)(None, scores).argmax(-1)  # type: ignore[arg-type]
    freq = torch.bincount(picks, minlength=4).float() / n
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    again = PerPromptSampler(list(range(n)), temperature=2.0, top_p=1.0)(None, scores).argmax(-1)  # type: ignore[arg-type]
    assert torch.equal(picks, again)
    first = PerPromptSampler([7], temperature=2.0, top_p=1.0)(None, scores[:1]).argmax(-1)  # type: ignore[arg-type]
    assert first.item() == picks[7].item()  # a row's draw does not depend on the other rows
