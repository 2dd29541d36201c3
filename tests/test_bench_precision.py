"""bench/bench_precision.py: the per-repeat ratio and the quick self-check on tiny shapes."""

from __future__ import annotations

import json

import pytest

from bench import bench_precision


def test_the_ratio_is_taken_within_each_repeat():
    runs = [
        {"op": "head", "dtype": "float32", "repeat": 0, "seconds": 1.0},
        {"op": "head", "dtype": "bfloat16", "repeat": 0, "seconds": 30.0},
        {"op": "head", "dtype": "bfloat16", "repeat": 1, "seconds": 40.0},  # a slower spell: both sides
        {"op": "head", "dtype": "float32", "repeat": 1, "seconds": 2.0},
    ]
    s = bench_precision.summarize(runs)["head"]
    assert s["float32_s"] == pytest.approx(1.5) and s["bfloat16_s"] == pytest.approx(35.0)
    assert s["bf16_over_fp32"]["median"] == pytest.approx(25.0)
    assert s["bf16_over_fp32"]["min"] == pytest.approx(20.0) and s["bf16_over_fp32"]["n"] == 2


def test_time_calls_takes_the_median_of_at_least_two_calls():
    calls = []
    assert bench_precision.time_calls(lambda: calls.append(1), 0.0) >= 0.0
    assert len(calls) == 3  # one untimed, two timed


def test_quick_run_measures_both_dtypes_and_says_what_auto_picks(tmp_path, monkeypatch):
    from distill import precision

    monkeypatch.setattr(precision, "_read_cpuinfo", lambda: "flags\t: avx2 fma\n")
    assert bench_precision.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "precision.json").read_text())
    assert {r["dtype"] for r in payload["runs"]} == {"float32", "bfloat16"}
    assert len(payload["summary"]) == 4 and all(r["seconds"] > 0 for r in payload["runs"])
    assert payload["native_bf16"] is False and payload["auto"]["target.dtype"] == "float32"
    md = (tmp_path / "precision.md").read_text()
    assert "bfloat16 feature flags: none (avx512f: no)" in md and "| target decode step (" in md
