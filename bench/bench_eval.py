"""Benchmark: `distill eval` on the embedded default (SmolLM2-135M-Instruct target, ShareGPT test prompts):
base (undistilled) vs distilled drafts vs vLLM's ngram baseline vs the target alone, inside vLLM, batch 1.

    python -m bench.bench_eval                      # `make bench`: train if needed, then phases t0 and t1
    python -m bench.bench_eval --phase t0           # temperature 0: the speedup protocol (hours on 2 cores)
    python -m bench.bench_eval --phase t1           # temperature 1: acceptance of greedy vs probabilistic drafting
    python -m bench.bench_eval --quick              # a smaller t0 sweep: k in {1, 2}, 16 prompts, 2 repeats
    python -m bench.bench_eval --phase t0 run.dir=runs/x eval.k=[1]   # overrides go last, win over the phase's

Phases (the protocol of BENCHMARKS.md):
  t0  temperature 0 (vLLM's default greedy drafting): >= 100 held-out prompts, 128 new tokens, batch 1,
      3 timed repeats (medians), no_spec, ngram, base and distilled at k = 1, 2, 3.
  t1  temperature 1: acceptance of base vs distilled under greedy and probabilistic drafting, and ngram
      (32 prompts, one timed pass: acceptance counts do not need repeats).
The draft comes from the config's run folder; when `draft/` is missing the data and train stages run first
(with the same config and overrides). Each phase's report (report.json, report.md, plots) is copied to
`bench/out/eval-<phase>/` and its table to `bench/out/eval-<phase>.{json,md}`.
"""

from __future__ import annotations

import argparse
import shutil
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
    markdown_table,
    spread,
    write_fragment,
)

COMMON = ["eval.max_tokens=128", "eval.max_num_seqs=1"]
PHASES: dict[str, list[str]] = {
    "t0": [
        "eval.temperatures=[0.0]",
        "eval.num_prompts=100",
        "eval.repeats=3",
        "eval.k=[1,2,3]",
        "eval.ngram=true",
    ],
    "t1": [
        "eval.temperatures=[1.0]",
        "eval.num_prompts=32",
        "eval.repeats=1",
        "eval.k=[1,2]",
        "eval.ngram=true",
        "eval.draft_sample_methods=[greedy,probabilistic]",
    ],
}
QUICK = [
    "eval.temperatures=[0.0]",
    "eval.k=[1,2]",
    "eval.num_prompts=16",
    "eval.repeats=2",
    "eval.ngram=true",
]


def ensure_trained(config: str, overrides: list[str]) -> int:
    """Run the data and train stages when the run folder has no trained draft yet (0 when it has one)."""
    from distill.cli import main as cli_main
    from distill.config import load_config

    run_dir = load_config(config, overrides).run_dir
    if (run_dir / "draft" / "config.json").is_file():
        return 0
    print(f"{run_dir}/draft missing: running the data and train stages first", flush=True)
    for stage in ("data", "train"):
        rc = cli_main([stage, "-c", config, *overrides])
        if rc:
            return rc
    return 0


def result_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured configuration: the figures of BENCHMARKS.md with the spread of the timed repeats."""
    rows = []
    for r in report["results"]:
        walls = r.get("wall_s") or []
        per_pass = r.get("output_tokens_per_pass") or [r.get("output_tokens") or 0] * len(walls)
        tps = [n / w for n, w in zip(per_pass, walls, strict=False) if n and w]
        rows.append(
            {
                "name": r["name"],
                "k": r.get("k", 0),
                "temperature": r.get("temperature"),
                "draft_sample_method": r.get("draft_sample_method"),
                "acceptance_rate": r.get("acceptance_rate"),
                "mean_acceptance_length": r.get("mean_acceptance_length"),
                "per_position_acceptance": r.get("per_position_acceptance"),
                "tokens_per_s": r.get("tokens_per_s"),
                "tokens_per_s_spread": spread(tps) if tps else None,
                "speedup": r.get("speedup"),
                "greedy_match": r.get("greedy_match"),
                "load_avg": r.get("load_avg"),
                "foreign_cpu": r.get("foreign_cpu"),
                "error": r.get("error"),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = ["config", "k", "T", "draft sampling", "acceptance", "mean acc. length", "tok/s (median)",
              "min–max", "speedup"]  # fmt: skip
    body = []
    for r in rows:
        sp = r["tokens_per_s_spread"]
        body.append(
            [
                r["name"],
                str(r["k"]),
                fmt(r["temperature"], 1),
                r["draft_sample_method"] or "–",
                fmt(r["acceptance_rate"]),
                fmt(r["mean_acceptance_length"], 2),
                fmt(r["tokens_per_s"], 1),
                f"{sp['min']:.1f}–{sp['max']:.1f} (n={sp['n']})" if sp else "—",
                fmt(r["speedup"], 2),
            ]
        )
    return markdown_table(header, body)


def display_path(path: Path) -> str:
    """Relative to the repository when inside it (as BENCHMARKS.md cites it), else absolute."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def fragment_name(phase: str, tag: str = "") -> str:
    """eval-<phase>, or eval-<phase>-<tag> for a tagged study that must not overwrite the phase's own figures."""
    return f"eval-{phase}" + (f"-{tag}" if tag else "")


def save_phase(
    phase: str, run_dir: Path, argv: list[str], rc: int, wall_s: float, out_dir: Path, tag: str = ""
) -> None:
    import json

    src = run_dir / "eval"
    report = json.loads((src / "report.json").read_text())
    dest = out_dir / fragment_name(phase, tag)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.log", "partial.json"))
    rows = result_rows(report)
    head = (
        f"### vLLM speculative decoding, phase {phase}: {report['prompts']['count']} prompts from "
        f"{report['prompts']['source']}, {report['max_tokens']} new tokens, batch 1, dtype {report['dtype']}\n\n"
    )
    rec = report.get("recommendation") or {}
    tail = (
        f"\n\nRecommendation: {rec.get('reason', '—')}\n\nFull report: `{display_path(dest / 'report.md')}`."
    )
    payload = {"phase": phase, "exit": rc, "wall_s": round(wall_s, 1), "complete": report["complete"],
               "rows": rows, "recommendation": rec, "warnings": report.get("warnings", [])}  # fmt: skip
    write_fragment(
        fragment_name(phase, tag),
        payload,
        head + table(rows) + tail,
        command=command_line("bench.bench_eval", argv),
        machine=machine_info(),
        out_dir=out_dir,
    )


def run_phase(
    phase: str, config: str, overrides: list[str], argv: list[str], out_dir: Path, tag: str = ""
) -> int:
    from distill.cli import main as cli_main
    from distill.config import load_config

    t0 = time.perf_counter()
    rc = cli_main(["eval", "-c", config, *overrides])
    wall = time.perf_counter() - t0
    run_dir = load_config(config, overrides).run_dir
    if not (run_dir / "eval" / "report.json").is_file():
        print(f"phase {phase}: no report written (exit {rc})", file=sys.stderr)
        return rc or 1
    save_phase(phase, run_dir, argv, rc, wall, out_dir, tag)
    print((out_dir / f"{fragment_name(phase, tag)}.md").read_text())
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="configs/smollm2-sharegpt.yaml")
    p.add_argument("--phase", choices=[*PHASES, "all"], default="all")
    p.add_argument("--quick", action="store_true", help="a smaller t0 sweep: " + " ".join(QUICK))
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument(
        "--tag",
        default="",
        help="name the figures eval-<phase>-<tag> (a study on another run folder, e.g. a longer training)",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    rc = ensure_trained(args.config, args.overrides)
    if rc:
        return rc
    if args.quick:
        phases = {"quick": QUICK}
    else:
        phases = PHASES if args.phase == "all" else {args.phase: PHASES[args.phase]}
    worst = 0
    for name, phase_overrides in phases.items():
        overrides = COMMON + phase_overrides + args.overrides
        rc = run_phase(name, args.config, overrides, argv, args.out_dir, args.tag)
        worst = worst or rc
    return worst


if __name__ == "__main__":
    sys.exit(main())
