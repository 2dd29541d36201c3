"""bench/bench_train.py: the order of the speed runs, their summary and ratios, the input checks, the output
files and the precision of the acceptance runs (the workers are faked: no training here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import bench_train
from bench.common import OUT_DIR

# tokens/s per configuration, one per repeat: plain_online's best (200) is not its median (100)
RATES = {
    ("plain", "online"): [100.0, 200.0, 100.0],
    ("lightning", "online"): [90.0, 100.0, 95.0],
    ("plain", "cached"): [300.0, 300.0, 300.0],
    ("lightning", "cached"): [270.0, 330.0, 300.0],
}


def _fake_worker(calls: list[tuple[str, str]]) -> Any:
    seen: dict[tuple[str, str], int] = {}

    def run(kind: str, args: dict[str, Any], threads: int) -> dict[str, Any]:
        key = (kind, args["teacher"])
        calls.append(key)
        i = seen[key] = seen.get(key, -1) + 1
        return {"tokens_per_s": RATES[key][i], "steps": args["steps"], "peak_rss_mib": 1000.0 + i}

    return run


def _main(monkeypatch, *argv: str) -> Any:
    monkeypatch.setattr(sys, "argv", ["bench_train.py", *argv])
    return bench_train.main()


def test_speed_runs_alternate_and_report_medians_and_ratios_per_repeat(monkeypatch, tmp_path):
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(bench_train, "_prepare_data", lambda *a, **k: None)
    monkeypatch.setattr(bench_train, "_run_worker", _fake_worker(calls))
    out = tmp_path / "train-speed.json"
    _main(monkeypatch, "--only", "speed", "--target", "t", "--repeats", "3", "--out", str(out))
    first = [("plain", "online"), ("lightning", "online"), ("plain", "cached"), ("lightning", "cached")]
    assert calls == first + first[::-1] + first
    data = json.loads(out.read_text())
    plain = data["speed"]["plain_online"]
    assert (plain["tokens_per_s"], plain["tokens_per_s_min"], plain["tokens_per_s_max"]) == (
        100.0,
        100.0,
        200.0,
    )
    assert plain["peak_rss_mib"] == 1001.0 and plain["n"] == 3
    ratio = data["lightning_over_plain_per_repeat"]  # 0.9, 0.5, 0.95: repeat by repeat, not best over best
    assert (ratio["median"], ratio["min"], ratio["max"], ratio["n"]) == (
        pytest.approx(0.9),
        pytest.approx(0.5),
        pytest.approx(0.95),
        3,
    )
    assert data["lightning_over_plain"] == pytest.approx(0.9)
    assert data["cached_over_online"] == pytest.approx(300 / 95)  # 3.0, 3.3, 3.16


def test_output_records_command_machine_and_markdown(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_train, "_prepare_data", lambda *a, **k: None)
    monkeypatch.setattr(bench_train, "_run_worker", _fake_worker([]))
    argv = ["--only", "speed", "--target", "t", "--repeats", "1", "--out", str(tmp_path / "train-speed.json")]
    _main(monkeypatch, *argv)
    data = json.loads((tmp_path / "train-speed.json").read_text())
    assert data["command"] == "python -m bench.bench_train " + " ".join(argv)
    assert data["machine"]["date"].endswith("Z") and data["machine"]["cores"]
    md = (tmp_path / "train-speed.md").read_text()
    assert "| plain_online | 100 (100–100, n=1) | 1000 | 20 |" in md
    assert "| Lightning / plain (online teacher) | **0.900** (0.900–0.900, n=1) |" in md
    assert "Command: `python -m bench.bench_train" in md


def test_out_defaults_to_bench_out(monkeypatch, tmp_path):
    """Not bench/results/train, which holds the curated copies BENCHMARKS.md cites."""
    written: list[Path] = []
    monkeypatch.setattr(bench_train, "_prepare_data", lambda *a, **k: None)
    monkeypatch.setattr(bench_train, "_run_worker", _fake_worker([]))
    monkeypatch.setattr(
        bench_train,
        "write_fragment",
        lambda name, *a, out_dir, **k: written.append(out_dir / name) or (1, 2),
        raising=False,  # the old code wrote with Path.write_text: those calls are recorded below
    )
    monkeypatch.setattr(Path, "write_text", lambda self, text: written.append(self))  # the old writer
    _main(monkeypatch, "--only", "speed", "--target", "t", "--repeats", "1")
    assert written and all(p.with_suffix("") == OUT_DIR / "train" for p in written)


@pytest.mark.parametrize(
    "argv",
    [
        ["--repeats", "0"],
        ["--steps", "0"],
        ["--threads", "0"],
        ["--warmup", "-1"],
        ["--top-k", "16,x"],
        ["--top-k", "0"],
    ],
)
def test_bad_input_is_exit_2_before_any_work(monkeypatch, tmp_path, capsys, argv):
    def must_not_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started before the input checks")

    monkeypatch.setattr(bench_train, "_prepare_data", must_not_run)
    monkeypatch.setattr(bench_train, "_run_worker", must_not_run)
    with pytest.raises(SystemExit) as exc:
        _main(monkeypatch, "--target", "t", *argv, "--out", str(tmp_path / "train"))
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_acceptance_trains_at_the_given_precision(monkeypatch):
    import bench.common
    import distill.models.draft
    import distill.train.data
    import distill.train.module
    import distill.train.stage

    precisions: list[str] = []

    class Trainer:
        def fit(self, module: Any, datamodule: Any) -> None:
            pass

    def fake_trainer(max_steps: int, *, precision: str = "32", callbacks: Any = ()) -> Trainer:
        precisions.append(precision)
        return Trainer()

    class Module:
        class draft:
            @staticmethod
            def cpu() -> None:
                return None

    cfg = type("Cfg", (), {"run_dir": "r", "train": type("T", (), {"max_seq_len": 8, "batch_size": 2})})
    tok = type("Tok", (), {"eos_token_id": 0, "__len__": lambda self: 10})()
    monkeypatch.setattr(
        bench_train, "_setup", lambda args, teacher: (cfg, tok, None, None, (None, None, "t"))
    )
    monkeypatch.setattr(bench.common, "bare_trainer", fake_trainer)
    monkeypatch.setattr(distill.train.stage, "build_module", lambda *a: Module())
    monkeypatch.setattr(distill.models.draft, "load_causal_lm", lambda *a, **k: None)
    monkeypatch.setattr(distill.train.data, "load_rows", lambda *a, **k: [])
    monkeypatch.setattr(distill.train.data, "val_loader", lambda *a, **k: [])
    monkeypatch.setattr(
        distill.train.module,
        "evaluate_draft",
        lambda *a, **k: {"expected_acceptance": 0.3, "top1_agreement": 0.1, "loss": 1.0},
    )
    out = bench_train.worker_acceptance({"steps": 5, "precision": "bf16-mixed", "teacher": "online"})
    assert precisions == ["bf16-mixed"] and out["expected_acceptance"] == 0.3
