"""The train stage end to end on tiny models: acceptance gain, export, resume, signals, bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distill.config import load_config
from distill.errors import InputError, RuntimeFailure

REPO = Path(__file__).resolve().parents[1]
FAST = ["train.warmup_steps=2", "train.val_every=10", "train.ckpt_every=10", "run.threads=1"]


@pytest.fixture(scope="session")
def data_template(tmp_path_factory, tiny_target_dir) -> Path:
    """run_dir/data built once from the tiny target's greedy generations (+ a top-16 cache)."""
    from distill.train.synthetic import build_run_data

    root = tmp_path_factory.mktemp("train_data")
    build_run_data(root, tiny_target_dir, n_train=48, n_val=8, max_new_tokens=24, top_k=16)
    return root / "data"


def make_cfg(tiny_config_overrides, data_template, *extra: str):
    cfg = load_config(REPO / "configs/tiny.yaml", [*tiny_config_overrides, *FAST, *extra])
    if not (cfg.run_dir / "data").exists():
        shutil.copytree(data_template, cfg.run_dir / "data")
    return cfg


def draft_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def max_weight_diff(a: Path, b: Path) -> float:
    sa, sb = draft_state(a), draft_state(b)
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def assert_same_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    worst = max_weight_diff(a, b)
    assert worst <= atol, f"weights differ by {worst}"


def csv_val_rows(path: Path) -> dict[int, float]:
    """step -> val/expected_acceptance of the rows that carry it (one per validation)."""
    import csv

    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/expected_acceptance")]
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), f"validation rows repeated: {steps}"
    return {int(r["step"]): float(r["val/expected_acceptance"]) for r in rows}


def tensorboard_scalars(train_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(train_dir / "tensorboard"))
    acc.Reload()
    return sorted((e.step, e.value) for e in acc.Scalars(tag))


def test_smoke_acceptance_rises_and_export_loads(tiny_config_overrides, data_template):
    from transformers import AutoModelForCausalLM

    from distill import rundir
    from distill.models.draft import build_initial_draft
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=30")
    assert run(cfg) is None
    rd, td = cfg.run_dir, cfg.run_dir / "train"
    base = json.loads((td / "baseline.json").read_text())
    final = json.loads((td / "val_metrics.json").read_text())["final"]
    assert final["step"] == 30
    assert final["expected_acceptance"] > base["expected_acceptance"] + 0.02, (base, final)
    assert final["loss"] < base["loss"]
    assert set(final["per_position"]) == {*map(str, range(8)), "8+"}
    assert sum(p["tokens"] for p in final["per_position"].values()) == final["tokens"]
    assert rundir.is_complete(cfg, "train")
    history = json.loads((td / "val_history.json").read_text())
    assert [h["step"] for h in history] == [10, 20, 30]
    header = (td / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val/expected_acceptance", "val/top1_agreement", "train/loss", "train/tokens_per_s"} <= set(
        header
    )
    assert list((td / "tensorboard").rglob("events.out.tfevents.*"))
    assert (rd / "draft_init" / "model.safetensors").is_file()
    # The undistilled draft is the curves' step 0, in metrics.csv and in TensorBoard, and every row sits at the
    # number of optimizer steps taken, as in val_history.json (not at Lightning's 0-based batch index).
    csv_val = csv_val_rows(td / "metrics.csv")
    assert sorted(csv_val) == [0, 10, 20, 30]
    assert csv_val[0] == pytest.approx(base["expected_acceptance"])
    assert csv_val[30] == pytest.approx(final["expected_acceptance"])
    tb = tensorboard_scalars(td, "val/expected_acceptance")
    assert [s for s, _ in tb] == [0, 10, 20, 30]
    assert tb[0][1] == pytest.approx(base["expected_acceptance"])
    assert [s for s, _ in tensorboard_scalars(td, "train/loss")][-1] == 30

    # The export is an HF folder whose logits equal the trained weights in the final checkpoint.
    exported = AutoModelForCausalLM.from_pretrained(str(rd / "draft"))
    ckpt = torch.load(td / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 30
    trained = build_initial_draft(cfg, Path(cfg.target.model))
    trained.load_state_dict({k.removeprefix("draft."): v for k, v in ckpt["state_dict"].items()})
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 2]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained.eval()(ids).logits)
        untrained = AutoModelForCausalLM.from_pretrained(str(rd / "draft_init"))
        assert not torch.allclose(untrained(ids).logits, exported(ids).logits)
    assert (rd / "draft" / "tokenizer.json").is_file() and (rd / "draft" / "generation_config.json").is_file()


def test_cached_teacher_trains_without_target(tiny_config_overrides, data_template, monkeypatch):
    import distill.models.draft as draft_mod
    import distill.train.stage as stage

    def no_teacher(*a, **k):
        raise AssertionError("the target must not be loaded with train.teacher=cached")

    monkeypatch.setattr(draft_mod, "load_causal_lm", no_teacher)
    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=20", "train.teacher=cached")
    stage.run(cfg)
    td = cfg.run_dir / "train"
    base = json.loads((td / "baseline.json").read_text())
    final = json.loads((td / "val_metrics.json").read_text())["final"]
    # On a top-16 cache, expected acceptance is an upper bound (the rest bucket merges 496 tokens), so the
    # gain looks smaller than with full logits; the loss must still fall clearly.
    assert final["expected_acceptance"] > base["expected_acceptance"] + 0.005, (base, final)
    assert final["loss"] < 0.9 * base["loss"], (base, final)


def test_grad_accum_matches_one_big_batch(tiny_config_overrides, data_template, tmp_path):
    """batch 8 x accum 1 and batch 4 x accum 2 see the same rows per step: same weights (float noise)."""
    from distill.train.stage import run

    a = make_cfg(tiny_config_overrides, data_template, "train.max_steps=4", f"run.dir={tmp_path / 'a'}")
    b = make_cfg(
        tiny_config_overrides,
        data_template,
        "train.max_steps=4",
        f"run.dir={tmp_path / 'b'}",
        "train.batch_size=4",
        "train.grad_accum=2",
    )
    run(a)
    run(b)
    d_ab = max_weight_diff(a.run_dir / "draft", b.run_dir / "draft")
    # ... while a different loss really changes the result (the comparison can fail). Adam turns float
    # summation-order noise in near-zero gradients into ~1e-5 weight noise after a few steps at lr 1e-3.
    c = make_cfg(
        tiny_config_overrides,
        data_template,
        "train.max_steps=4",
        f"run.dir={tmp_path / 'c'}",
        "train.loss=rkl",
    )
    run(c)
    d_ac = max_weight_diff(a.run_dir / "draft", c.run_dir / "draft")
    assert d_ab < 1e-4 and d_ac > 20 * d_ab, (d_ab, d_ac)


def test_loss_mix_and_jsd_run(tiny_config_overrides, data_template):
    from distill.train.stage import run

    cfg = make_cfg(
        tiny_config_overrides,
        data_template,
        "train.max_steps=3",
        "train.loss=mix",
        "train.loss_weights.jsd=1.0",
        "train.loss_weights.ce=0.5",
        "train.jsd_beta=0.3",
    )
    run(cfg)
    assert (cfg.run_dir / "draft" / "model.safetensors").is_file()


def test_nan_loss_stops_with_step_and_hint(tiny_config_overrides, data_template, monkeypatch):
    import distill.train.module as module
    from distill.train.stage import run

    real = module.per_token_loss
    monkeypatch.setattr(module, "per_token_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=3")
    with pytest.raises(RuntimeFailure, match=r"step 0 .*train\.lr"):
        run(cfg)


def test_missing_data_is_input_error_and_writes_nothing(tiny_config_overrides):
    from distill.train.stage import run

    cfg = load_config(REPO / "configs/tiny.yaml", tiny_config_overrides)
    with pytest.raises(InputError, match="distill data"):
        run(cfg)
    assert not cfg.run_dir.exists()


def test_cached_without_cache_is_input_error(tiny_config_overrides, data_template):
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "train.teacher=cached")
    shutil.rmtree(cfg.run_dir / "data" / "topk")
    with pytest.raises(InputError, match="top_k"):
        run(cfg)
    assert not (cfg.run_dir / "config.yaml").exists()


def test_config_problems_listed():
    from distill.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(
            REPO / "configs/tiny.yaml",
            ["train.teacher=cached", "train.kd_temperature=2.0", "train.loss=mix", "train.precision=16"],
        )
    text = str(e.value)
    assert "train.kd_temperature" in text and "train.loss_weights" in text and "train.precision" in text
    # warm-up longer than a short run is capped at max_steps, not an error
    assert load_config(REPO / "configs/tiny.yaml", ["train.max_steps=5", "train.warmup_steps=100"])


def test_resume_refuses_checkpoint_of_other_config(tiny_config_overrides, data_template):
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=2", "train.ckpt_every=1")
    run(cfg)
    other = make_cfg(tiny_config_overrides, data_template, "train.max_steps=2", "train.lr=0.5")
    with pytest.raises(InputError, match="different config"):
        run(other)
    again = make_cfg(
        tiny_config_overrides, data_template, "train.max_steps=2", "train.lr=0.5", "train.resume=never"
    )
    run(again)


# ---------------------------------------------------------------------------------------------------------
# Interruption: real processes (`python -m distill train`), killed with SIGKILL or stopped with SIGTERM


def _cli(cfg_overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "distill", "train", "-c", str(REPO / "configs/tiny.yaml"), *cfg_overrides]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def _start_and_signal(args: list[str], ckpt: Path, sig: int, log: Path, *, group: bool = False) -> int:
    """Start a training process, send `sig` once its first checkpoint exists, return its exit code.

    `group`: signal its whole process group, as a terminal's Ctrl-C does (every DDP rank gets it)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            args, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=group
        )
        deadline = time.time() + 300
        while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        return proc.wait(timeout=300)


@pytest.mark.slow
def test_resume_after_kill9_and_sigterm_match_uninterrupted(tiny_config_overrides, data_template, tmp_path):
    steps = ["train.max_steps=40", "train.ckpt_every=3", "train.val_every=20"]
    runs = {}
    for name in ("full", "kill9", "sigterm", "sigint"):
        cfg = make_cfg(tiny_config_overrides, data_template, *steps, f"run.dir={tmp_path / name}")
        runs[name] = (cfg, _cli([*tiny_config_overrides, *FAST, *steps, f"run.dir={cfg.run_dir}"]))

    cfg, args = runs["full"]
    assert subprocess.run(args, cwd=REPO, env=_env(), capture_output=True).returncode == 0

    for name, sig, want_rc in (
        ("kill9", signal.SIGKILL, -signal.SIGKILL),
        ("sigterm", signal.SIGTERM, 130),
        ("sigint", signal.SIGINT, 130),  # Ctrl-C: Lightning alone would exit 1 without saving
    ):
        cfg, args = runs[name]
        ckpt = cfg.run_dir / "train" / "last.ckpt"
        rc = _start_and_signal(args, ckpt, sig, tmp_path / f"{name}.log")
        assert rc == want_rc, (tmp_path / f"{name}.log").read_text()[-3000:]
        assert not (cfg.run_dir / "draft").exists(), f"{name}: the run finished before the signal"
        step = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
        assert 0 < step < 40
        done = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resuming from" in (cfg.run_dir / "distill.log").read_text()
        assert_same_weights(runs["full"][0].run_dir / "draft", cfg.run_dir / "draft")
        assert 0 in csv_val_rows(cfg.run_dir / "train" / "metrics.csv")  # the first attempt's baseline row


def test_bf16_mixed_with_bf16_teacher_runs(tiny_config_overrides, data_template):
    from distill.train.stage import run

    cfg = make_cfg(
        tiny_config_overrides,
        data_template,
        "train.max_steps=3",
        "train.val_every=3",
        "train.precision=bf16-mixed",
        "train.teacher_dtype=bfloat16",
    )
    run(cfg)
    final = json.loads((cfg.run_dir / "train" / "val_metrics.json").read_text())["final"]
    assert final["step"] == 3 and 0.0 < final["expected_acceptance"] < 1.0
    # The export stays float32 (Lightning's bf16-mixed keeps float32 master weights).
    assert all(t.dtype == torch.float32 for t in draft_state(cfg.run_dir / "draft").values())


def test_rerun_of_finished_run_is_a_noop_resume(tiny_config_overrides, data_template):
    from distill.train.stage import run

    cfg = make_cfg(
        tiny_config_overrides, data_template, "train.max_steps=4", "train.val_every=4", "train.ckpt_every=2"
    )
    run(cfg)
    before = draft_state(cfg.run_dir / "draft")
    run(cfg)  # resumes from last.ckpt at max_steps: no further step, same export
    after = draft_state(cfg.run_dir / "draft")
    assert all(torch.equal(before[k], after[k]) for k in before)
    history = json.loads((cfg.run_dir / "train" / "val_history.json").read_text())
    assert [h["step"] for h in history] == [4]
    assert sorted(csv_val_rows(cfg.run_dir / "train" / "metrics.csv")) == [0, 4]


# ---------------------------------------------------------------------------------------------------------
# Ctrl-C in process, checkpoint fallback, padded embedding tables


def _signal_at_step(monkeypatch, step: int, times: int = 1) -> None:
    """Send SIGINT to this process `times` times in the training step that ends at global step `step`."""
    import distill.train.module as module

    real = module.DistillModule._log_train

    def log_train(self, *a, **k):
        if self.global_step == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return real(self, *a, **k)

    monkeypatch.setattr(module.DistillModule, "_log_train", log_train)


def test_ctrl_c_saves_at_the_step_boundary_and_resumes(tiny_config_overrides, data_template, monkeypatch):
    from distill.errors import Interrupted
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=6", "train.val_every=3")
    ckpt = cfg.run_dir / "train" / "last.ckpt"
    handler = signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as m:
        _signal_at_step(m, 2)
        with pytest.raises(Interrupted, match="SIGINT"):  # not Lightning's sys.exit(1)
            run(cfg)
    assert signal.getsignal(signal.SIGINT) is handler  # restored for the rest of the process
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 2
    assert not (cfg.run_dir / "draft").exists()
    run(cfg)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 6
    assert (cfg.run_dir / "draft" / "model.safetensors").is_file()


def test_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(
    tiny_config_overrides, data_template, monkeypatch
):
    from distill.errors import Interrupted
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=6", "train.ckpt_every=1")
    _signal_at_step(monkeypatch, 2, times=2)
    with pytest.raises(Interrupted, match="second Ctrl-C"):
        run(cfg)
    # Stopped inside step 2, before its checkpoint: the one of step 1 is the last, and it is valid.
    ckpt = cfg.run_dir / "train" / "last.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 1


def test_unreadable_last_checkpoint_falls_back_to_the_newest_valid_one(
    tiny_config_overrides, data_template, tmp_path
):
    from distill.train.stage import run, validate

    steps = ["train.max_steps=3", "train.val_every=3", "train.ckpt_every=1"]
    cfg = make_cfg(tiny_config_overrides, data_template, *steps)
    run(cfg)
    td = cfg.run_dir / "train"
    last = td / "last.ckpt"
    last.write_bytes(b"not a checkpoint")
    with pytest.raises(InputError, match="no other checkpoint in .* to fall back to"):
        validate(cfg)

    # Candidates that are no good are named; files that are not checkpoints are not candidates.
    (td / "old.ckpt").write_bytes(b"broken too")
    (td / "notes.txt").write_text("not a checkpoint")
    foreign = make_cfg(
        tiny_config_overrides, data_template, *steps, "train.lr=0.5", f"run.dir={tmp_path / 'f'}"
    )
    run(foreign)
    shutil.copy(foreign.run_dir / "train" / "last.ckpt", td / "foreign.ckpt")
    with pytest.raises(
        InputError, match=r"foreign\.ckpt trained with a different config; old\.ckpt cannot be"
    ):
        validate(cfg)

    # The same training in another folder: a valid checkpoint, the newest, so it is the one resumed.
    twin = make_cfg(tiny_config_overrides, data_template, *steps, f"run.dir={tmp_path / 'twin'}")
    run(twin)
    shutil.copy(twin.run_dir / "train" / "last.ckpt", td / "backup.ckpt")
    assert validate(cfg).resume_from == td / "backup.ckpt"
    run(cfg)  # resumes at max_steps: exports, and last.ckpt is valid again
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 3
    assert validate(cfg).resume_from == last
    assert_same_weights(cfg.run_dir / "draft", twin.run_dir / "draft")


@pytest.fixture(scope="session")
def padded_target_dir(tmp_path_factory, tiny_target_dir) -> Path:
    """The tiny target with its embedding tables padded from 512 (the tokenizer) to 576 rows, the padded output
    rows scaled up so that they hold real probability mass (an untrained model's padding can)."""
    from distill.models.draft import load_causal_lm, load_tokenizer

    model = load_causal_lm(tiny_target_dir)
    tok = load_tokenizer(tiny_target_dir)
    assert len(tok) == 512
    model.resize_token_embeddings(576, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[512:] = 2.0 * head[:64]
    out = tmp_path_factory.mktemp("padded_target") / "model"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _spy_vocab(monkeypatch) -> list[int]:
    import distill.train.stage as stage

    seen: list[int] = []
    real = stage.build_module

    def build_module(cfg, draft, teacher, spec, vocab):
        seen.append(vocab)
        return real(cfg, draft, teacher, spec, vocab)

    monkeypatch.setattr(stage, "build_module", build_module)
    return seen


def test_padded_embeddings_compare_the_tokenizer_rows_only(
    tiny_config_overrides, data_template, padded_target_dir, monkeypatch
):
    from distill.models.draft import load_model_config
    from distill.train.stage import run

    seen = _spy_vocab(monkeypatch)
    cfg = make_cfg(
        tiny_config_overrides,
        data_template,
        f"target.model={padded_target_dir}",
        "train.max_steps=3",
        "train.val_every=3",
    )
    run(cfg)
    assert seen == [512]
    assert int(load_model_config(cfg.run_dir / "draft").vocab_size) == 576  # the export keeps its table
    final = json.loads((cfg.run_dir / "train" / "val_metrics.json").read_text())["final"]
    assert 0.0 < final["expected_acceptance"] < 1.0


def test_padded_target_cache_rows_past_the_tokenizer_train(
    tiny_config_overrides, data_template, padded_target_dir, monkeypatch
):
    import datasets

    from distill.data.format import data_dir, open_topk_cache, split_dir
    from distill.models.draft import load_causal_lm
    from distill.train.stage import run
    from distill.train.synthetic import write_topk

    seen = _spy_vocab(monkeypatch)
    cfg = make_cfg(
        tiny_config_overrides,
        data_template,
        f"target.model={padded_target_dir}",
        "train.max_steps=3",
        "train.val_every=3",
        "train.teacher=cached",
    )
    shutil.rmtree(data_dir(cfg.run_dir) / "topk")
    model = load_causal_lm(padded_target_dir).eval()
    for split in ("train", "val"):
        rows = list(datasets.load_from_disk(str(split_dir(cfg.run_dir, split))))
        write_topk(cfg.run_dir, split, model, rows, 16)
    cache = open_topk_cache(cfg.run_dir, "train")
    assert any(bool((torch.as_tensor(cache.get(i)[0]) >= 512).any()) for i in range(len(cache)))
    run(cfg)
    assert seen == [512]
    base = json.loads((cfg.run_dir / "train" / "baseline.json").read_text())
    final = json.loads((cfg.run_dir / "train" / "val_metrics.json").read_text())["final"]
    assert all(math.isfinite(f["loss"]) for f in (base, final))
    assert final["loss"] < base["loss"]


def test_freeze_embeddings_keeps_the_head_and_trains_the_rest(tiny_config_overrides, data_template):
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=10", "train.freeze_embeddings=true")
    assert run(cfg) is None
    before, after = draft_state(cfg.run_dir / "draft_init"), draft_state(cfg.run_dir / "draft")
    emb = "model.embed_tokens.weight"
    assert torch.equal(before[emb], after[emb])
    if "lm_head.weight" in after:
        assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    moved = [k for k in before if k != emb and not torch.equal(before[k], after[k])]
    assert any(".layers.0." in k for k in moved)


def test_head_candidates_train_on_a_subset_and_validate_on_the_full_vocabulary(
    tiny_config_overrides, data_template, monkeypatch
):
    from distill.train import module
    from distill.train.stage import run

    sizes: list[int] = []
    real = module.Predictions.restricted_to_candidates

    def spy(self, size):
        out = real(self, size)
        sizes.append(-1 if out is None else int(out[0].numel()))
        return out

    monkeypatch.setattr(module.Predictions, "restricted_to_candidates", spy)
    cfg = make_cfg(
        tiny_config_overrides,
        data_template,
        "train.max_steps=20",
        "train.teacher=cached",
        "train.head_candidates=64",
    )
    assert run(cfg) is None
    vocab = len(json.loads((cfg.run_dir / "draft" / "tokenizer.json").read_text())["model"]["vocab"])
    assert sizes and all(64 <= n < vocab for n in sizes), (sizes, vocab)  # every step on a strict subset
    td = cfg.run_dir / "train"
    base = json.loads((td / "baseline.json").read_text())
    final = json.loads((td / "val_metrics.json").read_text())["final"]
    # Validation's loss is over the whole vocabulary, so it falls only if the subset's training moved the
    # draft's full distribution towards the teacher's.
    assert final["loss"] < 0.9 * base["loss"], (base, final)
    assert final["expected_acceptance"] > base["expected_acceptance"], (base, final)


def test_retain_freed_memory_is_applied_unless_switched_off(
    tiny_config_overrides, data_template, monkeypatch, tmp_path
):
    """train.retain_freed_memory (default true) asks glibc to keep freed memory (distill.utils.malloc)."""
    import distill.train.stage as stage
    from distill.utils import malloc

    calls: list[bool] = []
    trims: list[bool] = []
    monkeypatch.setattr(malloc, "retain_freed_memory", lambda *a: calls.append(True) or True)
    monkeypatch.setattr(malloc, "trim_freed_memory", lambda *a: trims.append(True) or True)
    monkeypatch.setattr(malloc, "TRIM_EVERY_STEPS", 1)
    stage.run(make_cfg(tiny_config_overrides, data_template, "train.max_steps=2"))
    assert calls == [True]
    # the retained memory went back after each of the 2 steps (every 1 here) and once more when training ended
    assert trims == [True, True, True]
    off = make_cfg(
        tiny_config_overrides,
        data_template,
        "train.max_steps=2",
        f"run.dir={tmp_path / 'off'}",
        "train.retain_freed_memory=false",
    )
    stage.run(off)
    assert calls == [True] and (off.run_dir / "draft" / "model.safetensors").is_file()
    assert trims == [True, True, True]  # nothing retained, nothing to trim


def test_final_log_keeps_an_untrained_drafts_zero_agreement():
    """The closing log line shows an undistilled draft's top-1 of 0.0 as 0.0, and only a missing figure as nan."""
    import math

    from distill.train.stage import _or_nan

    assert _or_nan(0.0) == 0.0 and _or_nan(0.25) == 0.25 and math.isnan(_or_nan(None))


def test_vocab_size_exports_a_trimmed_draft_the_eval_accepts(tiny_config_overrides, data_template):
    from distill.evaluate.stage import preflight
    from distill.models import vocab
    from distill.models.draft import load_causal_lm
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=4", "draft.vocab_size=500")
    assert run(cfg) is None
    out = cfg.run_dir / "draft"
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 500 and config[vocab.TRIMMED_FROM_KEY] == 512
    kept, vocab_len = vocab.read_kept_ids(out)
    assert vocab_len == 512 and len(kept) == 500
    # The training rows' tokens are kept before any filler (with the always-kept ones, fewer than 500 here).
    seen = set(
        vocab.count_tokens(
            __import__("datasets").load_from_disk(str(cfg.run_dir / "data/train"))["input_ids"]
        )
    )
    assert len(seen) < 500 and seen <= set(kept)
    # Its logits at the kept tokens are the trained draft's, whose full copy draft_init is not.
    ckpt = torch.load(cfg.run_dir / "train" / "last.ckpt", map_location="cpu", weights_only=True)
    from distill.models.draft import build_initial_draft

    trained = build_initial_draft(cfg, Path(cfg.target.model))
    trained.load_state_dict({k.removeprefix("draft."): v for k, v in ckpt["state_dict"].items()})
    ids = torch.tensor([kept[30:40]])
    with torch.no_grad():
        got = load_causal_lm(out).eval()(input_ids=ids).logits
        torch.testing.assert_close(got[..., kept], trained.eval()(input_ids=ids).logits[..., kept])
    plan = preflight(load_config(REPO / "configs/tiny.yaml", [*tiny_config_overrides, "eval.engine=hf"]))
    assert plan.drafts["distilled"] == out


def test_too_small_vocab_size_stops_before_training(tiny_config_overrides, data_template):
    from distill.train.stage import run

    cfg = make_cfg(tiny_config_overrides, data_template, "draft.vocab_size=100")
    with pytest.raises(
        InputError, match=r"draft\.vocab_size: 100 cannot hold the \d+ special and single-byte"
    ):
        run(cfg)
    assert not (cfg.run_dir / "train").exists()
