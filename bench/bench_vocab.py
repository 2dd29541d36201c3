"""Trimmed-vocabulary drafts (`draft.vocab_size`): what a smaller output head saves, and what it costs.

    python -m bench.bench_vocab                      # the demo's distilled draft at 8192, 16384 and 24576 tokens
    python -m bench.bench_vocab --export bench/out/work/vocab   # also write the trimmed drafts (for bench_eval)
    python -m bench.bench_vocab --export bench/out/work/vocab --vllm   # and measure them inside vLLM
    python -m bench.bench_vocab --quick              # 8 validation rows, 20 timed head products

Per vocabulary size, in plain PyTorch on the CPU (no vLLM): the share of the run's validation tokens (prompts
and responses, and the responses alone) the kept set holds, the draft's top-1 agreement with the target's
response tokens on those rows (teacher forced; the trimmed draft through its full-vocabulary view, so a dropped
token is a miss, as in vLLM), and the time of the output head's product for `--k` positions in bfloat16 with
the caches flushed first (between two draft steps the target's forward evicts them), median of `--repeats`.
The tokens are chosen as `draft.vocab_size` chooses them: the run's training rows by frequency, then the lowest
remaining ids, always with the special and single-byte tokens.

With `--vllm` (which needs `--export`) the exported drafts are then measured inside vLLM beside the full draft
and the target alone: `bench_eval --phase t0 --tag vocab` at k = `--k` (parallel drafting, as the shipped draft
runs), `--vllm-prompts` test prompts, `--vllm-rounds` rounds of one timed pass each; its table lands in
`bench/out/eval-t0-vocab.{json,md}`. Written to `bench/out/vocab.{json,md}` (or `--name`).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, fmt, int_list, markdown_table, positive_int, run_study

# Bytes read between two timed head products: more than any last-level cache of the machines we run on.
FLUSH_BYTES = 256 * 2**20


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, default=Path("checkpoints/smollm2-sharegpt"))
    p.add_argument("--draft", type=Path, default=None, help="default: the run's draft/")
    p.add_argument(
        "--sizes", type=int_list, default=[8192, 16384, 24576], help="vocabulary sizes, comma list"
    )
    p.add_argument(
        "--rows", type=positive_int, default=None, help="the first N validation rows (default all)"
    )
    p.add_argument("--k", type=positive_int, default=3, help="positions per head product (a round's drafts)")
    p.add_argument("--repeats", type=positive_int, default=200, help="timed head products per size")
    p.add_argument("--export", type=Path, default=None, help="write each trimmed draft to DIR/draft-<size>")
    p.add_argument("--vllm", action="store_true", help="measure the exported drafts inside vLLM (bench_eval)")
    p.add_argument("--vllm-prompts", type=positive_int, default=32)
    p.add_argument("--vllm-rounds", type=positive_int, default=3)
    p.add_argument("--quick", action="store_true", help="8 validation rows, 20 timed head products")
    p.add_argument("--name", default="vocab")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = 8, 20
    if args.vllm and not args.export:
        p.error("--vllm measures the drafts --export writes: give --export DIR")
    return args


def vllm_command(args: argparse.Namespace, draft_dir: Path, exported: list[dict[str, Any]]) -> list[str]:
    """The bench_eval command that measures the full draft and the exported ones side by side."""
    drafts = [f"{{name: full, model: '{draft_dir}', k: [{args.k}]}}"] + [
        f"{{name: vocab-{e['size']}, model: '{e['exported']}', k: [{args.k}]}}" for e in exported
    ]
    return [
        sys.executable, "-m", "bench.bench_eval", "--phase", "t0", "--tag", "vocab",
        f"eval.drafts=[{', '.join(drafts)}]", f"eval.num_prompts={args.vllm_prompts}",
        f"eval.rounds={args.vllm_rounds}", "eval.repeats=1", "eval.ngram=false",
    ]  # fmt: skip


def response_top1(model: Any, rows: Any) -> tuple[float, int]:
    """(top-1 agreement with the response tokens, positions): the prediction after token i - 1 against token
    i where loss_mask[i] is set."""
    from bench.bench_copy import predictions

    hits = total = 0
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
        pred = predictions(model, ids)
        counted = [i for i in range(1, len(ids)) if mask[i]]
        hits += sum(pred[i - 1] == ids[i] for i in counted)
        total += len(counted)
    return (hits / total if total else 0.0), total


def head_ms(vocab_rows: int, hidden: int, k: int, repeats: int) -> float:
    """Median ms of a [k, hidden] x [hidden, vocab_rows] bfloat16 product, each after a cache flush."""
    import torch

    weight = torch.randn(vocab_rows, hidden, dtype=torch.bfloat16)
    x = torch.randn(k, hidden, dtype=torch.bfloat16)
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32)
    for _ in range(3):
        x @ weight.T
    times = []
    for _ in range(repeats):
        flush.add_(1.0)  # touches every byte: the head's weights leave the caches
        t0 = time.perf_counter()
        x @ weight.T
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def coverage_of(rows: Any, kept: set[int]) -> tuple[float, float]:
    """(share of all tokens, share of response tokens) of `rows` that are in `kept`."""
    all_n = all_k = resp_n = resp_k = 0
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
        for token, m in zip(ids, mask, strict=True):
            inside = token in kept
            all_n, all_k = all_n + 1, all_k + inside
            if m:
                resp_n, resp_k = resp_n + 1, resp_k + inside
    return (all_k / all_n if all_n else 1.0), (resp_k / resp_n if resp_n else 1.0)


def study(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from distill.data.format import load_split_dataset
    from distill.errors import InputError
    from distill.models import vocab
    from distill.models.draft import load_causal_lm, load_tokenizer, save_hf_folder
    from distill.models.resolve import require_weights

    draft_dir = args.draft or args.run_dir / "draft"
    require_weights(draft_dir, key="--draft")
    if vocab.read_kept_ids(draft_dir) is not None:
        raise InputError(f"--draft: {draft_dir} is already trimmed; give the full draft it was cut from.")
    train = load_split_dataset(args.run_dir, "train")
    val = load_split_dataset(args.run_dir, "val")
    if args.rows is not None:
        val = val.select(range(min(len(val), args.rows)))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokenizer = load_tokenizer(draft_dir)
    full = load_causal_lm(draft_dir).eval()
    vocab_len, hidden = int(full.config.vocab_size), int(full.config.hidden_size)
    counts = vocab.count_tokens(train["input_ids"])
    top1_full, positions = response_top1(full, val)
    full_ms = head_ms(vocab_len, hidden, args.k, args.repeats)
    sizes = []
    for size in sorted(set(args.sizes)):
        if size >= vocab_len:
            raise InputError(f"--sizes: {size} is not below the draft's vocabulary ({vocab_len}).")
        try:
            kept = vocab.kept_for(counts, size, tokenizer, full.config)
        except ValueError as exc:
            raise InputError(f"--sizes: {size} is too small: {exc}.") from exc
        small = vocab.trim_model(copy.deepcopy(full), kept)
        # Dropped tokens reach the draft as the token vLLM maps them to (kept ids keep their strings).
        unk = kept.index(vocab.unk_id(tokenizer))
        view = vocab.trimmed_wrapper_class()(small, kept, vocab_len, unk)
        share_all, share_resp = coverage_of(val, set(kept))
        top1, _ = response_top1(view, val)
        ms = head_ms(size, hidden, args.k, args.repeats)
        entry = {
            "size": size,
            "val_token_share": share_all,
            "val_response_token_share": share_resp,
            "top1": top1,
            "head_ms": ms,
            "head_ratio": ms / full_ms,
        }
        if args.export:
            out = save_hf_folder(small, tokenizer, args.export / f"draft-{size}", trimmed=(kept, vocab_len))
            entry["exported"] = str(out)
        sizes.append(entry)
    settings = {
        "run_dir": str(args.run_dir),
        "draft": str(draft_dir),
        "val_rows": len(val),
        "response_positions": positions,
        "train_rows": len(train),
        "k": args.k,
        "repeats": args.repeats,
        "hidden_size": hidden,
    }
    full_row = {"size": vocab_len, "top1": top1_full, "head_ms": full_ms, "head_ratio": 1.0}
    payload: dict[str, Any] = {"settings": settings, "full": full_row, "sizes": sizes}
    if args.vllm:
        import shlex
        import subprocess

        command = vllm_command(args, draft_dir, sizes)
        rc = subprocess.run(command, check=False).returncode
        payload["vllm"] = {"command": shlex.join(["python", *command[1:]]), "exit_code": rc}
    return payload


def render_markdown(payload: dict[str, Any]) -> str:
    s, full = payload["settings"], payload["full"]
    rows = [[f"{full['size']} (full)", "1.000", "1.000", fmt(full["top1"]), fmt(full["head_ms"], 2), "1.00"]]
    rows += [
        [
            str(e["size"]),
            fmt(e["val_token_share"]),
            fmt(e["val_response_token_share"]),
            fmt(e["top1"]),
            fmt(e["head_ms"], 2),
            fmt(e["head_ratio"], 2),
        ]
        for e in payload["sizes"]
    ]
    header = [
        "vocabulary",
        "validation tokens kept",
        "response tokens kept",
        "draft top-1 on responses",
        f"head ms (bf16, {s['k']} positions, cold cache)",
        "head vs full",
    ]
    vllm = payload.get("vllm")
    vllm_note = (
        f"Inside vLLM: `{vllm['command']}` (exit {vllm['exit_code']}; its table: `bench/out/eval-t0-vocab.md`)."
        if vllm
        else ""
    )
    return "\n\n".join(
        [
            f"### Trimmed vocabularies of `{s['draft']}`: {s['val_rows']} validation rows "
            f"({s['response_positions']} response positions), tokens chosen on {s['train_rows']} training rows",
            markdown_table(header, rows),
            vllm_note,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _, rc = run_study("bench.bench_vocab", study, render_markdown, parse_args(argv), argv)
    return rc


if __name__ == "__main__":
    sys.exit(main())
