"""The thin LightningModule: a trainable draft, a frozen teacher (or the top-k cache), one loss call per step.

Optimization is manual so that one DataLoader item (= one optimizer step, `grad_accum` micro-batches) is
normalised by the step's global counted-token count: the gradient is exactly that of the mean loss over every
counted token of the step, whatever the micro-batching or the number of ranks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from distill.errors import RuntimeFailure
from distill.losses import (
    LossSpec,
    SparseTeacher,
    eval_token_stats,
    has_closed_form,
    loss_and_logit_grad_,
    per_token_loss,
    select_labels,
    shift_mask,
)
from distill.train.data import MicroBatch
from distill.train.head_loss import autograd_row_grad, blocks, chunked_head_loss
from distill.train.parallel import ParallelView, accepted_lengths, run_lengths
from distill.utils.fs import atomic_write_json, read_json

EMPTY_LOGIT = -1e30  # a log-probability whose exp() is exactly 0.0 in float32 (as in `distill.losses`)


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    max_steps: int
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float


def output_head(model: Any) -> Any | None:
    """The model's output head when its logits are exactly `head(last hidden state)`, else None (no decoder /
    head accessors, or logits post-processed by soft-capping or scaling: those take the full forward)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        return None
    return model.get_output_embeddings()


def response_logits(
    model: Any, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor, vocab: int
) -> Tensor:
    """Logits [N, vocab] predicting the counted tokens (row-major), float32.

    The output head runs only on the N response positions (for a 49k vocabulary the full [B, T, V] logits
    dominate memory). Models that post-process logits (soft-capping, scaling) take the full forward instead.
    """
    hidden = response_hidden(model, input_ids, attention_mask, loss_mask)
    if hidden is None:
        pred = shift_mask(loss_mask)
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[pred][:, :vocab].float()
    return model.get_output_embeddings()(hidden)[:, :vocab].float()


def response_hidden(
    model: Any, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor
) -> Tensor | None:
    """The last hidden states [N, H] at the positions predicting the counted tokens (row-major), the output
    head's input; None when the model's logits are not `head(hidden)` (`output_head`)."""
    if output_head(model) is None:
        return None
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return hidden[shift_mask(loss_mask)]


class ValAccumulator:
    """Sums of the validation figures, overall and per position (last bucket = `P+`), and the greedy
    acceptance length of speculative rounds with k = 1..P draft tokens.

    Positions are positions in the response for an ordinary draft, draft positions (0..k-1) for a parallel one.
    """

    def __init__(self, max_positions: int, device: torch.device | str = "cpu"):
        self.p = max_positions
        # [loss_sum, count, acc_sum, top1_sum] + per bucket [acc, top1, count] * (P + 1)
        # + accepted drafts summed per k = 1..P + [rounds]
        self._base = 4 + 3 * (max_positions + 1)
        self.sums = torch.zeros(self._base + max_positions + 1, dtype=torch.float64, device=device)

    def update(
        self, loss: Tensor, acc: Tensor, top1: Tensor, positions: Tensor, runs: Tensor | None = None
    ) -> None:
        """[N] each: per-prediction loss, expected acceptance, top-1 agreement, position; runs [G]: greedy drafts
        accepted by each speculative round (uncapped; see `distill.train.parallel`)."""
        s = self.sums
        if runs is not None and runs.numel():
            ks = torch.arange(1, self.p + 1, device=s.device, dtype=torch.float64)
            capped = torch.minimum(runs.to(s.device).double()[:, None], ks[None, :])
            s[self._base : self._base + self.p] += capped.sum(0)
            s[self._base + self.p] += runs.numel()
        s[0] += loss.double().sum()
        s[1] += loss.numel()
        s[2] += acc.double().sum()
        s[3] += top1.double().sum()
        bucket = positions.clamp(max=self.p).to(s.device)
        nb = self.p + 1
        s[4 : 4 + nb].index_add_(0, bucket, acc.double().to(s.device))
        s[4 + nb : 4 + 2 * nb].index_add_(0, bucket, top1.double().to(s.device))
        s[4 + 2 * nb :].index_add_(0, bucket, torch.ones_like(acc, dtype=torch.float64).to(s.device))

    def summary(self) -> dict[str, Any]:
        s = self.sums.cpu().tolist()
        n = s[1]
        nb = self.p + 1
        acc_b, top1_b, cnt_b = s[4 : 4 + nb], s[4 + nb : 4 + 2 * nb], s[4 + 2 * nb : self._base]
        accepted, rounds = s[self._base : self._base + self.p], s[self._base + self.p]
        labels = [str(i) for i in range(self.p)] + [f"{self.p}+"]
        return {
            # vLLM's mean acceptance length (1 + accepted / drafts) of greedy rounds with k drafts, on this data.
            "accept_len": {str(k + 1): 1 + a / rounds if rounds else None for k, a in enumerate(accepted)},
            "loss": s[0] / n if n else math.nan,
            "expected_acceptance": s[2] / n if n else math.nan,
            "top1_agreement": s[3] / n if n else math.nan,
            "tokens": int(n),
            "per_position": {
                lab: {
                    "expected_acceptance": a / c if c else None,
                    "top1_agreement": t / c if c else None,
                    "tokens": int(c),
                }
                for lab, a, t, c in zip(labels, acc_b, top1_b, cnt_b, strict=False)
            },
        }


def fit_sparse_to_vocab(
    student_logits: Tensor, teacher: SparseTeacher, vocab: int
) -> tuple[Tensor, SparseTeacher]:
    """Restrict cached top-k rows to the first `vocab` token ids (the shared tokenizer's length).

    The cache holds the target's top-k over its whole, possibly padded, embedding table, while the student's
    logits [N, vocab] stop at the tokenizer. Entries at ids >= vocab are dropped and the teacher renormalised
    over the rest, as the dense path's softmax over the first `vocab` logits does. To keep k fixed, a dropped
    entry points at one extra student column of (numerically) zero probability with teacher probability zero:
    an empty bucket on both sides, which no divergence counts. Returns the (possibly widened) student logits
    and the teacher; unchanged when no id reaches `vocab`. (Padded rows outside the top-k stay in the rest
    bucket: the cache does not say how much of it they hold, a negligible share for trained models.)
    """
    outside = teacher.ids >= vocab
    if not bool(outside.any()):
        return student_logits, teacher
    lp = teacher.logprobs.float()
    dropped = torch.where(outside, lp, torch.full_like(lp, -math.inf)).logsumexp(-1)  # [N]
    keep_log = torch.log1p(-dropped.exp().clamp(max=1.0 - 1e-6))  # log of the mass left
    logprobs = torch.where(outside, torch.full_like(lp, EMPTY_LOGIT), lp - keep_log[:, None])
    rest = teacher.rest_logmass.float() - keep_log
    ids = teacher.ids.masked_fill(outside, vocab)
    extra = torch.full_like(student_logits[:, :1], EMPTY_LOGIT)
    return torch.cat([student_logits, extra], dim=-1), SparseTeacher(ids, logprobs, rest)


def micro_teacher(teacher: Any | None, mb: MicroBatch, vocab: int) -> Tensor | SparseTeacher | None:
    """The teacher distribution for the micro-batch's counted tokens: cached rows or a no-grad forward."""
    if mb.teacher is not None:
        return mb.teacher
    if teacher is None:
        return None
    with torch.no_grad():
        return response_logits(teacher, mb.input_ids, mb.attention_mask, mb.loss_mask, vocab)


@dataclass
class Predictions:
    """The draft's P predictions of a micro-batch, aligned with their teacher rows.

    hidden [P, H]: the draft's last hidden states at its predictions, the input of `head` (None when the model
    post-processes its logits: then `logits` [P, vocab] holds them); teacher: [P, vocab] logits, cached rows
    or None; labels [P]: the data's token; positions [P]: validation bucket (position in the response, or the
    draft position of a parallel draft). The vocabulary-sized logits are made block by block
    (`distill.train.head_loss`).
    """

    hidden: Tensor | None
    logits: Tensor | None
    head: Any
    vocab: int
    teacher: Tensor | SparseTeacher | None
    labels: Tensor
    positions: Tensor
    # Added to the logits before the loss (train.head_candidates' sampled candidates), None = nothing.
    logit_offset: Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    def block_logits(self, start: int, end: int) -> Tensor:
        """Float32 logits [end - start, vocab] of the predictions start..end-1."""
        if self.logits is not None:
            return self.logits[start:end]
        assert self.hidden is not None
        return self.head(self.hidden[start:end])[:, : self.vocab].float()

    def aligned(
        self, logits: Tensor, start: int, end: int
    ) -> tuple[Tensor, Tensor, Tensor | SparseTeacher | None]:
        """(student logits, labels, teacher rows) of the predictions start..end-1, the logits widened where
        cached ids reach past the vocabulary (`fit_sparse_to_vocab`)."""
        t = take_rows(self.teacher, slice(start, end))
        if isinstance(t, SparseTeacher):
            logits, t = fit_sparse_to_vocab(logits, t, self.vocab)
        return logits, self.labels[start:end], t

    def loss_sum(
        self, spec: LossSpec, block_rows: int, closed_form: bool = True, candidates: int = 0
    ) -> Tensor:
        """Summed per-token loss over all P predictions (a float32 scalar with a gradient), the head and the
        loss run `block_rows` predictions at a time (0 = all at once), each block's gradient in closed form
        where the loss has one (`closed_form`, train.loss_gradient auto) or by autograd; with `candidates` > 0
        the softmax runs over a candidate subset of the vocabulary (`restricted_to_candidates`)."""
        weight = getattr(self.head, "weight", None)
        plain_head = (
            self.hidden is not None and weight is not None and getattr(self.head, "bias", None) is None
        )
        if candidates > 0 and plain_head:
            assert weight is not None
            restricted = self.restricted_to_candidates(candidates)
            if restricted is not None:  # all rows in one block when block_rows is 0
                ids, preds = restricted
                return preds.chunked_loss_sum(spec, weight.index_select(0, ids), block_rows, closed_form)
        if not plain_head or block_rows <= 0:
            return per_token_loss(spec, *self.aligned(self.block_logits(0, self.rows), 0, self.rows)).sum()
        assert weight is not None
        return self.chunked_loss_sum(spec, weight, block_rows, closed_form)

    def chunked_loss_sum(self, spec: LossSpec, weight: Tensor, block_rows: int, closed_form: bool) -> Tensor:
        """`loss_sum` through `chunked_head_loss` with the head's weight rows `weight` [V', H]."""
        assert self.hidden is not None
        offset = self.logit_offset

        def row_loss(logits: Tensor, start: int, end: int) -> Tensor:
            z = logits[:, : self.vocab].float()
            return per_token_loss(spec, *self.aligned(z if offset is None else z + offset, start, end))

        by_autograd = autograd_row_grad(row_loss)
        if not (closed_form and has_closed_form(spec, self.teacher)):
            return chunked_head_loss(self.hidden, weight, by_autograd, block_rows)

        def row_grad(logits: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
            teacher = take_rows(self.teacher, slice(start, end)) if spec.needs_teacher() else None
            assert teacher is None or isinstance(teacher, SparseTeacher)  # `has_closed_form`
            if teacher is not None and bool((teacher.ids >= self.vocab).any()):
                return by_autograd(logits, start, end)  # ids past the tokenizer: `fit_sparse_to_vocab`
            # A constant shift of a logit leaves its gradient unchanged: the shifted float copy's is the one.
            z = logits if offset is None else logits.float() + offset
            return closed_form_rows(spec, z, self.labels[start:end], teacher, self.vocab)

        return chunked_head_loss(self.hidden, weight, row_grad, block_rows)

    def restricted_to_candidates(self, size: int) -> tuple[Tensor, Predictions] | None:
        """(candidate ids [C], these predictions over the candidates only) for train.head_candidates, or None
        when the candidates would be the whole vocabulary or a cached id lies past it (`fit_sparse_to_vocab`).

        The candidates are every token the labels and the teacher rows name (a dense teacher's top
        `CANDIDATE_TOPK` per row) and, up to `size`, a uniform sample of the others, whose logits are raised
        by log(others / sampled) (`logit_offset`) so that their exponentials estimate the whole rest of the
        vocabulary's share of the softmax's normaliser (sampled softmax): the draft's mass outside the named
        tokens is still pushed down, on a different sample at each step. Labels and sparse teacher ids become
        positions in the candidate list, a dense teacher keeps the candidates' columns.
        """
        t = self.teacher
        named = [self.labels]
        if isinstance(t, SparseTeacher):
            if bool((t.ids >= self.vocab).any()):
                return None
            named.append(t.ids.flatten())
        elif isinstance(t, Tensor):
            named.append(t.topk(min(CANDIDATE_TOPK, t.shape[-1]), dim=-1).indices.flatten())
        ids, offset = candidate_ids(torch.cat(named), size, self.vocab)
        if ids.numel() >= self.vocab:
            return None
        slot = torch.full((self.vocab,), -1, dtype=torch.long, device=ids.device)
        slot[ids] = torch.arange(ids.numel(), device=ids.device)
        teacher: Tensor | SparseTeacher | None = None
        if isinstance(t, SparseTeacher):
            teacher = SparseTeacher(slot[t.ids], t.logprobs, t.rest_logmass)
        elif isinstance(t, Tensor):
            teacher = t[:, ids]
        restricted = replace(
            self,
            head=None,
            vocab=int(ids.numel()),
            teacher=teacher,
            labels=slot[self.labels],
            logit_offset=offset,
        )
        return ids, restricted


# A dense (online) teacher's tokens named as candidates per prediction: as many as the data stage caches by
# default, the tokens that hold nearly all of the teacher's probability.
CANDIDATE_TOPK = 32


def candidate_ids(named: Tensor, size: int, vocab: int) -> tuple[Tensor, Tensor | None]:
    """(sorted distinct token ids, float32 logit offsets for them or None): the ids in `named` (all below
    `vocab`, offset 0) and a uniform sample of the others making `size` in all (every id when `size` >= `vocab`),
    each sampled id offset by log(others / sampled). More than `size` when `named` holds more distinct ids;
    None when nothing is sampled. The sample is drawn from a generator seeded by the named ids, so a resumed
    run draws what the first attempt drew."""
    ids = torch.unique(named)
    missing = min(size, vocab) - ids.numel()
    if missing <= 0:
        return ids, None
    free = torch.ones(vocab, dtype=torch.bool)
    free[ids.cpu()] = False
    others = free.nonzero().squeeze(1)
    seed = int(ids.sum()) * 1_000_003 + ids.numel()
    pick = others[torch.randperm(others.numel(), generator=torch.Generator().manual_seed(seed))[:missing]]
    all_ids, order = torch.cat([ids.cpu(), pick]).sort()
    offset = torch.cat([torch.zeros(ids.numel()), torch.full((missing,), math.log(others.numel() / missing))])
    return all_ids.to(ids.device), offset[order].to(ids.device)


# Rows of float32 logits the closed-form loss works on at once: 64 x 49,152 x 4 bytes = 12.6 MB stays in the
# processor's cache through its passes (exp, scale, scatter). Timed alone on 3000 rows of the shipped head:
# 2.05 s with 64 rows at a time, 2.33 s with 1024 (AMD EPYC, 2 cores).
CACHE_ROWS = 64


def closed_form_rows(
    spec: LossSpec, logits: Tensor, labels: Tensor, teacher: SparseTeacher | None, vocab: int
) -> tuple[Tensor, Tensor]:
    """(per-row loss [m], gradient [m, V'] in the logits' dtype) of logits [m, V'] cut to `vocab` columns, by
    `distill.losses.loss_and_logit_grad_`, CACHE_ROWS rows at a time; columns past `vocab` get no gradient."""
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits)
    grad[:, vocab:] = 0
    for start, end in blocks(logits.shape[0], CACHE_ROWS):
        rows = slice(start, end)
        loss[rows], grad[rows, :vocab] = loss_and_logit_grad_(
            spec, logits[rows, :vocab].float(), labels[rows], sparse_rows(teacher, rows)
        )
    return loss, grad


def parallel_outputs(model: Any, view: ParallelView, vocab: int) -> tuple[Tensor | None, Tensor | None]:
    """(hidden [P, H], None) at a parallel draft's proposals, one forward over the packed micro-batch; or
    (None, float32 logits [P, vocab]) from the full forward when the model's logits are not `head(hidden)`."""
    inputs = {
        "input_ids": view.input_ids,
        "attention_mask": view.attention,
        "position_ids": view.position_ids,
    }
    if output_head(model) is None:
        logits = model(**inputs).logits
        return None, logits.reshape(-1, logits.shape[-1])[view.predict_at][:, :vocab].float()
    hidden = model.get_decoder()(**inputs).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[view.predict_at], None


def take_rows(t: Tensor | SparseTeacher | None, index: Tensor | slice) -> Tensor | SparseTeacher | None:
    if t is None or isinstance(t, Tensor):
        return None if t is None else t[index]
    return sparse_rows(t, index)


def sparse_rows(t: SparseTeacher | None, index: Tensor | slice) -> SparseTeacher | None:
    return None if t is None else SparseTeacher(t.ids[index], t.logprobs[index], t.rest_logmass[index])


def student_and_teacher(draft: Any, teacher: Any | None, mb: MicroBatch, vocab: int) -> Predictions:
    """The draft's predictions for the micro-batch and the aligned teacher rows."""
    labels = select_labels(mb.input_ids, mb.loss_mask)
    t = micro_teacher(teacher, mb, vocab)
    head = output_head(draft)
    logits = None
    if mb.parallel is None:
        if mb.packed is not None:
            hidden, logits = parallel_outputs(draft, mb.packed, vocab)
        else:
            hidden = response_hidden(draft, mb.input_ids, mb.attention_mask, mb.loss_mask)
            if hidden is None:
                logits = response_logits(draft, mb.input_ids, mb.attention_mask, mb.loss_mask, vocab)
        positions = mb.positions
    else:
        # Each proposal's teacher is the target's row for the token it predicts (module docstring of parallel).
        hidden, logits = parallel_outputs(draft, mb.parallel, vocab)
        index = mb.parallel.target_index
        t, labels, positions = take_rows(t, index), labels[index], mb.parallel.draft_position
    return Predictions(hidden, logits, head, vocab, t, labels, positions)


def greedy_runs(mb: MicroBatch, top1: Tensor) -> Tensor:
    """Drafts a greedy speculative round starting at each anchor accepts (uncapped), from top-1 matches."""
    match = top1.bool()
    if mb.parallel is not None:
        k = int(mb.parallel.draft_position.max()) + 1 if match.numel() else 1
        return accepted_lengths(match.cpu(), mb.parallel.anchor.cpu(), mb.parallel.draft_position.cpu(), k)
    b, t = mb.loss_mask.shape
    rows = torch.arange(b, device=mb.loss_mask.device)[:, None].expand(b, t)[mb.loss_mask.bool()]
    return run_lengths(match.cpu(), rows.cpu())


def eval_micro(
    draft: Any,
    teacher: Any | None,
    mb: MicroBatch,
    spec: LossSpec,
    eval_temperature: float,
    vocab: int,
    acc: ValAccumulator,
    block_rows: int = 0,
) -> None:
    """Add one micro-batch's validation figures to `acc` (no grad); the head runs `block_rows` predictions at a
    time (0 = all at once)."""
    with torch.no_grad():
        pr = student_and_teacher(draft, teacher, mb, vocab)
        if pr.teacher is None:
            raise ValueError("validation needs a teacher (online model or top-k cache)")
        losses, accs, top1s = [], [], []
        for start, end in blocks(pr.rows, block_rows):
            logits, labels, t = pr.aligned(pr.block_logits(start, end), start, end)
            assert t is not None
            losses.append(per_token_loss(spec, logits, labels, t))
            a, top1 = eval_token_stats(logits, t, eval_temperature)
            accs.append(a)
            top1s.append(top1)
        top1 = torch.cat(top1s)
        acc.update(torch.cat(losses), torch.cat(accs), top1, pr.positions, greedy_runs(mb, top1))


def evaluate_draft(
    draft: Any,
    teacher: Any | None,
    loader: Any,
    spec: LossSpec,
    *,
    eval_temperature: float,
    vocab: int,
    max_positions: int,
    block_rows: int = 0,
) -> dict[str, Any]:
    """Validation figures of `draft` over `loader` (a plain loop: used for the undistilled baseline)."""
    acc = ValAccumulator(max_positions)
    was_training = draft.training
    draft.eval()
    for step in loader:
        for mb in step:
            eval_micro(draft, teacher, mb, spec, eval_temperature, vocab, acc, block_rows)
    draft.train(was_training)
    return acc.summary()


def with_logged_step(metrics: dict[str, float], optimizer_steps: int) -> dict[str, float]:
    """The metrics plus a `step` entry, which Lightning's logger connector takes as the x-axis of the row.
    Without it, a manually optimised module's rows land at the 0-based batch index: the validation after step
    100 would be plotted at 99, one step before the checkpoint and `val_history.json` that name it 100."""
    return {**metrics, "step": float(optimizer_steps)}


def val_log_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The logged validation figures (`val/...` overall, `val_pos/..._<position>` per position) of a summary."""
    metrics = {
        "val/loss": summary["loss"],
        "val/expected_acceptance": summary["expected_acceptance"],
        "val/top1_agreement": summary["top1_agreement"],
    }
    for lab, pos in summary["per_position"].items():
        if pos["tokens"]:
            metrics[f"val_pos/expected_acceptance_{lab}"] = pos["expected_acceptance"]
            metrics[f"val_pos/top1_agreement_{lab}"] = pos["top1_agreement"]
    for k, length in summary.get("accept_len", {}).items():
        if length is not None:
            metrics[f"val/accept_len_k{k}"] = length
    return metrics


def read_history(path: Path) -> list[dict[str, Any]]:
    """Validation summaries written so far (one per validation, by step)."""
    if not Path(path).is_file():
        return []
    data = read_json(path)
    return data if isinstance(data, list) else []


def append_history(path: Path, summary: dict[str, Any]) -> None:
    """Add a validation summary; entries at or after its step (from before a resume) are replaced.

    Written from the training process itself so that every strategy (also spawned ranks) leaves the record."""
    history = [h for h in read_history(path) if h.get("step", -1) < summary["step"]]
    atomic_write_json(path, [*history, summary])


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: norms and biases (1-d) keep their scale."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int, oc: OptimConfig) -> float:
    """LR multiplier: linear warm-up to 1, then cosine down to `min_lr_ratio` at `max_steps`."""
    if oc.warmup_steps and step < oc.warmup_steps:
        return (step + 1) / oc.warmup_steps
    span = max(1, oc.max_steps - oc.warmup_steps)
    progress = min(1.0, (step - oc.warmup_steps) / span)
    return oc.min_lr_ratio + (1 - oc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class DistillModule(L.LightningModule):
    """Draft (trained) + frozen teacher (held outside the module tree: no checkpoint, DDP or optimizer
    involvement, never switched to train mode) or none when the batches carry cached top-k rows."""

    def __init__(
        self,
        draft: torch.nn.Module,
        teacher: torch.nn.Module | None,
        spec: LossSpec,
        optim: OptimConfig,
        *,
        vocab: int,
        eval_temperature: float,
        max_positions: int,
        hparams: dict[str, Any],
        history_path: Path | None = None,
        block_rows: int = 0,
        closed_form: bool = True,
        head_candidates: int = 0,
    ):
        super().__init__()
        self.draft = draft
        self.draft.train()  # from_pretrained returns eval mode and Lightning does not switch it back
        if teacher is not None:
            teacher.eval()
            teacher.requires_grad_(False)
        object.__setattr__(self, "_teacher", teacher)  # not a registered submodule (see class docstring)
        self.spec = spec
        self.optim = optim
        self.vocab = vocab
        self.eval_temperature = eval_temperature
        self.max_positions = max_positions
        self.block_rows = block_rows  # train.logits_block_rows
        self.closed_form = closed_form  # train.loss_gradient auto
        self.head_candidates = head_candidates  # train.head_candidates (training steps only)
        self.automatic_optimization = False
        self.save_hyperparameters(hparams)  # plain containers only: safe `weights_only` loading
        self.history_path = history_path
        self.eval_step: int | None = None
        # The undistilled draft's validation summary (rank 0), logged at step 0 of a fresh start.
        self.baseline: dict[str, Any] | None = None
        self._val_acc: ValAccumulator | None = None
        self._t_last: float | None = None

    @property
    def teacher(self) -> torch.nn.Module | None:
        teacher: torch.nn.Module | None = self.__dict__["_teacher"]
        return teacher

    # -- setup -------------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        if self.teacher is not None:
            self.teacher.to(self.device)

    def on_fit_start(self) -> None:
        if self.teacher is not None:
            self.teacher.to(self.device).eval()

    def on_train_start(self) -> None:
        # A resumed run (global_step > 0) already logged it in its first attempt's files.
        if self.baseline is None or self.global_step != 0:
            return
        for logger in self.loggers:
            logger.log_metrics(val_log_metrics(self.baseline), step=0)
            logger.save()  # to disk now: an attempt killed before its first flush would lose the row

    def configure_optimizers(self) -> Any:
        oc = self.optim
        opt = torch.optim.AdamW(param_groups(self.draft, oc.weight_decay), lr=oc.lr, betas=oc.betas)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, oc))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- training ----------------------------------------------------------------------------------------

    def _global_sums(self, *values: float) -> list[float]:
        """Sum each value over all ranks (one collective)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            t = self.trainer.strategy.reduce(t, reduce_op="sum")
        return [float(x) for x in t.tolist()]

    def training_step(self, batch: list[MicroBatch], batch_idx: int) -> Tensor:
        opt: Any = self.optimizers()
        sched: Any = self.lr_schedulers()
        n_global, tokens_global = self._global_sums(
            sum(mb.num_tokens for mb in batch), sum(int(mb.attention_mask.sum()) for mb in batch)
        )
        # DDP averages gradients over ranks; multiplying by world size turns that into the global sum.
        scale = self.trainer.world_size / max(n_global, 1.0)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        bad_rows: list[int] = []
        for mb in batch:
            pr = student_and_teacher(self.draft, self.teacher, mb, self.vocab)
            loss_sum = pr.loss_sum(self.spec, self.block_rows, self.closed_form, self.head_candidates)
            if not torch.isfinite(loss_sum):
                bad_rows.extend(mb.rows.tolist())
            self.manual_backward(loss_sum * scale)
            total += loss_sum.detach().double()
        # The reduced loss is the same on every rank, so all ranks stop together (no DDP hang), and the bad
        # step is never applied to the weights.
        loss = self._global_sums(float(total))[0] / max(n_global, 1.0)
        if not math.isfinite(loss):
            self._non_finite(loss, batch_idx, bad_rows)
        if self.optim.grad_clip > 0:
            self.clip_gradients(opt, gradient_clip_val=self.optim.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        self._log_train(loss, tokens_global, n_global, sched.get_last_lr()[0])
        return torch.tensor(loss)

    def _log_train(self, loss: float, tokens: float, counted: float, lr: float) -> None:
        now = time.perf_counter()
        metrics = {"train/loss": loss, "train/lr": lr, "train/counted_tokens": counted}
        if self._t_last is not None:
            metrics["train/tokens_per_s"] = tokens / max(now - self._t_last, 1e-9)
        self._t_last = now
        self.log_dict(
            with_logged_step(metrics, self.global_step),
            prog_bar=False,
            on_step=True,
            on_epoch=False,
            rank_zero_only=True,
        )
        self.log("loss", loss, prog_bar=True, on_step=True, on_epoch=False, logger=False, rank_zero_only=True)
        if "train/tokens_per_s" in metrics:
            self.log(
                "tok/s",
                metrics["train/tokens_per_s"],
                prog_bar=True,
                on_step=True,
                on_epoch=False,
                logger=False,
                rank_zero_only=True,
            )

    def _non_finite(self, loss: float, batch_idx: int, rows: list[int]) -> None:
        where = f"dataset rows {rows[:16]} on rank {self.global_rank}" if rows else "on another rank"
        raise RuntimeFailure(
            f"training loss is {loss} at step {self.global_step} (batch {batch_idx}, {where}). Try a lower "
            "train.lr, train.grad_clip=1.0, train.precision=32 or train.teacher_dtype=float32; the last checkpoint "
            "is kept and resuming starts from it."
        )

    # -- validation --------------------------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self._val_acc = ValAccumulator(self.max_positions, device=self.device)
        if self.teacher is not None:
            self.teacher.eval()

    def validation_step(self, batch: list[MicroBatch], batch_idx: int) -> None:
        assert self._val_acc is not None
        for mb in batch:
            eval_micro(
                self.draft,
                self.teacher,
                mb,
                self.spec,
                self.eval_temperature,
                self.vocab,
                self._val_acc,
                self.block_rows,
            )

    def on_validation_epoch_end(self) -> None:
        assert self._val_acc is not None
        if self.trainer.world_size > 1:
            self._val_acc.sums = self.trainer.strategy.reduce(self._val_acc.sums, reduce_op="sum")
        summary = self._val_acc.summary()
        # A stand-alone `trainer.validate` (spawned ranks start with a fresh loop state) reports `eval_step`.
        fitting = self.trainer.state.fn == "fit"
        summary["step"] = int(self.global_step) if fitting or self.eval_step is None else self.eval_step
        if self.trainer.is_global_zero and self.history_path is not None:
            append_history(self.history_path, summary)
        metrics = with_logged_step(val_log_metrics(summary), summary["step"])
        self.log_dict(metrics, prog_bar=False, sync_dist=False, rank_zero_only=True)
        self.log("val_acc", summary["expected_acceptance"], prog_bar=True, logger=False, rank_zero_only=True)
