"""The draft's output head and the loss over its predictions, in fixed-size blocks of rows.

A micro-batch's P predictions (its response positions, or a parallel draft's proposals: P is 2-4 thousand for
the shipped config) each own a vocabulary-sized row of logits. Computed at once, the logits, their float copy,
the log-softmax and the gradient each take P x 49,152 x 4 bytes (0.7 GB at P = 3,500), and P changes from step
to step: with freed memory kept in the process (`distill.utils.malloc`) the next step's slightly larger blocks
rarely fit the freed ones, and the retained heap grew by about 1 GB a step until it was handed back
(BENCHMARKS.md, section 7). In blocks of a fixed number of rows, each block's logits live only while its loss
and gradient are computed, every block but the last has the same size, and a step's vocabulary-sized memory is
that of one block whatever P is.

`chunked_head_loss` computes the gradients with respect to the hidden states and the head's weight block by
block in its forward pass (the matmuls of the unblocked forward and backward, no more) and keeps only those two,
[P, hidden] and [vocab, hidden]: the micro-batch still has one backward call, as DDP expects. The gradient
with respect to a block's logits comes from autograd through the loss (`autograd_row_grad`) or, for the
forward KL and CE of `distill.losses.has_closed_form`, from its closed form, written over the logits' own
float copy a few dozen rows at a time while they are in the processor's cache: one vocabulary-sized array per
block instead of autograd's several (2.3 GB less at the peak for the shipped config) and fewer passes over it
(BENCHMARKS.md, section 7).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# logits of the rows [start, end) -> their per-row loss [end - start]
RowLoss = Callable[[Tensor, int, int], Tensor]
# logits of the rows [start, end) -> (their per-row loss [end - start], its gradient w.r.t. the logits)
RowGrad = Callable[[Tensor, int, int], tuple[Tensor, Tensor]]


def blocks(n: int, rows: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering 0..n in blocks of `rows` (one block when rows <= 0)."""
    if rows <= 0 or n <= rows:
        return [(0, n)]
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def autograd_row_grad(row_loss: RowLoss) -> RowGrad:
    """A `RowGrad` from any per-row loss, its gradient by autograd."""

    def row_grad(logits: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            loss = row_loss(x, start, end)
            (grad,) = torch.autograd.grad(loss.sum(), x)
        return loss.detach(), grad

    return row_grad


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The head matmul's dtype: autocast's when it is on (as `head(hidden)` would run), else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, row_grad: RowGrad, rows: int
    ) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = compute_dtype(hidden, weight)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        w = weight.detach().to(dtype)  # cast once for all blocks and both products
        with torch.autocast(hidden.device.type, enabled=False):
            for start, end in blocks(hidden.shape[0], rows):
                h = hidden[start:end].detach().to(dtype)
                loss, grad = row_grad(h @ w.T, start, end)
                grad = grad.to(dtype)
                if grad_h is not None:
                    grad_h[start:end] = grad @ w
                if grad_w is not None:
                    grad_w += grad.T @ h
                total += loss.sum().float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * grad_total.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * grad_total).to(ctx.weight_dtype)
        return gh, gw, None, None


def chunked_head_loss(hidden: Tensor, weight: Tensor, row_grad: RowGrad, rows: int) -> Tensor:
    """Sum over the P rows of a loss of `hidden @ weight.T`, computed `rows` rows at a time (module docstring).

    hidden [P, H]: the draft's last hidden states at its predictions; weight [V', H]: the output head's (a
    bias-free linear head: logits = hidden @ weight.T, V' may exceed the tokenizer, `row_grad` cuts it);
    row_grad(logits [m, V'], start, end) -> (per-row loss [m], its gradient with respect to the logits
    [m, V']) for rows [start, end): `autograd_row_grad(row_loss)` for any loss, or a closed form. Returns a
    float32 scalar whose backward gives the exact gradient of the summed loss with respect to hidden and
    weight (float rounding aside: blocks sum the weight gradient in another order). Under autocast the head's
    matmuls run in the autocast dtype, as `head(hidden)` and its backward would.
    """
    out: Tensor = _ChunkedHeadLoss.apply(hidden, weight, row_grad, rows)
    return out
