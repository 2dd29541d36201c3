"""Train-step time with and without `train.retain_freed_memory` (glibc keeps freed memory in the process),
side by side, on a real data run: the autoregressive draft and the parallel (PARD) draft of the embedded default.

    python -m bench.bench_malloc                                   # the demo's data run (make demo first)
    python -m bench.bench_malloc --run-dir checkpoints/smollm2-sharegpt --steps 20 --warmup 2 --repeats 2
    python -m bench.bench_malloc --quick                           # 2 timed steps, 1 repeat, AR only

Each measurement is its own process (a fresh heap), running `distill train`'s Lightning step (same module,
data module and precision as the config) on the run's cached data for --warmup untimed + --steps timed steps.
Within a repeat every draft runs once with the setting on and once off, the order alternating from repeat to
repeat so that a drifting machine does not favour one side. Reported per draft: the median step time over all
timed steps of all repeats for each setting, their ratio per repeat (off / on; its median and min–max), the
CPU time the kernel spent on the process (system) against user time, and peak RSS. With the setting on the
worker hands the retained memory back every TRIM_EVERY_STEPS steps as `distill train` does (distill/utils/malloc.py), so
the default 2 + 20 steps include one such trim and the page faults of the step after it. Written to
`bench/out/malloc.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    OUT_DIR,
    REPO,
    bare_trainer,
    command_line,
    fmt,
    machine_info,
    markdown_table,
    median,
    non_negative_int,
    order_for_repeat,
    positive_int,
    spread,
    utc_now,
    write_fragment,
)

# Draft variants: config overrides on top of --config.
DRAFTS: dict[str, list[str]] = {
    "autoregressive": ["draft.parallel_tokens=0"],
    "parallel-k4": ["draft.parallel_tokens=4", "train.parallel_mask_fraction=0.25"],
}


# ---------------------------------------------------------------------------------------------------------
# Worker side: one (draft, setting) in one process


def trim_every(args: argparse.Namespace) -> int:
    from distill.utils.malloc import TRIM_EVERY_STEPS

    return int(getattr(args, "trim_every", 0) or TRIM_EVERY_STEPS)


def worker(args: dict[str, Any]) -> dict[str, Any]:
    if args["retain"]:
        from distill.utils.malloc import retain_freed_memory

        if not retain_freed_memory():
            raise SystemExit("glibc refused the mallopt settings: nothing to compare on this machine")

    import torch
    from lightning.pytorch.callbacks import Callback

    from distill.config import load_config
    from distill.models.draft import build_initial_draft, load_model_config, load_tokenizer
    from distill.models.resolve import resolve_model
    from distill.train.callbacks import TrimFreedMemory
    from distill.train.stage import (
        build_datamodule,
        build_module,
        load_teacher,
        loss_spec,
        parallel_of,
        shared_vocab,
    )
    from distill.utils.malloc import memory_reserve_bytes, resident_bytes, retained_memory_budget

    steps = args["warmup"] + args["steps"]
    cfg = load_config(
        args["config"],
        [
            f"run.dir={args['run_dir']}",
            *args["overrides"],
            f"train.max_steps={steps}",
            f"train.warmup_steps={min(2, steps)}",
            "train.retain_freed_memory=false",  # decided above, before anything was allocated
        ],
    )
    torch.set_num_threads(args["threads"])
    target_dir = resolve_model(cfg.target.model, key="target.model")
    tok = load_tokenizer(target_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(cfg.run.seed)
    draft = build_initial_draft(cfg, target_dir)
    vocab = shared_vocab(
        len(tok), int(draft.config.vocab_size), int(load_model_config(target_dir).vocab_size)
    )
    module = build_module(cfg, draft, load_teacher(cfg, target_dir), loss_spec(cfg), vocab)
    dm = build_datamodule(cfg, pad_id, parallel_of(draft, cfg.train.parallel_mask_fraction))

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.rss_gib: list[float] = []  # resident after each step, before any hand-back
            self.cpu: list[tuple[float, float]] = []
            self._t0 = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if len(self.times) == args["warmup"]:
                use = resource.getrusage(resource.RUSAGE_SELF)
                self.cpu.append((use.ru_utime, use.ru_stime))
            self._t0 = time.perf_counter()

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.times.append(time.perf_counter() - self._t0)
            self.rss_gib.append((resident_bytes() or 0) / 2**30)
            if len(self.times) == steps:
                use = resource.getrusage(resource.RUSAGE_SELF)
                self.cpu.append((use.ru_utime, use.ru_stime))

    timer = Timer()
    # As `distill train` does with the setting on: the retained memory goes back every few steps, and with
    # "budget" also at once past the memory budget or short of available memory (distill.train.stage).
    with_budget = bool(args.get("budget"))
    trims = (
        [
            TrimFreedMemory(
                args["trim_every"],
                retained_memory_budget() if with_budget else None,
                reserve_bytes=memory_reserve_bytes() if with_budget else None,
            )
        ]
        if args["retain"]
        else []
    )
    trainer = bare_trainer(steps, precision=cfg.train.precision, callbacks=[timer, *trims])
    trainer.fit(module, datamodule=dm)
    (u0, s0), (u1, s1) = timer.cpu
    return {
        "step_s": timer.times[args["warmup"] :],
        "rss_gib": timer.rss_gib,
        "forced_trims": trims[0].over_budget if trims else 0,
        "released_at": trims[0].released_at if trims else None,
        "user_s": u1 - u0,
        "system_s": s1 - s0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---------------------------------------------------------------------------------------------------------
# Driver side


def run_worker(args: dict[str, Any], threads: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, "-m", "bench.bench_malloc", "--worker", json.dumps(args)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker {args['draft']} retain={args['retain']} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def complete_data(run_dir: str, config: str) -> Path | None:
    """The data folder of `run_dir` when its data stage is complete; else None, the reason on stderr."""
    data = (REPO / run_dir / "data").resolve()
    if (data / "manifest.json").is_file():
        return data
    print(
        f"{data}: no complete data stage; run `make demo` (or `distill data -c {config}`) first, or pass --run-dir",
        file=sys.stderr,
    )
    return None


def workspace(data: Path, prefix: str) -> Path:
    """A fresh run folder whose `data` is the given data stage (the workers train in it)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    (work / "data").symlink_to(data, target_is_directory=True)
    return work


def worker_job(
    args: argparse.Namespace, work: Path, overrides: list[str], label: str, retain: bool, budget: bool = False
) -> dict[str, Any]:
    """One worker's arguments: the bench's command-line settings, the run folder and the config overrides."""
    return {
        "config": str(REPO / args.config),
        "run_dir": str(work),
        "overrides": overrides,
        "retain": retain,
        "budget": budget,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "draft": label,
        "trim_every": trim_every(args),
    }


def write_study(
    name: str,
    started: str,
    summary: dict[str, Any],
    runs: list[dict[str, Any]],
    table: str,
    argv: list[str] | None,
    out_dir: Path,
    module: str = "",
) -> None:
    """Write `<out_dir>/<name>.{json,md}` (summary, every run, command, machine) and print the table; the
    command names `bench.<module>` (default `bench.bench_<name>`)."""
    payload = {"started_utc": started, "finished_utc": utc_now(), "summary": summary, "runs": runs}
    write_fragment(
        name,
        payload,
        table,
        command=command_line(f"bench.{module or 'bench_' + name}", argv),
        machine=machine_info(),
        out_dir=out_dir,
    )
    print((out_dir / f"{name}.md").read_text())


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per draft: step-time medians per setting, the per-repeat ratio off / on, kernel share of CPU time."""
    out: dict[str, Any] = {}
    for draft in dict.fromkeys(r["draft"] for r in runs):
        mine = [r for r in runs if r["draft"] == draft]
        row: dict[str, Any] = {}
        for label, retain in (("on", True), ("off", False)):
            side = [r for r in mine if r["retain"] is retain]
            steps = [s for r in side for s in r["step_s"]]
            row[label] = {
                "step_s": spread(steps),
                "system_share": median([r["system_s"] / (r["system_s"] + r["user_s"]) for r in side]),
                "peak_rss_mib": median([r["peak_rss_mib"] for r in side]),
            }
        ratios = []
        for rep in sorted({r["repeat"] for r in mine}):
            pair = {r["retain"]: median(r["step_s"]) for r in mine if r["repeat"] == rep}
            if True in pair and False in pair:
                ratios.append(pair[False] / pair[True])
        row["off_over_on"] = spread(ratios) if ratios else None
        out[draft] = row
    return out


def markdown(summary: dict[str, Any], args: argparse.Namespace) -> str:
    header = [
        "draft",
        "retain_freed_memory",
        "s/step (median, min–max)",
        "kernel share of CPU time",
        "peak RSS MiB",
        "speedup (off / on, per repeat)",
    ]
    rows = []
    for draft, row in summary.items():
        ratio = row["off_over_on"]
        for label in ("on", "off"):
            s = row[label]
            rows.append(
                [
                    draft,
                    "true" if label == "on" else "false",
                    f"{fmt(s['step_s']['median'], 2)} ({fmt(s['step_s']['min'], 2)}–{fmt(s['step_s']['max'], 2)})",
                    f"{100 * s['system_share']:.0f}%",
                    f"{s['peak_rss_mib']:.0f}",
                    (
                        f"**{ratio['median']:.2f}x** ({ratio['min']:.2f}–{ratio['max']:.2f}, n={ratio['n']})"
                        if label == "on" and ratio
                        else ""
                    ),
                ]
            )
    note = (
        f"\n\n{args.steps} timed steps after {args.warmup} untimed, {args.repeats} repeat(s), each run its own "
        f"process, settings alternating in order; data: `{args.run_dir}`, config `{args.config}`, "
        f"{args.threads} threads; retained memory handed back every {trim_every(args)} steps."
    )
    return (
        "### Train step: glibc keeping freed memory (`train.retain_freed_memory`)\n\n"
        + markdown_table(header, rows)
        + note
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-sharegpt.yaml")
    p.add_argument(
        "--run-dir", default="checkpoints/smollm2-sharegpt", help="a run with a complete data stage"
    )
    p.add_argument("--drafts", default=",".join(DRAFTS), help=f"comma list of {sorted(DRAFTS)}")
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument(
        "--trim-every",
        type=non_negative_int,
        default=0,
        help="hand retained memory back every N steps (0 = distill train's TRIM_EVERY_STEPS)",
    )
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="2 timed steps, 1 repeat, the autoregressive draft")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.quick:
        args.steps, args.warmup, args.repeats, args.drafts = 2, 1, 1, "autoregressive"
    data = complete_data(args.run_dir, args.config)
    if data is None:
        return 2
    drafts = [d for d in args.drafts.split(",") if d]
    unknown = [d for d in drafts if d not in DRAFTS]
    if unknown:
        print(f"--drafts: unknown {unknown}; choose from {sorted(DRAFTS)}", file=sys.stderr)
        return 2
    work = workspace(data, "bench_malloc.")
    started = utc_now()
    runs = []
    for rep in range(args.repeats):
        order = order_for_repeat((True, False), rep)
        for draft in drafts:
            for retain in order:
                result = run_worker(worker_job(args, work, DRAFTS[draft], draft, retain), args.threads)
                runs.append({"draft": draft, "retain": retain, "repeat": rep, **result})
                print(
                    f"repeat {rep} {draft} retain={retain}: median {median(result['step_s']):.2f} s/step, "
                    f"system {result['system_s']:.1f} s / user {result['user_s']:.1f} s",
                    flush=True,
                )
    summary = summarize(runs)
    write_study("malloc", started, summary, runs, markdown(summary, args), argv, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
