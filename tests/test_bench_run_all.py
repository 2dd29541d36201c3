"""bench/run_all.py: its options and what the summary shows of each bench's fragments (no bench runs here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import run_all


def test_an_unknown_only_bench_is_a_usage_error(monkeypatch, capsys):
    """exit 2 (argparse's usage error, as for every bad option), before any bench runs."""
    monkeypatch.setattr(run_all, "run_one", lambda *a: pytest.fail("no bench may run"))
    with pytest.raises(SystemExit) as exit_info:
        run_all.main(["--only", "drafts,nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown bench ['bench_nope']" in err and "drafts" in err


def bench_result(out: Path, rc: int, files: dict[str, str], stale: tuple[str, ...] = ()) -> dict:
    """A finished bench_eval run that wrote `files` (name -> markdown); `stale` ones predate the run."""
    started = 1_000_000.0
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        when = started - 60 if name in stale else started + 60
        os.utime(path, (when, when))
    result = {"name": "bench_eval", "command": "python -m bench.bench_eval", "rc": rc, "wall_s": 1.0}
    result["log"] = str(out / "logs" / "bench_eval.log")
    return {**result, "fragments": run_all.fragments("bench_eval", out, started)}


def test_the_summary_embeds_every_fresh_fragment_of_a_bench(tmp_path: Path):
    """bench_eval writes one fragment per phase (eval-t0.md, eval-t1.md): both are results of this run."""
    files = {"eval-t0.md": "| t0 figures |", "eval-t1.md": "| t1 figures |", "eval-t0-900.md": "| old |"}
    result = bench_result(tmp_path, 0, files, stale=("eval-t0-900.md",))
    summary = run_all.render_summary([result], {}, False, tmp_path)
    assert "| t0 figures |" in summary and "| t1 figures |" in summary
    assert "| old |" not in summary and "eval-t0-900.md (STALE: from an earlier run)" in summary
    assert "FAILED" not in summary


def test_a_failed_benchs_fragments_are_marked_as_such(tmp_path: Path):
    """What a bench wrote before it failed may be partial: every fragment of it carries the warning."""
    files = {"eval-t0.md": "| t0 figures |", "eval-t1.md": "| t1 figures |"}
    summary = run_all.render_summary([bench_result(tmp_path, 3, files)], {}, False, tmp_path)
    assert "## eval — FAILED (exit 3)" in summary
    for name, text in files.items():
        warning = f"> **FAILED (exit 3)**: {name} below was written by a run that failed"
        assert summary.index(warning) < summary.index(text)
    assert summary.count("> **FAILED (exit 3)**") == 2
