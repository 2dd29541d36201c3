"""train.head_candidates: the training loss's softmax over a candidate subset of the vocabulary.

The reference for each case is written out by hand: the head's rows of the candidates, a log-softmax over them,
the teacher's ids looked up in the candidate list, plain autograd.
"""

from __future__ import annotations

import math

import pytest
import torch

from distill.losses import LossSpec, SparseTeacher, per_token_loss
from distill.train.module import Predictions, candidate_ids

VOCAB, HIDDEN, ROWS = 40, 8, 23


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


def _sparse_teacher(rows: int, k: int, width: int, seed: int) -> SparseTeacher:
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(rows, width, generator=g) * 2, -1)
    top = logp.topk(k, -1)
    rest = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-6))
    return SparseTeacher(top.indices, top.values, rest)


def _leaves(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=g, requires_grad=True)
    head = _Head(torch.randn(VOCAB, HIDDEN, generator=g) * 0.5)
    return hidden, head


def _predictions(hidden, head, teacher, labels) -> Predictions:
    return Predictions(hidden, None, head, VOCAB, teacher, labels, torch.zeros_like(labels))


def _run(preds: Predictions, spec: LossSpec, candidates: int, closed_form: bool = True, block_rows: int = 5):
    preds.head.weight.grad = None
    loss = preds.loss_sum(spec, block_rows, closed_form, candidates)
    loss.backward()
    return loss.item(), preds.hidden.grad.clone(), preds.head.weight.grad.clone()


def _reference(hidden, weight, teacher, labels, spec, ids, offset):
    """The loss over the candidate ids `ids` (sorted), their logits shifted by `offset`, by hand."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logits = h @ w[ids].T + (0.0 if offset is None else offset)
    slot = torch.searchsorted(ids, labels)
    assert bool((ids[slot] == labels).all())
    if isinstance(teacher, SparseTeacher):
        t = SparseTeacher(torch.searchsorted(ids, teacher.ids), teacher.logprobs, teacher.rest_logmass)
    else:
        t = teacher[:, ids]
    loss = per_token_loss(spec, logits, slot, t).sum()
    loss.backward()
    return loss.item(), h.grad, w.grad


def test_candidate_ids_keep_every_named_id_and_sample_the_others_with_their_weight():
    named = torch.tensor([30, 7, 7, 12, 2, 30])
    ids, offset = candidate_ids(named, 10, 40)
    assert ids.tolist() == sorted(set(ids.tolist())) and ids.numel() == 10
    assert {2, 7, 12, 30} <= set(ids.tolist())
    named_cols = torch.isin(ids, torch.tensor([2, 7, 12, 30]))
    # 6 of the 36 others sampled: each stands for 6 of them in the normaliser.
    assert bool((offset[named_cols] == 0).all())
    torch.testing.assert_close(offset[~named_cols], torch.full((6,), math.log(36 / 6)))
    again = candidate_ids(named[torch.randperm(6)], 10, 40)  # the same named set draws the same sample
    assert torch.equal(again[0], ids) and torch.equal(again[1], offset)
    other = candidate_ids(torch.tensor([2, 7, 12, 31]), 10, 40)[0]
    assert not torch.equal(other[~torch.isin(other, torch.tensor([2, 7, 12, 31]))], ids[~named_cols])
    ids, offset = candidate_ids(named, 3, 40)  # more named than asked for: all of them, nothing sampled
    assert ids.tolist() == [2, 7, 12, 30] and offset is None
    ids, offset = candidate_ids(named, 100, 40)  # capped at the vocabulary
    assert ids.tolist() == list(range(40)) and offset is not None


def test_sampled_offsets_estimate_the_full_normaliser():
    """Over many draws, the candidates' exp-sum is on average the whole vocabulary's (what the offset is for)."""
    z = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9))
    named = torch.tensor([1, 5, 9])
    sums = []
    for draw in range(400):
        ids, offset = candidate_ids(torch.cat([named, named.new_tensor([draw % 30 + 10])]), 12, VOCAB)
        named_now = torch.isin(ids, torch.cat([named, named.new_tensor([draw % 30 + 10])]))
        exact_rest = z[~torch.isin(torch.arange(VOCAB), ids[named_now])].exp().sum()
        sums.append(((z[ids] + offset)[~named_now].exp().sum() / exact_rest).item())
    assert sum(sums) / len(sums) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize(
    "spec", [LossSpec.single("fkl"), LossSpec({"fkl": 0.7, "ce": 0.3}), LossSpec.single("rkl")]
)
@pytest.mark.parametrize("closed_form", [True, False])
def test_sparse_teacher_loss_and_gradients_are_those_over_the_candidates(spec, closed_form):
    hidden, head = _leaves()
    teacher = _sparse_teacher(ROWS, k=4, width=VOCAB, seed=1)
    labels = teacher.ids[:, 0].clone()
    preds = _predictions(hidden, head, teacher, labels)
    loss, gh, gw = _run(preds, spec, candidates=38, closed_form=closed_form)
    ids, offset = candidate_ids(torch.cat([labels, teacher.ids.flatten()]), 38, VOCAB)
    assert 38 == ids.numel() < VOCAB and offset is not None
    ref_loss, ref_gh, ref_gw = _reference(hidden, head.weight, teacher, labels, spec, ids, offset)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-4, atol=1e-6)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert outside.any() and bool((gw[outside] == 0).all())  # no gradient outside the candidates
    assert bool((gw[ids].abs().sum(-1) > 0).any())


def test_dense_teacher_names_its_top_tokens_and_is_cut_to_the_candidates(monkeypatch):
    from distill.train import module

    monkeypatch.setattr(module, "CANDIDATE_TOPK", 3)
    hidden, head = _leaves(seed=2)
    teacher = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    labels = teacher.argmax(-1)
    spec = LossSpec.single("tvd")
    loss, gh, gw = _run(_predictions(hidden, head, teacher, labels), spec, candidates=10)
    ids, offset = candidate_ids(torch.cat([labels, teacher.topk(3, -1).indices.flatten()]), 10, VOCAB)
    assert ids.numel() < VOCAB
    ref_loss, ref_gh, ref_gw = _reference(hidden, head.weight, teacher, labels, spec, ids, offset)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("candidates", [VOCAB, 10 * VOCAB])
def test_candidates_covering_the_vocabulary_are_the_exact_loss(candidates):
    hidden, head = _leaves(seed=3)
    teacher = _sparse_teacher(ROWS, k=4, width=VOCAB, seed=5)
    labels = teacher.ids[:, 0].clone()
    spec = LossSpec.single("fkl")
    full = _run(_predictions(hidden, head, teacher, labels), spec, candidates=0)
    hidden.grad = None
    cut = _run(_predictions(hidden, head, teacher, labels), spec, candidates=candidates)
    assert cut[0] == pytest.approx(full[0], rel=1e-6)
    torch.testing.assert_close(cut[1], full[1])
    torch.testing.assert_close(cut[2], full[2])


def test_cached_ids_past_the_vocabulary_take_the_full_loss():
    """A padded target's cache can name ids past the tokenizer: the exact path (`fit_sparse_to_vocab`)."""
    hidden, head = _leaves(seed=6)
    teacher = _sparse_teacher(ROWS, k=4, width=VOCAB + 6, seed=7)
    assert bool((teacher.ids >= VOCAB).any())
    labels = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(8))
    preds = _predictions(hidden, head, teacher, labels)
    assert preds.restricted_to_candidates(8) is None
    spec = LossSpec.single("fkl")
    full = _run(preds, spec, candidates=0)
    hidden.grad = None
    cut = _run(_predictions(hidden, head, teacher, labels), spec, candidates=8)
    assert cut[0] == pytest.approx(full[0], rel=1e-6)


def test_head_candidates_at_their_default_leave_run_hashes_as_they_were():
    """The key came after run folders existed: at 0 it is not hashed, so their training still matches."""
    from pathlib import Path

    from distill import rundir
    from distill.config import load_config, output_view

    shipped = Path(__file__).resolve().parents[1] / "configs/smollm2-sharegpt.yaml"
    # The shipped config sets 16384 since 2026-12-07; its run folders of before were trained at the default.
    cfg = load_config(shipped, ["train.head_candidates=0"])
    assert "head_candidates" not in output_view(cfg.train) and "lr" in output_view(cfg.train)
    sampled = load_config(shipped, ["train.head_candidates=8192"])
    assert output_view(sampled.train)["head_candidates"] == 8192
    assert rundir.stage_hash(sampled, "train") != rundir.stage_hash(cfg, "train")


def test_all_rows_at_once_give_the_blocked_candidate_loss():
    """train.logits_block_rows 0 (one block) trains on the candidates too."""
    hidden, head = _leaves(seed=11)
    teacher = _sparse_teacher(ROWS, k=4, width=VOCAB, seed=12)
    labels = teacher.ids[:, 0].clone()
    spec = LossSpec.single("fkl")
    blocked = _run(_predictions(hidden, head, teacher, labels), spec, candidates=38, block_rows=5)
    hidden.grad = None
    at_once = _run(_predictions(hidden, head, teacher, labels), spec, candidates=38, block_rows=0)
    assert at_once[0] == pytest.approx(blocked[0], rel=1e-5)
    torch.testing.assert_close(at_once[1], blocked[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(at_once[2], blocked[2], rtol=1e-4, atol=1e-6)
    assert bool((at_once[2].abs().sum(-1) == 0).any())  # some rows outside the candidates: no gradient
