"""bench/bench_gpu.py without a GPU: the input checks, the alternation of the training runs, their medians and
per-repeat ratios, and the table (the workers are faked)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench import bench_gpu, bench_train


def _assets(tmp_path: Path, layers: int = 30) -> Path:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "vocab_size": 64}))
    return assets


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--repeats", "0"],
        ["--layers", "1,x"],
        ["--layers", "0"],
        ["--layers", "2,40"],
        ["--draft-layers", "31"],
        ["--warmup", "-1"],
        ["--prompt-len", "512"],
    ],
)
def test_bad_input_is_exit_2_naming_the_option_before_any_work(tmp_path, monkeypatch, capsys, argv):
    def must_not_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started before the input checks")

    monkeypatch.setattr(bench_gpu, "build_random_target", must_not_run)
    with pytest.raises(SystemExit) as exc:
        bench_gpu.main(["--assets", str(_assets(tmp_path)), "--out-dir", str(tmp_path), "--allow-cpu", *argv])
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(
        draft_layers=2,
        batch_size=4,
        seq_len=16,
        prompt_len=4,
        steps=3,
        warmup=1,
        repeats=3,
        threads=1,
        parallel_tokens=4,
        dtype="bfloat16",
    )
    return argparse.Namespace(**{**base, **kw})


def test_training_runs_alternate_and_ratios_are_per_repeat(tmp_path, monkeypatch):
    calls: list[str] = []
    # tokens/s per (kind, precision, parallel) and repeat; Lightning fp32's best (300) is not its median (100)
    rates = {
        ("lightning", "bf16-mixed", 0): [300.0, 330.0, 150.0],
        ("plain", "bf16-mixed", 0): [300.0, 300.0, 150.0],
        ("lightning", "32", 0): [100.0, 300.0, 50.0],
        ("plain", "32", 0): [100.0, 100.0, 50.0],
        ("lightning", "bf16-mixed", 4): [270.0, 300.0, 150.0],
    }
    seen: dict[tuple[str, str, int], int] = {}

    def fake(kind: str, args: dict[str, Any], threads: int) -> dict[str, Any]:
        key = (kind, args["precision"], args["parallel_tokens"])
        calls.append(f"{kind}_{args['precision']}_{args['parallel_tokens']}")
        i = seen[key] = seen.get(key, -1) + 1
        return {
            "tokens_per_s": rates[key][i],
            "steps": args["steps"],
            "peak_rss_mib": 1.0,
            "peak_cuda_mib": 9.0,
        }

    monkeypatch.setattr(bench_train, "_run_worker", fake)
    out = bench_gpu.train_speed(tmp_path / "target", tmp_path / "run", _args())
    first = [
        "lightning_bf16-mixed_0",
        "plain_bf16-mixed_0",
        "lightning_32_0",
        "plain_32_0",
        "lightning_bf16-mixed_4",
    ]
    assert calls == first + first[::-1] + first
    fp32 = out["summary"]["lightning_32"]
    assert (fp32["tokens_per_s"], fp32["tokens_per_s_min"], fp32["tokens_per_s_max"], fp32["n"]) == (
        100.0,
        50.0,
        300.0,
        3,
    )
    bf16 = out["ratios"]["bf16_over_fp32"]  # 3.0, 1.1, 3.0 repeat by repeat
    assert (bf16["median"], bf16["min"], bf16["n"]) == (pytest.approx(3.0), pytest.approx(1.1), 3)
    assert out["ratios"]["lightning_over_plain_bf16"]["median"] == pytest.approx(1.0)
    assert out["ratios"]["parallel_over_next_token"]["median"] == pytest.approx(300 / 330)

    results = {
        "gpu": "G",
        "config": {**vars(_args()), "dtype": "bfloat16"},
        "train": out,
        "cost": {"target_step_ms": 10.0, "drafts": {"truncate-1": {"step_ms": 1.0, "c": 0.1}}},
    }
    md = bench_gpu.render(results, {"torch": "2.x", "date": "2026-12-06T00:00:00Z"})
    assert "| lightning_32 | 100 (50–300, n=3) | 9 | 3 |" in md
    assert "| bf16-mixed / fp32 (Lightning) | **3.00x** (1.10–3.00, n=3) |" in md
    assert "| parallel draft (4 tokens) / next-token draft | **0.91x**" in md


def test_no_parallel_row_with_parallel_tokens_0(tmp_path):
    plan = bench_gpu.train_plan(tmp_path, tmp_path, _args(parallel_tokens=0))
    assert [name for name, _, _ in plan] == [
        "lightning_bf16-mixed",
        "plain_bf16-mixed",
        "lightning_32",
        "plain_32",
    ]
