"""The train stage recovering from what goes wrong between attempts: a fresh start after a config change cut
short, damaged checkpoints, a validation lost to a hard kill, train.num_workers changed on resume, reruns of a
finished run; and the model/data checks that must refuse bad input before anything is written."""

# ruff: noqa: F401, F811  (the imported `data_template` fixture, taken by the tests as an argument)
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_folders import model_copy
from test_train_stage import (  # the shared tiny-run helpers (and the session's data template)
    _signal_at_step,
    csv_val_rows,
    data_template,
    make_cfg,
)

from distill.errors import InputError, Interrupted, RuntimeFailure


def _flip(path: Path, xor: int | None = None) -> None:
    """Damage 4 KiB a third into `path` the way bit rot does: the file still unpickles. `xor` flips bits (the
    floats stay finite), None writes 0xFF (nan)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    for i in range(start, start + 4096):
        data[i] = 0xFF if xor is None else data[i] ^ xor
    path.write_bytes(bytes(data))


def _history_steps(run_dir: Path) -> list[int]:
    path = run_dir / "train" / "val_history.json"
    return [h["step"] for h in json.loads(path.read_text())] if path.is_file() else []


def _train_rows(path: Path) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["train/loss"])) for r in _csv_rows(path) if r.get("train/loss")]


def _csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------------------
# 1. A fresh start discards the earlier training first


def test_changed_config_fresh_start_cut_short_before_its_first_checkpoint_reruns(
    tiny_config_overrides, data_template, monkeypatch
):
    from distill import rundir
    from distill.train.stage import run

    old = make_cfg(tiny_config_overrides, data_template, "train.max_steps=2", "train.ckpt_every=1")
    run(old)
    changed = ("train.max_steps=4", "train.val_every=2", "train.ckpt_every=2", "train.lr=0.002")
    # `distill run` reruns a changed train stage with resume=never; a second Ctrl-C stops it inside its first
    # step, before any checkpoint of the new training exists.
    with monkeypatch.context() as m:
        _signal_at_step(m, 1, times=2)
        with pytest.raises(Interrupted, match="second Ctrl-C"):
            run(make_cfg(tiny_config_overrides, data_template, *changed, "train.resume=never"))
    rd = old.run_dir
    assert not list((rd / "train").glob("*.ckpt")), "the old config's checkpoint outlived the fresh start"
    assert not (rd / "draft").exists() and not rundir.completion_path(rd, "train").exists()
    assert (rd / "draft_init" / "model.safetensors").is_file()

    # The rerun plans a plain start (resume=auto): it finds nothing foreign to refuse, and trains.
    cfg = make_cfg(tiny_config_overrides, data_template, *changed)
    run(cfg)
    assert rundir.is_complete(cfg, "train")
    assert torch.load(rd / "train" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert _history_steps(rd) == [2, 4]


# ---------------------------------------------------------------------------------------------------------
# 2. Damaged checkpoints and non-finite drafts


def test_checkpoint_checksum_catches_bit_rot_that_still_loads(tmp_path):
    from distill.train.callbacks import checksum_path, checksum_problem, write_checksum

    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 7, "state_dict": {"w": torch.linspace(-1, 1, 8192)}}, ckpt)
    write_checksum(ckpt, 7)
    assert checksum_problem(ckpt, 7) is None
    _flip(ckpt, xor=0x01)
    state = torch.load(ckpt, weights_only=True)  # loads, and every value is finite: only the checksum knows
    assert bool(torch.isfinite(state["state_dict"]["w"]).all())
    assert "damaged" in (checksum_problem(ckpt, 7) or "")
    # The record of another save (a crash between the rename and the record) and a missing record: unverified.
    assert checksum_problem(ckpt, 8) is None
    checksum_path(ckpt).unlink()
    assert checksum_problem(ckpt, 7) is None


def test_checkpoint_with_non_finite_weights_is_not_resumable(tmp_path):
    from distill.train.stage import _ckpt_problem

    ckpt = tmp_path / "old.ckpt"  # no checksum record: written before checksums
    state = {"global_step": 3, "hyper_parameters": {"stage_hash": "h"}, "optimizer_states": []}
    torch.save({**state, "state_dict": {"draft.w": torch.ones(4)}}, ckpt)
    assert _ckpt_problem(ckpt, "h") is None
    torch.save({**state, "state_dict": {"draft.w": torch.tensor([1.0, float("nan")])}}, ckpt)
    assert "non-finite" in (_ckpt_problem(ckpt, "h") or "")


def test_damaged_last_checkpoint_falls_back_and_is_restored(tiny_config_overrides, data_template):
    from distill.train.callbacks import checksum_path, checksum_problem
    from distill.train.stage import run, validate
    from distill.utils.fs import sha256_file

    cfg = make_cfg(
        tiny_config_overrides, data_template, "train.max_steps=3", "train.val_every=3", "train.ckpt_every=1"
    )
    run(cfg)
    td = cfg.run_dir / "train"
    last = td / "last.ckpt"
    assert json.loads(checksum_path(last).read_text())["global_step"] == 3
    shutil.copy(last, td / "backup.ckpt")  # a copy has no checksum record: loadable, unverified
    _flip(last, xor=0x01)
    assert validate(cfg).resume_from == td / "backup.ckpt"
    run(cfg)  # resumes from the copy, which is put back over the damaged last.ckpt with a fresh record
    assert sha256_file(last) == sha256_file(td / "backup.ckpt")
    assert checksum_problem(last, 3) is None
    assert json.loads(checksum_path(last).read_text())["global_step"] == 3
    _flip(last, xor=0x01)
    (td / "backup.ckpt").unlink()
    with pytest.raises(InputError, match=r"damaged \(its sha256 differs.*no other checkpoint"):
        validate(cfg)


def test_missing_last_checkpoint_with_only_foreign_ones_is_refused_not_deleted(
    tiny_config_overrides, data_template
):
    from distill.train.stage import validate

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_steps=2", "train.ckpt_every=1")
    td = cfg.run_dir / "train"
    td.mkdir(parents=True)
    state = {"global_step": 1, "hyper_parameters": {"stage_hash": "another config"}, "optimizer_states": []}
    torch.save({**state, "state_dict": {"draft.w": torch.ones(2)}}, td / "copy.ckpt")
    with pytest.raises(InputError, match=r"no last\.ckpt.*copy\.ckpt trained with a different config"):
        validate(cfg)
    assert (td / "copy.ckpt").is_file()


def test_export_refuses_a_draft_with_non_finite_weights(tiny_llama, tiny_tokenizer, tmp_path):
    from types import SimpleNamespace

    from distill.train.stage import _export

    with torch.no_grad():
        tiny_llama.model.norm.weight[0] = float("nan")
    cfg = SimpleNamespace(run_dir=tmp_path)
    with pytest.raises(RuntimeFailure, match=r"non-finite weights .*model\.norm\.weight"):
        _export(cfg, SimpleNamespace(draft=tiny_llama), tiny_tokenizer, tmp_path)  # type: ignore[arg-type]
    assert not (tmp_path / "draft").exists()


# ---------------------------------------------------------------------------------------------------------
# 3. A validation lost to a hard kill runs on resume


class HardKill(Exception):
    """Stands in for SIGKILL: the process stops inside the validation, after the step's checkpoint was saved."""


def test_validation_cut_short_after_its_checkpoint_runs_on_resume(
    tiny_config_overrides, data_template, monkeypatch, tmp_path
):
    import distill.train.module as module
    from distill.train.stage import run

    steps = ("train.max_steps=6", "train.val_every=3", "train.ckpt_every=3")
    full = make_cfg(tiny_config_overrides, data_template, *steps, f"run.dir={tmp_path / 'full'}")
    run(full)
    cfg = make_cfg(tiny_config_overrides, data_template, *steps)
    real = module.DistillModule.validation_step

    def killed(self, batch, batch_idx):
        if self.trainer.state.fn == "fit" and self.global_step == 3:
            raise HardKill
        return real(self, batch, batch_idx)

    with monkeypatch.context() as m:
        m.setattr(module.DistillModule, "validation_step", killed)
        with pytest.raises(HardKill):
            run(cfg)
    assert torch.load(cfg.run_dir / "train" / "last.ckpt", weights_only=True)["global_step"] == 3
    assert _history_steps(cfg.run_dir) == []
    run(cfg)
    assert _history_steps(cfg.run_dir) == [3, 6]
    # Measured on the checkpoint's weights: the uninterrupted run's figures at step 3.
    want = json.loads((full.run_dir / "train" / "val_history.json").read_text())
    got = json.loads((cfg.run_dir / "train" / "val_history.json").read_text())
    for a, b in zip(want, got, strict=True):
        assert a["expected_acceptance"] == pytest.approx(b["expected_acceptance"], abs=1e-6)
    assert sorted(csv_val_rows(cfg.run_dir / "train" / "metrics.csv")) == [0, 3, 6]


# ---------------------------------------------------------------------------------------------------------
# 4. train.num_workers changed between attempts; 5. metrics.csv across attempts


def _loader(workers: int, data: list[int]):
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    from distill.train.data import PositionedLoader

    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3, drop_last=True)
    return PositionedLoader(data, batch_size=4, sampler=sampler, drop_last=True, num_workers=workers)


def _epoch(loader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)  # as Lightning does at each epoch start
    return [b.tolist() for b in loader]


def test_loader_position_resumes_with_any_worker_count():
    data = list(range(24))
    epoch1, epoch2 = _epoch(_loader(0, data), 1), _epoch(_loader(0, data), 2)
    for before, after in ((0, 2), (2, 0)):
        first = _loader(before, data)
        first.sampler.set_epoch(1)
        it = iter(first)
        seen = [next(it).tolist() for _ in range(2)]
        again = _loader(after, data)
        again.load_state_dict(first.state_dict())  # Lightning restores the state before it sets the epoch
        assert seen + _epoch(again, 1) == epoch1, (before, after)
    # Resumed twice in one epoch: the second save counts the batches handed out before the first resume too.
    first = _loader(0, data)
    first.sampler.set_epoch(1)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(2)]
    second = _loader(2, data)
    second.load_state_dict(first.state_dict())
    it = iter(second)
    seen += [next(it).tolist()]
    assert second.state_dict()["distill_position"] == {"epoch": 1, "batches": 3}
    third = _loader(0, data)
    third.load_state_dict(second.state_dict())
    assert seen + _epoch(third, 1) == epoch1
    # Saved after the epoch's last batch: the next epoch starts whole (not skipped).
    first = _loader(0, data)
    assert _epoch(first, 1) == epoch1
    again = _loader(2, data)
    again.load_state_dict(first.state_dict())
    assert _epoch(again, 2) == epoch2


def test_loader_reads_the_position_of_a_torchdata_state():
    """Checkpoints written before PositionedLoader hold torchdata's own state; its position carries over."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    data = list(range(24))
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3, drop_last=True)
    old = StatefulDataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    sampler.set_epoch(1)
    it = iter(old)
    seen = [next(it).tolist() for _ in range(3)]
    again = _loader(2, data)
    again.load_state_dict(old.state_dict())
    assert seen + _epoch(again, 1) == _epoch(_loader(0, data), 1)


def test_resume_with_other_num_workers_then_rerun_finished_run_keeps_rows(
    tiny_config_overrides, data_template, monkeypatch
):
    from distill.train.stage import run

    # Validation at 3 in fit, and a stand-alone final one at 4 (4 % 3 != 0), repeated by every rerun.
    steps = ("train.max_steps=4", "train.val_every=3", "train.ckpt_every=1", "train.log_every=1")
    with monkeypatch.context() as m:
        _signal_at_step(m, 2)
        with pytest.raises(Interrupted):
            run(make_cfg(tiny_config_overrides, data_template, *steps))
    cfg = make_cfg(tiny_config_overrides, data_template, *steps, "train.num_workers=1")
    run(cfg)
    assert (cfg.run_dir / "draft" / "model.safetensors").is_file()
    metrics = cfg.run_dir / "train" / "metrics.csv"
    before = _train_rows(metrics)
    assert before[-1][0] == 4
    run(cfg)  # a rerun of the finished run: its only row is the final validation again
    assert _train_rows(metrics) == before
    assert sorted(csv_val_rows(metrics)) == [0, 3, 4]


def test_merge_replaces_replayed_rows_per_family(tmp_path):
    from distill.train.stage import merge_csv_logs

    header = "step,train/loss,val/loss,val_pos/loss_0\n"
    first = "0,,2.0,2.1\n1,1.9,,\n2,1.8,,\n2,,1.7,1.6\n3,1.5,,\n"  # cut short after step 3
    resumed = "3,1.45,,\n4,1.4,,\n4,,1.3,1.2\n"  # resumed from the checkpoint of step 2
    rerun = "4,,1.3,1.2\n"  # a rerun of the finished run repeats the final validation only
    for i, body in enumerate((first, resumed, rerun)):
        (tmp_path / "csv" / f"version_{i}").mkdir(parents=True)
        (tmp_path / "csv" / f"version_{i}" / "metrics.csv").write_text(header + body)
    rows = _csv_rows(merge_csv_logs(tmp_path))
    assert [(r["step"], r["train/loss"]) for r in rows if r["train/loss"]] == [
        ("1", "1.9"),
        ("2", "1.8"),
        ("3", "1.45"),
        ("4", "1.4"),
    ]
    assert [(r["step"], r["val/loss"]) for r in rows if r["val/loss"]] == [
        ("0", "2.0"),
        ("2", "1.7"),
        ("4", "1.3"),
    ]


# ---------------------------------------------------------------------------------------------------------
# 6-8. Input the validation refuses before anything is written


def _run_with_broken_model(which, overrides, data_template, folder, match):
    """Train with `folder` as the target or as a pretrained draft; it must be refused before anything is written."""
    from distill.train.stage import run

    extra = (
        [f"target.model={folder}"]
        if which == "target"
        else ["draft.init=pretrained", f"draft.model={folder}"]
    )
    cfg = make_cfg(overrides, data_template, *extra)
    with pytest.raises(InputError, match=match):
        run(cfg)
    assert not (cfg.run_dir / "config.yaml").exists()


@pytest.mark.parametrize("which", ["target", "draft"])
def test_pickle_only_weights_are_refused_before_writing(
    which, tiny_config_overrides, data_template, tiny_target_dir, tiny_draft_dir, tmp_path
):
    src = tiny_target_dir if which == "target" else tiny_draft_dir
    folder = model_copy(src, tmp_path / "pickled", weights="pickled")
    _run_with_broken_model(
        which, tiny_config_overrides, data_template, folder, rf"{which}\.model: .*pickled weights"
    )


@pytest.mark.parametrize("which", ["target", "draft"])
def test_custom_code_names_trust_remote_code(
    which, tiny_config_overrides, data_template, tiny_target_dir, tiny_draft_dir, tmp_path
):
    src = tiny_target_dir if which == "target" else tiny_draft_dir
    folder = model_copy(src, tmp_path / "custom", remote_code=True)
    match = rf"{which}\.trust_remote_code: .*only if you trust this code"
    _run_with_broken_model(which, tiny_config_overrides, data_template, folder, match)


def test_max_seq_len_that_cuts_every_response_is_named(tiny_config_overrides, data_template):
    import re

    from distill.train.data import load_rows
    from distill.train.stage import validate

    cfg = make_cfg(tiny_config_overrides, data_template, "train.max_seq_len=8")
    with pytest.raises(InputError) as e:
        validate(cfg)
    text = str(e.value)
    assert text.startswith("train.max_seq_len: ") and "train.batch_size" not in text, text
    least = int(re.search(r"at least (\d+)", text).group(1))  # type: ignore[union-attr]
    assert len(load_rows(cfg.run_dir, "train", cached=False, max_seq_len=least)) >= cfg.train.batch_size
