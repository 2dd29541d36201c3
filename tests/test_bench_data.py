"""bench_data's eager-vs-compiled study: which overrides each pass gets, and the summary arithmetic."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import bench_data


def test_eager_study_alternates_modes_and_summarises(monkeypatch, tmp_path):
    calls: list[tuple[str, tuple[str, ...]]] = []
    rates = iter([400.0, 500.0, 410.0, 520.0])  # eager, compiled, eager, compiled

    def fake_stage(run_dir: Path, engine: str, args: Any, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        calls.append((run_dir.name, extra))
        return {"tokens_per_s": next(rates), "generation_s": 50.0, "wall_s_including_startup": 80.0}

    monkeypatch.setattr(bench_data, "run_stage", fake_stage)
    monkeypatch.setattr(
        bench_data, "agreement", lambda a, b: 0.25 if {a.name, b.name} == {"eager-0", "compiled-0"} else -1
    )
    out = bench_data.eager_study(tmp_path, argparse.Namespace(repeats=2))
    assert calls == [
        ("eager-0", ("data.vllm_enforce_eager=true",)),
        ("compiled-0", ("data.vllm_enforce_eager=false",)),
        ("eager-1", ("data.vllm_enforce_eager=true",)),
        ("compiled-1", ("data.vllm_enforce_eager=false",)),
    ]
    assert out["eager"]["tokens_per_s_median"] == 405.0
    assert (out["compiled"]["tokens_per_s_min"], out["compiled"]["tokens_per_s_max"]) == (500.0, 520.0)
    assert out["eager"]["startup_s_median"] == 30.0
    assert out["compiled_over_eager"] == round(510.0 / 405.0, 3)
    assert out["identical_responses"] == 0.25
