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
    assert int(t0["eval.num_prompts"]) >= 100 and int(t0["eval.repeats"]) >= 3
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
