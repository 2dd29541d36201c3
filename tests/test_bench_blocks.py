"""bench/bench_blocks.py: the side-by-side summary and table (no training here)."""

from __future__ import annotations

import argparse

import pytest

from bench import bench_blocks


def _run(
    rows: int,
    repeat: int,
    steps: list[float],
    rss: list[float],
    forced: int = 0,
    grad: str = "autograd",
    pack: bool = False,
) -> dict:
    return {
        "setting": bench_blocks.setting_label(rows, grad, pack),
        "block_rows": rows,
        "loss_gradient": grad,
        "pack_sequences": pack,
        "repeat": repeat,
        "step_s": steps,
        "rss_gib": rss,
        "forced_trims": forced,
        "released_at": None,
        "user_s": 9.0,
        "system_s": 1.0,
        "peak_rss_mib": 1024.0 * max(rss),
    }


def _args(steps: int, repeats: int) -> argparse.Namespace:
    return argparse.Namespace(
        draft="parallel-k4",
        steps=steps,
        warmup=1,
        repeats=repeats,
        run_dir="r",
        config="c.yaml",
        threads=2,
        trim_every=20,
    )


def test_growth_runs_from_the_first_timed_step_to_before_the_first_hand_back():
    rss = [3.0, 4.0, 5.0, 6.0, 7.0, 2.0, 3.0]  # handed back after step 5 (every=5)
    assert bench_blocks.growth_per_step(rss, warmup=1, every=5) == pytest.approx(1.0)  # 4 -> 7 over 3 steps
    assert bench_blocks.growth_per_step([3.0, 3.0], warmup=1, every=5) is None


def test_speedup_is_per_repeat_against_the_first_setting():
    runs = [
        _run(0, 0, [3.0, 3.0, 3.0], [5.0, 6.0, 7.0, 8.0], forced=1),
        _run(1024, 0, [2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0]),
        _run(1024, 1, [3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]),  # the machine slowed down: both sides did
        _run(0, 1, [6.0, 6.0, 6.0], [5.0, 6.0, 7.0, 8.0], forced=3),
        _run(1024, 1, [2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0], grad="auto"),
        _run(1024, 0, [1.5, 1.5, 1.5], [3.0, 3.0, 3.0, 3.0], grad="auto"),
        _run(1024, 0, [1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0], grad="auto", pack=True),
    ]
    summary = bench_blocks.summarize(runs, warmup=1, every=20)
    assert list(summary) == [
        "0/autograd/unpacked",
        "1024/autograd/unpacked",
        "1024/auto/unpacked",
        "1024/auto/packed",
    ]
    packed = summary["1024/auto/packed"]["speedup_vs_first"]
    assert packed["median"] == pytest.approx(3.0) and packed["n"] == 1  # only repeat 0 ran it
    assert summary["0/autograd/unpacked"]["speedup_vs_first"]["median"] == pytest.approx(1.0)
    assert summary["1024/autograd/unpacked"]["speedup_vs_first"]["median"] == pytest.approx((1.5 + 2.0) / 2)
    assert summary["1024/autograd/unpacked"]["step_s"]["median"] == pytest.approx(
        2.5
    )  # both repeats' timed steps
    assert summary["1024/auto/unpacked"]["speedup_vs_first"]["median"] == pytest.approx((2.0 + 3.0) / 2)
    assert summary["0/autograd/unpacked"]["rss_growth_gib_per_step"] == pytest.approx(1.0)
    assert summary["1024/autograd/unpacked"]["rss_growth_gib_per_step"] == pytest.approx(0.0)
    assert summary["0/autograd/unpacked"]["forced_trims"] == pytest.approx(2.0)
    args = _args(steps=3, repeats=2)
    md = bench_blocks.markdown(summary, args)
    assert (
        "| 0 (all at once) | autograd | false | 4.50 (3.00–6.00) | **1.00x** (1.00–1.00, n=2) | 6.0 | +1.00 | 2 | 8192 |"
        in md
    )
    assert (
        "| 1024 | autograd | false | 2.50 (2.00–3.00) | **1.75x** (1.50–2.00, n=2) | 3.0 | +0.00 | 0 | 3072 |"
        in md
    )
    assert "| 1024 | auto | false | 1.75 (1.50–2.00) | **2.50x** (2.00–3.00, n=2) |" in md


@pytest.mark.parametrize("bad", ["", "a,b", "0,-1"])
def test_bad_block_rows_is_an_input_error(tmp_path, capsys, bad):
    assert bench_blocks.main(["--block-rows", bad, "--out-dir", str(tmp_path)]) == 2
    assert "--block-rows" in capsys.readouterr().err
    assert not (tmp_path / "blocks.json").exists()


@pytest.mark.parametrize("bad", ["", "fast", "auto,closed"])
def test_bad_loss_gradient_is_an_input_error(tmp_path, capsys, bad):
    assert bench_blocks.main(["--loss-gradient", bad, "--out-dir", str(tmp_path)]) == 2
    assert "--loss-gradient" in capsys.readouterr().err
    assert not (tmp_path / "blocks.json").exists()


def test_bad_pack_is_an_input_error(tmp_path, capsys):
    assert bench_blocks.main(["--pack", "yes", "--out-dir", str(tmp_path)]) == 2
    assert "--pack" in capsys.readouterr().err
    assert not (tmp_path / "blocks.json").exists()


def test_missing_data_run_is_an_input_error(tmp_path, capsys):
    assert bench_blocks.main(["--run-dir", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path)]) == 2
    assert "no complete data stage" in capsys.readouterr().err
    assert not (tmp_path / "blocks.json").exists()


def test_head_candidates_get_their_own_settings_and_column():
    runs = [_run(1024, 0, [4.0, 4.0], [3.0, 3.0, 3.0], grad="auto", pack=True)]
    cut = _run(1024, 0, [3.0, 3.0], [3.0, 3.0, 3.0], grad="auto", pack=True)
    cut.update(setting=bench_blocks.setting_label(1024, "auto", True, 16384), head_candidates=16384)
    summary = bench_blocks.summarize([*runs, cut], warmup=1, every=20)
    assert list(summary) == ["1024/auto/packed", "1024/auto/packed/16384 candidates"]
    args = _args(steps=2, repeats=1)
    md = bench_blocks.markdown(summary, args)
    assert "| logits_block_rows | loss_gradient | pack_sequences | head_candidates |" in md
    assert "| 1024 | auto | true | 0 | 4.00 (4.00–4.00) | **1.00x**" in md
    assert "| 1024 | auto | true | 16384 | 3.00 (3.00–3.00) | **1.33x** (1.33–1.33, n=1) |" in md
    assert "head_candidates" not in bench_blocks.markdown(bench_blocks.summarize(runs, 1, 20), args)


@pytest.mark.parametrize("bad", ["", "x", "0,-5"])
def test_bad_head_candidates_is_an_input_error(tmp_path, capsys, bad):
    assert bench_blocks.main(["--head-candidates", bad, "--out-dir", str(tmp_path)]) == 2
    assert "--head-candidates" in capsys.readouterr().err
    assert not (tmp_path / "blocks.json").exists()
