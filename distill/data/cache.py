"""Teacher top-k cache: one batched, no-grad target forward pass per group of sequences."""

from __future__ import annotations

from typing import Any

import torch

from distill.data.format import encode_row, topk_from_logits


def _batch_topk(
    model: Any, seqs: list[list[int]], masks: list[list[int]], k: int, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Top-k for a batch of sequences (right padded). Only the response span's logits are computed."""
    lengths = [len(s) for s in seqs]
    width = max(lengths)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    # The first response token of any row is at index >= lo + 1, so logits before `lo` are never needed.
    lo = min(m.index(1) for m in masks) - 1
    keep = torch.arange(lo, width)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep).logits  # [B, width - lo, V]
    out = []
    for i, m in enumerate(masks):
        sub_mask = torch.zeros(width - lo, dtype=torch.long)
        sub_mask[: len(m) - lo] = torch.tensor(m[lo:])
        out.append(topk_from_logits(logits[i], sub_mask, k))
    return out


def topk_rows(
    model: Any, seqs: list[list[int]], masks: list[list[int]], *, k: int, batch_size: int, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids [R, k], logprobs [R, k], rest [R]) for every sequence, in order."""
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    # Length-sorted batches waste less compute on padding; results are put back in input order.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    by_index: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        res = _batch_topk(model, [seqs[i] for i in idx], [masks[i] for i in idx], k, pad_id)
        by_index.update(zip(idx, res, strict=True))
    out = [by_index[i] for i in range(len(seqs))]
    return out


def encode_rows(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, vocab_size: int, codec: str
) -> tuple[list[bytes], list[int]]:
    blobs, counts = [], []
    for ids, lp, rest in rows:
        blobs.append(encode_row(ids.numpy(), lp.numpy(), rest.numpy(), vocab_size=vocab_size, codec=codec))
        counts.append(int(ids.shape[0]))
    return blobs, counts


def rows_from_vllm(
    response: dict[str, Any], n_tokens: int, *, k: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Cache rows (ids [n, k], logprobs [n, k], rest [n]) from the top-k vLLM returned while generating.

    Row j is the distribution that predicted response token j, as in `topk_rows`. None when vLLM's rows do not
    cover the `n_tokens` response tokens exactly (no log-probs requested, or an EOS appended after a stop
    that vLLM did not generate): the caller falls back to a forward pass for that response.
    """
    ids, lps = response.get("topk_ids"), response.get("topk_logprobs")
    if ids is None or lps is None or len(ids) != n_tokens or any(len(r) != k for r in ids):
        return None
    id_t = torch.tensor(ids, dtype=torch.int64).reshape(n_tokens, k)
    lp_t = torch.tensor(lps, dtype=torch.float32).reshape(n_tokens, k)
    # The mass outside the top-k, as topk_from_logits stores it: log(1 - sum p), clamped away from log(0).
    kept = torch.exp(lp_t.double()).sum(-1).clamp(max=1.0 - 1e-12)
    rest = torch.log1p(-kept).float()
    if k >= vocab_size:
        rest = torch.full((n_tokens,), float("-inf"))
    return id_t, lp_t, rest
