"""distill.utils.progress: outside a terminal, progress goes to the log at a bounded rate."""

from __future__ import annotations

import logging

from distill.utils.progress import LoggedProgress, progress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_logged_progress_rate_limits_and_reports_eta(caplog):
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="distill.progress")
    with LoggedProgress(every_s=30, clock=clock) as bar:
        task = bar.add_task("generate (vllm)", total=100, rate="")
        for _ in range(10):
            clock.t += 5
            bar.update(task, advance=5, rate="480 tok/s")
        clock.t += 5
        bar.update(task, advance=50)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "generate (vllm): 30/100 (30%), 480 tok/s, elapsed 0m30s, eta 1m10s"
    assert len(lines) == 2 and lines[-1].startswith("generate (vllm): 100/100 (100%)")


def test_progress_outside_a_terminal_is_logged():
    assert isinstance(progress(), LoggedProgress)  # pytest captures stdout: not a terminal


def test_training_progress_lines(caplog):
    from types import SimpleNamespace

    import torch

    from distill.train.callbacks import LogProgress

    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="distill.train")
    trainer = SimpleNamespace(global_step=0, max_steps=300, is_global_zero=True, sanity_checking=False,
                              callback_metrics={"loss": torch.tensor(2.5)},
                              state=SimpleNamespace(fn="fit"))  # fmt: skip
    cb = LogProgress(every_s=30, clock=clock)
    cb.on_train_start(trainer, None)
    for _ in range(20):  # 2 s per step: a line every 15 steps
        clock.t += 2
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, None, None, 0)
    trainer.callback_metrics = {"val/top1_agreement": torch.tensor(0.25), "loss": torch.tensor(2.0)}
    cb.on_validation_end(trainer, None)
    # A stand-alone validation (trainer.validate: the final one, or a resumed step's) counts from step 0; the
    # module's eval_step says which step it measures.
    trainer.global_step, trainer.state.fn = 0, "validate"
    cb.on_validation_end(trainer, SimpleNamespace(eval_step=300))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "train: step 15/300 (5%), loss 2.5000, 2.00 s/step, eta 9.5 min",
        "validation at step 20: val/top1_agreement 0.2500",
        "validation at step 300: val/top1_agreement 0.2500",
    ]


def test_eval_progress_reads_the_partial_results(tmp_path, caplog):
    import json

    from distill.evaluate.stage import PartialWatcher

    caplog.set_level(logging.INFO, logger="distill.progress")
    partial = tmp_path / "partial.json"
    with LoggedProgress(every_s=0) as bar:
        watch = PartialWatcher(partial, bar, total=3)
        watch()  # nothing yet
        partial.write_text("{not json")
        watch()  # half-written: ignored
        row = {"name": "distilled", "k": 2, "temperature": 0.0, "wall_s": [10.0, 8.0, 9.0], "output_tokens": 288,
               "num_draft_tokens": 100, "num_accepted_tokens": 39}  # fmt: skip
        partial.write_text(json.dumps({"results": [{"name": "no_spec", "k": 0, "temperature": 0.0}, row]}))
        watch()
        watch()  # no new rows: no new line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "eval (vllm): 2/3 (67%), distilled k=2 T=0.0: 32.0 tok/s, acceptance 0.39, elapsed 0m00s, eta 0m00s"
    ]


def test_eval_progress_counts_every_rounds_measurements(tmp_path, caplog):
    """With eval.rounds > 1 the pooled rows stop growing after round 1: progress follows `measured` and names
    the configuration measured last."""
    import json

    from distill.evaluate.stage import PartialWatcher

    caplog.set_level(logging.INFO, logger="distill.progress")
    partial = tmp_path / "partial.json"
    rows = [{"name": "no_spec", "k": 0, "temperature": 0.0}, {"name": "d", "k": 2, "temperature": 0.0}]
    with LoggedProgress(every_s=0) as bar:
        watch = PartialWatcher(partial, bar, total=4)
        partial.write_text(json.dumps({"results": rows, "measured": 2, "last": rows[1]}))
        watch()
        partial.write_text(json.dumps({"results": rows, "measured": 3, "last": rows[0]}))
        watch()
    lines = [r.getMessage() for r in caplog.records]
    assert [ln.split(", elapsed")[0] for ln in lines] == [
        "eval (vllm): 2/4 (50%), d k=2 T=0.0",
        "eval (vllm): 3/4 (75%), no_spec T=0.0",
    ]


def test_worker_poll_runs_while_waiting(tmp_path):
    import sys

    from distill.utils.subproc import run_worker

    calls = []
    script = "import json,sys,time; time.sleep(0.6); json.dump({'ok': 1}, open(sys.argv[2], 'w'))"
    out = run_worker({}, log_path=tmp_path / "w.log", timeout_s=30, command=[sys.executable, "-c", script],
                     poll=lambda: calls.append(1), poll_every_s=0.1)  # fmt: skip
    assert out == {"ok": 1} and len(calls) >= 2
