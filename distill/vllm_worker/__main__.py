"""Entry point of the worker subprocess: read a job JSON, run it, write the result JSON atomically.

Jobs: {"kind": "generate", ...} (data stage, `generate.py`) and {"kind": "speculate", ...} (eval stage,
`speculate.py`). The `__main__` guard matters: vLLM's engine spawns processes that re-import the main module.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m distill.vllm_worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = argv
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    kind = job.get("kind")
    try:
        if kind == "generate":
            from distill.vllm_worker.generate import run_job
        elif kind == "speculate":
            from distill.vllm_worker.speculate import run_job
        else:
            print(f"unknown job kind {kind!r}", file=sys.stderr)
            return 2
        result = run_job(job)
    except Exception:
        traceback.print_exc()
        return 1
    from distill.utils.fs import atomic_write_json

    atomic_write_json(result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
