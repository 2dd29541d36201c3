"""Train-step time and resident memory with the output head and loss run in blocks of rows
(`train.logits_block_rows`) against all of a micro-batch's predictions at once, with each block's gradient by
autograd or in closed form (`train.loss_gradient`), and with one sequence per row of the draft's input or
several (`train.pack_sequences`), and with the training softmax over the whole vocabulary or a sampled set of
candidate tokens (`train.head_candidates`), side by side on a real data run.

    python -m bench.bench_blocks                                   # the demo's data run (make demo first)
    python -m bench.bench_blocks --block-rows 0,512,1024,2048 --loss-gradient autograd --pack false --steps 40 --repeats 2
    python -m bench.bench_blocks --block-rows 1024 --loss-gradient autograd,auto --pack false,true --steps 16 --repeats 3
    python -m bench.bench_blocks --block-rows 1024 --head-candidates 0,8192,16384 --steps 16 --repeats 3
    python -m bench.bench_blocks --quick                           # 2 timed steps, 1 repeat

Each measurement is its own process (a fresh heap) running `distill train`'s Lightning step on the run's cached
data (bench_malloc's worker) with freed memory retained and handed back as `distill train` does: every
TRIM_EVERY_STEPS steps, and at once past the memory budget or when the machine runs short
(distill/utils/malloc.py). Within a repeat every setting runs once, the order rotating from repeat to repeat.
A setting is a (block rows, loss gradient, packing) triple: every --block-rows with every --loss-gradient and
every --pack.
Reported per setting: the median step time over all timed steps, its ratio to the first setting's per repeat,
the resident memory after the first timed step and its growth per step until the first hand-back (the heap
fragmentation blocks are meant to stop), the hand-backs the budget forced, and peak RSS. Written to
`bench/out/blocks.{json,md}`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from bench.bench_malloc import (
    DRAFTS,
    complete_data,
    run_worker,
    trim_every,
    worker_job,
    workspace,
    write_study,
)
from bench.common import (
    OUT_DIR,
    fmt,
    markdown_table,
    median,
    non_negative_int,
    positive_int,
    spread,
    utc_now,
)


def growth_per_step(rss_gib: list[float], warmup: int, every: int) -> float | None:
    """Resident growth in GiB per step from the first timed step to the step before the first periodic
    hand-back (steps are 1-based: the hand-back runs after step `every`), None when fewer than 2 steps lie
    between."""
    end = min(len(rss_gib), every) - 1  # index of the last step before the periodic trim
    start = warmup
    if end - start < 1:
        return None
    return (rss_gib[end] - rss_gib[start]) / (end - start)


def setting_label(block_rows: int, loss_gradient: str, pack: bool, candidates: int = 0) -> str:
    label = f"{block_rows}/{loss_gradient}/{'packed' if pack else 'unpacked'}"
    return f"{label}/{candidates} candidates" if candidates else label


def summarize(runs: list[dict[str, Any]], warmup: int, every: int) -> dict[str, Any]:
    """Per setting (`block rows/loss gradient/packing`): step-time spread, per-repeat ratio to the first setting,
    memory figures."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    base = settings[0]
    out: dict[str, Any] = {}
    for setting in settings:
        mine = [r for r in runs if r["setting"] == setting]
        ratios = []
        for rep in sorted({r["repeat"] for r in mine}):
            pair = {r["setting"]: median(r["step_s"]) for r in runs if r["repeat"] == rep}
            if base in pair and setting in pair:
                ratios.append(pair[base] / pair[setting])
        growth = [g for r in mine if (g := growth_per_step(r["rss_gib"], warmup, every)) is not None]
        out[setting] = {
            "block_rows": mine[0]["block_rows"],
            "loss_gradient": mine[0]["loss_gradient"],
            "pack_sequences": mine[0]["pack_sequences"],
            "head_candidates": mine[0].get("head_candidates", 0),
            "step_s": spread([s for r in mine for s in r["step_s"]]),
            "speedup_vs_first": spread(ratios) if ratios else None,
            "rss_first_timed_gib": median([r["rss_gib"][warmup] for r in mine if len(r["rss_gib"]) > warmup]),
            "rss_growth_gib_per_step": median(growth) if growth else None,
            "forced_trims": median([float(r["forced_trims"]) for r in mine]),
            "released": sum(1 for r in mine if r["released_at"] is not None),
            "peak_rss_mib": median([r["peak_rss_mib"] for r in mine]),
        }
    return out


def markdown(summary: dict[str, Any], args: argparse.Namespace) -> str:
    # The head_candidates column only where a setting trains on candidates (tables before it had none).
    with_candidates = any(row.get("head_candidates") for row in summary.values())
    header = [
        "logits_block_rows",
        "loss_gradient",
        "pack_sequences",
        *(["head_candidates"] if with_candidates else []),
        "s/step (median, min–max)",
        "speedup vs first (per repeat)",
        "RSS after first timed step GiB",
        "RSS growth GiB/step",
        "forced hand-backs",
        "peak RSS MiB",
    ]
    rows = []
    for row in summary.values():
        s, ratio, growth = row["step_s"], row["speedup_vs_first"], row["rss_growth_gib_per_step"]
        rows.append(
            [
                "0 (all at once)" if row["block_rows"] == 0 else str(row["block_rows"]),
                row["loss_gradient"],
                str(row["pack_sequences"]).lower(),
                *([str(row.get("head_candidates") or 0)] if with_candidates else []),
                f"{fmt(s['median'], 2)} ({fmt(s['min'], 2)}–{fmt(s['max'], 2)})",
                f"**{ratio['median']:.2f}x** ({ratio['min']:.2f}–{ratio['max']:.2f}, n={ratio['n']})"
                if ratio
                else "",
                f"{row['rss_first_timed_gib']:.1f}",
                "" if growth is None else f"{growth:+.2f}",
                f"{row['forced_trims']:.0f}"
                + (f" (retaining stopped in {row['released']})" if row["released"] else ""),
                f"{row['peak_rss_mib']:.0f}",
            ]
        )
    note = (
        f"\n\nDraft `{args.draft}`; {args.steps} timed steps after {args.warmup} untimed, {args.repeats} repeat(s), "
        f"each run its own process, settings rotating in order; freed memory retained and handed back every "
        f"{trim_every(args)} steps and past the budget (as `distill train`); data: `{args.run_dir}`, config "
        f"`{args.config}`, {args.threads} threads. Growth: resident memory from the first timed step to the step "
        "before the first periodic hand-back, per step. With all rows at once (0) the loss always takes autograd."
    )
    title = (
        "### Train step: output head and loss in blocks of rows (`train.logits_block_rows`), gradient by "
        "autograd or in closed form (`train.loss_gradient`), sequences packed (`train.pack_sequences`)"
        + (", softmax over candidate tokens (`train.head_candidates`)" if with_candidates else "")
    )
    return f"{title}\n\n{markdown_table(header, rows)}{note}"


def comma_choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str] | None:
    """The values of a comma list option, each one of `allowed`; None (the reason on stderr) otherwise."""
    values = [x.strip().lower() for x in text.split(",") if x.strip()]
    if not values or any(v not in allowed for v in values):
        print(f"{flag}: expected a comma list of {', '.join(allowed)}; got {text!r}", file=sys.stderr)
        return None
    return values


def comma_ints(text: str, flag: str) -> list[int] | None:
    """The integers >= 0 of a comma list option; None (the reason on stderr) otherwise."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(x < 0 for x in values):
        print(f"{flag}: expected a comma list of integers >= 0, got {text!r}", file=sys.stderr)
        return None
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-sharegpt.yaml")
    p.add_argument(
        "--run-dir", default="checkpoints/smollm2-sharegpt", help="a run with a complete data stage"
    )
    p.add_argument("--draft", default="parallel-k4", choices=sorted(DRAFTS))
    p.add_argument("--block-rows", default="0,512,1024,2048", help="comma list; the first is the reference")
    p.add_argument(
        "--loss-gradient",
        default="auto",
        help="comma list of train.loss_gradient values (auto, autograd); the first is the reference",
    )
    p.add_argument(
        "--pack",
        default="true",
        help="comma list of train.pack_sequences values (true, false); the first is the reference",
    )
    p.add_argument(
        "--head-candidates",
        default="0",
        help="comma list of train.head_candidates values (0 = the whole vocabulary); the first is the reference",
    )
    p.add_argument("--steps", type=positive_int, default=40)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument(
        "--trim-every", type=non_negative_int, default=0, help="0 = distill train's TRIM_EVERY_STEPS"
    )
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="2 timed steps, 1 repeat")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--name", default="blocks", help="output stem: <out-dir>/<name>.{json,md}")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    settings = comma_ints(args.block_rows, "--block-rows")
    gradients = comma_choices(args.loss_gradient, ("auto", "autograd"), "--loss-gradient")
    packs = comma_choices(args.pack, ("true", "false"), "--pack")
    candidates = comma_ints(args.head_candidates, "--head-candidates")
    if settings is None or gradients is None or packs is None or candidates is None:
        return 2
    combos = [
        (rows, grad, pack == "true", cand)
        for cand in candidates
        for pack in packs
        for grad in gradients
        for rows in settings
    ]
    data = complete_data(args.run_dir, args.config)
    if data is None:
        return 2
    work = workspace(data, "bench_blocks.")
    started = utc_now()
    runs = []
    for rep in range(args.repeats):
        shift = rep % len(combos)
        for rows, grad, pack, cand in combos[shift:] + combos[:shift]:
            packed = str(pack).lower()
            overrides = [
                *DRAFTS[args.draft],
                f"train.logits_block_rows={rows}",
                f"train.loss_gradient={grad}",
                f"train.pack_sequences={packed}",
                f"train.head_candidates={cand}",
            ]
            label = f"{args.draft} logits_block_rows={rows} loss_gradient={grad} pack_sequences={packed}"
            label += f" head_candidates={cand}" if cand else ""
            job = worker_job(args, work, overrides, label, retain=True, budget=True)
            result = run_worker(job, args.threads)
            runs.append(
                {
                    "setting": setting_label(rows, grad, pack, cand),
                    "block_rows": rows,
                    "loss_gradient": grad,
                    "pack_sequences": pack,
                    "head_candidates": cand,
                    "repeat": rep,
                    **result,
                }
            )
            print(
                f"repeat {rep} {label}: median {median(result['step_s']):.2f} s/step, "
                f"peak RSS {result['peak_rss_mib'] / 1024:.1f} GiB, forced hand-backs {result['forced_trims']}",
                flush=True,
            )
    summary = summarize(runs, args.warmup, trim_every(args))
    table = markdown(summary, args)
    write_study(args.name, started, summary, runs, table, argv, args.out_dir, module="bench_blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
