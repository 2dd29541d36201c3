"""The closed-form gradient of the train stage's fast path (`distill.losses.loss_and_logit_grad_`) against
autograd through `per_token_loss`, on the rows where the sparse forward KL is delicate."""

from __future__ import annotations

import math

import pytest
import torch

from distill.losses import (
    LossSpec,
    SparseTeacher,
    has_closed_form,
    loss_and_logit_grad_,
    per_token_loss,
)

V = 40


def _teacher(n: int, k: int, seed: int, scale: float = 2.0) -> SparseTeacher:
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(n, V, generator=g) * scale, -1)
    top = logp.topk(k, -1)
    rest = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-7))
    return SparseTeacher(top.indices, top.values, rest)


def _by_autograd(spec, logits, labels, teacher):
    x = logits.clone().requires_grad_()
    loss = per_token_loss(spec, x, labels, teacher)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), grad


def _check(spec, logits, labels, teacher, atol=1e-6):
    ref_loss, ref_grad = _by_autograd(spec, logits, labels, teacher)
    loss, grad = loss_and_logit_grad_(spec, logits.clone(), labels, teacher)
    assert torch.isfinite(grad).all() and torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=atol)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=atol)


SPECS = [LossSpec.single("fkl"), LossSpec.single("ce"), LossSpec({"fkl": 0.7, "ce": 0.3})]


@pytest.mark.parametrize("spec", SPECS, ids=["fkl", "ce", "fkl+ce"])
@pytest.mark.parametrize("k", [1, 5, 39])
@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_matches_autograd_on_random_rows(spec, k, scale):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(23, V, generator=g) * scale
    labels = torch.randint(0, V, (23,), generator=g)
    _check(spec, logits, labels, _teacher(23, k, seed=k))


@pytest.mark.parametrize("spec", SPECS[0::2], ids=["fkl", "fkl+ce"])
def test_a_student_whose_top_k_hold_nearly_all_its_mass(spec):
    """Rows past 1 - 1e-4 take `student_buckets`' exact rest; the gradient outside the top-k is then tiny and
    must come out finite and right (q_j / R would divide by almost nothing)."""
    teacher = _teacher(6, 4, seed=2)
    logits = torch.zeros(6, V)
    logits.scatter_(-1, teacher.ids, 30.0)  # student mass outside the top-4: ~36 * e^-30
    logits[0, 7] = 5.0  # one row a little less extreme
    labels = teacher.ids[:, 0]
    _check(spec, logits, labels, teacher, atol=1e-7)


def test_a_teacher_whose_top_k_hold_all_its_mass_and_empty_buckets():
    """rest_logmass -inf (nothing outside the top-k) and entries of probability zero (the empty buckets of
    `fit_sparse_to_vocab`): the student's mass there is pushed down, nothing is NaN."""
    base = _teacher(5, 6, seed=3)
    logprobs = base.logprobs.clone()
    logprobs[:, 4:] = -1e30
    logprobs = logprobs - logprobs.logsumexp(-1, keepdim=True).clamp_min(-1e29)
    logprobs[:, 4:] = -1e30
    teacher = SparseTeacher(base.ids, logprobs, torch.full((5,), -math.inf))
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4)) * 3
    _check(LossSpec.single("fkl"), logits, teacher.ids[:, 0], teacher)


def test_teacher_ids_covering_the_whole_vocabulary_equal_the_dense_gradient():
    teacher = _teacher(4, V, seed=5)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    _, grad = loss_and_logit_grad_(LossSpec.single("fkl"), logits.clone(), teacher.ids[:, 0], teacher)
    p = torch.zeros(4, V).scatter_(-1, teacher.ids, teacher.logprobs.exp())
    torch.testing.assert_close(grad, logits.softmax(-1) - p, rtol=1e-4, atol=1e-6)


def test_the_logits_storage_becomes_the_gradient():
    teacher = _teacher(3, 5, seed=7)
    logits = torch.randn(3, V)
    loss, grad = loss_and_logit_grad_(LossSpec.single("fkl"), logits, teacher.ids[:, 0], teacher)
    assert grad.data_ptr() == logits.data_ptr() and loss.shape == (3,)
    torch.testing.assert_close(grad.sum(-1), torch.zeros(3), atol=1e-6, rtol=0)  # a softmax's gradient


def test_which_specs_have_a_closed_form():
    sparse = _teacher(2, 3, seed=8)
    dense = torch.randn(2, V)
    assert has_closed_form(LossSpec.single("fkl"), sparse)
    assert has_closed_form(LossSpec({"fkl": 1.0, "ce": 0.5, "tvd": 0.0}), sparse)  # zero weights ignored
    assert has_closed_form(LossSpec.single("ce"), None)
    assert has_closed_form(LossSpec.single("ce"), dense)
    assert not has_closed_form(LossSpec.single("fkl"), dense)  # online teacher: autograd
    assert not has_closed_form(LossSpec.single("fkl"), None)
    for name in ("rkl", "jsd", "tvd"):
        assert not has_closed_form(LossSpec.single(name), sparse)
    assert not has_closed_form(LossSpec.single("ce", temperature=2.0), None)
    assert not has_closed_form(LossSpec({"fkl": 0.0}), sparse)
