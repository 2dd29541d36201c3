"""Benchmark: `distill eval` on the embedded default (SmolLM2-135M-Instruct target, ShareGPT test prompts):
base (undistilled) vs distilled drafts vs vLLM's ngram baseline vs the target alone, inside vLLM.

    python bench/bench_eval.py                        # the full sweep of configs/smollm2-sharegpt.yaml
    python bench/bench_eval.py --quick                # k in {2, 4}, 16 prompts, 2 repeats (fewer engines)
    python bench/bench_eval.py run.dir=runs/x 'eval.drafts=[{name: a, model: models/a}]'

Needs the run folder's draft_init/ and draft/ (run `distill train` first) unless eval.drafts says otherwise.
Prints the report's tables; the figures to copy into BENCHMARKS.md are in RUN_DIR/eval/report.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

QUICK = ["eval.k=[2,4]", "eval.num_prompts=16", "eval.repeats=2"]


def main(argv: list[str] | None = None) -> int:
    from distill.cli import main as cli_main
    from distill.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="configs/smollm2-sharegpt.yaml")
    p.add_argument("--quick", action="store_true", help="a smaller sweep: " + " ".join(QUICK))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    overrides = (QUICK if args.quick else []) + list(args.overrides)
    t0 = time.perf_counter()
    rc = cli_main(["eval", "-c", args.config, *overrides])
    elapsed = time.perf_counter() - t0
    report = load_config(args.config, overrides).run_dir / "eval" / "report.json"
    if report.is_file():
        rep = json.loads(report.read_text())
        print((report.parent / "report.md").read_text())
        print(
            json.dumps(
                {
                    "bench": "eval",
                    "exit": rc,
                    "wall_s": round(elapsed, 1),
                    "complete": rep["complete"],
                    "recommendation": rep["recommendation"],
                },
                indent=2,
            )
        )
    else:
        print(f"no report written (exit {rc})", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
