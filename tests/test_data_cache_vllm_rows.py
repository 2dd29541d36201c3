"""Top-k cache rows taken from vLLM's generation log-probs equal those of a forward pass over the same logits."""

from __future__ import annotations

import torch

from distill.data.cache import rows_from_vllm
from distill.data.format import topk_from_logits


def _vllm_response(logits: torch.Tensor, k: int) -> dict:
    """What the worker writes: per generated token the k best ids and raw log-probs, descending."""
    lp = torch.log_softmax(logits.double(), -1)
    vals, ids = lp.topk(k, dim=-1)
    return {"token_ids": [0] * logits.shape[0], "topk_ids": ids.tolist(), "topk_logprobs": vals.tolist()}


def test_rows_from_vllm_equal_a_forward_pass_over_the_same_logits():
    g = torch.Generator().manual_seed(0)
    n_prompt, n_resp, vocab, k = 5, 7, 50, 8
    logits = torch.randn(n_prompt + n_resp, vocab, generator=g) * 3
    mask = torch.tensor([0] * n_prompt + [1] * n_resp)
    # Row j of the cache is the distribution that predicted response token j: logits at position j - 1.
    response = _vllm_response(logits[n_prompt - 1 : -1], k)
    got = rows_from_vllm(response, n_resp, k=k, vocab_size=vocab)
    assert got is not None
    ids, lp, rest = got
    f_ids, f_lp, f_rest = topk_from_logits(logits, mask, k)
    assert torch.equal(ids, f_ids)
    torch.testing.assert_close(lp, f_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest, f_rest, atol=1e-5, rtol=1e-5)


def test_rows_from_vllm_refuse_rows_that_do_not_cover_the_response():
    logits = torch.randn(4, 30)
    response = _vllm_response(logits, 5)
    assert rows_from_vllm(response, 5, k=5, vocab_size=30) is None  # an EOS appended after vLLM stopped
    assert rows_from_vllm(response, 4, k=6, vocab_size=30) is None  # fewer log-probs than k
    assert rows_from_vllm({"token_ids": [1, 2]}, 2, k=5, vocab_size=30) is None  # none requested


def test_full_vocab_rows_have_no_remaining_mass():
    logits = torch.randn(3, 6)
    got = rows_from_vllm(_vllm_response(logits, 6), 3, k=6, vocab_size=6)
    assert got is not None and torch.isinf(got[2]).all() and (got[2] < 0).all()
