"""bench/bench_malloc.py: the side-by-side summary and table (no training here)."""

from __future__ import annotations

import argparse

import pytest

from bench import bench_blocks, bench_malloc


def _run(draft: str, retain: bool, repeat: int, steps: list[float], system: float = 1.0) -> dict:
    return {
        "draft": draft,
        "retain": retain,
        "repeat": repeat,
        "step_s": steps,
        "user_s": 9.0,
        "system_s": system,
        "peak_rss_mib": 6000.0 if retain else 5000.0,
    }


def test_drafts_are_valid_config_overrides():
    from distill.config import load_config

    for overrides in bench_malloc.DRAFTS.values():
        load_config("configs/smollm2-sharegpt.yaml", overrides)  # raises if invalid


def test_ratio_is_taken_per_repeat_and_medians_over_steps():
    runs = [
        _run("ar", True, 0, [1.0, 1.2, 1.1], system=1.0),
        _run("ar", False, 0, [2.0, 2.4, 2.2], system=9.0),
        _run("ar", False, 1, [3.0, 3.0, 3.0], system=9.0),  # the machine slowed down: both sides did
        _run("ar", True, 1, [2.0, 2.0, 2.0], system=1.0),
    ]
    row = bench_malloc.summarize(runs)["ar"]
    assert row["off_over_on"]["median"] == pytest.approx((2.0 + 1.5) / 2)
    assert row["off_over_on"]["min"] == pytest.approx(1.5) and row["off_over_on"]["n"] == 2
    assert row["on"]["step_s"]["median"] == pytest.approx(1.6)  # over the 6 timed steps of both repeats
    assert row["off"]["system_share"] == pytest.approx(0.5) and row["on"]["system_share"] == pytest.approx(
        0.1
    )
    args = argparse.Namespace(steps=3, warmup=1, repeats=2, run_dir="r", config="c.yaml", threads=2)
    md = bench_malloc.markdown(bench_malloc.summarize(runs), args)
    assert "| ar | true | 1.60 (1.00–2.00) | 10% | 6000 | **1.75x** (1.50–2.00, n=2) |" in md
    assert "| ar | false | 2.70 (2.00–3.00) | 50% | 5000 |  |" in md


def test_missing_data_run_is_an_input_error(tmp_path, capsys):
    assert bench_malloc.main(["--run-dir", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path)]) == 2
    assert "no complete data stage" in capsys.readouterr().err
    assert not (tmp_path / "malloc.json").exists()


@pytest.mark.parametrize("bench", ["malloc", "blocks"])
@pytest.mark.parametrize(
    "argv", [["--repeats", "0"], ["--steps", "0"], ["--threads", "0"], ["--warmup", "-1"]]
)
def test_bad_counts_are_exit_2_before_any_run(tmp_path, capsys, monkeypatch, bench, argv):
    """The two training-loop benches: --repeats 0 used to exit 0 with an empty table (malloc) or fail with an
    IndexError (blocks), --steps 0 to crash in spread([]) / median([]) after the runs."""
    module = {"malloc": bench_malloc, "blocks": bench_blocks}[bench]
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "manifest.json").write_text("{}")

    def must_not_run(*args, **kwargs):
        raise AssertionError("a worker ran before the input checks")

    monkeypatch.setattr(module, "run_worker", must_not_run)
    with pytest.raises(SystemExit) as exc:
        module.main(["--run-dir", str(run), "--out-dir", str(tmp_path), *argv])
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err
    assert not (tmp_path / f"{bench}.json").exists()
