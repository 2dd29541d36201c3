"""`distill data` on the tiny in-code target with the transformers engine: format, masks, resume, cache, faults."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from model_folders import model_copy

from distill.cli import main
from distill.data import store
from distill.data.format import (
    load_split_dataset,
    manifest_path,
    open_topk_cache,
    topk_from_logits,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny.yaml")
EOS = 2  # <|im_end|> in the tiny tokenizer


def run_data(overrides: list[str]) -> int:
    return main(["data", "-c", CONFIG, *overrides])


@pytest.fixture()
def base(tiny_config_overrides) -> list[str]:
    return [*tiny_config_overrides, "data.engine=hf", "data.batch_size=8", "data.max_new_tokens=24"]


def rows(run_dir: Path, split: str) -> list[dict]:
    return [dict(r) for r in load_split_dataset(run_dir, split)]


def run_dir_of(overrides: list[str]) -> Path:
    return Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run.dir=")))


def _prompt_texts(prompts_file: Path, tok) -> dict[str, str]:
    from distill.prompts.sources import load_prompts

    pset = load_prompts(str(prompts_file))
    return {
        r.prompt_id: tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        for r in pset.records
    }


def test_record_format_and_loss_masks(base, prompts_file, tiny_tokenizer, tiny_target_dir):
    assert run_data(base) == 0
    run_dir = run_dir_of(base)
    ds = load_split_dataset(run_dir, "train")
    assert set(ds.column_names) == {"input_ids", "loss_mask", "prompt_id", "response_index"}
    texts = _prompt_texts(prompts_file, tiny_tokenizer)
    manifest = json.loads(manifest_path(run_dir).read_text())
    for split in ("train", "val"):
        data = rows(run_dir, split)
        m = manifest["splits"][split]
        assert len(data) == m["records"] == m["prompts_used"] > 0
        assert sum(sum(r["loss_mask"]) for r in data) == m["response_tokens"]
        assert sum(len(r["input_ids"]) - sum(r["loss_mask"]) for r in data) == m["prompt_tokens"]
        no_eos = 0
        for r in data:
            ids, mask = r["input_ids"], r["loss_mask"]
            n_prompt = mask.index(1)
            assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)  # 1 exactly on the response
            assert tiny_tokenizer.decode(ids[:n_prompt]) == texts[r["prompt_id"]]
            response = ids[n_prompt:]
            assert 1 <= len(response) <= 24
            assert EOS not in response[:-1]
            no_eos += response[-1] != EOS
            assert r["response_index"] == 0
        assert no_eos == m["truncated_responses"]
    assert manifest["engine"] == "hf" and manifest["generation_tokens_per_s"] > 0
    assert manifest["tokenizer_hash"] and manifest["config_hash"]
    assert not (run_dir / "data" / "work").exists()  # work folders removed after the merge
    # The masked tokens are exactly what the target writes for that prompt on its own (no batch, no padding).
    from distill.models.draft import load_causal_lm

    model = load_causal_lm(tiny_target_dir).eval()
    data = rows(run_dir, "train")
    same = 0
    for r in data[:10]:
        n_prompt = r["loss_mask"].index(1)
        out = model.generate(
            torch.tensor([r["input_ids"][:n_prompt]]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
        same += out[0, n_prompt:].tolist() == r["input_ids"][n_prompt:]
    assert same >= 9


def test_dataset_responses_decode_to_the_response_text(tmp_path, tiny_target_dir, tiny_tokenizer):
    src = tmp_path / "pairs.jsonl"
    with open(src, "w") as f:
        for i in range(40):
            f.write(
                json.dumps(
                    {
                        "prompt": f"question number {i} about trains",
                        "response": f"answer {i}: " + "the train is long " * (1 + i % 6),
                    }
                )
                + "\n"
            )
    overrides = [
        f"target.model={tiny_target_dir}",
        f"run.dir={tmp_path / 'run'}",
        f"data.source={src}",
        "data.responses=dataset",
        "data.max_new_tokens=20",
    ]
    assert run_data(overrides) == 0
    from distill.prompts.sources import load_prompts

    truth = {r.prompt_id: r.response for r in load_prompts(str(src)).records}
    data = rows(tmp_path / "run", "train")
    assert data
    cut = 0
    for r in data:
        n_prompt = r["loss_mask"].index(1)
        response = r["input_ids"][n_prompt:]
        full = tiny_tokenizer(truth[r["prompt_id"]], add_special_tokens=False)["input_ids"]
        if len(full) >= 20:
            assert response == full[:20]
            cut += 1
        else:
            assert response[-1] == EOS
            assert tiny_tokenizer.decode(response[:-1]) == truth[r["prompt_id"]]
    assert cut > 0
    manifest = json.loads(manifest_path(tmp_path / "run").read_text())
    assert manifest["engine"] == "dataset" and manifest["splits"]["train"]["truncated_responses"] == cut


def _same_output(a: Path, b: Path) -> None:
    for split in ("train", "val"):
        assert rows(a, split) == rows(b, split)
        ca, cb = open_topk_cache(a, split), open_topk_cache(b, split)
        assert (ca is None) == (cb is None)
        if ca is not None and cb is not None:
            assert len(ca) == len(cb)
            for i in range(len(ca)):
                assert ca.raw_bytes(i) == cb.raw_bytes(i)


def test_resume_after_crash_equals_uninterrupted(base, tmp_path, monkeypatch):
    ref = [*base, f"run.dir={tmp_path / 'ref'}", "data.logits.top_k=8"]
    assert run_data(ref) == 0
    crashed = [*base, f"run.dir={tmp_path / 'crash'}", "data.logits.top_k=8"]
    real_write = store.write_chunk
    calls = {"n": 0}

    def crash_after_two(*args, **kwargs):
        if calls["n"] == 2:
            raise RuntimeError("simulated crash")
        calls["n"] += 1
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store, "write_chunk", crash_after_two)
    assert run_data(crashed) == 1
    done = list((tmp_path / "crash" / "data" / "work" / "chunks").iterdir())
    assert len(done) == 2 and not manifest_path(tmp_path / "crash").exists()
    monkeypatch.setattr(store, "write_chunk", real_write)
    assert run_data(crashed) == 0
    _same_output(tmp_path / "ref", tmp_path / "crash")


@pytest.mark.slow
def test_kill9_mid_run_then_rerun_equals_uninterrupted(tiny_config_overrides, tmp_path):
    common = [o for o in tiny_config_overrides if not o.startswith("run.dir=")]
    common += ["data.engine=hf", "data.batch_size=2", "data.max_new_tokens=32", "data.logits.top_k=4"]
    ref = [*common, f"run.dir={tmp_path / 'ref'}"]
    assert run_data(ref) == 0
    killed_dir = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "distill", "data", "-c", CONFIG, *common, f"run.dir={killed_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    chunks = killed_dir / "data" / "work" / "chunks"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if chunks.is_dir() and len([p for p in chunks.iterdir() if not p.name.startswith(".")]) >= 3:
            break
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.skip("the run finished before it could be killed")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not manifest_path(killed_dir).exists()
    assert run_data([*common, f"run.dir={killed_dir}"]) == 0
    _same_output(tmp_path / "ref", killed_dir)


def test_rerun_does_nothing_and_changed_config_refuses(base, capsys):
    assert run_data(base) == 0
    run_dir = run_dir_of(base)
    before = manifest_path(run_dir).stat().st_mtime_ns
    capsys.readouterr()
    assert run_data(base) == 0
    assert "already complete" in capsys.readouterr().out
    assert manifest_path(run_dir).stat().st_mtime_ns == before
    assert run_data([*base, "data.max_new_tokens=8"]) == 2
    err = capsys.readouterr().err
    assert "data.overwrite" in err and "max_new_tokens" in err
    assert manifest_path(run_dir).stat().st_mtime_ns == before
    assert run_data([*base, "data.max_new_tokens=8", "data.overwrite=true"]) == 0
    assert max(sum(r["loss_mask"]) for r in rows(run_dir, "train")) <= 8


def test_partial_data_with_another_config_refuses(base, monkeypatch, capsys):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(store, "write_chunk", crash)
    assert run_data(base) == 1
    monkeypatch.undo()
    assert run_data([*base, "data.temperature=0.7"]) == 2
    assert "data.overwrite" in capsys.readouterr().err


def _crash_after(monkeypatch, n: int) -> None:
    real_write = store.write_chunk
    calls = {"n": 0}

    def crash(*args, **kwargs):
        if calls["n"] == n:
            raise RuntimeError("simulated crash")
        calls["n"] += 1
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store, "write_chunk", crash)


def test_prompts_edited_in_place_are_refused_partial_or_complete(base, prompts_file, monkeypatch, capsys):
    """The config names the prompt file, not its contents: resuming after an edit must not pair the old
    chunks' responses with the new prompts (nor call a build of the old prompts complete)."""
    from distill.prompts.sources import load_prompts, prompt_id, split_of

    original = prompts_file.read_text()
    extra = next(  # a new prompt that lands in the train split (prompts of the test split change nothing)
        f"An extra prompt added later, number {i}"
        for i in range(100)
        if split_of(
            prompt_id([{"role": "user", "content": f"An extra prompt added later, number {i}"}]), 0.1, 0.1
        )
        == "train"
    )
    extra_line = json.dumps({"prompt": extra}) + "\n"
    _crash_after(monkeypatch, 2)
    assert run_data(base) == 1
    monkeypatch.undo()
    prompts_file.write_text(extra_line + original)
    assert run_data(base) == 2
    err = capsys.readouterr().err
    assert "data.source" in err and "data.overwrite=true" in err and "Traceback" not in err
    prompts_file.write_text(original)
    assert run_data(base) == 0  # restored: the partial build resumes
    prompts_file.write_text(extra_line + original)
    capsys.readouterr()
    assert run_data(base) == 2
    assert "not known to be the ones" in capsys.readouterr().err
    assert run_data([*base, "data.overwrite=true"]) == 0
    ids = {r["prompt_id"] for split in ("train", "val") for r in rows(run_dir_of(base), split)}
    assert prompt_id([{"role": "user", "content": extra}]) in ids
    expected = {r.prompt_id for r in load_prompts(str(prompts_file)).records}
    assert ids == {pid for pid in expected if split_of(pid, 0.1, 0.1) != "test"}


def test_a_run_that_failed_before_any_chunk_does_not_block_the_corrected_config(base, monkeypatch, capsys):
    """A first attempt that stopped before its first chunk left only its plan (job.json): no data to protect,
    so the corrected config goes ahead instead of being told to set data.overwrite."""
    from distill.data import stage

    def engine_fails(*args, **kwargs):
        raise RuntimeError("simulated engine failure")

    monkeypatch.setattr(stage, "generate_hf", engine_fails)
    assert run_data([*base, "data.max_new_tokens=8"]) == 1
    assert (run_dir_of(base) / "data" / "work" / "job.json").is_file()
    monkeypatch.undo()
    capsys.readouterr()
    assert run_data(base) == 0, capsys.readouterr().err


def test_a_partial_build_that_recorded_no_prompts_is_refused(base, monkeypatch, capsys):
    """Partial builds from before the prompts fingerprint: their chunks are matched to prompts by position, and
    which prompts a config selects changed with it, so they are not resumed blindly."""
    _crash_after(monkeypatch, 2)
    assert run_data(base) == 1
    monkeypatch.undo()
    job = run_dir_of(base) / "data" / "work" / "job.json"
    record = json.loads(job.read_text())
    del record["prompts_sha256"]
    job.write_text(json.dumps(record))
    assert run_data(base) == 2
    assert "data.overwrite=true" in capsys.readouterr().err
    assert run_data([*base, "data.overwrite=true"]) == 0


def test_another_shards_plan_with_another_config_still_blocks(base, capsys):
    """Only this job's own empty plan is ignored: another shard's may belong to a job that is running."""
    other = run_dir_of(base) / "data" / "shards" / "1"
    other.mkdir(parents=True)
    (other / "job.json").write_text(json.dumps({"config_hash": "another", "config": {"data": {}}}))
    assert run_data([*base, "data.num_shards=2", "data.shard_index=0"]) == 2
    assert "data.overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(("weights", "needle"), [("truncated", "model.safetensors"), ("pickled", "pickled")])
def test_target_folder_without_loadable_weights_is_exit_2_and_writes_nothing(
    base, tmp_path, tiny_target_dir, capsys, weights, needle
):
    broken = model_copy(tiny_target_dir, tmp_path / "broken_target", weights=weights)
    overrides = [o for o in base if not o.startswith("target.model=")]
    assert run_data([*overrides, f"target.model={broken}"]) == 2
    err = capsys.readouterr().err
    assert "target.model" in err and needle in err and "Traceback" not in err
    assert not run_dir_of(base).exists()


def test_a_target_with_custom_code_names_trust_remote_code(base, tmp_path, tiny_target_dir, capsys):
    folder = model_copy(tiny_target_dir, tmp_path / "custom", remote_code=True)
    overrides = [o for o in base if not o.startswith("target.model=")]
    assert run_data([*overrides, f"target.model={folder}"]) == 2
    err = capsys.readouterr().err
    assert "target.trust_remote_code" in err and "Traceback" not in err
    assert not run_dir_of(base).exists()


def test_limits_count_prompts_that_fit(base, tmp_path, prompts_file):
    """data.max_train_prompts is the number of prompts used, found past the ones too long to keep."""
    long_ones = "".join(json.dumps({"prompt": f"long {i} " + "word " * 200}) + "\n" for i in range(30))
    src = tmp_path / "mixed.jsonl"
    src.write_text(long_ones + prompts_file.read_text())
    overrides = [o for o in base if not o.startswith("data.source=")]
    overrides += [f"data.source={src}", "data.max_train_prompts=10", "data.max_prompt_tokens=120"]
    assert run_data(overrides) == 0
    manifest = json.loads(manifest_path(run_dir_of(base)).read_text())
    train = manifest["splits"]["train"]
    assert train["skipped"]["too_long"] > 0  # long prompts were among those read, yet 10 are used
    assert train["prompts_used"] == 10 and train["prompts_loaded"] == 10 + train["skipped"].get("too_long", 0)


def test_several_greedy_responses_per_prompt_are_refused(base, capsys):
    assert run_data([*base, "data.responses_per_prompt=2"]) == 2
    assert "data.temperature" in capsys.readouterr().err
    assert not run_dir_of(base).exists()
    assert (
        run_data([*base, "data.responses_per_prompt=2", "data.temperature=1.0", "data.max_new_tokens=4"]) == 0
    )


def test_a_chat_template_that_refuses_the_system_turn_names_the_key(base, tmp_path, capsys):
    from distill.models.resolve import resolve_model

    target = resolve_model(next(o.split("=", 1)[1] for o in base if o.startswith("target.model=")), key="t")
    model = tmp_path / "no_system"
    shutil.copytree(target, model)
    template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
    (model / "chat_template.jinja").write_text(template)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    overrides = [o for o in base if not o.startswith("target.model=")]
    assert run_data([*overrides, f"target.model={model}", "data.system_prompt=Be brief."]) == 2
    err = capsys.readouterr().err
    assert "data.system_prompt" in err and "System role not supported" in err and "Traceback" not in err
    assert not run_dir_of(base).exists()


def test_no_dataset_responses_names_data_responses(base, capsys):
    assert run_data([*base, "data.responses=dataset"]) == 2
    err = capsys.readouterr().err
    assert "error: data.responses: all" in err and "no_dataset_response" in err


def test_topk_cache_matches_a_fresh_forward_pass(base, tiny_target_dir):
    k = 16
    assert run_data([*base, f"data.logits.top_k={k}", "data.logits.batch_size=3"]) == 0
    run_dir = run_dir_of(base)
    from distill.models.draft import load_causal_lm

    model = load_causal_lm(tiny_target_dir).eval()
    total_positions = 0
    for split in ("train", "val"):
        data = rows(run_dir, split)
        cache = open_topk_cache(run_dir, split)
        assert cache is not None and len(cache) == len(data) and cache.k == k
        for i, r in enumerate(data):
            with torch.no_grad():
                logits = model(torch.tensor([r["input_ids"]])).logits[0]
            ids, lp, rest = cache.get(i)
            f_ids, f_lp, f_rest = topk_from_logits(logits, torch.tensor(r["loss_mask"]), k)
            assert ids.shape == (sum(r["loss_mask"]), k) and ids.dtype == torch.int64
            assert lp.dtype == torch.float32 and rest.dtype == torch.float32
            # The log-prob of each stored id, read off the fresh pass (robust to near-ties reordering ids).
            fresh_all = torch.log_softmax(logits.float(), -1)[torch.tensor(r["loss_mask"]).bool().roll(-1)]
            torch.testing.assert_close(lp, fresh_all.gather(1, ids), atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(lp, f_lp, atol=1e-3, rtol=1e-3)
            assert (ids == f_ids).float().mean() > 0.99
            torch.testing.assert_close(rest, f_rest, atol=1e-3, rtol=1e-3)
            consistent = torch.log1p(-lp.double().exp().sum(-1).clamp(max=1 - 1e-12))
            torch.testing.assert_close(rest.double(), consistent, atol=2e-3, rtol=1e-3)
            total_positions += ids.shape[0]
    manifest = json.loads(manifest_path(run_dir).read_text())
    c = manifest["cache"]
    assert c["top_k"] == k and c["tokens"] == total_positions
    on_disk = sum(p.stat().st_size for p in (run_dir / "data" / "topk").rglob("*") if p.is_file())
    assert c["bytes"] == on_disk
    assert c["bytes_per_token"] == pytest.approx(on_disk / total_positions, rel=1e-3)
    assert c["bytes_per_token"] < k * 4  # smaller than uint16 ids + fp16 values


def test_sharded_jobs_merge_to_the_single_job_result(base, tmp_path, capsys):
    single = [*base, f"run.dir={tmp_path / 'single'}", "data.logits.top_k=4"]
    assert run_data(single) == 0
    sharded = [*base, f"run.dir={tmp_path / 'sharded'}", "data.logits.top_k=4", "data.num_shards=2"]
    assert run_data([*sharded, "data.merge=true"]) == 2  # nothing to merge yet
    assert run_data([*sharded, "data.shard_index=1"]) == 0
    assert "waiting for shards [0]" in capsys.readouterr().out
    assert not manifest_path(tmp_path / "sharded").exists()
    assert run_data([*sharded, "data.shard_index=0"]) == 0
    assert manifest_path(tmp_path / "sharded").exists()
    a, b = rows(tmp_path / "single", "train"), rows(tmp_path / "sharded", "train")
    assert [r["prompt_id"] for r in a] == [r["prompt_id"] for r in b]
    same = sum(x == y for x, y in zip(a, b, strict=True))
    assert same >= 0.9 * len(a)  # chunks differ (left padding): near-ties may flip a greedy token
    assert len(open_topk_cache(tmp_path / "sharded", "train")) == len(b)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# Bad input and faults


def test_no_chat_template_is_exit_2_and_writes_nothing(tmp_path, tiny_target_dir, prompts_file, capsys):
    model = tmp_path / "no_template"
    shutil.copytree(tiny_target_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    run_dir = tmp_path / "run"
    assert run_data([f"target.model={model}", f"run.dir={run_dir}", f"data.source={prompts_file}"]) == 2
    assert "chat template" in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("data.max_prompt_tokens=3", "data.max_prompt_tokens"),
        ("data.max_prompt_tokens=4000", "context"),
    ],
)
def test_bad_lengths_are_exit_2(base, override, needle, capsys):
    assert run_data([*base, override]) == 2
    assert needle in capsys.readouterr().err
    assert not run_dir_of(base).exists()


def test_empty_prompt_source_is_exit_2(tmp_path, tiny_target_dir, capsys):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    assert (
        run_data([f"target.model={tiny_target_dir}", f"run.dir={tmp_path / 'run'}", f"data.source={src}"])
        == 2
    )
    assert "data.source" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_vllm_requested_but_missing_is_exit_2(base, monkeypatch, capsys):
    import distill.utils.subproc as subproc

    monkeypatch.setattr(subproc, "vllm_available", lambda: False)
    assert run_data([*base, "data.engine=vllm"]) == 2
    assert "data.engine" in capsys.readouterr().err


def test_logits_from_vllm_without_the_vllm_engine_is_exit_2(base, capsys):
    assert run_data([*base, "data.logits.top_k=4", "data.logits.source=vllm"]) == 2
    assert "data.logits.source" in capsys.readouterr().err
    assert not (run_dir_of(base) / "data").exists()


def test_disk_full_mid_chunk_leaves_no_half_shard_and_resumes(base, tmp_path, monkeypatch, capsys):
    overrides = [*base, "data.logits.top_k=4"]
    real = store.write_cache_folder
    calls = {"n": 0}

    def full_disk(folder, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            (folder).mkdir(parents=True, exist_ok=True)
            (folder / "blobs.bin").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(store, "write_cache_folder", full_disk)
    assert run_data(overrides) == 1
    assert "No space left" in capsys.readouterr().err
    chunks = run_dir_of(base) / "data" / "work" / "chunks"
    assert [p.name for p in chunks.iterdir()] == ["train-00000"]  # the complete one only, no temporaries
    monkeypatch.setattr(store, "write_cache_folder", real)
    assert run_data(overrides) == 0
    ref = [*[o for o in overrides if not o.startswith("run.dir=")], f"run.dir={tmp_path / 'ref'}"]
    assert run_data(ref) == 0
    _same_output(run_dir_of(base), tmp_path / "ref")


def test_non_utf8_prompt_file_is_exit_2_naming_file_and_line(tmp_path, tiny_target_dir, capsys):
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    run_dir = tmp_path / "run"
    assert run_data([f"target.model={tiny_target_dir}", f"run.dir={run_dir}", f"data.source={src}"]) == 2
    err = capsys.readouterr().err
    assert "latin1.jsonl:2" in err and "UTF-8" in err and "Traceback" not in err
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------------------
# Leftovers, damaged outputs, manifest counts


def _crash_writes(monkeypatch, after: int, sleep_s: float = 0.0) -> None:
    real = store.write_chunk
    calls = {"n": 0}

    def crash(*args, **kwargs):
        if calls["n"] == after:
            time.sleep(sleep_s)
            raise RuntimeError("simulated crash")
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "write_chunk", crash)


def test_temporaries_of_a_killed_merge_are_removed_and_nothing_else(base, monkeypatch):
    overrides = [*base, "data.logits.top_k=4"]
    _crash_writes(monkeypatch, after=1)
    assert run_data(overrides) == 1
    monkeypatch.undo()
    data = run_dir_of(base) / "data"
    # What a kill -9 inside save_split / merge_cache / a manifest write leaves (atomic_dir / atomic_write_json).
    ours = [data / ".train.k2j4x_1a.tmp", data / ".val.old-4242", data / "topk" / ".train.9zz1.tmp"]
    files = [data / ".manifest.json.abc123.tmp", data / ".merge.lock.0a1b2c3d.stale"]
    others = [data / ".notes.tmp", data / "train-backup.tmp", data / "topk" / ".mine.tmp"]
    for d in ours:
        d.mkdir(parents=True)
        (d / "data-00000-of-00001.arrow").write_bytes(b"half")
    for f in [*files, *others]:
        f.write_text("x")
    assert run_data(overrides) == 0
    assert not any(p.exists() for p in [*ours, *files])
    assert all(p.exists() for p in others)  # not the stage's: left alone
    (
        data / ".val.x7.tmp"
    ).mkdir()  # a kill -9 after the manifest was written: the "complete" rerun tidies too
    assert run_data(overrides) == 0
    assert not (data / ".val.x7.tmp").exists()


@pytest.mark.parametrize("damage", ["train", "topk/val", "topk/train/blobs.bin"])
def test_deleted_outputs_are_rebuilt_not_reported_complete(base, tmp_path, damage, capsys):
    overrides = [*base, "data.logits.top_k=4"]
    assert run_data(overrides) == 0
    ref = tmp_path / "ref"
    shutil.copytree(run_dir_of(base), ref)
    target = run_dir_of(base) / "data" / damage
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.write_bytes(target.read_bytes()[:-5])  # cut off
    capsys.readouterr()
    assert run_data(overrides) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "already complete" not in text and "rebuilding" in text and damage.split("/")[0] in text
    _same_output(ref, run_dir_of(base))
    assert run_data(overrides) == 0
    assert "already complete" in capsys.readouterr().out


def test_manifest_counts_source_records_and_wall_time_over_resumes(tmp_path, tiny_target_dir, monkeypatch):
    src = tmp_path / "p.jsonl"
    rows = [{"prompt": f"tell me about item {i}"} for i in range(30)]
    rows += [rows[0], rows[1], rows[2], {"prompt": "  "}, {"prompt": ""}]  # 3 duplicates, 2 empty
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    overrides = [
        f"target.model={tiny_target_dir}",
        f"run.dir={run_dir}",
        f"data.source={src}",
        "data.engine=hf",
        "data.batch_size=4",
        "data.max_new_tokens=6",
        "data.max_train_prompts=10",
        "data.val_fraction=0.2",
    ]
    _crash_writes(monkeypatch, after=1, sleep_s=1.5)  # the first invocation spends >= 1.5 s, then dies
    assert run_data(overrides) == 1
    monkeypatch.undo()
    assert run_data(overrides) == 0
    m = json.loads(manifest_path(run_dir).read_text())
    s = m["source"]
    assert s["source"] == str(src) and s["records_read"] == 35 and s["unique_prompts"] == 30
    assert s["dropped"] == {"duplicate": 3, "empty_or_no_user_turn": 2}
    assert sum(s["by_split"].values()) == 30 and set(s["by_split"]) == {"train", "val", "test"}
    train = m["splits"]["train"]
    assert train["prompts_in_split"] == s["by_split"]["train"] >= 10 and train["prompts_loaded"] == 10
    assert m["splits"]["val"]["prompts_in_split"] == s["by_split"]["val"]
    assert m["wall_s_total"] >= m["wall_s_last_invocation"] + 1.5


def test_compiled_vllm_generation_without_a_cpp_compiler_stops_before_writing(
    base, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    monkeypatch.setattr("distill.utils.subproc.cpp_compiler", lambda: None)
    assert run_data([*base, "data.engine=vllm", "data.vllm_enforce_eager=false"]) == 2
    err = capsys.readouterr().err
    assert "data.vllm_enforce_eager" in err and "C++ compiler" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "data").exists()


def test_cpp_compiler_is_found_on_this_machine():
    """The check asks inductor itself; the test machines have g++ (the eval's compiled decoding uses it)."""
    from distill.utils.subproc import cpp_compiler

    assert cpp_compiler()
