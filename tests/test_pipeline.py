"""`distill run` with stand-in stages: order, skipping, config-change reruns, exit codes, interruption."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from distill import cli, pipeline, rundir
from distill.cli import main
from distill.config import Config, load_config
from distill.errors import InputError, Interrupted, RuntimeFailure

CONFIG = "configs/tiny.yaml"


def complete(cfg: Config, stage: str, summary: dict | None = None) -> None:
    """What a real stage leaves: its output files (placeholders here) and its completion record."""
    for rel in rundir.STAGE_OUTPUTS[stage]:
        (cfg.run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / rel).write_text(json.dumps({"complete": True}))
    rundir.mark_complete(cfg, stage, summary)


class FakeStages:
    """Stand-ins that behave like real stages: start_stage, do nothing heavy, mark_complete."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.behaviour: dict[str, object] = {}  # stage -> exit code, or an exception to raise

    def make(self, name: str):
        def stage(cfg: Config) -> int | None:
            self.calls.append(name)
            action = self.behaviour.pop(name, None)
            if isinstance(action, BaseException):
                raise action
            if isinstance(action, int):
                return action
            rundir.start_stage(cfg, name)
            if action != "no-record":
                complete(cfg, name, {"fake": True})
            return None

        return stage


@pytest.fixture()
def fake(monkeypatch) -> FakeStages:
    stages = FakeStages()
    monkeypatch.setattr(pipeline, "resolve_stage", stages.make)
    return stages


@pytest.fixture()
def overrides(tmp_path) -> list[str]:
    # No model or data is touched by the stand-ins: only the run folder matters.
    return [f"run.dir={tmp_path / 'run'}"]


def run(overrides: list[str], *extra: str) -> int:
    return main(["run", "-c", CONFIG, *overrides, *extra])


def test_runs_all_stages_in_order_and_logs_to_the_run_folder(fake, overrides, tmp_path):
    assert run(overrides) == 0
    assert fake.calls == ["data", "train", "eval", "publish"]
    log_text = (tmp_path / "run" / "distill.log").read_text()
    assert "publish: done" in log_text and "pipeline complete" in log_text
    assert json.loads((tmp_path / "run" / "stages" / "run.json").read_text())["status"] == "done"


def test_rerun_after_completion_does_nothing(fake, overrides, tmp_path):
    assert run(overrides) == 0
    fake.calls.clear()
    assert run(overrides) == 0
    assert fake.calls == []
    log_text = (tmp_path / "run" / "distill.log").read_text()
    assert "data: complete with the same config" in log_text and "nothing to do" in log_text


def test_changed_train_config_reruns_train_and_later_stages(fake, overrides, tmp_path):
    assert run(overrides) == 0
    fake.calls.clear()
    assert run(overrides, "train.lr=0.002") == 0
    assert fake.calls == ["train", "eval", "publish"]
    assert "train: config changed" in (tmp_path / "run" / "distill.log").read_text()
    fake.calls.clear()
    assert run(overrides, "train.lr=0.002", "eval.k=[1]") == 0
    assert fake.calls == ["eval", "publish"]
    fake.calls.clear()
    assert run(overrides, "train.lr=0.002", "eval.k=[1]", "run.threads=1") == 0  # not an input of any stage
    assert fake.calls == []


def test_a_rerun_stage_forces_later_stages_even_if_their_records_match(fake, overrides, tmp_path):
    assert run(overrides) == 0
    cfg = load_config(CONFIG, overrides)
    rundir.clear_complete(cfg, "data")  # e.g. data folder rebuilt by hand
    fake.calls.clear()
    assert run(overrides) == 0
    assert fake.calls == ["data", "train", "eval", "publish"]


def test_stage_exit_code_stops_the_pipeline(fake, overrides):
    fake.behaviour["eval"] = 2
    assert run(overrides) == 2
    assert fake.calls == ["data", "train", "eval"]
    fake.calls.clear()
    assert run(overrides) == 0
    assert fake.calls == ["eval", "publish"]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InputError("data.source: x not found"), 2),
        (RuntimeFailure("engine died"), 1),
        (ValueError("a bug"), 1),
    ],
)
def test_stage_exceptions_map_to_exit_codes(fake, overrides, tmp_path, capsys, error, code):
    fake.behaviour["train"] = error
    assert run(overrides) == code
    assert str(error) in capsys.readouterr().err
    assert fake.calls == ["data", "train"]
    status = json.loads((tmp_path / "run" / "stages" / "run.json").read_text())
    assert status["status"] == "failed" and status["stage"] == "train"


@pytest.mark.parametrize("error", [Interrupted("received signal 15"), KeyboardInterrupt()])
def test_interrupted_exits_130_and_rerun_resumes_that_stage(fake, overrides, tmp_path, error):
    fake.behaviour["train"] = error
    assert run(overrides) == 130
    status = json.loads((tmp_path / "run" / "stages" / "run.json").read_text())
    assert status == {**status, "status": "interrupted", "stage": "train"}
    assert "interrupted during train" in (tmp_path / "run" / "distill.log").read_text()
    fake.calls.clear()
    assert run(overrides) == 0
    assert fake.calls == ["train", "eval", "publish"]


def test_stage_without_completion_record_runs_again(fake, overrides):
    fake.behaviour["publish"] = "no-record"
    assert run(overrides) == 0
    fake.calls.clear()
    assert run(overrides) == 0
    assert fake.calls == ["publish"]


def test_stages_not_built_are_named(monkeypatch, overrides, capsys, tmp_path):
    monkeypatch.setitem(cli.STAGES, "train", "distill.train.no_such_stage:run")
    monkeypatch.setitem(cli.STAGES, "eval", "distill.evaluate.no_such_stage:run")
    assert run(overrides) == 1
    err = capsys.readouterr().err
    assert "train (" in err and "eval (" in err and "not built yet" in err
    assert not (tmp_path / "run").exists()  # nothing ran, nothing written


def test_plan_reports_each_action(fake, overrides):
    cfg = load_config(CONFIG, overrides)
    assert pipeline.plan(cfg) == [
        ("data", "start"),
        ("train", "start"),
        ("eval", "start"),
        ("publish", "start"),
    ]
    assert run(overrides) == 0
    changed = load_config(CONFIG, [*overrides, "data.max_new_tokens=16"])
    assert pipeline.plan(changed) == [
        ("data", "changed"),
        ("train", "changed"),
        ("eval", "changed"),
        ("publish", "changed"),
    ]
    assert pipeline.plan(cfg) == [(s, "skip") for s in rundir.STAGES]


def test_follower_rank_waits_for_data_then_trains_only(fake, overrides, monkeypatch):
    cfg = load_config(CONFIG, overrides)
    rundir.start_stage(cfg, "data")
    complete(cfg, "data")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pipeline.launcher_rank() == 1
    assert pipeline.run(cfg) == 0
    assert fake.calls == ["train"]


def test_follower_rank_stops_when_rank_0_fails(fake, overrides, monkeypatch):
    cfg = load_config(CONFIG, overrides)
    Path(cfg.run_dir / "stages").mkdir(parents=True)
    (cfg.run_dir / "stages" / "run.json").write_text(
        json.dumps({"status": "failed", "stage": "data", "time": time.time() + 5})
    )
    monkeypatch.setattr(pipeline, "WAIT_POLL_S", 0.01)
    monkeypatch.setenv("SLURM_PROCID", "3")
    with pytest.raises(RuntimeFailure, match="rank 0 stopped during data"):
        pipeline.run(cfg)
    assert fake.calls == []


def test_plain_process_is_rank_0(monkeypatch):
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert pipeline.launcher_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert pipeline.launcher_rank() == 0


def test_real_stages_resolve():
    funcs = pipeline.load_stages()
    assert list(funcs) == ["data", "train", "eval", "publish"] and all(callable(f) for f in funcs.values())


def test_follower_rank_never_writes_the_status(fake, overrides, monkeypatch):
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("distill").addHandler(handler)
    monkeypatch.setattr(logging.getLogger("distill"), "level", logging.DEBUG)
    cfg = load_config(CONFIG, overrides)
    rundir.start_stage(cfg, "data")
    complete(cfg, "data")
    fake.behaviour["train"] = (
        "no-record"  # like Lightning's extra ranks: the train stage records nothing there
    )
    monkeypatch.setenv("NODE_RANK", "1")
    assert pipeline.run(cfg) == 0
    logging.getLogger("distill").removeHandler(handler)
    assert not (cfg.run_dir / "stages" / "run.json").exists()
    messages = [r.getMessage() for r in records]
    assert any("train: done" in m for m in messages)
    assert not any("recorded no completion" in m for m in messages)


def test_stage_whose_outputs_were_deleted_runs_again(fake, overrides):
    cfg = load_config(CONFIG, overrides)
    assert pipeline.run(cfg) == 0
    (cfg.run_dir / "draft" / "model.safetensors").unlink()
    assert pipeline.plan(cfg) == [("data", "skip"), ("train", "redo"), ("eval", "redo"), ("publish", "redo")]


def test_one_run_log_per_process_at_a_time(tmp_path):
    # A process that runs stages of two runs one after the other writes each run's records to its own log only.
    logger = logging.getLogger("distill.test_run_log")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        rundir.attach_log_file(tmp_path / "a")
        logger.info("record of run a")
        rundir.attach_log_file(tmp_path / "b")
        rundir.attach_log_file(tmp_path / "b")  # attaching the same run again adds nothing
        logger.info("record of run b")
        marked = [h for h in logging.getLogger("distill").handlers if getattr(h, "_distill_run_log", False)]
        assert len(marked) == 1
        a, b = (tmp_path / "a" / "distill.log").read_text(), (tmp_path / "b" / "distill.log").read_text()
        assert "record of run a" in a and "record of run b" not in a
        assert b.count("record of run b") == 1 and "record of run a" not in b
    finally:
        rundir.detach_log_file()
    assert not [h for h in logging.getLogger("distill").handlers if getattr(h, "_distill_run_log", False)]


def test_the_cli_closes_the_run_log_when_its_stage_returns(tmp_path, monkeypatch):
    # A process that calls the CLI and goes on (a notebook, a scheduler) keeps no run log open, and what it
    # logs afterwards stays out of the finished run's log.
    from distill import cli

    def stage(cfg):
        rundir.attach_log_file(cfg.run_dir)
        logging.getLogger("distill.test_run_log").info("record of the stage")

    monkeypatch.setattr(cli, "resolve_stage", lambda name: stage)
    (tmp_path / "run").mkdir()
    assert cli.main(["train", "-c", CONFIG, f"run.dir={tmp_path / 'run'}"]) == 0
    assert not [h for h in logging.getLogger("distill").handlers if getattr(h, "_distill_run_log", False)]
    logging.getLogger("distill.test_run_log").info("record after the stage")
    text = (tmp_path / "run" / "distill.log").read_text()
    assert "record of the stage" in text and "record after the stage" not in text
