"""Benchmark: `distill eval` on the embedded default (SmolLM2-135M-Instruct target, ShareGPT test prompts):
base (undistilled) vs distilled drafts vs vLLM's ngram baseline vs the target alone, inside vLLM, batch 1.

    python -m bench.bench_eval                      # `make bench`: train if needed, then phases t0 and t1
    python -m bench.bench_eval --phase t0           # temperature 0: the speedup protocol (hours on 2 cores)
    python -m bench.bench_eval --phase t1           # temperature 1: acceptance of greedy vs probabilistic drafting
    python -m bench.bench_eval --quick              # a smaller t0 sweep: k in {1, 2}, 16 prompts, 2 repeats
    python -m bench.bench_eval --phase t0 run.dir=runs/x eval.k=[1]   # overrides go last, win over the phase's
    python -m bench.bench_eval --phase t0 eval.rounds=1 eval.repeats=3   # the single-round protocol before 2026-12-06

Phases (the protocol of BENCHMARKS.md):
  t0  temperature 0 (vLLM's default greedy drafting): >= 100 held-out prompts, 128 new tokens, batch 1,
      3 rounds of one timed pass per configuration in turn (medians of 3), no_spec, ngram, base and distilled
      at k = 1, 2, 3.
  t1  temperature 1: acceptance of base vs distilled under greedy and probabilistic drafting, and ngram
      (32 prompts, one timed pass: acceptance counts do not need repeats).
The drafts come from the config's run folder (`run.dir`, overrides included): when eval.drafts measures a draft
there and the data or train stage is not complete for exactly this config, those stages run first. The eval
itself writes to the bench's own run folder, `bench/out/work/eval-<phase>[-<tag>]/`, never to the training
run's eval/ (whose report `distill publish` ships). Each phase's report (report.json, report.md, plots) is
copied to `bench/out/eval-<phase>/` and its table to `bench/out/eval-<phase>.{json,md}`; a failed or incomplete
eval says so there, with its exit code, instead of figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from distill.config import Config

COMMON = ["eval.max_tokens=128", "eval.max_num_seqs=1"]
PHASES: dict[str, list[str]] = {
    "t0": [
        "eval.temperatures=[0.0]",
        "eval.num_prompts=100",
        # 3 passes per configuration, one in each of 3 rounds over all of them in turn: a slow spell of the
        # shared machine then lands in one pass of every configuration's median instead of in one
        # configuration's every pass (BENCHMARKS.md, section 1). Costs an engine start per config and round.
        "eval.repeats=1",
        "eval.rounds=3",
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


TRAIN_STAGES = ("data", "train")


def reads_run_drafts(cfg: Config) -> bool:
    """Whether eval.drafts measures a draft inside the run folder (the config's own `${run.dir}/draft`): that
    one must be trained with this config. Drafts named by a path elsewhere are measured as they are."""
    run_dir = cfg.run_dir.resolve()
    return any(Path(d.model).expanduser().resolve().is_relative_to(run_dir) for d in cfg.eval.drafts)


def stages_to_run(cfg: Config) -> list[str]:
    """The data and train stages still to run: from the first one not complete for exactly this config (its
    record's config hash differs, or its outputs are gone) on, since train reads what data writes."""
    from distill import rundir

    for i, stage in enumerate(TRAIN_STAGES):
        if not rundir.is_complete(cfg, stage):
            return list(TRAIN_STAGES[i:])
    return []


def ensure_trained(config: str, overrides: list[str]) -> int:
    """Run the data and train stages unless the run folder's draft was trained with exactly this config.

    A draft/ that merely exists may come from other settings (`train.max_steps=900` without a new run.dir
    would measure the 300-step draft under the 900 label). A stage whose folder holds another config's data
    or checkpoints refuses (exit 2) and names the fix, rather than overwriting it."""
    from distill.cli import main as cli_main
    from distill.config import load_config

    cfg = load_config(config, overrides)
    if not reads_run_drafts(cfg):
        return 0
    stages = stages_to_run(cfg)
    if stages:
        print(
            f"{cfg.run_dir}: no draft trained with this config; running {', '.join(stages)} first", flush=True
        )
    for stage in stages:
        rc = cli_main([stage, "-c", config, *overrides])
        if rc:
            return rc
    return 0


def result_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured configuration: the figures of BENCHMARKS.md with the spread of the timed repeats."""
    from distill.evaluate.report import pass_rates

    rows = []
    for r in report["results"]:
        # the passes the report's median counts, so the spread brackets that median
        tps = pass_rates(r)
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
                "speedup_per_round": r.get("speedup_per_round"),
                "greedy_match": r.get("greedy_match"),
                "load_avg": r.get("load_avg"),
                "foreign_cpu": r.get("foreign_cpu"),
                "error": r.get("error"),
            }
        )
    return rows


def first_line(text: str | None) -> str:
    """A worker error carries its whole log tail: a table cell or a bullet holds its first line only."""
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def table(rows: list[dict[str, Any]]) -> str:
    header = ["config", "k", "T", "draft sampling", "acceptance", "mean acc. length", "tok/s (median)",
              "min–max", "speedup"]  # fmt: skip
    body = []
    for r in rows:
        sp = r["tokens_per_s_spread"]
        body.append(
            [
                r["name"] + (" (error)" if r["error"] else ""),
                str(r["k"]),
                fmt(r["temperature"], 1),
                r["draft_sample_method"] or "–",
                fmt(r["acceptance_rate"]),
                fmt(r["mean_acceptance_length"], 2),
                fmt(r["tokens_per_s"], 1),
                f"{sp['min']:.1f}–{sp['max']:.1f} (n={sp['n']})" if sp else "—",
                fmt(r["speedup"], 2) + per_round_cell(r.get("speedup_per_round")),
            ]
        )
    return markdown_table(header, body)


def per_round_cell(per_round: list[float | None] | None) -> str:
    """` (1.16, 1.12 by round)` for an eval run with eval.rounds > 1: how far the pooled speedup moved."""
    if not per_round:
        return ""
    return " (" + ", ".join(fmt(x, 2) for x in per_round) + " by round)"


def error_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One bullet per failed configuration, so its row of dashes reads as a failure, not as missing data."""
    return [f"- {r['name']} k={r['k']}: {first_line(r['error']) or 'failed'}" for r in rows if r["error"]]


def display_path(path: Path) -> str:
    """Relative to the repository when inside it (as BENCHMARKS.md cites it), else absolute."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def fragment_name(phase: str, tag: str = "") -> str:
    """eval-<phase>, or eval-<phase>-<tag> for a tagged study that must not overwrite the phase's own figures."""
    return f"eval-{phase}" + (f"-{tag}" if tag else "")


def read_report(path: Path) -> dict[str, Any] | None:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def phase_problem(rc: int, report: dict[str, Any] | None) -> str | None:
    """Why a phase's figures are not a result; None when the eval exited 0 with every configuration measured."""
    if report is None:
        return (
            f"FAILED: the eval exited {rc} before writing a report; no figures (its error is in the output)"
        )
    if report.get("complete") is not True:
        why = first_line(report.get("error")) or "the run did not finish"
        return f"INCOMPLETE (exit {rc}): {why}. The rows are partial figures, not a result"
    if rc:
        return f"FAILED (exit {rc}) after writing its report: the rows are not a result until the error is understood"
    return None


def phase_markdown(
    phase: str, report: dict[str, Any] | None, rows: list[dict[str, Any]], problem: str | None, dest: Path
) -> str:
    if report is None:
        return f"### vLLM speculative decoding, phase {phase}\n\n**{problem}.**"
    head = (
        f"### vLLM speculative decoding, phase {phase}: {report['prompts']['count']} prompts from "
        f"{report['prompts']['source']}, {report['max_tokens']} new tokens, batch 1, dtype {report['dtype']}\n\n"
    )
    warning = f"**{problem}.**\n\n" if problem else ""
    errors = error_lines(rows)
    error_block = ("\n\n" + "\n".join(errors)) if errors else ""
    rec = report.get("recommendation") or {}
    tail = (
        f"\n\nRecommendation: {rec.get('reason', '—')}\n\nFull report: `{display_path(dest / 'report.md')}`."
    )
    return head + warning + table(rows) + error_block + tail


def save_phase(
    phase: str, run_dir: Path, argv: list[str], rc: int, wall_s: float, out_dir: Path, tag: str = ""
) -> str | None:
    """Write the phase's fragment from `run_dir/eval` (a report this eval wrote, or none); returns
    `phase_problem` (None when the figures are a result)."""
    src = run_dir / "eval"
    report = read_report(src / "report.json")
    dest = out_dir / fragment_name(phase, tag)
    if dest.exists():  # an earlier run's copy must not stand beside a failed run's fragment
        shutil.rmtree(dest)
    if report is not None:
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.log", "partial.json"))
    rows = result_rows(report) if report else []
    problem = phase_problem(rc, report)
    payload = {"phase": phase, "exit": rc, "wall_s": round(wall_s, 1), "complete": problem is None,
               "problem": problem, "rows": rows, "recommendation": (report or {}).get("recommendation") or {},
               "warnings": (report or {}).get("warnings", [])}  # fmt: skip
    write_fragment(
        fragment_name(phase, tag),
        payload,
        phase_markdown(phase, report, rows, problem, dest),
        command=command_line("bench.bench_eval", argv),
        machine=machine_info(),
        out_dir=out_dir,
    )
    return problem


def work_dir(out_dir: Path, phase: str, tag: str = "") -> Path:
    """The bench's own run folder for a phase's eval (`<out-dir>/work/eval-<phase>[-<tag>]`)."""
    return out_dir / "work" / fragment_name(phase, tag)


def eval_overrides(config: str, overrides: list[str], work: Path) -> list[str]:
    """`overrides` with the eval written to `work` instead of the training run folder, whose eval/ report
    `distill publish` ships. eval.drafts and eval.prompts are pinned to the paths they resolve to first, so a
    `${run.dir}` in them still names the training run folder: the same drafts and prompts are measured."""
    from distill.config import load_config

    cfg = load_config(config, overrides)
    drafts = [{"name": d.name, "model": d.model, "k": list(d.k)} for d in cfg.eval.drafts]
    pinned = [f"eval.drafts={json.dumps(drafts)}", f"eval.prompts={json.dumps(cfg.eval.prompts)}"]
    return [*overrides, *pinned, f"run.dir={work}"]


def run_phase(
    phase: str, config: str, overrides: list[str], argv: list[str], out_dir: Path, tag: str = ""
) -> int:
    from distill.cli import main as cli_main

    work = work_dir(out_dir, phase, tag)
    args = eval_overrides(config, overrides, work)
    # The folder is the bench's own: the last run's report goes first, so that a report found after this eval
    # is one it wrote, and a failure cannot pass old figures off as its own.
    shutil.rmtree(work / "eval", ignore_errors=True)
    t0 = time.perf_counter()
    rc = cli_main(["eval", "-c", config, *args])
    wall = time.perf_counter() - t0
    problem = save_phase(phase, work, argv, rc, wall, out_dir, tag)
    print((out_dir / f"{fragment_name(phase, tag)}.md").read_text())
    if problem:
        print(f"phase {phase}: {problem}", file=sys.stderr)
    return rc or (1 if problem else 0)


def check_config(config: str, phases: dict[str, list[str]], overrides: list[str]) -> int:
    """Exit 2 with the config's own message for a bad override, before any training or eval starts."""
    from distill.config import load_config
    from distill.errors import DistillError

    try:
        for phase_overrides in phases.values():
            load_config(config, COMMON + phase_overrides + overrides)
    except DistillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


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
    if args.quick:
        phases = {"quick": QUICK}
    else:
        phases = PHASES if args.phase == "all" else {args.phase: PHASES[args.phase]}
    rc = check_config(args.config, phases, args.overrides) or ensure_trained(args.config, args.overrides)
    if rc:
        return rc
    worst = 0
    for name, phase_overrides in phases.items():
        overrides = COMMON + phase_overrides + args.overrides
        rc = run_phase(name, args.config, overrides, argv, args.out_dir, args.tag)
        worst = worst or rc
    return worst


if __name__ == "__main__":
    sys.exit(main())
