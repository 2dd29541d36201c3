"""Property and reference tests of distill.losses (pure functions, no models)."""

from __future__ import annotations

import math

import pytest
import torch

from distill.losses import (
    LossSpec,
    SparseTeacher,
    acceptance_per_token,
    dense_pair,
    distill_loss,
    eval_token_stats,
    jsd_per_token,
    kl_per_token,
    per_token_loss,
    select_labels,
    select_positions,
    sparse_pair,
    tvd_per_token,
)


@pytest.fixture(autouse=True)
def _double_default_dtype():
    """Reference comparisons in double (the losses cast to float32 anyway); restored after each test so
    the rest of the suite keeps float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _logits(n: int = 6, v: int = 11, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


# --- slow, obvious reference implementations (python loops over rows and vocab) ---


def _ref_probs(row: list[float], temp: float = 1.0) -> list[float]:
    m = max(row)
    e = [math.exp((x - m) / temp) for x in row]
    z = sum(e)
    return [x / z for x in e]


def _ref_kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=False) if pi > 0)


def _ref_all(
    t_logits: torch.Tensor, s_logits: torch.Tensor, beta: float, temp: float = 1.0
) -> dict[str, list]:
    out: dict[str, list] = {"fkl": [], "rkl": [], "jsd": [], "tvd": [], "acc": []}
    for tr, sr in zip(t_logits.tolist(), s_logits.tolist(), strict=False):
        p, q = _ref_probs(tr, temp), _ref_probs(sr, temp)
        m = [beta * a + (1 - beta) * b for a, b in zip(p, q, strict=False)]
        out["fkl"].append(_ref_kl(p, q))
        out["rkl"].append(_ref_kl(q, p))
        out["jsd"].append((beta * _ref_kl(p, m) + (1 - beta) * _ref_kl(q, m)) / (beta * (1 - beta)))
        out["tvd"].append(0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=False)))
        out["acc"].append(sum(min(a, b) for a, b in zip(p, q, strict=False)))
    return out


def _topk(logits: torch.Tensor, k: int) -> SparseTeacher:
    logp = torch.log_softmax(logits.float(), -1)
    vals, ids = logp.topk(k, dim=-1)
    rest = torch.log1p(-vals.exp().sum(-1).clamp(max=1.0))
    rest = torch.where(vals.exp().sum(-1) >= 1.0 - 1e-7, torch.full_like(rest, float("-inf")), rest)
    return SparseTeacher(ids=ids, logprobs=vals, rest_logmass=rest)


@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_dense_terms_match_reference(temp):
    t, s = _logits(seed=1), _logits(seed=2)
    ref = _ref_all(t, s, beta=0.3, temp=temp)
    tl, sl = dense_pair(t, s, temp)
    torch.testing.assert_close(kl_per_token(tl, sl).double(), torch.tensor(ref["fkl"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kl_per_token(sl, tl).double(), torch.tensor(ref["rkl"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        jsd_per_token(tl, sl, 0.3).double(), torch.tensor(ref["jsd"]), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(tvd_per_token(tl, sl).double(), torch.tensor(ref["tvd"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        acceptance_per_token(tl, sl).double(), torch.tensor(ref["acc"]), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_identical_inputs_give_zero(name):
    x = _logits()
    loss = per_token_loss(LossSpec.single(name), x, torch.zeros(x.shape[0], dtype=torch.long), x.clone())
    assert loss.abs().max().item() < 1e-5


def test_nonidentical_inputs_give_positive():
    t, s = _logits(seed=1), _logits(seed=2)
    for name in ["fkl", "rkl", "jsd", "tvd"]:
        assert (per_token_loss(LossSpec.single(name), s, torch.zeros(6, dtype=torch.long), t) > 1e-3).all(), (
            name
        )


def test_jsd_symmetric_at_half():
    tl, sl = dense_pair(_logits(seed=1), _logits(seed=2))
    torch.testing.assert_close(jsd_per_token(tl, sl, 0.5), jsd_per_token(sl, tl, 0.5))
    assert not torch.allclose(jsd_per_token(tl, sl, 0.3), jsd_per_token(sl, tl, 0.3))


def test_jsd_endpoints_are_the_kls_and_continuous():
    tl, sl = dense_pair(_logits(seed=1, scale=1.0), _logits(seed=2, scale=1.0))
    fkl, rkl = kl_per_token(tl, sl), kl_per_token(sl, tl)
    torch.testing.assert_close(jsd_per_token(tl, sl, 0.0), fkl)
    torch.testing.assert_close(jsd_per_token(tl, sl, 1.0), rkl)
    # The scaled JSD tends to the KLs: the endpoints are limits, not special cases.
    torch.testing.assert_close(jsd_per_token(tl, sl, 1e-4), fkl, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(jsd_per_token(tl, sl, 1 - 1e-4), rkl, rtol=2e-2, atol=1e-3)


def test_tvd_is_one_minus_sum_min():
    tl, sl = dense_pair(_logits(seed=3), _logits(seed=4))
    torch.testing.assert_close(tvd_per_token(tl, sl), 1 - acceptance_per_token(tl, sl), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_sparse_with_k_equal_vocab_equals_dense(name):
    t, s = _logits(seed=5), _logits(seed=6)
    s1 = s.clone().requires_grad_(True)
    s2 = s.clone().requires_grad_(True)
    labels = torch.zeros(6, dtype=torch.long)
    spec = LossSpec.single(name, jsd_beta=0.3)
    dense = per_token_loss(spec, s1, labels, t)
    sparse = per_token_loss(spec, s2, labels, _topk(t, t.shape[-1]))
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-5)
    dense.sum().backward()
    sparse.sum().backward()
    assert torch.isfinite(s2.grad).all()
    torch.testing.assert_close(s2.grad, s1.grad, rtol=1e-4, atol=1e-5)


def test_sparse_rest_bucket_matches_reference():
    """k < V: the divergence between the (k+1)-bucket distributions, computed by hand."""
    t, s = _logits(n=3, v=9, seed=7), _logits(n=3, v=9, seed=8)
    k = 3
    st = _topk(t, k)
    tl, sl = sparse_pair(st, s)
    for r in range(3):
        p, q = _ref_probs(t[r].tolist()), _ref_probs(s[r].tolist())
        ids = st.ids[r].tolist()
        pb = [p[i] for i in ids] + [1 - sum(p[i] for i in ids)]
        qb = [q[i] for i in ids] + [1 - sum(q[i] for i in ids)]
        assert abs(kl_per_token(tl[r : r + 1], sl[r : r + 1]).item() - _ref_kl(pb, qb)) < 1e-4
        assert abs(tl[r].exp().sum().item() - 1) < 1e-5 and abs(sl[r].exp().sum().item() - 1) < 1e-5


def test_sparse_small_k_does_not_ignore_rest_mass():
    """A student that copies the teacher's top-k shares but puts the rest elsewhere still pays."""
    t = _logits(n=4, v=20, seed=9, scale=1.0)
    st = _topk(t, 2)
    s = t.clone()
    s.scatter_(-1, st.ids, 50.0)  # nearly all mass on the top-2 tokens -> rest bucket ~0 vs teacher's large
    assert (per_token_loss(LossSpec.single("fkl"), s, torch.zeros(4, dtype=torch.long), st) > 0.1).all()


def test_ce_and_mix_and_global_normalisation():
    t, s = _logits(seed=10), _logits(seed=11)
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    ce = per_token_loss(LossSpec.single("ce"), s, labels, None)
    ref_ce = torch.tensor(
        [-math.log(_ref_probs(r)[y]) for r, y in zip(s.tolist(), labels.tolist(), strict=False)]
    )
    torch.testing.assert_close(ce.double(), ref_ce, rtol=1e-5, atol=1e-6)
    mix = LossSpec({"fkl": 0.5, "ce": 2.0})
    fkl = per_token_loss(LossSpec.single("fkl"), s, labels, t)
    torch.testing.assert_close(per_token_loss(mix, s, labels, t), 0.5 * fkl + 2.0 * ce)
    # Two micro-batches normalised by the global count add up to the mean over all tokens.
    a = distill_loss(mix, s[:2], labels[:2], t[:2], 6) + distill_loss(mix, s[2:], labels[2:], t[2:], 6)
    torch.testing.assert_close(a, per_token_loss(mix, s, labels, t).mean())


def test_sparse_rejects_temperature():
    t, s = _logits(), _logits(seed=1)
    with pytest.raises(ValueError, match="temperature"):
        per_token_loss(
            LossSpec.single("fkl", temperature=2.0), s, torch.zeros(6, dtype=torch.long), _topk(t, 4)
        )


def test_selection_shift():
    ids = torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    logits = torch.arange(2 * 5, dtype=torch.float64).reshape(2, 5, 1)
    # counted tokens 7, 8 (predicted at t=1, 2) and 2, 3 (predicted at t=0, 1)
    assert select_positions(logits, mask).flatten().tolist() == [1.0, 2.0, 5.0, 6.0]
    assert select_labels(ids, mask).tolist() == [7, 8, 2, 3]


def test_eval_stats_greedy_and_sampled():
    t, s = _logits(seed=12), _logits(seed=13)
    acc, top1 = eval_token_stats(s, t, 1.0)
    tl, sl = dense_pair(t, s)
    torch.testing.assert_close(acc, acceptance_per_token(tl, sl))
    assert top1.tolist() == (s.argmax(-1) == t.argmax(-1)).float().tolist()
    acc0, _ = eval_token_stats(s, t, 0.0)
    assert acc0.tolist() == top1.tolist()
    acc_same, top1_same = eval_token_stats(t, t.clone(), 1.0)
    assert torch.allclose(acc_same, torch.ones(6, dtype=acc_same.dtype)) and top1_same.all()
    sp_acc, sp_top1 = eval_token_stats(s, _topk(t, t.shape[-1]), 1.0)
    torch.testing.assert_close(sp_acc, acc, rtol=1e-5, atol=1e-6)
    assert sp_top1.tolist() == top1.tolist()


def test_sparse_rest_complement_equals_the_exact_logsumexp_in_both_regimes():
    """The fast complement log(1 - top mass) and the exact path (confident rows) agree, values and gradients."""
    from distill import losses

    torch.manual_seed(3)
    v, k = 500, 8
    t = (torch.randn(6, v) * 3).float()
    st = _topk(t, k)
    s = (torch.randn(6, v) * 2).float()
    s[3:].scatter_(-1, st.ids[3:], 30.0)  # rows 3-5: the student's top-k hold > 1 - 1e-4 of its mass
    a = s.clone().requires_grad_(True)
    _, fast = sparse_pair(st, a)
    top = a.gather(-1, st.ids) - torch.logsumexp(a, -1, keepdim=True)
    b = s.clone().requires_grad_(True)
    outside = b.scatter(-1, st.ids, losses._EMPTY)
    ref_rest = torch.logsumexp(outside, -1) - torch.logsumexp(b, -1)
    torch.testing.assert_close(fast[:, -1], ref_rest, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[:, :-1], top.detach(), rtol=1e-6, atol=1e-6)
    # The exact path was taken for the confident rows only.
    assert (top.detach().exp().sum(-1)[3:] > 1 - 1e-4).all() and (
        top.detach().exp().sum(-1)[:3] < 0.999
    ).all()
    fast[:, -1].sum().backward()
    ref_rest.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
