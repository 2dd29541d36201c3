"""Prompt files written in code for the data and eval tests (never the shipped suites: tests pick their size)."""

from __future__ import annotations

import json
from pathlib import Path

from distill.train.synthetic import synthetic_prompts


def write_prompts(path: Path, n: int = 60) -> Path:
    """`n` short, distinct prompts as jsonl (`prompt` field): the synthetic dataset's chat prompts."""
    with open(path, "w") as f:
        for text in synthetic_prompts(n):
            f.write(json.dumps({"prompt": text}) + "\n")
    return path
