"""Benchmark: the training-recipe study on the embedded default — which draft and training settings raise
acceptance per second of CPU training, measured on held-out data with the target's own greedy continuations.

    python -m bench.bench_recipes                         # every recipe (hours on 2 cores)
    python -m bench.bench_recipes --recipes ar2-lr1e-3,ar6-lr1e-3
    python -m bench.bench_recipes --list
    python -m bench.bench_recipes --data-run checkpoints/smollm2-sharegpt --recipes pard4-lr4e-3   # the demo's data
    python -m bench.bench_recipes --data-run checkpoints/smollm2-sharegpt --table-only             # re-render

All recipes share one data run (the config's data section with --train-prompts prompts, top-32 log-probs cached
from vLLM's generation), created under `bench/out/work/recipes/data` when missing, and train with
`distill train` for the same number of steps on the cached teacher. Each recipe's figures come from its run's
`train/val_history.json` (the last validation): top-1 agreement with the target and the greedy mean acceptance
length E[k] the draft would reach per k, plus the wall time of the stage. Written to `bench/out/recipes.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, REPO, command_line, fmt, machine_info, markdown_table, write_fragment

# Every recipe names its drafting mode (draft.parallel_tokens=0 unless it overrides it), so the recipes keep
# their meaning whichever mode the shipped config uses.
SHARED = [
    "target.dtype=bfloat16",
    "train.teacher=cached",
    "train.batch_size=16",
    "train.val_every=100",
    "draft.parallel_tokens=0",
]
# The 2-layer parallel draft proposing 4 tokens per pass, as shipped at lr 1e-3; configs/smollm2-sharegpt.yaml
# now trains it at lr 4e-3 (the pard4-lr4e-3 recipe).
PARD4 = [
    "draft.num_layers=2",
    "draft.parallel_tokens=4",
    "train.parallel_mask_fraction=0.25",
    "train.precision=bf16-mixed",
    "train.lr=1e-3",
]
RECIPES: dict[str, list[str]] = {
    "ar2-fp32-lr5e-4": ["draft.num_layers=2", "train.precision=32", "train.lr=5e-4"],
    "ar2-lr1e-3": ["draft.num_layers=2", "train.precision=bf16-mixed", "train.lr=1e-3"],
    "ar2-lr1e-3-frozen-embeddings": [
        "draft.num_layers=2",
        "train.precision=bf16-mixed",
        "train.lr=1e-3",
        "train.freeze_embeddings=true",
    ],
    # The loss study: the shipped recipe with each other loss. Greedy drafting accepts only argmax matches,
    # which argmax-targeted (ce on the target's T=0 tokens) and mode-seeking (rkl, tvd) losses might favour.
    "ar2-lr1e-3-ce": ["draft.num_layers=2", "train.precision=bf16-mixed", "train.lr=1e-3", "train.loss=ce"],
    "ar2-lr1e-3-fkl+ce": [
        "draft.num_layers=2",
        "train.precision=bf16-mixed",
        "train.lr=1e-3",
        "train.loss=mix",
        "train.loss_weights.fkl=1.0",
        "train.loss_weights.ce=1.0",
    ],
    "ar2-lr1e-3-rkl": ["draft.num_layers=2", "train.precision=bf16-mixed", "train.lr=1e-3", "train.loss=rkl"],
    "ar2-lr1e-3-tvd": ["draft.num_layers=2", "train.precision=bf16-mixed", "train.lr=1e-3", "train.loss=tvd"],
    "ar1-lr1e-3": ["draft.num_layers=1", "train.precision=bf16-mixed", "train.lr=1e-3"],
    "ar6-lr1e-3": ["draft.num_layers=6", "train.precision=bf16-mixed", "train.lr=1e-3"],
    "pard4-ar2-mask0.25": PARD4,
    # Which target layers the 2-layer draft keeps: the first and the last instead of the first two (layer-
    # skipping drafts keep the late layers, which already write in the head's space).
    "pard4-layers-first-last": [*PARD4, "draft.layers=[0,-1]"],
    # A 300-step schedule may be too short for lr 1e-3 to settle: a larger peak learning rate.
    "pard4-lr2e-3": [*PARD4[:-1], "train.lr=2e-3"],
    "pard4-lr4e-3": [*PARD4[:-1], "train.lr=4e-3"],
    "pard4-lr8e-3": [*PARD4[:-1], "train.lr=8e-3"],
    # The shipped recipe (lr 4e-3) seeing the same responses in twice the updates of half the size; measured
    # 21.0 vs 18.5 min of training for no gain (BENCHMARKS.md, section 5).
    "pard4-lr4e-3-batch8-600steps": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "train.batch_size=8",
        "train.max_steps=600",
        "train.val_every=200",
    ],
    # The shipped recipe on sampled (T=1) target responses instead of greedy ones (DATA_VARIANTS).
    "pard4-lr4e-3-data-t1": [*PARD4[:-1], "train.lr=4e-3"],
}
# Recipes whose training responses are generated another way: a data run of their own (the shared run's data
# settings plus these overrides) supplies the train split, while the validation split stays the shared run's, so
# every row is measured on the same target greedy continuations.
DATA_VARIANTS: dict[str, list[str]] = {
    "pard4-lr4e-3-data-t1": ["data.temperature=1.0"],
}


def distill_cmd(stage: str, config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "distill", stage, "-c", config, *overrides]


def ensure_data(config: str, data_dir: Path, train_prompts: int) -> None:
    """One shared data run with cached top-32 log-probs (skipped when complete: `distill data` resumes)."""
    overrides = [
        f"run.dir={data_dir}",
        "target.dtype=bfloat16",
        f"data.max_train_prompts={train_prompts}",
        "data.max_val_prompts=171",  # the 171 of the first 200 that fit, as measured before 2026-12-06
        "data.logits.top_k=32",
        "data.logits.source=vllm",
        "data.logits.codec=zlib",
    ]
    subprocess.run(distill_cmd("data", config, overrides), cwd=REPO, check=True)


def ensure_variant_data(data_dir: Path, variant_dir: Path, overrides: list[str]) -> None:
    """A data run like `data_dir`'s (its resolved config) with `overrides` (skipped when complete)."""
    config = str(data_dir / "config.yaml")
    cmd = distill_cmd("data", config, [f"run.dir={variant_dir}", f"run.name={variant_dir.name}", *overrides])
    subprocess.run(cmd, cwd=REPO, check=True)


class RecipeDataError(ValueError):
    """A recipe's run folder holds other data than the study gives it."""


def ensure_link(link: Path, target: Path) -> None:
    """`link` -> `target`, made once. Anything else already at `link` is refused: a recipe trained on other data
    than its row names would be a wrong figure."""
    if link.is_symlink() and link.resolve() == target.resolve():
        return
    if link.is_symlink() or link.exists():
        raise RecipeDataError(
            f"{link} is not a link to {target}: remove it, so that the recipe trains on the study's data"
        )
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=True)


def link_data(run_dir: Path, data_dir: Path, train_dir: Path | None) -> None:
    """`run_dir/data`: the shared data run's, or (`train_dir` given) a folder whose train split and its top-k
    cache come from `train_dir` and whose validation split and cache come from `data_dir`."""
    data = run_dir / "data"
    if train_dir is None:
        ensure_link(data, data_dir / "data")
        return
    if data.is_symlink():
        raise RecipeDataError(f"{data} links one data run; remove it: this recipe mixes two")
    for relative, source in (
        ("train", train_dir),
        ("topk/train", train_dir),
        ("val", data_dir),
        ("topk/val", data_dir),
    ):
        if (source / "data" / relative).exists():  # no top-k cache: no link
            ensure_link(data / relative, source / "data" / relative)


def validations(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "train" / "val_history.json"
    return json.loads(path.read_text()) if path.is_file() else []


def last_validation(run_dir: Path) -> dict[str, Any] | None:
    history = validations(run_dir)
    return history[-1] if history else None


def first_token_top1(validation: dict[str, Any]) -> float | None:
    """Top-1 agreement of the next-token proposal: for a parallel draft that of its first drafted token (its
    overall figure averages in the mask positions), for an autoregressive draft the overall one."""
    first = (validation.get("per_position") or {}).get("0") or {}
    value = first.get("top1_agreement")
    return validation.get("top1_agreement") if value is None else value


def run_recipe(name: str, config: str, data_dir: Path, work: Path, steps: int) -> dict[str, Any]:
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    train_dir = None
    if name in DATA_VARIANTS:
        train_dir = work / f"data-{name}"
        ensure_variant_data(data_dir, train_dir, DATA_VARIANTS[name])
    link_data(run_dir, data_dir, train_dir)
    overrides = [f"run.dir={run_dir}", f"train.max_steps={steps}", *SHARED, *RECIPES[name]]
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(
            distill_cmd("train", config, overrides), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    wall = time.perf_counter() - t0
    # The validation figures are read from the run folder with every other row's (`with_validation`).
    return {
        "recipe": name,
        "overrides": RECIPES[name],
        "data_overrides": DATA_VARIANTS.get(name, []),
        "exit": rc,
        "wall_s": round(wall, 1),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def with_validation(row: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`row` with the figures of its run folder's validations (saved rows are re-read this way, so the table
    always shows what the run folders hold)."""
    history = validations(run_dir)
    if not history:
        return {"step": None, "top1_agreement": None, "accept_len": None, "top1_by_step": {}, **row}
    val = history[-1]
    return {
        **row,
        "step": val.get("step"),
        "top1_agreement": first_token_top1(val),
        "accept_len": val.get("accept_len"),
        "top1_by_step": {str(v["step"]): first_token_top1(v) for v in history},
    }


def merge_with_saved(
    saved_path: Path, rows: list[dict[str, Any]], study: dict[str, Any]
) -> list[dict[str, Any]]:
    """This invocation's rows plus the saved rows of recipes it did not run, when the saved table is the same
    study (same steps, same data): recipes run one invocation at a time still make one table, and a rerun
    recipe replaces its row. Ordered as in RECIPES."""
    if not saved_path.is_file():
        return rows
    saved = json.loads(saved_path.read_text())
    if any(saved.get(key) != value for key, value in study.items()):
        return rows
    fresh = {r["recipe"] for r in rows}
    merged = [r for r in saved.get("rows", []) if r.get("recipe") not in fresh] + rows
    order = {name: i for i, name in enumerate(RECIPES)}
    return sorted(merged, key=lambda r: order.get(r["recipe"], len(order)))


def overrides_cell(row: dict[str, Any]) -> str:
    cell = " ".join(f"`{o}`" for o in row["overrides"])
    data = row.get("data_overrides") or []
    return cell + ("; training responses: " + " ".join(f"`{o}`" for o in data) if data else "")


def markdown(rows: list[dict[str, Any]], steps: int, data_run: Path | None = None) -> str:
    ks = ["1", "2", "3", "4"]
    header = [
        "recipe",
        "overrides",
        "steps",
        "top-1 agreement by step",
        *[f"E[k={k}]" for k in ks],
        "train wall (min)",
        "finished (UTC)",
    ]
    body = []
    for r in rows:
        al = r["accept_len"] or {}
        body.append(
            [
                r["recipe"],
                overrides_cell(r),
                str(r["step"] or "—"),
                " → ".join(f"{fmt(v)} @{k}" for k, v in (r.get("top1_by_step") or {}).items()) or "—",
                *[fmt(al.get(k), 2) for k in ks],
                fmt(r["wall_s"] / 60, 1),
                (r.get("finished_utc") or "—").replace("T", " ")[:16],
            ]
        )
    note = (
        f"\n\nEvery recipe: {steps} steps of `distill train` with {' '.join(f'`{o}`' for o in SHARED)} on "
        + ("one shared data run" if data_run is None else f"the data of the run `{data_run}`")
        + ", unless its own overrides (applied after these) say otherwise; a recipe with training-response "
        "overrides trains on a data run of its own and validates on the shared one's rows "
        "(recipes may come from several invocations: see each row's finish time). "
        "E[k] = greedy mean acceptance length with k drafted tokens on the validation rows "
        "(1 + expected accepted tokens per round)."
    )
    return "### Training recipes\n\n" + markdown_table(header, body) + note


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="configs/smollm2-sharegpt.yaml")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list (default: all)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--train-prompts",
        type=int,
        default=5035,
        help="usable train prompts (5035: the first 6000 read before)",
    )
    p.add_argument(
        "--data-run",
        type=Path,
        help="train on this finished run's data (e.g. checkpoints/smollm2-sharegpt, the demo's) instead of "
        "building the shared data run; --train-prompts is then unused",
    )
    p.add_argument("--list", action="store_true", help="print the recipes and exit")
    p.add_argument(
        "--table-only",
        action="store_true",
        help="train nothing: rewrite the saved table from its rows and their run folders",
    )
    p.add_argument("--quick", action="store_true", help="a self-check: one recipe, 64 prompts, 20 steps")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.list:
        for name, overrides in RECIPES.items():
            print(name, *overrides)
        return 0
    if args.quick:
        args.recipes, args.steps, args.train_prompts = "ar2-lr1e-3", 20, 64
    names = [n for n in args.recipes.split(",") if n]
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        p.error(f"unknown recipe {unknown}; choose from {', '.join(RECIPES)}")
    work = args.out_dir / "work" / ("recipes-quick" if args.quick else "recipes")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    if args.data_run is not None:
        data_dir = args.data_run.resolve()
        if not (data_dir / "data" / "manifest.json").is_file():
            p.error(f"--data-run {args.data_run}: no finished data stage there (data/manifest.json)")
        work = work.with_name(f"{work.name}-{data_dir.name}")
        study = {"steps": args.steps, "data_run": str(data_dir)}
    else:
        data_dir = work / "data"
        if not args.table_only:
            ensure_data(args.config, data_dir, args.train_prompts)
        study = {"steps": args.steps, "train_prompts": args.train_prompts}
    try:
        rows = (
            [] if args.table_only else [run_recipe(n, args.config, data_dir, work, args.steps) for n in names]
        )
    except RecipeDataError as err:
        p.error(str(err))
    out_name = "recipes" if args.data_run is None else f"recipes-{data_dir.name}"
    rows = merge_with_saved(args.out_dir / f"{out_name}.json", rows, study)
    rows = [with_validation(r, work / r["recipe"]) for r in rows]
    write_fragment(
        out_name,
        {**study, "rows": rows},
        markdown(rows, args.steps, args.data_run),
        command=command_line("bench.bench_recipes", argv),
        machine=machine_info(),
        out_dir=args.out_dir,
    )
    print((args.out_dir / f"{out_name}.md").read_text())
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
