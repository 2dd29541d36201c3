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
length E[k] the draft would reach per k, plus the wall time of the stage. Every recipe trains from step 0
(`train.resume=never`); a failed training (exit not 0) shows its exit code and no figures. Written to
`bench/out/recipes.{json,md}` (`recipes-<data run>.*` with --data-run, `recipes-quick*` with --quick), merged with
the saved rows of other recipes of the same study: same config file (path and contents), steps and data. A
saved table of another study is kept beside it as `<name>.<config sha>-<steps>steps.{json,md}`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    OUT_DIR,
    REPO,
    command_line,
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    positive_int,
    write_fragment,
)

# Every recipe names its drafting mode (draft.parallel_tokens=0 unless it overrides it) and its layers (the
# first draft.num_layers unless it sets draft.layers), so the recipes keep their meaning whichever draft the
# shipped config trains.
SHARED = [
    "target.dtype=bfloat16",
    "train.teacher=cached",
    "train.batch_size=16",
    "train.val_every=100",
    "draft.parallel_tokens=0",
    "draft.layers=null",
]
# Every recipe trains from step 0 in its invocation (an earlier training in its folder is deleted first).
FRESH_START = "train.resume=never"
# The 2-layer parallel draft proposing 4 tokens per pass, as shipped at lr 1e-3 until 2026-12-05 and at lr 4e-3
# (the pard4-lr4e-3 recipe) until 2026-12-06; configs/smollm2-sharegpt.yaml now trains the induction-layer draft
# (pard4-lr4e-3-layers-induction) for 160 steps.
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
    # The pard4-lr4e-3 recipe on the first 2 layers plus the target's previous-token layer 16 and induction layers
    # 17-18 (bench_copy): the first-2-layer draft never learns to copy, which prompt lookup does.
    "pard4-lr4e-3-layers-induction": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=5",
        "draft.layers=[0,1,16,17,18]",
    ],
    # The shipped induction-layer recipe at twice its peak learning rate: its 160-step schedule is half the one
    # lr 4e-3 was chosen on.
    "pard4-lr8e-3-layers-induction": [
        *PARD4[:-1],
        "train.lr=8e-3",
        "draft.num_layers=5",
        "draft.layers=[0,1,16,17,18]",
    ],
    # The shipped induction-layer draft plus the target's last layer (29): it writes in the space the final norm
    # and the shared head read, which the draft's layer 18 has to learn to imitate otherwise.
    "pard4-lr4e-3-layers-induction-last": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=6",
        "draft.layers=[0,1,16,17,18,29]",
    ],
    # Wider still: the next previous-token (19) and induction (20) layers too, and the last layer. In a
    # parallel round the draft runs once, so its depth costs less than an autoregressive draft's (section 10).
    "pard4-lr4e-3-layers-induction-wide": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=8",
        "draft.layers=[0,1,16,17,18,19,20,29]",
    ],
    # The eight-layer draft above without the last layer, which alone did not help: two layers (0.06 of a target
    # step per round inside vLLM) for the gain layers 19-20 brought.
    "pard4-lr4e-3-layers-induction-19-20": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=7",
        "draft.layers=[0,1,16,17,18,19,20]",
    ],
    # The shipped induction-layer recipe with cross-entropy on the target's argmax beside the forward KL: greedy
    # drafting accepts only argmax matches (the 2-layer draft gained 0.004-0.008 top-1 on validation from it).
    "pard4-lr4e-3-layers-induction-fkl+ce": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=5",
        "draft.layers=[0,1,16,17,18]",
        "train.loss=mix",
        "train.loss_weights.fkl=1.0",
        "train.loss_weights.ce=1.0",
    ],
    # The shipped induction-layer recipe training twice the share of mask groups per step: its later drafted
    # tokens are accepted far less often than its first (0.35 and 0.22 conditionally, against 0.51 on the
    # validation rows at 160 steps), and they cost nothing more inside vLLM, only training time.
    "pard4-lr4e-3-layers-induction-mask0.5": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=5",
        "draft.layers=[0,1,16,17,18]",
        "train.parallel_mask_fraction=0.5",
    ],
    # The shipped induction-layer recipe with the training softmax over 8192 or 16384 candidate tokens per
    # micro-batch (train.head_candidates: the ~7k its 16 rows' cached top-32 name and a reweighted sample of the
    # others) instead of all 49,152: the head and the loss were about half of a step (BENCHMARKS.md section 7).
    "pard4-lr4e-3-layers-induction-cand8k": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=5",
        "draft.layers=[0,1,16,17,18]",
        "train.head_candidates=8192",
    ],
    "pard4-lr4e-3-layers-induction-cand16k": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "draft.num_layers=5",
        "draft.layers=[0,1,16,17,18]",
        "train.head_candidates=16384",
    ],
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
    # The "truncate vs fresh init": the shipped recipe on a fresh small Llama (`draft.init=config`: 4
    # layers of width 256, tied embeddings, the target's tokenizer) instead of the target's first 2 layers; its
    # 49152 x 256 head costs less than half the truncated draft's 49152 x 576 one.
    "pard4-fresh-h256-l4-lr4e-3": [
        "draft.num_layers=4",
        *PARD4[1:-1],
        "train.lr=4e-3",
        "draft.init=config",
        "draft.hidden_size=256",
        "draft.intermediate_size=768",
        "draft.num_attention_heads=4",
        "draft.num_key_value_heads=2",
    ],
    # The distillation temperature (train.kd_temperature divides teacher and student logits in the loss). It
    # needs the online teacher (the cache holds T=1 log-probs), so both arms train online, at T=1 and at T=2.
    "pard4-lr4e-3-online": [*PARD4[:-1], "train.lr=4e-3", "train.teacher=online"],
    "pard4-lr4e-3-online-kd2": [
        *PARD4[:-1],
        "train.lr=4e-3",
        "train.teacher=online",
        "train.kd_temperature=2.0",
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


def train_finished(run_dir: Path) -> str | None:
    """When the train stage last completed in `run_dir` (its completion record), or None. A row keeps it, so
    that a later training of the same folder (another study's invocation) is not read as the row's figures."""
    try:
        return json.loads((run_dir / "stages" / "train.json").read_text()).get("finished")
    except (OSError, ValueError, AttributeError):
        return None


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
    # FRESH_START: the folder persists between invocations, and resuming its finished checkpoint would train
    # 0 steps and report the earlier training's validation with this invocation's wall time.
    overrides = [f"run.dir={run_dir}", f"train.max_steps={steps}", FRESH_START, *SHARED, *RECIPES[name]]
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
        "train_finished": train_finished(run_dir) if rc == 0 else None,
    }


NO_FIGURES: dict[str, Any] = {"step": None, "top1_agreement": None, "accept_len": None, "top1_by_step": {}}
RETRAINED = "its run folder was trained again since: figures withheld"


def with_validation(row: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`row` with the figures of its run folder's validations (saved rows are re-read this way, so the table
    always shows what the run folders hold). A failed training shows none: its folder may still hold an
    earlier training's history. Neither does a folder trained again after the row was recorded."""
    retrained = row.get("exit") == 0 and train_finished(run_dir) != row.get("train_finished")
    history = validations(run_dir) if row.get("exit") == 0 and not retrained else []
    row = {**row, "withheld": RETRAINED if retrained else None}
    if not history:
        return {**row, **NO_FIGURES}
    val = history[-1]
    return {
        **row,
        "step": val.get("step"),
        "top1_agreement": first_token_top1(val),
        "accept_len": val.get("accept_len"),
        "top1_by_step": {str(v["step"]): first_token_top1(v) for v in history},
    }


def read_saved(saved_path: Path) -> dict[str, Any] | None:
    return json.loads(saved_path.read_text()) if saved_path.is_file() else None


def same_study(saved: dict[str, Any] | None, study: dict[str, Any]) -> bool:
    return saved is not None and all(saved.get(key) == value for key, value in study.items())


def merge_with_saved(
    saved_path: Path, rows: list[dict[str, Any]], study: dict[str, Any]
) -> list[dict[str, Any]]:
    """This invocation's rows plus the saved rows of recipes it did not run, when the saved table is the same
    study (same config file and contents, steps, data): recipes run one invocation at a time still make one
    table, and a rerun recipe replaces its row. Ordered as in RECIPES."""
    saved = read_saved(saved_path)
    if saved is None or not same_study(saved, study):
        return rows
    fresh = {r["recipe"] for r in rows}
    merged = [r for r in saved.get("rows", []) if r.get("recipe") not in fresh] + rows
    order = {name: i for i, name in enumerate(RECIPES)}
    return sorted(merged, key=lambda r: order.get(r["recipe"], len(order)))


def set_aside_other_study(saved_path: Path, study: dict[str, Any]) -> list[Path]:
    """Move a saved table of another study (other config contents, steps or data) out of the way, to
    `<name>.<config sha>-<steps>steps.{json,md}`, instead of letting this invocation's table replace it."""
    saved = read_saved(saved_path)
    if saved is None or same_study(saved, study):
        return []
    tag = f"{str(saved.get('config_sha256') or 'unkeyed')[:12]}-{saved.get('steps')}steps"
    moved = []
    for old in (saved_path, saved_path.with_suffix(".md")):
        if old.is_file():
            new = old.with_name(f"{saved_path.stem}.{tag}{old.suffix}")
            old.replace(new)
            moved.append(new)
    return moved


def overrides_cell(row: dict[str, Any]) -> str:
    cell = " ".join(f"`{o}`" for o in row["overrides"])
    data = row.get("data_overrides") or []
    return cell + ("; training responses: " + " ".join(f"`{o}`" for o in data) if data else "")


def exit_cell(row: dict[str, Any]) -> str:
    code = row.get("exit")
    cell = "—" if code is None else str(code)
    return cell + (f" ({row['withheld']})" if row.get("withheld") else "")


def wall_cell(row: dict[str, Any]) -> str:
    """Minutes of a training that ran from step 0 to the end (every successful one, FRESH_START); a failed
    run's time measures nothing."""
    trained = row.get("exit") == 0 and not row.get("withheld") and row.get("wall_s") is not None
    return fmt(row["wall_s"] / 60, 1) if trained else "—"


def table_row(r: dict[str, Any], ks: list[str]) -> list[str]:
    al = r["accept_len"] or {}
    return [
        r["recipe"],
        overrides_cell(r),
        exit_cell(r),
        str(r["step"] or "—"),
        " → ".join(f"{fmt(v)} @{k}" for k, v in (r.get("top1_by_step") or {}).items()) or "—",
        *[fmt(al.get(k), 2) for k in ks],
        wall_cell(r),
        (r.get("finished_utc") or "—").replace("T", " ")[:16],
    ]


def invocations(rows: list[dict[str, Any]]) -> str:
    """Which command, machine and commit produced each row: a table may merge several invocations."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        machine = r.get("machine")
        key = (
            r.get("command") or "(not recorded)",
            machine_line(machine) if machine else "(not recorded)",
        )
        groups.setdefault(key, []).append(r["recipe"])
    lines = [f"- {', '.join(names)}: `{command}`; {machine}" for (command, machine), names in groups.items()]
    return "Rows by invocation (command; machine, git commit, start):\n\n" + "\n".join(lines)


def markdown(
    rows: list[dict[str, Any]], steps: int, data_run: Path | None = None, config: str | None = None
) -> str:
    """`config`: how the note names the config file (its path and hash)."""
    ks = ["1", "2", "3", "4"]
    header = [
        "recipe",
        "overrides",
        "exit",
        "steps",
        "top-1 agreement by step",
        *[f"E[k={k}]" for k in ks],
        "train wall (min)",
        "finished (UTC)",
    ]
    body = [table_row(r, ks) for r in rows]
    note = (
        f"\n\nEvery recipe: {steps} steps from step 0 (`{FRESH_START}`) of `distill train`"
        + (f" with the config {config}" if config else "")
        + f" and {' '.join(f'`{o}`' for o in SHARED)} on "
        + ("one shared data run" if data_run is None else f"the data of the run `{data_run}`")
        + ", unless its own overrides (applied after these) say otherwise; a recipe with training-response "
        "overrides trains on a data run of its own and validates on the shared one's rows. "
        "A row whose training failed (exit not 0) shows no figures. "
        "E[k] = greedy mean acceptance length with k drafted tokens on the validation rows "
        "(1 + expected accepted tokens per round)."
    )
    return "### Training recipes\n\n" + markdown_table(header, body) + note + "\n\n" + invocations(rows)


def config_file(config: str) -> Path:
    """The config file as `distill` (run from the repository root) reads it."""
    return (REPO / config).resolve()


def study_of(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    """What a saved row must share with this invocation to be merged into its table."""
    path = config_file(args.config)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    study: dict[str, Any] = {
        "steps": args.steps,
        "config": str(shown),
        "config_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    if args.data_run is not None:
        return {**study, "data_run": str(data_dir)}
    return {**study, "train_prompts": args.train_prompts}


def describe(study: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={str(v)[:12] if k == 'config_sha256' else v}" for k, v in study.items() if k != "rows"
    )


def table_only_problem(saved_path: Path, study: dict[str, Any]) -> str | None:
    """Why --table-only has no rows to render (None when it has)."""
    saved = read_saved(saved_path)
    if saved is None:
        return f"--table-only: no saved table {saved_path}; train recipes first (without --table-only)"
    if same_study(saved, study) and saved.get("rows"):
        return None
    unkeyed = (
        " (saved before tables recorded their config: retrain its recipes)" if "config" not in saved else ""
    )
    return (
        f"--table-only: {saved_path} holds no rows of this study ({describe(study)}); it holds "
        f"{describe({k: saved.get(k) for k in study})}{unkeyed}. Give the -c/--config, --steps and "
        "--train-prompts or --data-run (and --quick) of the invocation that trained them."
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="configs/smollm2-sharegpt.yaml")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list (default: all)")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument(
        "--train-prompts",
        type=positive_int,
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
    p.add_argument(
        "--quick",
        action="store_true",
        help="a self-check: one recipe, 64 prompts, 20 steps (its own work folder and recipes-quick.* files)",
    )
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
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
    if not config_file(args.config).is_file():
        p.error(f"-c/--config {args.config}: no such file")
    # Quick mode has its own work folder and table: its 20-step rows must not replace the study's.
    work = args.out_dir / "work" / ("recipes-quick" if args.quick else "recipes")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    if args.data_run is not None:
        data_dir = args.data_run.resolve()
        if not (data_dir / "data" / "manifest.json").is_file():
            p.error(f"--data-run {args.data_run}: no finished data stage there (data/manifest.json)")
        work = work.with_name(f"{work.name}-{data_dir.name}")
    else:
        data_dir = work / "data"
    study = study_of(args, data_dir)
    saved_path = args.out_dir / f"{work.name}.json"
    if args.table_only and (problem := table_only_problem(saved_path, study)):
        p.error(problem)
    rows = []
    if not args.table_only:
        for kept in set_aside_other_study(saved_path, study):
            print(f"{saved_path.name} held another study's rows: kept as {kept}", file=sys.stderr)
        if args.data_run is None:
            ensure_data(args.config, data_dir, args.train_prompts)
        try:
            rows = [run_recipe(n, args.config, data_dir, work, args.steps) for n in names]
        except RecipeDataError as err:
            p.error(str(err))
    # Each row keeps the invocation that trained it: a table merges rows of several.
    command, machine = command_line("bench.bench_recipes", argv), machine_info()
    rows = [{**r, "command": command, "machine": machine} for r in rows]
    rows = merge_with_saved(saved_path, rows, study)
    rows = [with_validation(r, work / r["recipe"]) for r in rows]
    config = f"`{study['config']}` (sha256 {study['config_sha256'][:12]})"
    write_fragment(
        work.name,
        {**study, "rows": rows},
        markdown(rows, args.steps, args.data_run, config),
        command=command,
        machine=machine,
        out_dir=args.out_dir,
    )
    print((args.out_dir / f"{work.name}.md").read_text())
    return 0 if all(r.get("exit") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
