"""A small distillation dataset in the data stage's format, built in-process (tests and benchmarks).

The target writes greedy responses to short chat prompts with plain transformers; rows and the optional top-k
cache are laid out exactly as `distill.data.format` describes, so the train stage reads them like real data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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


def synthetic_prompts(n: int, offset: int = 0) -> list[str]:
    return [
        f"Explain {TOPICS[i % len(TOPICS)]} in {i % 5 + 1} short sentences, example {i}."
        for i in range(offset, offset + n)
    ]


def greedy_rows(model: Any, tok: Any, prompts: list[str], max_new_tokens: int) -> list[dict[str, Any]]:
    """One row per prompt: chat-templated prompt + the model's greedy response (+ EOS if it stopped)."""
    rows = []
    eos = tok.eos_token_id
    for i, text in enumerate(prompts):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        response = out[0, len(ids) :].tolist()
        if eos in response:
            response = response[: response.index(eos) + 1]
        rows.append(
            {
                "input_ids": ids + response,
                "loss_mask": [0] * len(ids) + [1] * len(response),
                "prompt_id": f"p{i:05d}",
                "response_index": 0,
            }
        )
    return rows


def write_split(run_dir: Path, split: str, rows: list[dict[str, Any]]) -> Path:
    import datasets

    from distill.data.format import split_dir

    out = split_dir(run_dir, split)
    ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})
    ds.save_to_disk(str(out))
    return out


def write_topk(run_dir: Path, split: str, model: Any, rows: list[dict[str, Any]], k: int) -> Path:
    """The target's top-k cache for `rows`, in the data stage's format."""
    import numpy as np

    from distill.data.format import CacheMeta, encode_row, topk_dir, topk_from_logits, write_cache_folder

    vocab = int(model.config.vocab_size)
    blobs, counts = [], []
    for r in rows:
        with torch.no_grad():
            logits = model(torch.tensor([r["input_ids"]])).logits[0]
        ids, lp, rest = topk_from_logits(logits, torch.tensor(r["loss_mask"]), k)
        blobs.append(encode_row(ids.numpy(), lp.numpy(), rest.numpy().astype(np.float32), vocab_size=vocab))
        counts.append(int(ids.shape[0]))
    folder = topk_dir(run_dir, split)
    write_cache_folder(folder, CacheMeta(k=min(k, vocab), vocab_size=vocab), blobs, counts)
    return folder


def build_run_data(
    run_dir: Path,
    target_dir: Path,
    *,
    n_train: int = 48,
    n_val: int = 8,
    max_new_tokens: int = 24,
    top_k: int = 0,
) -> Path:
    """Write `run_dir/data/{train,val}` (and `topk/` when top_k > 0) from the target's greedy generations."""
    from distill.models.draft import load_causal_lm, load_tokenizer

    tok = load_tokenizer(target_dir)
    model = load_causal_lm(target_dir)
    model.eval()
    splits = {"train": synthetic_prompts(n_train), "val": synthetic_prompts(n_val, offset=10_000)}
    for split, prompts in splits.items():
        rows = greedy_rows(model, tok, prompts, max_new_tokens)
        write_split(run_dir, split, rows)
        if top_k:
            write_topk(run_dir, split, model, rows, top_k)
    return Path(run_dir) / "data"
