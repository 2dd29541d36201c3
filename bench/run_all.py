"""Run every bench script, one after another, and index their figures in `bench/out/summary.md`.

    python -m bench.run_all                 # `make bench`: every bench with its full default arguments
    python -m bench.run_all --quick         # each bench's quick self-check
    python -m bench.run_all --only drafts   # one bench (repeat --only, or give a comma list, for several)

Benches run sequentially, never in parallel (the machine is noisy: parallel runs would time each other), each
as its own subprocess so one crash cannot take the others down; a failure is recorded and the run continues.
Each bench's output goes to `bench/out/logs/<bench>.log`; its figures to `bench/out/<stem>.json|md`.
Exit status: 0 when every bench exited 0, else 1; 2 for a bad option (an unknown --only bench), before any runs.
A failed bench's fragments appear in the summary under a FAILED warning; stale ones (earlier runs') never do.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, REPO, machine_info, machine_line, utc_now

# bench_eval trains the embedded default's draft when it is missing, so it runs before bench_drafts, which
# measures that distilled draft beside the undistilled candidates, and before bench_malloc and bench_blocks,
# which train on that run's data, as does bench_eagle (an EAGLE-1 head on that run's responses); bench_copy
# reads that run's validation rows and its undistilled and distilled drafts, bench_vocab its data and distilled
# draft (which it trims and measures inside vLLM).
BENCHES = (
    "bench_precision",
    "bench_data",
    "bench_train",
    "bench_recipes",
    "bench_eval",
    "bench_eagle",
    "bench_malloc",
    "bench_blocks",
    "bench_drafts",
    "bench_copy",
    "bench_vocab",
)
# Quick arguments for benches that have no --quick flag (used only when their --help lacks one).
QUICK_FALLBACK = {
    "bench_data": ["--skip-vllm", "--prompts", "16", "--max-new-tokens", "64", "--repeats", "1"]
}
# Full runs that are not a bench's own defaults, each variant with its own log and `<stem>-<variant>` files:
# bench_train's defaults are a tiny target built in code (right for its acceptance comparison, which trains
# three drafts to a plateau); its speed figures are wanted on the embedded default.
_MODE_STUDY = ["--phase", "t0", "eval.k=[2]", "eval.num_prompts=32", "eval.repeats=2", "eval.ngram=false",
               "eval.analytic_prompts=0", "eval.drafts=[{name: distilled, model: '${run.dir}/draft'}]"]  # fmt: skip
FULL_RUNS: dict[str, dict[str, list[str]]] = {
    "bench_data": {
        "": [],
        # vLLM generation compiled (data.vllm_enforce_eager=false, the default) vs eager at the demo's batch
        # and dtype, 2 alternated passes per mode.
        "eager-study": ["--eager-study", "--prompts", "256", "--batch-size", "64", "--dtype", "bfloat16",
                        "--repeats", "2"],
        # Prompts per generation call (data.batch_size) with the shipped top-k cache, as the demo generates.
        "batch-study": ["--batch-sizes", "64,128,256", "--prompts", "256", "--dtype", "bfloat16", "--repeats", "2"],
        # One generate call per batch vs requests streamed across batches (data.vllm_stream), at the shipped
        # batch of 128 with the shipped top-k cache; 640 prompts are 5 batches, 4 of whose ends can overlap.
        "stream-study": ["--stream-study", "--prompts", "640", "--batch-size", "128", "--dtype", "bfloat16",
                         "--repeats", "2"],
    },
    "bench_train": {
        "speed": ["--only", "speed", "--target", "smollm2-135m-instruct", "--draft-layers", "2",
                  "--seq-len", "384", "--batch-size", "16", "--precision", "bf16-mixed", "--steps", "10",
                  "--warmup", "2", "--threads", "2", "--n-train", "64", "--n-val", "16"],
        "acceptance": ["--only", "acceptance"],
    },
    "bench_eval": {
        "": [],
        # Compiled (vLLM's default, eval.enforce_eager=false) vs eager decoding, the shipped draft, side by side
        # with no_spec in each mode.
        "t0-eager": ["--tag", "eager", *_MODE_STUDY, "eval.enforce_eager=true"],
        "t0-compiled": ["--tag", "compiled", *_MODE_STUDY, "eval.enforce_eager=false"],
        # The learning-curve study: the shipped recipe trained 900 steps instead of 300 (its own run folder,
        # same data config), beside the shipped 300-step draft that the default run above trained, 1 pass.
        "t0-900": ["--phase", "t0", "--tag", "900", "run.dir=bench/out/work/pard-900", "train.max_steps=900",
                   "eval.k=[2]", "eval.repeats=1", "eval.ngram=false", "eval.analytic_prompts=0",
                   "eval.drafts=[{name: distilled-300, model: checkpoints/smollm2-sharegpt/draft}, "
                   "{name: distilled-900, model: '${run.dir}/draft'}]"],
    },
    "bench_blocks": {
        # The block-rows study of section 7 as it was measured (autograd, one sequence per row), then the
        # closed-form gradient and packed rows beside it at the default 1024 rows.
        "": ["--loss-gradient", "autograd", "--pack", "false"],
        "head": ["--block-rows", "1024", "--loss-gradient", "autograd,auto", "--pack", "false,true",
                 "--steps", "16", "--repeats", "3", "--name", "blocks-head"],
    },
    "bench_vocab": {
        # The trimmed drafts exported, then timed inside vLLM beside the full one (bench_eval --tag vocab).
        "": ["--export", "bench/out/work/vocab", "--vllm"],
    },
    "bench_drafts": {
        "bf16": ["--layers", "1,2,4,6", "--dtype", "bfloat16", "--name", "drafts-bf16", "--repeats", "3",
                 "--draft", "distilled=checkpoints/smollm2-sharegpt/draft"],
    },
}  # fmt: skip
_OUT_FLAG = re.compile(r"--out(?![\w-])")


def stem(name: str) -> str:
    """Fragment name of a bench: bench_drafts -> drafts."""
    return name.removeprefix("bench_")


def available(names: Sequence[str] = BENCHES, bench_dir: Path = REPO / "bench") -> list[str]:
    return [n for n in names if (bench_dir / f"{n}.py").is_file()]


def wanted_benches(only: Sequence[str]) -> set[str]:
    """Bench module names of --only values (comma lists, with or without the bench_ prefix)."""
    return {w if w.startswith("bench_") else f"bench_{w}" for item in only for w in item.split(",") if w}


def unknown_benches_message(only: Sequence[str]) -> str | None:
    unknown = sorted(wanted_benches(only) - set(BENCHES))
    if not unknown:
        return None
    return f"unknown bench {unknown}; choose from {', '.join(stem(b) for b in BENCHES)}"


def only_option(text: str) -> str:
    """argparse `type=` of --only: an unknown bench is argparse's exit 2 before anything runs."""
    problem = unknown_benches_message([text])
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def select(only: Sequence[str], present: Sequence[str]) -> list[str]:
    """The benches named by --only (with or without the bench_ prefix), in the standard order."""
    if not only:
        return list(present)
    problem = unknown_benches_message(only)
    if problem:
        raise SystemExit(f"--only: {problem}")
    wanted = wanted_benches(only)
    return [n for n in present if n in wanted]


def help_text(name: str) -> str:
    try:
        out = subprocess.run(
            [sys.executable, "-m", f"bench.{name}", "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout


def variants(name: str, quick: bool) -> dict[str, list[str]]:
    """The runs of one bench: {"": []} (its own defaults, or its quick mode) or FULL_RUNS' variants."""
    return {"": []} if quick or name not in FULL_RUNS else FULL_RUNS[name]


def bench_args(
    name: str, quick: bool, help_: str, out_dir: Path, variant: str = "", extra: Sequence[str] = ()
) -> list[str]:
    """Arguments for one bench run: nothing (its full defaults), a FULL_RUNS variant's, or its quick mode;
    `--out` where it takes one (`<stem>-<variant>.json` for a variant)."""
    args: list[str] = list(extra)
    if quick:
        args += ["--quick"] if "--quick" in help_ else QUICK_FALLBACK.get(name, [])
    if _OUT_FLAG.search(help_):  # benches that print unless told where to write their JSON
        args += ["--out", str(out_dir / f"{stem(name)}{'-' + variant if variant else ''}.json")]
    if "--out-dir" in help_ and out_dir != OUT_DIR:
        args += ["--out-dir", str(out_dir)]
    return args


def run_one(name: str, args: list[str], log_path: Path) -> dict[str, Any]:
    """Run `python -m bench.NAME ARGS` with its output in `log_path`; never raises for the bench's failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", f"bench.{name}", *args])
    print(f"[{utc_now()}] {command}  (log: {log_path})", flush=True)
    started, t0 = time.time(), time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as logf:
        try:
            rc = subprocess.run(
                [sys.executable, "-m", f"bench.{name}", *args],
                cwd=REPO,
                stdout=logf,
                stderr=subprocess.STDOUT,
            ).returncode
        except OSError as exc:
            logf.write(f"could not start: {exc}\n")
            rc = -1
    wall = round(time.perf_counter() - t0, 1)
    print(f"[{utc_now()}] {name}: exit {rc} after {wall} s", flush=True)
    return {
        "name": name,
        "command": command,
        "rc": rc,
        "wall_s": wall,
        "log": str(log_path),
        "started": started,
    }


def fragments(name: str, out_dir: Path, since: float, variant: str = "") -> list[dict[str, Any]]:
    """The bench's output files and whether this run wrote them (modified after it started)."""
    found = []
    for ext in ("md", "json"):  # `<stem>.md`, one per phase (`eval-t0.md`, `eval-t1.md`), or the variant's
        if variant:
            paths = [out_dir / f"{stem(name)}-{variant}.{ext}"]
        else:
            paths = [out_dir / f"{stem(name)}.{ext}", *sorted(out_dir.glob(f"{stem(name)}-*.{ext}"))]
        found += [{"path": p, "fresh": p.stat().st_mtime >= since} for p in paths if p.is_file()]
    return found


def render_summary(
    results: Sequence[dict[str, Any]], machine: dict[str, Any], quick: bool, out_dir: Path
) -> str:
    lines = [
        "# Benchmark summary" + (" (quick mode: self-check figures, not for BENCHMARKS.md)" if quick else ""),
        "",
        f"Machine: {machine_line(machine)}",
        "",
        "| bench | exit | wall (s) | command | log |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {stem(r['name'])} | {r['rc']} | {r['wall_s']} | `{r['command']}` | {_rel(r['log'], out_dir)} |"
        )
    for r in results:
        lines += [
            "",
            f"## {stem(r['name'])}" + ("" if r["rc"] == 0 else f" — FAILED (exit {r['rc']})"),
            "",
            f"Command: `{r['command']}` — exit {r['rc']}, {r['wall_s']} s.",
            "",
        ]
        lines += fragment_lines(r, out_dir)
    return "\n".join(lines) + "\n"


def fragment_lines(result: dict[str, Any], out_dir: Path) -> list[str]:
    """One bench run's files, then every markdown fragment it wrote (a bench may write one per phase or
    variant). Stale ones are listed, never shown; a failed run's are shown under a warning, since what a bench
    wrote before failing may be partial."""
    frags = result["fragments"]
    lines = [] if frags else [f"No figure files written; see the log {_rel(result['log'], out_dir)}."]
    for f in frags:
        state = "written by this run" if f["fresh"] else "STALE: from an earlier run"
        lines.append(f"- {_rel(f['path'], out_dir)} ({state})")
    for f in frags:
        if f["path"].suffix != ".md" or not f["fresh"]:
            continue
        if result["rc"] != 0:
            lines += ["", failed_warning(result, f["path"], out_dir)]
        lines += ["", f["path"].read_text(encoding="utf-8").rstrip()]
    return lines


def failed_warning(result: dict[str, Any], path: Path, out_dir: Path) -> str:
    return (
        f"> **FAILED (exit {result['rc']})**: {_rel(path, out_dir)} below was written by a run that failed; "
        f"its figures may be partial or wrong, not results (log: {_rel(result['log'], out_dir)})."
    )


def _rel(path: str | Path, base: Path) -> str:
    p = Path(path)
    try:
        return str(p.relative_to(base))
    except ValueError:
        return str(p)


def main(argv: Sequence[str] | None = None) -> int:
    from distill.utils.fs import atomic_write_text

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only",
        action="append",
        default=[],
        type=only_option,
        help="bench name (data, train, eval, drafts)",
    )
    p.add_argument(
        "--quick", action="store_true", help="each bench's quick self-check instead of the full run"
    )
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    names = select(args.only, available())
    if not names:
        print("no bench scripts found", file=sys.stderr)
        return 1
    machine = machine_info()
    results = []
    for name in names:
        help_ = help_text(name)
        for variant, extra in variants(name, args.quick).items():
            r = run_one(
                name,
                bench_args(name, args.quick, help_, args.out_dir, variant, extra),
                args.out_dir / "logs" / f"{name}{'-' + variant if variant else ''}.log",
            )
            r["fragments"] = fragments(name, args.out_dir, r["started"], variant)
            results.append(r)
    summary = args.out_dir / "summary.md"
    atomic_write_text(summary, render_summary(results, machine, args.quick, args.out_dir))
    print(f"wrote {summary}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
