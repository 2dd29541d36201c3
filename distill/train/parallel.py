"""Parallel drafting (PARD): a draft that proposes k tokens in ONE forward pass.

vLLM's `parallel_drafting` feeds the draft `[..., next_token, MASK, MASK, ...]` (k - 1 mask tokens at the
positions that follow) and reads the k proposals from the logits at `next_token` and at each mask. On a CPU,
where a draft forward costs about the same for 1 or 8 tokens, one round then costs about one draft step
instead of k.

Training packs every anchor of a sequence into ONE forward pass: the sequence itself (ordinary causal
attention; the logits at position a give draft position 0, the next token) followed by, for each anchor a, a
group of up to k - 1 mask tokens at positions a+1 .. a+k-1. Mask j of anchor a sees the real tokens 0..a and the
masks 1..j of its own group, exactly what vLLM's draft sees in a round that starts at a, and predicts token
a+1+j. Its teacher is the target's distribution at that token: in the target's own greedy data the tokens
between a and a+1+j are the target's, so that is the distribution the verifier compares against.

Shapes: B rows, T padded sequence length, L = T + masks (padded), N = counted (response) tokens of the micro-batch
in row-major order, P = predicted positions (N anchors' draft position 0 plus their masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ParallelView:
    """The packed PARD input of a micro-batch.

    input_ids, position_ids: int64 [B, L]; attention: bool [B, 1, L, L] (True = may attend);
    predict_at: int64 [P] flat index into the [B * L] hidden states whose logits make a proposal;
    target_index: int64 [P] index into the micro-batch's N counted tokens of the token each proposal predicts;
    draft_position: int64 [P] 0 for the next-token proposal, j for mask j;
    anchor: int64 [P] index (0..N-1) of the anchor group each proposal belongs to.
    """

    input_ids: Tensor
    position_ids: Tensor
    attention: Tensor
    predict_at: Tensor
    target_index: Tensor
    draft_position: Tensor
    anchor: Tensor

    def to(self, device: torch.device | str) -> ParallelView:
        return ParallelView(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def keeps_masks(row_id: int, anchor: int, fraction: float) -> bool:
    """Whether an anchor trains its mask group: a fixed pseudo-random choice per (row, anchor), so a resumed
    run and every epoch see the same layout, independent of batching."""
    if fraction >= 1.0:
        return True
    h = (row_id * 0x9E3779B1 + anchor * 0x85EBCA77) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h ^= h >> 12
    return (h % 10_000) < fraction * 10_000


def _row_layout(
    loss_mask: list[int], k: int, row_id: int = 0, fraction: float = 1.0
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int, int]]]:
    """For one row: anchors (a, counted index i of token a+1, first mask slot) and masks (a, j, target i+j, slot).

    Counted tokens must form runs; a proposal is made only for a token that is counted and reachable from
    its anchor without leaving the run (a mask whose target is not counted would teach nothing). Every anchor
    trains draft position 0; a `fraction` of them (`keeps_masks`) also train their masks.
    """
    n = len(loss_mask)
    counted = [t for t in range(n) if loss_mask[t]]
    index_of = {t: i for i, t in enumerate(counted)}
    anchors, masks = [], []
    slot = n
    for t in counted:
        a = t - 1
        if a < 0:
            continue
        i = index_of[t]
        anchors.append((a, i, slot))
        if not keeps_masks(row_id, a, fraction):
            continue
        for j in range(1, k):
            u = t + j
            if u >= n or not loss_mask[u] or index_of[u] != i + j:
                break
            masks.append((a, j, i + j, slot))
            slot += 1
    return anchors, masks


def pack_rows(footprints: list[int], pack: bool) -> tuple[list[tuple[int, int]], list[int]]:
    """Where each sequence goes: its (row, offset) and every row's filled length, in rows as long as the
    longest footprint. Unpacked, sequence r fills row r from 0; packed, sequences share rows by first fit in
    order of decreasing footprint, so the rows hold less padding (their attention keeps them apart)."""
    if not pack:
        return [(r, 0) for r in range(len(footprints))], list(footprints)
    length = max(footprints, default=0)
    place = [(0, 0)] * len(footprints)
    filled: list[int] = []
    for r in sorted(range(len(footprints)), key=lambda r: -footprints[r]):
        row = next((i for i, used in enumerate(filled) if used + footprints[r] <= length), len(filled))
        if row == len(filled):
            filled.append(0)
        place[r] = (row, filled[row])
        filled[row] += footprints[r]
    return place, filled


def build_parallel_view(
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    *,
    k: int,
    mask_token_id: int,
    pad_id: int,
    row_ids: list[int] | None = None,
    mask_fraction: float = 1.0,
    pack: bool = False,
) -> ParallelView:
    """Pack a right-padded micro-batch ([B, T] each) for k-token parallel drafting (module docstring).

    `mask_fraction` < 1 trains the mask groups of that share of anchors only (chosen per dataset row id and
    anchor), cutting the vocabulary-sized work of a step from about k x to 1 + (k - 1) x fraction of an
    ordinary draft's. `pack` puts several sequences (each with its mask groups) in one row where they fit
    (`pack_rows`): each sees only itself, positions restart at 0 for each, so every hidden state equals the
    unpacked one's while the padding the draft's layers run over shrinks (train.pack_sequences). The
    predictions keep their order either way.
    """
    b = input_ids.shape[0]
    ids_of_rows = row_ids if row_ids is not None else list(range(b))
    layouts = []
    for r in range(b):
        n = int(attention_mask[r].sum())
        layouts.append((n, *_row_layout(loss_mask[r, :n].tolist(), k, ids_of_rows[r], mask_fraction)))
    place, filled = pack_rows([n + len(masks) for n, _, masks in layouts], pack)
    rows, length = len(filled), max(filled)
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    pos = torch.zeros((rows, length), dtype=torch.long)
    attn = torch.zeros((rows, 1, length, length), dtype=torch.bool)
    predict_at, target_index, draft_position, anchor_of = [], [], [], []
    counted_before = 0
    for r, (n, anchors, masks) in enumerate(layouts):
        row, off = place[r]
        ids[row, off : off + n] = input_ids[r, :n]
        pos[row, off : off + n] = torch.arange(n)
        attn[row, 0, off : off + n, off : off + n] = torch.ones(n, n, dtype=torch.bool).tril()
        group_start: dict[int, int] = {}
        anchor_index: dict[int, int] = {}
        for a, i, _ in anchors:
            anchor_index[a] = counted_before + i
            predict_at.append(row * length + off + a)
            target_index.append(counted_before + i)
            draft_position.append(0)
            anchor_of.append(counted_before + i)
        for a, j, target, slot in masks:
            start = off + group_start.setdefault(a, slot)
            at = off + slot
            ids[row, at] = mask_token_id
            pos[row, at] = a + j
            attn[row, 0, at, off : off + a + 1] = True
            attn[row, 0, at, start : at + 1] = True
            predict_at.append(row * length + at)
            target_index.append(counted_before + target)
            draft_position.append(j)
            anchor_of.append(anchor_index[a])
        counted_before += int(loss_mask[r, :n].sum())
    # Padding queries attend to themselves only, so no attention row is empty (softmax of nothing = NaN).
    for row, used in enumerate(filled):
        for q in range(used, length):
            attn[row, 0, q, q] = True
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return ParallelView(
        ids,
        pos,
        attn,
        as_long(predict_at),
        as_long(target_index),
        as_long(draft_position),
        as_long(anchor_of),
    )


def accepted_lengths(match: Tensor, group: Tensor, step: Tensor, k: int) -> Tensor:
    """Greedy speculative decoding's accepted drafts per round, from per-proposal top-1 matches.

    match: bool [P] (draft argmax == target argmax); group: int64 [P] the round each proposal belongs to;
    step: int64 [P] its draft position (0..k-1) within the round. Returns int64 [G] for each group id 0..G-1
    (G = max(group) + 1): the number of leading draft positions that all match, capped at k and at the group's
    proposals. vLLM accepts a
    greedy draft token iff it equals the target's argmax given the accepted prefix, so on the target's own
    greedy data this is exactly what a round starting at that anchor accepts.
    """
    if match.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    n_groups = int(group.max()) + 1
    keep = step < k
    # A proposal counts when it and every earlier draft position of its round match: the first miss at
    # position s cuts the run there, so the run length is the smallest missing position (or k).
    # Groups near a response's end have fewer proposals (no token to predict): cap at their count.
    first_miss = torch.bincount(group[keep], minlength=n_groups).clamp(max=k)
    miss = keep & ~match
    first_miss.scatter_reduce_(0, group[miss], step[miss], reduce="amin")
    return first_miss


def run_lengths(match: Tensor, rows: Tensor) -> Tensor:
    """Consecutive top-1 matches starting at each counted token, within its own row.

    match: bool [N]; rows: int64 [N] row (response) of each token, row-major and contiguous. For an ordinary
    autoregressive draft on teacher-forced greedy data, a round anchored at token i accepts
    min(run_lengths[i], k): its proposal at step s equals the teacher-forced prediction at i+s whenever the
    steps before it were accepted (they equal the data then).
    """
    out = torch.zeros_like(rows)
    run = 0
    m, r = match.tolist(), rows.tolist()
    for i in range(len(m) - 1, -1, -1):
        if i + 1 < len(m) and r[i + 1] != r[i]:
            run = 0
        run = run + 1 if m[i] else 0
        out[i] = run
    return out
