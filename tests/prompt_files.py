"""Prompt files written in code for the data and eval tests (never the shipped suites: tests pick their size)."""

from __future__ import annotations

import json
from pathlib import Path

TOPICS = [
    "decoding",
    "sorting",
    "the moon",
    "python lists",
    "coffee",
    "trains",
    "rain",
    "music",
    "chess",
    "gardens",
    "maps",
    "bread",
]


def write_prompts(path: Path, n: int = 60) -> Path:
    """`n` short, distinct prompts as jsonl (`prompt` field)."""
    with open(path, "w") as f:
        for i in range(n):
            text = f"Explain {TOPICS[i % len(TOPICS)]} in {i % 5 + 1} short sentences, example {i}."
            f.write(json.dumps({"prompt": text}) + "\n")
    return path
