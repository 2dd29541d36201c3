"""The top-k cache format: extraction from logits, quantisation, compression round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distill.data.format import (
    CacheMeta,
    TopKCache,
    decode_ids,
    decode_logprobs,
    decode_row,
    encode_ids,
    encode_logprobs,
    encode_row,
    id_dtype,
    topk_from_logits,
    write_cache_folder,
)


def _peaked_logits(t: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, v, generator=g) * 4.0


def test_topk_from_logits_matches_reference():
    logits = _peaked_logits(12, 300)
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    ids, lp, rest = topk_from_logits(logits, mask, 20)
    positions = [t for t in range(12) if mask[t]]
    assert ids.shape == (len(positions), 20) and lp.shape == (len(positions), 20) and rest.shape == (7,)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32 and rest.dtype == torch.float32
    for j, t in enumerate(positions):
        ref = torch.log_softmax(logits[t - 1].double(), -1)
        ref_vals, ref_ids = torch.sort(ref, descending=True)
        assert torch.equal(ids[j], ref_ids[:20])
        torch.testing.assert_close(lp[j].double(), ref_vals[:20], atol=1e-5, rtol=1e-5)
        expected_rest = math.log(1.0 - float(ref_vals[:20].exp().sum()))
        assert rest[j].item() == pytest.approx(expected_rest, abs=1e-4)
    # Descending order per row.
    assert bool((lp[:, 1:] <= lp[:, :-1]).all())


def test_topk_full_vocab_rest_is_minus_inf_and_k_is_clamped():
    logits = _peaked_logits(4, 10)
    ids, lp, rest = topk_from_logits(logits, torch.tensor([0, 1, 1, 1]), 64)
    assert ids.shape == (3, 10)
    assert torch.isinf(rest).all() and (rest < 0).all()
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3), atol=1e-5, rtol=0)


def test_topk_rejects_mask_on_first_token_and_bad_shapes():
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        topk_from_logits(torch.zeros(3, 5), torch.tensor([1, 1, 0]), 2)
    with pytest.raises(ValueError, match="expected logits"):
        topk_from_logits(torch.zeros(3, 5), torch.tensor([0, 1]), 2)


def test_empty_mask_gives_empty_rows():
    ids, lp, rest = topk_from_logits(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), 2)
    assert ids.shape == (0, 2) and lp.shape == (0, 2) and rest.shape == (0,)


def test_id_dtype_is_smallest():
    assert id_dtype(200) == np.uint8
    assert id_dtype(49152) == np.uint16
    assert id_dtype(65536) == np.uint16
    assert id_dtype(65537) == np.uint32
    assert id_dtype(152064) == np.uint32


def fp16_tol(x: np.ndarray | torch.Tensor) -> float:
    """Largest rounding error of fp16 over the magnitudes in x (half a unit in the last place, 10-bit mantissa)."""
    return float(np.abs(np.asarray(x)).max()) * 2.0**-11 + 1e-7


def test_logprob_coding_is_fp16_exact_and_monotone():
    lp = -np.sort(np.random.default_rng(0).exponential(3.0, size=(50, 64)), axis=1).astype(np.float32)
    lp[:, 0] = 0.0  # a certain token: log-prob exactly 0
    deltas = encode_logprobs(lp)
    assert deltas.dtype == np.uint16
    back = decode_logprobs(deltas)
    np.testing.assert_array_equal(back, lp.astype(np.float16).astype(np.float32))
    assert np.abs(back - lp).max() <= fp16_tol(lp)
    assert not np.signbit(-back[:, 0]).any()  # no -0.0 sneaking in
    inf = np.array([[-1.0, -np.inf]], dtype=np.float32)
    assert decode_logprobs(encode_logprobs(inf))[0, 1] == -np.inf


def test_id_back_references_round_trip_and_shrink_repeats():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(1000, size=16, replace=False) for _ in range(40)])
    ids[5] = ids[4][::-1]  # all ids seen one position earlier
    sym = encode_ids(ids, 1000)
    np.testing.assert_array_equal(decode_ids(sym), ids)
    assert (sym[5] < 8 * 16).all() and (sym[0] >= 8 * 16).all()


@pytest.mark.parametrize("codec", ["zlib", "lzma", "none"])
def test_row_round_trip(codec):
    logits = _peaked_logits(30, 49152, seed=1)
    mask = torch.tensor([0] * 10 + [1] * 20)
    ids, lp, rest = topk_from_logits(logits, mask, 32)
    blob = encode_row(ids.numpy(), lp.numpy(), rest.numpy(), vocab_size=49152, codec=codec)
    ids2, lp2, rest2 = decode_row(blob, 20, 32, vocab_size=49152, codec=codec)
    assert torch.equal(ids2, ids)
    assert (lp2 - lp).abs().max().item() <= fp16_tol(lp)
    assert torch.equal(rest2, rest)
    if codec == "none":
        assert len(blob) == 20 * 32 * (2 + 2) + 20 * 4  # uint16 id symbols, uint16 deltas, float32 rest


def test_cache_folder_random_access(tmp_path):
    rows_in = []
    for seed, (t, p) in enumerate([(8, 3), (12, 5), (5, 1)]):
        logits = _peaked_logits(t, 100, seed=seed)
        mask = torch.tensor([0] * p + [1] * (t - p))
        rows_in.append(topk_from_logits(logits, mask, 7))
    blobs = [encode_row(i.numpy(), lp.numpy(), r.numpy(), vocab_size=100) for i, lp, r in rows_in]
    write_cache_folder(
        tmp_path / "c", CacheMeta(k=7, vocab_size=100), blobs, [int(r[0].shape[0]) for r in rows_in]
    )
    cache = TopKCache(tmp_path / "c")
    assert len(cache) == 3 and cache.k == 7
    for i in (2, 0, 1):
        ids, lp, rest = cache.get(i)
        assert torch.equal(ids, rows_in[i][0])
        assert torch.equal(rest, rows_in[i][2])
        assert (lp - rows_in[i][1]).abs().max().item() <= fp16_tol(rows_in[i][1])
    with pytest.raises(IndexError):
        cache.get(3)
    import pickle

    clone = pickle.loads(pickle.dumps(cache))
    assert torch.equal(clone.get(1)[0], rows_in[1][0])
