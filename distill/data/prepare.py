"""Prompts -> chat-templated token ids, filtered by length, sharded deterministically into chunks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError

from distill.data.config import DataConfig
from distill.errors import InputError
from distill.prompts.sources import PromptRecord, load_prompts, split_prompts

SPLITS = ("train", "val")


@dataclass
class Prompt:
    prompt_id: str
    token_ids: list[int]
    response: str | None  # the dataset's own response (for `responses: dataset`)


@dataclass
class SplitPrompts:
    split: str
    prompts: list[Prompt]  # usable prompts of the whole split (all shards), in a stable order
    loaded: int  # prompts of the split read to fill the limit (usable + skipped)
    skipped: dict[str, int] = field(default_factory=dict)
    in_split: int = 0  # prompts of the source in this split, before the limit


@dataclass
class SourceCounts:
    """What the prompt source held before the split: records read, dropped (empty / no user turn, duplicate)."""

    source: str
    records_read: int
    dropped: dict[str, int]
    unique_prompts: int
    by_split: dict[str, int]  # train / val / test (held out), before data.max_*_prompts

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "records_read": self.records_read,
            "dropped": dict(self.dropped),
            "unique_prompts": self.unique_prompts,
            "by_split": dict(self.by_split),
        }


def require_chat_template(tok: Any, model_ref: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise InputError(
            f"target.model: the tokenizer of {model_ref} has no chat template, and the data stage formats prompts "
            "as chat turns. Use an instruct/chat model (e.g. smollm2-135m-instruct), or add a `chat_template` "
            "to its tokenizer_config.json."
        )


def prompt_token_ids(
    tok: Any, rec: PromptRecord, system_prompt: str | None, *, key: str = "data.source"
) -> list[int]:
    """The chat-templated prompt's token ids; a template that refuses the conversation is an `InputError`
    naming data.system_prompt when one was added, else `key` (where the prompts come from)."""
    messages = list(rec.messages)
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # templates may refuse a conversation, e.g. "System role not supported"
        raise _template_refusal(rec, messages, system_prompt, exc, key) from None
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _template_refusal(
    rec: PromptRecord,
    messages: list[dict[str, str]],
    system_prompt: str | None,
    exc: Exception,
    source_key: str,
) -> InputError:
    has_system = any(m.get("role") == "system" for m in messages)
    key = "data.system_prompt" if system_prompt else source_key
    fix = (
        "unset data.system_prompt (or drop the system turns from the source)"
        if has_system
        else "give prompts this template accepts, or another target.model"
    )
    roles = "/".join(m.get("role", "?") for m in messages)
    return InputError(
        f"{key}: the target's chat template rejects prompt {rec.prompt_id} (turns {roles}): {exc}. Fix: {fix}."
    )


def _limit(cfg: DataConfig, split: str) -> int:
    return cfg.max_train_prompts if split == "train" else cfg.max_val_prompts


def load_splits(cfg: DataConfig, tok: Any) -> tuple[dict[str, SplitPrompts], SourceCounts]:
    """Both splits, tokenised and filtered (too long, missing dataset response), and the source's counts.
    Raises InputError when the train split ends up empty."""
    pset = load_prompts(
        cfg.source, prompt_field=cfg.prompt_field, response_field=cfg.response_field, key="data.source"
    )
    by_split = split_prompts(pset.records, val_fraction=cfg.val_fraction, test_fraction=cfg.test_fraction)
    out = {}
    for split in SPLITS:
        chosen = sorted(by_split[split], key=lambda r: r.prompt_id)
        limit = _limit(cfg, split)
        sp = SplitPrompts(split, [], 0, in_split=len(by_split[split]))
        for rec in chosen:
            if limit and len(sp.prompts) >= limit:  # the limit counts usable prompts, as the eval's does
                break
            sp.loaded += 1
            if cfg.responses == "dataset" and not rec.response:
                sp.skipped["no_dataset_response"] = sp.skipped.get("no_dataset_response", 0) + 1
                continue
            ids = prompt_token_ids(tok, rec, cfg.system_prompt)
            if len(ids) > cfg.max_prompt_tokens:
                sp.skipped["too_long"] = sp.skipped.get("too_long", 0) + 1
                continue
            sp.prompts.append(Prompt(rec.prompt_id, ids, rec.response))
        out[split] = sp
    _check_not_empty(cfg, out["train"])
    counts = SourceCounts(
        source=cfg.source,
        records_read=pset.read,
        dropped=dict(pset.skipped),
        unique_prompts=len(pset.records),
        by_split={s: len(v) for s, v in by_split.items()},
    )
    return out, counts


def _check_not_empty(cfg: DataConfig, train: SplitPrompts) -> None:
    if train.prompts:
        return
    if train.loaded == 0:
        raise InputError(
            f"data.source: no train prompts in '{cfg.source}' after the split (val_fraction={cfg.val_fraction}, "
            f"test_fraction={cfg.test_fraction}). Add prompts or lower data.val_fraction / data.test_fraction."
        )
    reasons = ", ".join(f"{n} {why}" for why, n in train.skipped.items())
    if "too_long" in train.skipped:
        key, fix = "data.max_prompt_tokens", "raise data.max_prompt_tokens"
    else:
        key, fix = (
            "data.responses",
            "use data.responses=generate or a source with responses (data.response_field)",
        )
    raise InputError(f"{key}: all {train.loaded} train prompts were skipped ({reasons}); {fix}.")


def prompts_fingerprint(splits: dict[str, SplitPrompts]) -> str:
    """Hash of the prompts a build answers (ids, token ids, dataset responses, per split, in order): a prompt
    file edited in place changes it while the config, which names only the file, stays the same."""
    h = hashlib.sha256()
    for split in SPLITS:
        for p in splits[split].prompts:
            h.update(f"{split}\t{p.prompt_id}\t{p.token_ids}\t{p.response!r}\n".encode())
    return h.hexdigest()[:16]


def shard_slice(n: int, shard_index: int, num_shards: int) -> tuple[int, int]:
    """Contiguous block of `n` items for one shard: concatenating the shards in order gives the whole list."""
    return n * shard_index // num_shards, n * (shard_index + 1) // num_shards


def chunks_of(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    return [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]


def request_seed(run_seed: int, prompt_id: str) -> int:
    """Per-prompt sampling seed: the sample does not depend on batching, sharding or resumes."""
    digest = hashlib.sha256(f"{run_seed}:{prompt_id}".encode()).hexdigest()
    return int(digest[:8], 16)


def tokenizer_hash(model_dir: Path, tok: Any) -> str:
    h = hashlib.sha256()
    files = [
        model_dir / n
        for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    ]
    present = [p for p in files if p.is_file()]
    if present:
        for p in present:
            h.update(p.name.encode())
            h.update(p.read_bytes())
    else:
        h.update(repr(sorted(tok.get_vocab().items())).encode())
    return h.hexdigest()[:16]
