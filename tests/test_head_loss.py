"""The output head and the loss in blocks of rows (`distill.train.head_loss`, `train.logits_block_rows`): the
same loss and gradients as all rows at once, for ordinary and parallel drafts, frozen heads, autocast and
validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distill.losses import LossSpec, SparseTeacher, per_token_loss
from distill.train.head_loss import autograd_row_grad, blocks, chunked_head_loss
from distill.train.module import fit_sparse_to_vocab

VOCAB = 45  # the tokenizer; the head has 50 rows (a padded table)


def _sparse_teacher(n: int, k: int = 6, seed: int = 1, width: int = 50) -> SparseTeacher:
    """Top-k rows of a random teacher over `width` ids (the padded table by default: some ids land past
    VOCAB)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(n, width, generator=g) * 2, -1)
    top = logp.topk(k, -1)
    rest = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-6))
    return SparseTeacher(top.indices, top.values, rest)


def _take(t: SparseTeacher, start: int, end: int) -> SparseTeacher:
    return SparseTeacher(t.ids[start:end], t.logprobs[start:end], t.rest_logmass[start:end])


def _row_loss(spec, teacher, labels):
    def row_loss(logits, start, end):
        s, t = fit_sparse_to_vocab(logits[:, :VOCAB].float(), _take(teacher, start, end), VOCAB)
        return per_token_loss(spec, s, labels[start:end], t)

    return row_loss


def _row_grad(spec, teacher, labels):
    return autograd_row_grad(_row_loss(spec, teacher, labels))


def _reference(spec, hidden, weight, teacher, labels):
    """All rows at once, plain autograd."""
    return _row_loss(spec, teacher, labels)(F.linear(hidden, weight), 0, hidden.shape[0]).sum()


def _leaves(seed: int = 0, n: int = 37, h: int = 16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(50, h, generator=g).mul_(0.3).requires_grad_()
    return hidden, weight


def test_blocks_cover_every_row_once():
    assert blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert blocks(8, 4) == [(0, 4), (4, 8)]
    assert blocks(3, 4) == [(0, 3)]
    assert blocks(10, 0) == [(0, 10)]
    assert blocks(0, 4) == [(0, 0)]


@pytest.mark.parametrize("rows", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("spec", [LossSpec.single("fkl"), LossSpec({"fkl": 0.5, "tvd": 1.0, "ce": 0.3})])
def test_blocked_loss_and_gradients_equal_all_rows_at_once(rows, spec):
    teacher, labels = _sparse_teacher(37), torch.randint(0, VOCAB, (37,))
    assert bool((teacher.ids >= VOCAB).any())  # the widening of fit_sparse_to_vocab is exercised
    h1, w1 = _leaves()
    ref = _reference(spec, h1, w1, teacher, labels)
    (ref * 0.7).backward()
    h2, w2 = _leaves()
    got = chunked_head_loss(h2, w2, _row_grad(spec, teacher, labels), rows)
    (got * 0.7).backward()  # the upstream gradient scales both results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-6)


def test_frozen_head_gets_no_gradient_and_hidden_still_does():
    spec = LossSpec.single("fkl")
    teacher, labels = _sparse_teacher(37), torch.randint(0, VOCAB, (37,))
    h1, w1 = _leaves()
    w1.requires_grad_(False)
    _reference(spec, h1, w1, teacher, labels).backward()
    h2, w2 = _leaves()
    w2.requires_grad_(False)
    chunked_head_loss(h2, w2, _row_grad(spec, teacher, labels), 8).backward()
    assert w2.grad is None
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_the_head_runs_in_bf16_like_the_plain_path():
    spec = LossSpec.single("fkl")
    teacher, labels = _sparse_teacher(37), torch.randint(0, VOCAB, (37,))
    h0, w0 = _leaves()
    _reference(spec, h0, w0, teacher, labels).backward()  # float32: the exact gradient
    h1, w1 = _leaves()
    h2, w2 = _leaves()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(spec, h1, w1, teacher, labels)
        got = chunked_head_loss(h2, w2, _row_grad(spec, teacher, labels), 8)
    ref.backward()
    got.backward()
    assert w2.grad is not None and w2.grad.dtype == torch.float32  # the parameter's dtype, not bf16
    # The forward logits are the plain path's rows: the same bf16 products.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-3, atol=1e-4)
    # The weight gradient sums over rows: the plain path rounds the whole sum to bf16 once, the blocks round
    # each block's and add them in float32. Neither is the other; both must be as close to the exact one.
    plain_err = (w1.grad - w0.grad).abs().max()
    blocked_err = (w2.grad - w0.grad).abs().max()
    assert blocked_err <= 1.5 * plain_err + 1e-6, (blocked_err, plain_err)


# ---------------------------------------------------------------------------------------------------------
# Through the training module: a tiny Llama, an ordinary and a parallel micro-batch


def _micro_batch(parallel: bool):
    from distill.train.data import MicroBatch
    from distill.train.parallel import build_parallel_view

    ids = torch.tensor([[5, 6, 7, 10, 11, 12, 13, 14], [8, 9, 20, 21, 22, 0, 0, 0]])
    attn = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    loss = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0]])
    teacher = _sparse_teacher(int(loss.sum()), k=8, seed=3, width=64)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    view = build_parallel_view(ids, attn, loss, k=3, mask_token_id=63, pad_id=0) if parallel else None
    return MicroBatch(ids, attn, loss, positions, teacher, torch.tensor([0, 1]), view)


FKL = LossSpec.single("fkl")


def _grads(model, mb, rows: int, vocab: int, spec=FKL):
    from distill.train.module import student_and_teacher

    model.zero_grad(set_to_none=True)
    loss = student_and_teacher(model, None, mb, vocab).loss_sum(spec, rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("vocab", [64, 60])  # 60: cached ids past the tokenizer
def test_module_loss_and_every_parameter_gradient_match_unblocked(tiny_llama, parallel, vocab):
    mb = _micro_batch(parallel)
    loss0, g0 = _grads(tiny_llama, mb, 0, vocab)
    loss3, g3 = _grads(tiny_llama, mb, 3, vocab)
    assert mb.num_tokens > 3  # several blocks
    assert abs(loss3 - loss0) < 1e-5 * max(1.0, abs(loss0))
    assert g3.keys() == g0.keys() and "model.embed_tokens.weight" in g0  # the tied head/embedding too
    for name in g0:
        torch.testing.assert_close(g3[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


CLOSED_FORM_SPECS = [LossSpec.single("fkl"), LossSpec.single("ce"), LossSpec({"fkl": 0.6, "ce": 0.4})]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("spec", CLOSED_FORM_SPECS, ids=["fkl", "ce", "fkl+ce"])
def test_closed_form_path_gives_the_autograd_gradients(tiny_llama, parallel, spec, monkeypatch):
    """Blocks of 3 rows, each in closed form 2 rows at a time, against all rows at once through autograd;
    with cached ids past the tokenizer (vocab 60) the blocks that hold them take autograd instead."""
    from distill.train import module

    monkeypatch.setattr(module, "CACHE_ROWS", 2)
    calls = []
    real = module.loss_and_logit_grad_
    monkeypatch.setattr(module, "loss_and_logit_grad_", lambda *a: calls.append(1) or real(*a))
    mb = _micro_batch(parallel)
    for vocab in (64, 60):
        calls.clear()
        loss0, g0 = _grads(tiny_llama, mb, 0, vocab, spec)
        assert not calls  # unblocked: the plain path
        loss3, g3 = _grads(tiny_llama, mb, 3, vocab, spec)
        if vocab == 64 or spec.weights == {"ce": 1.0}:
            assert len(calls) >= mb.num_tokens // 2
        else:
            assert len(calls) < mb.num_tokens // 2
        assert abs(loss3 - loss0) < 1e-5 * max(1.0, abs(loss0))
        assert g3.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(g3[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_closed_form_under_bf16_autocast_matches_autograd_blocks():
    from distill.train.module import closed_form_rows

    spec = LossSpec({"fkl": 0.8, "ce": 0.2})
    teacher, labels = _sparse_teacher(37, width=VOCAB), torch.randint(0, VOCAB, (37,))
    h1, w1 = _leaves()
    h2, w2 = _leaves()

    def closed(logits, start, end):
        return closed_form_rows(spec, logits, labels[start:end], _take(teacher, start, end), VOCAB)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = chunked_head_loss(h1, w1, _row_grad(spec, teacher, labels), 8)
        got = chunked_head_loss(h2, w2, closed, 8)
    ref.backward()
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-2, atol=1e-4)  # both cast the gradient to bf16
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-2, atol=1e-4)
    assert float(w2.grad[VOCAB:].abs().max()) == 0.0  # the padded rows past the tokenizer


@pytest.mark.parametrize("parallel", [False, True])
def test_validation_figures_match_unblocked(tiny_llama, parallel):
    from distill.train.module import ValAccumulator, eval_micro

    mb = _micro_batch(parallel)
    summaries = []
    for rows in (0, 2):
        acc = ValAccumulator(4)
        eval_micro(tiny_llama, None, mb, LossSpec.single("fkl"), 1.0, 64, acc, rows)
        summaries.append(acc.summary())
    plain, blocked = summaries
    assert blocked["tokens"] == plain["tokens"] == mb.num_tokens
    for key in ("loss", "expected_acceptance", "top1_agreement"):
        assert blocked[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6)
    assert blocked["accept_len"] == pytest.approx(plain["accept_len"])


@pytest.mark.parametrize("parallel", [False, True])
def test_models_that_post_process_logits_take_the_full_forward(tiny_llama, parallel, monkeypatch):
    """A soft-capping config sends both drafts through `model(...).logits` (no blocks); Llama ignores the
    setting, so the loss and gradients must equal the blocked head path's."""
    from distill.train.module import student_and_teacher

    mb = _micro_batch(parallel)
    loss_blocked, g_blocked = _grads(tiny_llama, mb, 3, 64)
    monkeypatch.setattr(tiny_llama.config, "final_logit_softcapping", 30.0, raising=False)
    pr = student_and_teacher(tiny_llama, None, mb, 64)
    assert pr.hidden is None and pr.logits is not None and pr.logits.shape == (mb.num_tokens, 64)
    loss_full, g_full = _grads(tiny_llama, mb, 3, 64)
    assert abs(loss_full - loss_blocked) < 1e-5 * max(1.0, abs(loss_blocked))
    for name in g_blocked:
        torch.testing.assert_close(g_full[name], g_blocked[name], rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------------------
# Several sequences per row of the draft's input (train.pack_sequences)


def _items(seed: int = 5):
    """Four dataset rows of ragged lengths with their cached top-k rows (one per response token)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for row, (prompt, response) in enumerate([(3, 9), (2, 3), (2, 2), (3, 3)]):
        n = prompt + response
        t = _sparse_teacher(response, k=8, seed=seed + row, width=64)
        items.append(
            {
                "input_ids": torch.randint(1, 60, (n,), generator=g).tolist(),
                "loss_mask": [0] * prompt + [1] * response,
                "row": row,
                "topk": (t.ids, t.logprobs, t.rest_logmass),
            }
        )
    return items


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("rows", [0, 3])
def test_packed_micro_batch_gives_the_unpacked_loss_and_gradients(tiny_llama, parallel, rows):
    from distill.train.data import Parallel, collate_micro

    layout = Parallel(3, 63) if parallel else None
    plain, packed = (collate_micro(_items(), 0, layout, pack) for pack in (False, True))
    view = packed.parallel if parallel else packed.packed
    assert view is not None and view.input_ids.shape[0] < 4  # packed: fewer rows than sequences
    assert plain.packed is None  # unpacked: the [B, T] input as it is (a parallel draft's one row each)
    assert packed.num_tokens == plain.num_tokens
    loss0, g0 = _grads(tiny_llama, plain, rows, 64)
    loss1, g1 = _grads(tiny_llama, packed, rows, 64)
    assert abs(loss1 - loss0) < 1e-5 * max(1.0, abs(loss0))
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("parallel", [False, True])
def test_packed_validation_figures_equal_unpacked(tiny_llama, parallel):
    from distill.train.data import Parallel, collate_micro
    from distill.train.module import ValAccumulator, eval_micro

    layout = Parallel(3, 63) if parallel else None
    summaries = []
    for pack in (False, True):
        acc = ValAccumulator(4)
        eval_micro(
            tiny_llama,
            None,
            collate_micro(_items(), 0, layout, pack),
            LossSpec.single("fkl"),
            1.0,
            64,
            acc,
            2,
        )
        summaries.append(acc.summary())
    plain, packed = summaries
    for key in ("tokens", "loss", "expected_acceptance", "top1_agreement", "accept_len"):
        assert packed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
