"""Where the distilled draft loses to prompt lookup: the positions an n-gram copy gets right, and induction.

    python -m bench.bench_copy                          # the demo's run: its undistilled and distilled drafts
    python -m bench.bench_copy --drafts base=checkpoints/smollm2-sharegpt/draft_init,tuned=path/to/draft
    python -m bench.bench_copy --quick                  # 8 rows, 2 induction sequences

Two figures, both in plain transformers on the CPU (no vLLM, no timing):

1. **Positions by what prompt lookup proposes.** For every response token of the run's `--split` rows (the
   target's own greedy responses), the token vLLM's `ngram` proposer would draft there (the longest suffix
   n-gram, `--min-n`..`--max-n` tokens, found earlier in prompt + response, continued from its earliest
   occurrence): a correct copy through a `--max-n`-gram, a correct copy through a shorter one, a wrong copy, or
   no proposal. Per group: its share of the positions and each model's top-1 agreement with the target's token
   there (what greedy drafting of the first token accepts).
2. **Induction.** `--induction-seqs` sequences of `--induction-len` random tokens, each repeated once after a
   BOS token: each model's top-1 accuracy at predicting the repeat (copying), and per target layer the strongest
   head's induction score (attention from a repeated token to the token after its earlier occurrence) and
   previous-token score (attention to the token just before).

Written to `bench/out/copy.{json,md}` (or `--name`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    OUT_DIR,
    fmt,
    markdown_table,
    positive_int,
    run_study,
)

GROUPS = ("copy_right_max_n", "copy_right_shorter", "copy_wrong", "no_proposal")
RIGHT_GROUPS = ("copy_right_max_n", "copy_right_shorter")
GROUP_LABELS = {
    "copy_right_max_n": "lookup right, longest n-gram",
    "copy_right_shorter": "lookup right, shorter n-gram",
    "copy_wrong": "lookup wrong",
    "no_proposal": "no lookup proposal",
}


def prompt_lookup(tokens: Sequence[int], min_n: int, max_n: int) -> tuple[int, int] | None:
    """(proposed token, n) that vLLM's n-gram proposer drafts first after `tokens`, or None.

    Its rule (vllm/v1/spec_decode/ngram_proposer.py): the longest n in [min_n, max_n] whose last n tokens occur
    earlier in `tokens` with at least one token after them; among those occurrences the earliest; the proposal
    is the token that followed it.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n):
            if list(tokens[start : start + n]) == suffix:
                return int(tokens[start + n]), n
    return None


def lookup_group(tokens: Sequence[int], next_token: int, min_n: int, max_n: int) -> str:
    """The `GROUPS` entry of predicting `next_token` after `tokens`."""
    found = prompt_lookup(tokens, min_n, max_n)
    if found is None:
        return "no_proposal"
    token, n = found
    if token != next_token:
        return "copy_wrong"
    return "copy_right_max_n" if n == max_n else "copy_right_shorter"


def row_groups(
    input_ids: Sequence[int], loss_mask: Sequence[int], min_n: int, max_n: int
) -> list[tuple[int, str]]:
    """(position t, group) for every counted response token t >= 1 of one row: predicting input_ids[t] from
    input_ids[:t]."""
    return [
        (t, lookup_group(input_ids[:t], int(input_ids[t]), min_n, max_n))
        for t in range(1, len(input_ids))
        if loss_mask[t]
    ]


def empty_counts() -> dict[str, dict[str, int]]:
    return {g: {"positions": 0, "hits": 0} for g in GROUPS}


def add_row(
    counts: dict[str, dict[str, int]],
    groups: list[tuple[int, str]],
    predicted: Sequence[int],
    input_ids: Sequence[int],
) -> None:
    """Count one row: `predicted[t - 1]` is the model's argmax for position t."""
    for t, g in groups:
        counts[g]["positions"] += 1
        counts[g]["hits"] += int(int(predicted[t - 1]) == int(input_ids[t]))


def summarize_counts(counts: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Per group: share of the positions and top-1 agreement; over all positions: top-1 agreement, and what it
    would be if the model also got every position right that prompt lookup gets right (a draft that copies
    as well as lookup does, and keeps its own predictions elsewhere)."""
    total = sum(c["positions"] for c in counts.values())
    hits = sum(c["hits"] for c in counts.values())
    copies_missed = sum(counts[g]["positions"] - counts[g]["hits"] for g in RIGHT_GROUPS)
    groups = {
        g: {
            "positions": c["positions"],
            "share": c["positions"] / total if total else None,
            "top1": c["hits"] / c["positions"] if c["positions"] else None,
        }
        for g, c in counts.items()
    }
    return {
        "positions": total,
        "top1": hits / total if total else None,
        "top1_with_lookup_copies": (hits + copies_missed) / total if total else None,
        "groups": groups,
    }


def predictions(model: Any, input_ids: Sequence[int]) -> list[int]:
    """The model's argmax token after each prefix of one row (one forward pass)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(input_ids)]), use_cache=False).logits[0]
    return [int(x) for x in logits.argmax(-1).tolist()]


def lookup_split(models: dict[str, Any], rows: Any, min_n: int, max_n: int) -> dict[str, Any]:
    """Figure 1 over the rows ({input_ids, loss_mask} records) for each named model."""
    counts = {name: empty_counts() for name in models}
    for row in rows:
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        groups = row_groups(ids, mask, min_n, max_n)
        for name, model in models.items():
            add_row(counts[name], groups, predictions(model, ids), ids)
    return {name: summarize_counts(c) for name, c in counts.items()}


def repeated_random_tokens(seqs: int, length: int, low: int, high: int, bos: int, seed: int) -> Any:
    """[seqs, 1 + 2 * length] int64: BOS, then `length` random ids in [low, high), then the same ids again."""
    import torch

    g = torch.Generator().manual_seed(seed)
    body = torch.randint(low, high, (seqs, length), generator=g)
    return torch.cat([torch.full((seqs, 1), bos, dtype=torch.long), body, body], dim=1)


def induction(model: Any, x: Any, length: int, *, attention: bool) -> dict[str, Any]:
    """Copy accuracy on the repeat of `x` (`repeated_random_tokens`), and with `attention` per layer the
    strongest head's induction and previous-token scores (the model must run eager attention)."""
    import torch

    with torch.no_grad():
        out = model(x, use_cache=False, output_attentions=attention)
    # Position q in the repeat (q = length + 1 .. 2 * length) sees the token at q - length before it, whose
    # successor x[q - length + 1] is what it should predict: x[q + 1].
    query = torch.arange(length + 1, 2 * length + 1)
    predicted = out.logits[:, query[:-1]].argmax(-1)
    result: dict[str, Any] = {"copy_accuracy": float((predicted == x[:, query[:-1] + 1]).float().mean())}
    if attention:
        layers = []
        for a in out.attentions:  # [B, heads, L, L]
            ind = a[:, :, query, query - length + 1].mean(dim=(0, 2))
            prev = a[:, :, query, query - 1].mean(dim=(0, 2))
            layers.append(
                {
                    "induction": float(ind.max()),
                    "induction_head": int(ind.argmax()),
                    "previous_token": float(prev.max()),
                    "previous_token_head": int(prev.argmax()),
                }
            )
        result["layers"] = layers
    return result


def parse_drafts(text: str, run_dir: Path) -> dict[str, Path]:
    """`name=path,...` (default: the run's undistilled and distilled drafts)."""
    from distill.errors import InputError

    if not text:
        return {"base": run_dir / "draft_init", "distilled": run_dir / "draft"}
    out: dict[str, Path] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, path = part.partition("=")
        if not sep or not name or not path:
            raise InputError(
                f"--drafts: {part!r} is not name=path; e.g. --drafts tuned=checkpoints/run/draft."
            )
        out[name] = Path(path)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, default=Path("checkpoints/smollm2-sharegpt"))
    p.add_argument("--split", default="val", choices=("train", "val"))
    p.add_argument(
        "--rows", type=positive_int, default=None, help="the first N rows of the split (default all)"
    )
    p.add_argument("--drafts", default="", help="name=path,... (default: the run's draft_init and draft)")
    p.add_argument("--target", default=None, help="default: the run's target.model")
    p.add_argument("--min-n", type=positive_int, default=2, help="eval.ngram_prompt_lookup_min's default")
    p.add_argument("--max-n", type=positive_int, default=5, help="eval.ngram_prompt_lookup_max's default")
    p.add_argument("--induction-seqs", type=positive_int, default=8)
    p.add_argument("--induction-len", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 rows, 2 induction sequences")
    p.add_argument("--name", default="copy")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.induction_seqs = 8, 2
    if args.min_n > args.max_n:
        p.error(f"--min-n {args.min_n} must be <= --max-n {args.max_n}")
    return args


def study(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import load_from_disk

    from bench.bench_eagle import run_target
    from distill.errors import InputError
    from distill.models.draft import load_causal_lm
    from distill.models.resolve import require_weights, resolve_model

    split_dir = args.run_dir / "data" / args.split
    if not (split_dir / "dataset_info.json").is_file():
        raise InputError(
            f"--run-dir: {split_dir} is missing; run `distill data` for that run first (or point --run-dir at "
            "a run whose data stage completed)."
        )
    drafts = parse_drafts(args.drafts, args.run_dir)
    for name, path in drafts.items():
        require_weights(path, key=f"--drafts {name}")
    target_dir = resolve_model(args.target or run_target(args.run_dir), key="--target")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    # Eager attention returns the attention weights the induction scores read; float32 for exact argmaxes.
    models = {"target": load_causal_lm(target_dir, attn_implementation="eager").eval()}
    for name, path in drafts.items():
        models[name] = load_causal_lm(path, attn_implementation="eager").eval()
    rows = load_from_disk(str(split_dir))
    if args.rows is not None:
        rows = rows.select(range(min(len(rows), args.rows)))
    cfg = models["target"].config
    bos = int(cfg.bos_token_id if cfg.bos_token_id is not None else 0)
    # Ids away from the special tokens at the start of the vocabulary and from rarely trained ones at its end.
    vocab = int(cfg.vocab_size)
    x = repeated_random_tokens(
        args.induction_seqs, args.induction_len, min(300, vocab // 4), vocab // 2, bos, args.seed
    )
    ind = {name: induction(m, x, args.induction_len, attention=True) for name, m in models.items()}
    split = lookup_split({k: v for k, v in models.items() if k != "target"}, rows, args.min_n, args.max_n)
    settings = {
        "run_dir": str(args.run_dir),
        "split": args.split,
        "rows": len(rows),
        "drafts": {k: str(v) for k, v in drafts.items()},
        "target": str(target_dir),
        "min_n": args.min_n,
        "max_n": args.max_n,
        "induction_seqs": args.induction_seqs,
        "induction_len": args.induction_len,
        "seed": args.seed,
    }
    return {"settings": settings, "lookup_split": split, "induction": ind}


def render_markdown(payload: dict[str, Any]) -> str:
    s = payload["settings"]
    split = payload["lookup_split"]
    names = list(split)
    first = split[names[0]]
    header = ["response positions", "share", *[f"{n} top-1" for n in names]]
    rows = [
        [
            f"{GROUP_LABELS[g]}" + (f" ({s['max_n']})" if g == "copy_right_max_n" else ""),
            fmt(first["groups"][g]["share"]),
            *[fmt(split[n]["groups"][g]["top1"]) for n in names],
        ]
        for g in GROUPS
    ]
    rows.append(["all", "1.000", *[fmt(split[n]["top1"]) for n in names]])
    rows.append(
        [
            "all, if the model also made lookup's right copies",
            "",
            *[fmt(split[n]["top1_with_lookup_copies"]) for n in names],
        ]
    )
    ind = payload["induction"]
    copy_rows = [[name, fmt(r["copy_accuracy"])] for name, r in ind.items()]
    target_layers = ind["target"]["layers"]
    layer_rows = [
        [
            str(i),
            fmt(la["induction"], 2),
            str(la["induction_head"]),
            fmt(la["previous_token"], 2),
            str(la["previous_token_head"]),
        ]
        for i, la in enumerate(target_layers)
    ]
    return "\n\n".join(
        [
            f"### Response positions by what prompt lookup (n = {s['min_n']}..{s['max_n']}) proposes, "
            f"{first['positions']} positions of {s['rows']} `{s['split']}` rows of `{s['run_dir']}`",
            markdown_table(header, rows),
            f"### Copying a repeated random sequence ({s['induction_seqs']} x {s['induction_len']} tokens)",
            markdown_table(["model", "copy accuracy in the repeat"], copy_rows),
            "Target layers: the strongest head's induction and previous-token scores",
            markdown_table(["layer", "induction", "head", "previous token", "head"], layer_rows),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _, rc = run_study("bench.bench_copy", study, render_markdown, parse_args(argv), argv)
    return rc


if __name__ == "__main__":
    sys.exit(main())
