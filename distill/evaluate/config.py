"""Schema of the `eval` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distill.schema import opt


@dataclass
class DraftRef:
    name: str = opt("draft", "Label of this draft in the report.")
    model: str = opt("", "Model reference: folder, hub id or alias.")


@dataclass
class EvalConfig:
    engine: Literal["auto", "vllm", "hf"] = opt(
        "auto", "`vllm` = real vLLM speculative decoding; `hf` = the reference PyTorch engine; `auto` = vLLM if installed."
    )
    prompts: str = opt("", "Prompt source for eval; empty = the `test` split of `data.source`.")
    num_prompts: int = opt(100, "Prompts evaluated.", ge=1)
    max_tokens: int = opt(128, "New tokens per prompt (stops early at EOS).", ge=1)
    drafts: list[DraftRef] = opt(
        [DraftRef("base", "${run.dir}/draft_init"), DraftRef("distilled", "${run.dir}/draft")],
        "Drafts to compare, each {name, model}.",
    )
    k: list[int] = opt([1, 2, 3, 4, 5, 6], "Speculative tokens per step to sweep.", each_ge=1)
    temperatures: list[float] = opt([0.0], "Sampling temperatures to evaluate.", each_ge=0.0)
    repeats: int = opt(3, "Timed repeats per configuration (median reported).", ge=1)
