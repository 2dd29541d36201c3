"""bench/bench_eval.py: phase arguments and the saved per-phase table (no engine: a report written by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_eval


def _report() -> dict:
    spec = {"name": "distilled", "k": 2, "temperature": 0.0, "draft_sample_method": "greedy",
            "wall_s": [10.0, 8.0, 12.5], "output_tokens": 400, "tokens_per_s": 40.0, "speedup": 1.25,
            "acceptance_rate": 0.5, "mean_acceptance_length": 2.0, "per_position_acceptance": [0.6, 0.4]}  # fmt: skip
    base = {"name": "no_spec", "k": 0, "temperature": 0.0, "wall_s": [12.5, 12.5, 12.5], "output_tokens": 400,
            "tokens_per_s": 32.0, "speedup": 1.0}  # fmt: skip
    return {"results": [base, spec], "prompts": {"count": 3, "source": "sharegpt (test split)"},
            "max_tokens": 128, "dtype": "bfloat16", "complete": True,
            "recommendation": {"reason": "distilled k=2"}}  # fmt: skip


def test_phases_follow_the_protocol():
    t0 = dict(o.split("=", 1) for o in bench_eval.COMMON + bench_eval.PHASES["t0"])
    assert int(t0["eval.num_prompts"]) >= 100 and int(t0["eval.repeats"]) * int(t0["eval.rounds"]) >= 3
    assert int(t0["eval.rounds"]) >= 3  # each configuration's passes spread over the whole run
    assert t0["eval.max_tokens"] == "128" and t0["eval.max_num_seqs"] == "1" and t0["eval.ngram"] == "true"
    t1 = dict(o.split("=", 1) for o in bench_eval.PHASES["t1"])
    assert t1["eval.temperatures"] == "[1.0]" and "probabilistic" in t1["eval.draft_sample_methods"]


def test_saved_phase_has_medians_spread_command_and_report(tmp_path: Path):
    run_dir = tmp_path / "run"
    (run_dir / "eval").mkdir(parents=True)
    (run_dir / "eval" / "report.json").write_text(json.dumps(_report()))
    (run_dir / "eval" / "report.md").write_text("# report")
    (run_dir / "eval" / "worker.log").write_text("noise")
    out = tmp_path / "out"
    bench_eval.save_phase("t0", run_dir, ["--phase", "t0"], 0, 3.0, out)
    saved = json.loads((out / "eval-t0.json").read_text())
    spec = saved["rows"][1]
    assert spec["tokens_per_s_spread"]["min"] == 32.0 and spec["tokens_per_s_spread"]["max"] == 50.0
    assert saved["command"] == "python -m bench.bench_eval --phase t0" and saved["machine"]["cpu"]
    md = (out / "eval-t0.md").read_text()
    assert "| distilled | 2 | 0.0 | greedy | 0.500 | 2.00 | 40.0 | 32.0–50.0 (n=3) | 1.25 |" in md
    assert (out / "eval-t0" / "report.md").is_file() and not (out / "eval-t0" / "worker.log").exists()
    assert f"Full report: `{out.resolve() / 'eval-t0' / 'report.md'}`" in md  # where --out-dir put it


def test_spread_counts_each_pass_own_tokens():
    # At T=1 every pass samples a different output: a pass's rate is its own token count over its wall time.
    row = {"name": "distilled", "k": 1, "temperature": 1.0, "wall_s": [10.0, 10.0, 10.0],
           "output_tokens": 400, "output_tokens_per_pass": [400, 300, 500]}  # fmt: skip
    (r,) = bench_eval.result_rows({"results": [row]})
    assert r["tokens_per_s_spread"]["min"] == 30.0 and r["tokens_per_s_spread"]["max"] == 50.0


def test_a_tagged_study_keeps_the_phase_figures(tmp_path: Path):
    """`--tag 900` (e.g. a longer training in its own run folder) writes eval-t0-900, leaving eval-t0 alone."""
    run_dir = tmp_path / "run"
    (run_dir / "eval").mkdir(parents=True)
    (run_dir / "eval" / "report.json").write_text(json.dumps(_report()))
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval-t0.md").write_text("the phase's own figures")
    bench_eval.save_phase("t0", run_dir, ["--phase", "t0", "--tag", "900"], 0, 3.0, out, tag="900")
    assert (out / "eval-t0.md").read_text() == "the phase's own figures"
    assert json.loads((out / "eval-t0-900.json").read_text())["command"].endswith("--tag 900")
    assert (out / "eval-t0-900" / "report.json").is_file()


# ---------------------------------------------------------------------------------------------------------
# Failed, incomplete and stale evals; which draft is measured; where the eval writes

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _stale_report() -> dict:
    report = _report()
    report["prompts"]["source"] = "OLD RUN"
    return report


def test_a_failed_eval_never_saves_the_previous_report(tmp_path: Path, monkeypatch):
    """An eval that exits 2 in preflight writes nothing: the fragment says so, with no figures, old or new."""
    import distill.cli

    run, out = tmp_path / "run", tmp_path / "out"
    for old in (run / "eval", out / "work" / "eval-t1" / "eval"):  # wherever an older eval left one
        old.mkdir(parents=True)
        (old / "report.json").write_text(json.dumps(_stale_report()))
    (out / "eval-t1").mkdir(parents=True)
    (out / "eval-t1" / "report.json").write_text(json.dumps(_stale_report()))
    monkeypatch.setattr(distill.cli, "main", lambda argv: 2)
    rc = bench_eval.run_phase("t1", TINY, [f"run.dir={run}"], ["--phase", "t1"], out)
    saved = json.loads((out / "eval-t1.json").read_text())
    md = (out / "eval-t1.md").read_text()
    assert rc == 2 and saved["exit"] == 2 and saved["complete"] is False and saved["rows"] == []
    assert "FAILED: the eval exited 2" in md and "OLD RUN" not in md and "| no_spec" not in md
    assert not (out / "eval-t1").exists()  # no earlier copy left to read as this run's full report


def test_an_incomplete_eval_says_so_and_names_each_failed_row(tmp_path: Path):
    report = _report()
    report["complete"], report["error"] = False, "worker timed out after 3600 s\n...log tail..."
    report["results"][1].update(
        wall_s=[], tokens_per_s=None, speedup=None, error="engine died\nTraceback ..."
    )
    run_dir = tmp_path / "run"
    (run_dir / "eval").mkdir(parents=True)
    (run_dir / "eval" / "report.json").write_text(json.dumps(report))
    out = tmp_path / "out"
    problem = bench_eval.save_phase("t0", run_dir, ["--phase", "t0"], 3, 3.0, out)
    saved = json.loads((out / "eval-t0.json").read_text())
    md = (out / "eval-t0.md").read_text()
    assert saved["complete"] is False and saved["exit"] == 3
    assert "INCOMPLETE (exit 3): worker timed out after 3600 s. The rows are partial" in md
    assert "| distilled (error) | 2 |" in md and "- distilled k=2: engine died" in md
    assert "Traceback" not in md and "log tail" not in md  # first lines only; the rest is in the report
    assert problem == saved["problem"]


def test_the_speedup_cell_shows_each_rounds_speedup():
    """`eval.rounds=2` passed through: the pooled speedup and, beside it, each round's."""
    row = {"name": "distilled", "k": 2, "temperature": 0.0, "wall_s": [10.0, 12.0], "output_tokens": 400,
           "speedup": 1.11, "speedup_per_round": [1.16, 1.12]}  # fmt: skip
    (r,) = bench_eval.result_rows({"results": [row]})
    assert "| 1.11 (1.16, 1.12 by round) |" in bench_eval.table([r])
    assert "by round" not in bench_eval.table([{**r, "speedup_per_round": None}])


def test_spread_and_median_count_the_same_passes():
    """A pass that produced no tokens counts in the report's median (0 tok/s), so it counts in the spread."""
    from distill.evaluate.report import tokens_per_s

    row = {"name": "distilled", "k": 1, "temperature": 0.0, "wall_s": [10.0, 10.0, 10.0],
           "output_tokens_per_pass": [400, 0, 500]}  # fmt: skip
    row["tokens_per_s"] = tokens_per_s(row)
    (r,) = bench_eval.result_rows({"results": [row]})
    sp = r["tokens_per_s_spread"]
    assert sp["n"] == 3 and sp["min"] == 0.0 and sp["median"] == r["tokens_per_s"] == 40.0


def _trained_run(run: Path) -> list[str]:
    """A run folder whose data and train stages completed with tiny.yaml (300 steps); its overrides."""
    from distill import rundir
    from distill.config import load_config

    overrides = [f"run.dir={run}", "train.max_steps=300"]
    for rel in ("data/manifest.json", "draft/config.json", "draft/model.safetensors"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("{}")
    cfg = load_config(TINY, overrides)
    rundir.mark_complete(cfg, "data")
    rundir.mark_complete(cfg, "train")
    return overrides


def _record_stages(monkeypatch) -> list[str]:
    import distill.cli

    calls: list[str] = []
    monkeypatch.setattr(distill.cli, "main", lambda argv: calls.append(argv[0]) or 0)
    return calls


def test_a_draft_trained_with_this_config_is_reused(tmp_path: Path, monkeypatch):
    overrides = _trained_run(tmp_path / "run")
    calls = _record_stages(monkeypatch)
    assert bench_eval.ensure_trained(TINY, overrides) == 0 and calls == []


def test_a_draft_trained_with_other_settings_is_not_measured_under_this_label(tmp_path: Path, monkeypatch):
    """train.max_steps=900 in the 300-step run's folder: train runs (and refuses there if it must), rather than
    the 300-step draft being measured as the 900-step one."""
    overrides = _trained_run(tmp_path / "run")
    calls = _record_stages(monkeypatch)
    assert bench_eval.ensure_trained(TINY, [*overrides, "train.max_steps=900"]) == 0
    assert calls == ["train"]  # data's config did not change


def test_a_draft_without_completion_records_is_retrained(tmp_path: Path, monkeypatch):
    run = tmp_path / "run"
    overrides = _trained_run(run)
    for record in (run / "stages").iterdir():
        record.unlink()
    calls = _record_stages(monkeypatch)
    bench_eval.ensure_trained(TINY, overrides)
    assert calls == ["data", "train"]


def test_drafts_named_outside_the_run_folder_need_no_training(tmp_path: Path, monkeypatch):
    calls = _record_stages(monkeypatch)
    drafts = f"eval.drafts=[{{name: other, model: {tmp_path / 'elsewhere'}}}]"
    assert bench_eval.ensure_trained(TINY, [f"run.dir={tmp_path / 'empty'}", drafts]) == 0 and calls == []


def test_eval_writes_to_the_bench_folder_and_measures_the_run_drafts(tmp_path: Path, monkeypatch):
    """The training run's eval/ (what `distill publish` ships) is left alone; `${run.dir}/draft` still names
    the training run's draft."""
    import distill.cli
    from distill.config import load_config

    run, out = tmp_path / "run", tmp_path / "out"
    seen = []

    def fake_eval(argv: list[str]) -> int:
        cfg = load_config(argv[2], argv[3:])
        seen.append(cfg)
        (cfg.run_dir / "eval").mkdir(parents=True)
        (cfg.run_dir / "eval" / "report.json").write_text(json.dumps(_report()))
        return 0

    monkeypatch.setattr(distill.cli, "main", fake_eval)
    rc = bench_eval.run_phase("t0", TINY, [f"run.dir={run}"], ["--phase", "t0"], out)
    (cfg,) = seen
    assert rc == 0 and not (run / "eval").exists()
    assert cfg.run_dir == out / "work" / "eval-t0" and cfg.eval.num_prompts == 16  # tiny.yaml's own
    assert [d.model for d in cfg.eval.drafts] == [f"{run}/draft_init", f"{run}/draft"]
    saved = json.loads((out / "eval-t0.json").read_text())
    assert saved["complete"] is True and len(saved["rows"]) == 2


def test_a_bad_override_exits_2_before_any_stage(tmp_path: Path, monkeypatch, capsys):
    calls = _record_stages(monkeypatch)
    rc = bench_eval.main(["-c", TINY, "--out-dir", str(tmp_path), f"run.dir={tmp_path}", "train.max_stepz=9"])
    assert rc == 2 and calls == [] and "max_stepz" in capsys.readouterr().err
