"""Parallel drafting (PARD) training layout: the packed forward equals what vLLM's draft computes per round."""

from __future__ import annotations

import itertools

import pytest
import torch

from distill.train.parallel import accepted_lengths, build_parallel_view, run_lengths


def _batch():
    # Two rows: prompt of 3 / 2 tokens, responses of 5 / 3 tokens, right-padded.
    ids = torch.tensor([[5, 6, 7, 10, 11, 12, 13, 14], [8, 9, 20, 21, 22, 0, 0, 0]])
    attn = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    loss = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0]])
    return ids, attn, loss


def test_layout_counts_and_targets():
    ids, attn, loss = _batch()
    v = build_parallel_view(ids, attn, loss, k=3, mask_token_id=63, pad_id=0)
    # Row 0: 5 anchors (positions 2..6) with 2, 2, 2, 1, 0 masks; row 1: 3 anchors with 2, 1, 0 masks.
    assert v.predict_at.numel() == 5 + 7 + 3 + 3
    counted_tokens = ids[loss.bool()]
    # Every proposal's target is a counted token, at draft position j after its anchor's next token.
    for t, j, a in zip(v.target_index, v.draft_position, v.anchor, strict=True):
        assert int(t) - int(a) == int(j)
        assert 0 <= int(t) < counted_tokens.numel()
    assert sorted(set(v.draft_position.tolist())) == [0, 1, 2]
    # Masks carry the mask id at positions anchor + j.
    row0 = v.input_ids[0]
    assert (row0[8:] == 63).all()
    assert v.position_ids[0, 8:].tolist() == [3, 4, 4, 5, 5, 6, 6]


def test_packed_logits_equal_one_forward_per_round(tiny_llama):
    """Logits at mask j of anchor a equal a plain forward over tokens 0..a followed by j masks."""
    ids, attn, loss = _batch()
    k, mask_id = 3, 63
    v = build_parallel_view(ids, attn, loss, k=k, mask_token_id=mask_id, pad_id=0)
    with torch.no_grad():
        out = tiny_llama(
            input_ids=v.input_ids, attention_mask=v.attention, position_ids=v.position_ids
        ).logits
    flat = out.reshape(-1, out.shape[-1])[v.predict_at]
    length = v.input_ids.shape[1]
    checked = 0
    for p in range(v.predict_at.numel()):
        row, slot = divmod(int(v.predict_at[p]), length)
        j = int(v.draft_position[p])
        a = int(v.position_ids[row, slot]) - j  # the anchor's position
        plain = torch.cat([ids[row, : a + 1], torch.full((j,), mask_id)])
        with torch.no_grad():
            ref = tiny_llama(input_ids=plain[None]).logits[0, -1]
        torch.testing.assert_close(flat[p], ref, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked == v.predict_at.numel()


def test_k1_is_the_ordinary_next_token_objective(tiny_llama):
    ids, attn, loss = _batch()
    v = build_parallel_view(ids, attn, loss, k=1, mask_token_id=63, pad_id=0)
    assert (v.draft_position == 0).all() and v.input_ids.shape == ids.shape
    with torch.no_grad():
        packed = tiny_llama(
            input_ids=v.input_ids, attention_mask=v.attention, position_ids=v.position_ids
        ).logits
        plain = tiny_llama(input_ids=ids, attention_mask=attn).logits
    pred = torch.zeros_like(loss, dtype=torch.bool)
    pred[:, :-1] = loss[:, 1:].bool()
    torch.testing.assert_close(packed.reshape(-1, 64)[v.predict_at], plain[pred], atol=1e-4, rtol=1e-4)


def test_accepted_lengths_cut_at_the_first_miss():
    match = torch.tensor([True, True, False, True, False, True, True, True])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    step = torch.tensor([0, 1, 2, 3, 0, 1, 0, 1])
    assert accepted_lengths(match, group, step, k=4).tolist() == [2, 0, 2]
    assert accepted_lengths(match, group, step, k=1).tolist() == [1, 0, 1]


def test_run_lengths_stop_at_row_boundaries():
    match = torch.tensor([True, True, False, True, True, True, True])
    rows = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    assert run_lengths(match, rows).tolist() == [2, 1, 0, 1, 3, 2, 1]


# ---------------------------------------------------------------------------------------------------------
# The train stage with a parallel draft (tiny models)


@pytest.fixture(scope="module")
def pard_data(tmp_path_factory, tiny_target_dir):
    from distill.train.synthetic import build_run_data

    root = tmp_path_factory.mktemp("pard_data")
    build_run_data(root, tiny_target_dir, n_train=48, n_val=8, max_new_tokens=24, top_k=16)
    return root / "data"


def _cfg(tiny_config_overrides, data, *extra):
    import shutil
    from pathlib import Path

    from distill.config import load_config

    repo = Path(__file__).resolve().parents[1]
    fast = ["train.warmup_steps=2", "train.val_every=10", "train.ckpt_every=10", "run.threads=1"]
    cfg = load_config(repo / "configs/tiny.yaml", [*tiny_config_overrides, *fast, *extra])
    shutil.copytree(data, cfg.run_dir / "data")
    return cfg


@pytest.mark.parametrize("teacher", ["online", "cached"])
def test_parallel_draft_trains_and_exports_pard_config(tiny_config_overrides, pard_data, teacher):
    import json

    from transformers import AutoConfig

    from distill.train.stage import run

    cfg = _cfg(
        tiny_config_overrides,
        pard_data,
        "draft.parallel_tokens=3",
        f"train.teacher={teacher}",
        "train.max_steps=30",
        "train.lr=0.003",
    )
    assert run(cfg) is None
    td = cfg.run_dir / "train"
    base = json.loads((td / "baseline.json").read_text())
    final = json.loads((td / "val_metrics.json").read_text())["final"]
    # Validation buckets are the draft positions 0..2; every position learns.
    assert set(final["per_position"]) == {"0", "1", "2", "3+"}
    assert final["per_position"]["3+"]["tokens"] == 0
    for j in ("0", "1", "2"):
        assert final["per_position"][j]["tokens"] > 0
    assert final["loss"] < base["loss"] - 0.05, (base, final)
    assert final["expected_acceptance"] > base["expected_acceptance"] + 0.005, (base, final)
    # Acceptance length grows with k and is at most 1 + k.
    lengths = [final["accept_len"][str(k)] for k in (1, 2, 3)]
    assert lengths == sorted(lengths) and all(
        1.0 <= x <= 1 + k for k, x in zip((1, 2, 3), lengths, strict=True)
    )
    # Both folders eval loads carry the mask vLLM needs (`pard_token`) and the trained k.
    for folder in ("draft_init", "draft"):
        config = AutoConfig.from_pretrained(str(cfg.run_dir / folder))
        assert isinstance(config.pard_token, int) and 0 <= config.pard_token < config.vocab_size
        assert config.distill_parallel_tokens == 3


def test_mask_token_is_an_unused_special_token():
    from distill.models.draft import choose_mask_token
    from distill.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    mask = choose_mask_token(tok)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=True)
    assert mask not in chat["input_ids"]
    assert mask not in {tok.eos_token_id, tok.pad_token_id, tok.bos_token_id}
    assert 0 <= mask < len(tok)


def test_mask_fraction_keeps_every_next_token_proposal_and_a_stable_share_of_groups():
    ids, attn, loss = _batch()
    full = build_parallel_view(ids, attn, loss, k=3, mask_token_id=63, pad_id=0)
    part = build_parallel_view(
        ids, attn, loss, k=3, mask_token_id=63, pad_id=0, row_ids=[7, 9], mask_fraction=0.5
    )
    again = build_parallel_view(
        ids, attn, loss, k=3, mask_token_id=63, pad_id=0, row_ids=[7, 9], mask_fraction=0.5
    )
    assert int((part.draft_position == 0).sum()) == int((full.draft_position == 0).sum())
    assert int((part.draft_position > 0).sum()) < int((full.draft_position > 0).sum())
    assert torch.equal(part.predict_at, again.predict_at)  # the same layout on every pass (resume, epochs)


def test_keeps_masks_hits_the_fraction():
    from distill.train.parallel import keeps_masks

    share = sum(keeps_masks(r, a, 0.3) for r in range(50) for a in range(200)) / 10_000
    assert abs(share - 0.3) < 0.02


# ---------------------------------------------------------------------------------------------------------
# Packing several sequences per row (train.pack_sequences)


def _ragged_batch():
    """Five rows of very different lengths (prompt 2-3 tokens, responses 1-9), right-padded to 12."""
    lengths = [(3, 9), (2, 2), (2, 3), (3, 1), (2, 5)]
    g = torch.Generator().manual_seed(7)
    b, t = len(lengths), max(p + r for p, r in lengths)
    ids, attn, loss = (
        torch.zeros(b, t, dtype=torch.long),
        torch.zeros(b, t, dtype=torch.long),
        torch.zeros(b, t, dtype=torch.long),
    )
    for r, (p, n) in enumerate(lengths):
        ids[r, : p + n] = torch.randint(1, 60, (p + n,), generator=g)
        attn[r, : p + n] = 1
        loss[r, p : p + n] = 1
    return ids, attn, loss


def test_pack_rows_first_fit_keeps_every_sequence_whole_and_apart():
    from distill.train.parallel import pack_rows

    assert pack_rows([5, 3, 4], pack=False) == ([(0, 0), (1, 0), (2, 0)], [5, 3, 4])
    place, filled = pack_rows([10, 3, 4, 6, 2, 5], pack=True)
    assert max(filled) == 10 and len(filled) == 3  # 30 tokens in 3 rows of 10 instead of 6
    spans = {}
    for r, (row, off) in enumerate(place):
        spans.setdefault(row, []).append((off, off + [10, 3, 4, 6, 2, 5][r]))
    for row, ranges in spans.items():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))  # no overlap
        assert ranges[-1][1] == filled[row] <= 10
    assert pack_rows([], pack=True) == ([], [])


@pytest.mark.parametrize("k", [1, 3])
def test_packed_rows_give_every_prediction_the_unpacked_logits(tiny_llama, k):
    ids, attn, loss = _ragged_batch()
    views = [
        build_parallel_view(ids, attn, loss, k=k, mask_token_id=63, pad_id=0, pack=pack)
        for pack in (False, True)
    ]
    plain, packed = views
    assert packed.input_ids.shape[0] < plain.input_ids.shape[0]  # fewer rows ...
    assert packed.input_ids.shape[1] == plain.input_ids.shape[1]  # ... as long as the longest sequence
    for field in ("target_index", "draft_position", "anchor"):
        assert torch.equal(getattr(packed, field), getattr(plain, field)), (
            field
        )  # the same predictions, in order
    logits = []
    for v in views:
        with torch.no_grad():
            out = tiny_llama(
                input_ids=v.input_ids, attention_mask=v.attention, position_ids=v.position_ids
            ).logits
        logits.append(out.reshape(-1, out.shape[-1])[v.predict_at])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
