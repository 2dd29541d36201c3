"""bench/bench_recipes.py: recipe table from run folders (no training here)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_recipes


def test_recipes_are_valid_config_overrides():
    from distill.config import load_config

    for name, overrides in bench_recipes.RECIPES.items():
        cfg = load_config(
            "configs/smollm2-sharegpt.yaml", [*bench_recipes.SHARED, *overrides]
        )  # raises if invalid
        assert any(o.startswith("draft.num_layers=") for o in overrides), name
        # autoregressive recipes stay autoregressive whatever the shipped config's drafting mode
        assert cfg.draft.parallel_tokens == (4 if name.startswith("pard4") else 0), name


def test_table_from_validation_history(tmp_path: Path):
    run = tmp_path / "r"
    (run / "train").mkdir(parents=True)
    hist = [{"step": 100, "top1_agreement": 0.25, "accept_len": {"1": 1.2}},
            {"step": 300, "top1_agreement": 0.35, "accept_len": {"1": 1.36, "2": 1.5}}]  # fmt: skip
    (run / "train" / "val_history.json").write_text(json.dumps(hist))
    assert bench_recipes.last_validation(run)["step"] == 300
    row = {"recipe": "ar2", "overrides": ["draft.num_layers=2"], "step": 300, "wall_s": 120.0,
           "top1_by_step": {"100": 0.25, "300": 0.35}, "accept_len": hist[-1]["accept_len"]}  # fmt: skip
    md = bench_recipes.markdown([row], 300)
    assert (
        "| ar2 | `draft.num_layers=2` | 300 | 0.250 @100 → 0.350 @300 | 1.36 | 1.50 | — | — | 2.0 | — |" in md
    )


def test_recipes_run_one_at_a_time_make_one_table(tmp_path: Path):
    saved = tmp_path / "recipes.json"
    old = [{"recipe": "ar2-lr1e-3", "top1_agreement": 0.30}, {"recipe": "ar6-lr1e-3", "top1_agreement": 0.40}]
    saved.write_text(json.dumps({"steps": 300, "train_prompts": 6000, "rows": old}))
    fresh = [
        {"recipe": "ar2-lr1e-3", "top1_agreement": 0.35},
        {"recipe": "ar1-lr1e-3", "top1_agreement": 0.3},
    ]
    merged = bench_recipes.merge_with_saved(saved, fresh, 300, 6000)
    # A rerun recipe replaces its saved row; the others are kept; the order is the RECIPES order.
    assert [(r["recipe"], r["top1_agreement"]) for r in merged] == [
        ("ar2-lr1e-3", 0.35),
        ("ar1-lr1e-3", 0.3),
        ("ar6-lr1e-3", 0.40),
    ]
    # Another study (other steps or data size) is not mixed in.
    assert bench_recipes.merge_with_saved(saved, fresh, 600, 6000) == fresh
    assert bench_recipes.merge_with_saved(tmp_path / "none.json", fresh, 300, 6000) == fresh
