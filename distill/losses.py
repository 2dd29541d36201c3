"""Distillation losses: pure, typed functions on the response positions of a batch.

Shapes: `N` = counted (response) positions, flattened over the batch; `V` = vocabulary; `k` = cached top-k.

Every divergence works on a pair of *aligned* log-distributions `(teacher_logp, student_logp)` of shape
[N, B] over the same B buckets:
- dense: the full vocabulary (B = V), from full teacher logits;
- sparse: the teacher's top-k tokens plus one explicit "rest" bucket (B = k + 1) holding the teacher's
  remaining mass and the student's mass outside those k tokens. Nothing is dropped: with k = V the rest
  bucket is empty on both sides and sparse equals dense exactly.

Softmaxes run in float32. The reduction is `sum over tokens / num_tokens` where `num_tokens` is passed in:
the GLOBAL count of counted tokens of the whole optimizer step (all micro-batches, all ranks), so gradient
accumulation and DDP give exactly the gradient of the mean over the step's tokens.

Conventions:
- forward KL = KL(teacher || student) (mode-covering); reverse KL = KL(student || teacher) (mode-seeking).
- JSD(beta) with the mixture M = beta * teacher + (1 - beta) * student is
  `[beta KL(T||M) + (1 - beta) KL(S||M)] / (beta (1 - beta))`. The scaling makes it continuous in beta with
  the limits beta -> 0: forward KL, beta -> 1: reverse KL, which are used at exactly 0 and 1. At beta = 0.5 it
  is symmetric (4x the plain Jensen-Shannon divergence).
- TVD = 0.5 * sum |p - q| = 1 - sum min(p, q): one minus the acceptance rate of sampled speculative decoding.
- CE = -log q(token) on the response tokens (the target's own generations).
- temperature divides both teacher and student logits before the softmax (no T^2 rescaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_NAMES = ("fkl", "rkl", "jsd", "tvd", "ce")
_EMPTY = -1e30  # log-probability of an empty bucket: exp() is exactly 0.0 in float32
_LOG_EXACT_ABOVE = math.log1p(-1e-4)  # top-k mass above 1 - 1e-4: the student's rest is computed exactly


@dataclass(frozen=True)
class SparseTeacher:
    """The teacher's top-k log-probs per counted position (the data stage's cache format).

    ids: int64 [N, k]; logprobs: float32 [N, k]; rest_logmass: float32 [N] = log(1 - sum exp(logprobs)),
    -inf when the top-k hold all the mass.
    """

    ids: Tensor
    logprobs: Tensor
    rest_logmass: Tensor


# ---------------------------------------------------------------------------------------------------------
# Selecting the counted positions


def shift_mask(loss_mask: Tensor) -> Tensor:
    """Positions whose logits predict a counted token.

    loss_mask: [B, T] (1 on response tokens). Returns bool [B, T]: True at t-1 where loss_mask[t] == 1
    (the logits at t-1 predict the token at t).
    """
    pred = torch.zeros_like(loss_mask, dtype=torch.bool)
    pred[:, :-1] = loss_mask[:, 1:].bool()
    return pred


def select_positions(logits: Tensor, loss_mask: Tensor) -> Tensor:
    """logits [B, T, V], loss_mask [B, T] -> [N, V]: the logits predicting each counted token, row-major."""
    return logits[shift_mask(loss_mask)]


def select_labels(input_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """input_ids [B, T], loss_mask [B, T] -> int64 [N]: the counted tokens, row-major (aligned with
    `select_positions`)."""
    return input_ids[loss_mask.bool()]


# ---------------------------------------------------------------------------------------------------------
# Aligned distributions


def dense_pair(
    teacher_logits: Tensor, student_logits: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """[N, V] logits each -> (teacher_logp, student_logp) float32 [N, V]."""
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return t, s


def sparse_pair(teacher: SparseTeacher, student_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Top-k teacher + full student logits [N, V] -> (teacher_logp, student_logp) float32 [N, k + 1].

    The last bucket is "everything outside the teacher's top-k". The student's rest mass is the complement
    of its top-k mass, log(1 - exp(log top mass)) in a stable form: two passes over the vocabulary (the
    logsumexp and the gather) instead of a full-size copy, which dominated the loss's cost at a 49k vocabulary.
    Where the top-k hold more than 1 - 1e-4 of the student's mass the complement would lose float32 digits,
    so those rows (and rows whose ids cover the whole vocabulary) take the exact logsumexp over the
    non-top-k logits instead.
    """
    s_all = student_logits.float()
    s_top, s_rest = student_buckets(s_all, torch.logsumexp(s_all, dim=-1), teacher.ids)
    return teacher_buckets(teacher), torch.cat([s_top, s_rest[:, None]], dim=-1)


def teacher_buckets(teacher: SparseTeacher) -> Tensor:
    """The teacher's log-probabilities in the buckets of `sparse_pair`: float32 [N, k + 1]."""
    t_rest = teacher.rest_logmass.float().clamp_min(_EMPTY)
    return torch.cat([teacher.logprobs.float(), t_rest[:, None]], dim=-1)


def student_buckets(s_all: Tensor, log_z: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """The student's log-probabilities in the buckets of `sparse_pair`: float32 logits [N, V], their
    logsumexp [N] and the teacher's top-k ids [N, k] -> (top-k log-probs [N, k], rest log-mass [N])."""
    s_top = s_all.gather(-1, ids) - log_z[:, None]  # [N, k]
    log_top = torch.logsumexp(s_top, dim=-1)  # [N], <= 0
    exact = log_top > _LOG_EXACT_ABOVE
    if ids.shape[-1] >= s_all.shape[-1]:
        exact = torch.ones_like(exact)
    # Both branches of log(1 - e^x) stay finite on the clamped input, so the unused one has no NaN gradient.
    x = log_top.clamp(max=_LOG_EXACT_ABOVE)
    s_rest = torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    if bool(exact.any()):
        rows = exact.nonzero().squeeze(-1)
        # A huge finite negative instead of -inf: an empty bucket still has probability exactly 0, but
        # logsumexp over an all-empty row keeps a finite gradient (with -inf it is NaN, and 0 * NaN = NaN).
        outside = s_all[rows].scatter(-1, ids[rows], _EMPTY)
        exact_rest = (torch.logsumexp(outside, dim=-1) - log_z[rows]).clamp_min(_EMPTY)  # "empty" when k = V
        s_rest = s_rest.index_put((rows,), exact_rest)
    return s_top, s_rest


# ---------------------------------------------------------------------------------------------------------
# Per-token divergences on aligned log-distributions [N, B] -> [N]


def kl_per_token(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """KL(p || q) per row. Buckets with p = 0 contribute 0 (also when q = 0 there)."""
    p = p_logp.exp()
    diff = torch.where(p > 0, p_logp - q_logp, torch.zeros_like(p_logp))
    return (p * diff).sum(-1)


def jsd_per_token(t_logp: Tensor, s_logp: Tensor, beta: float) -> Tensor:
    """Scaled generalized JSD (module docstring): beta 0 = forward KL, 1 = reverse KL, symmetric at 0.5."""
    if beta <= 0.0:
        return kl_per_token(t_logp, s_logp)
    if beta >= 1.0:
        return kl_per_token(s_logp, t_logp)
    m_logp = torch.logsumexp(torch.stack([t_logp + math.log(beta), s_logp + math.log(1.0 - beta)]), dim=0)
    mix = beta * kl_per_token(t_logp, m_logp) + (1.0 - beta) * kl_per_token(s_logp, m_logp)
    return mix / (beta * (1.0 - beta))


def tvd_per_token(t_logp: Tensor, s_logp: Tensor) -> Tensor:
    """Total variation 0.5 * sum |p - q| = 1 - sum min(p, q) per row."""
    return 0.5 * (t_logp.exp() - s_logp.exp()).abs().sum(-1)


def acceptance_per_token(t_logp: Tensor, s_logp: Tensor) -> Tensor:
    """sum min(p, q) per row: the probability that a token sampled from q is accepted against p.

    On a sparse pair this is an upper bound (the rest bucket merges tokens: min of sums >= sum of mins)."""
    return torch.minimum(t_logp.exp(), s_logp.exp()).sum(-1)


def ce_per_token(student_logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """-log q(label): student_logits [N, V], labels int64 [N] -> [N]."""
    return F.cross_entropy(student_logits.float() / temperature, labels, reduction="none")


# ---------------------------------------------------------------------------------------------------------
# The training loss


@dataclass(frozen=True)
class LossSpec:
    """Weights of each term (a single loss is a one-hot mix), the JSD beta and the temperature."""

    weights: dict[str, float]
    jsd_beta: float = 0.5
    temperature: float = 1.0

    @staticmethod
    def single(name: str, *, jsd_beta: float = 0.5, temperature: float = 1.0) -> LossSpec:
        return LossSpec({name: 1.0}, jsd_beta=jsd_beta, temperature=temperature)

    def needs_teacher(self) -> bool:
        return any(w for n, w in self.weights.items() if n != "ce")


def per_token_loss(
    spec: LossSpec, student_logits: Tensor, labels: Tensor, teacher: Tensor | SparseTeacher | None
) -> Tensor:
    """Weighted sum of the loss terms per counted token.

    student_logits [N, V]; labels int64 [N]; teacher: dense logits [N, V], a `SparseTeacher` of N rows
    (temperature must be 1: the cache holds T = 1 log-probs), or None when only CE is weighted. Returns [N].
    """
    total = torch.zeros(student_logits.shape[0], dtype=torch.float32, device=student_logits.device)
    pair: tuple[Tensor, Tensor] | None = None
    for name, w in spec.weights.items():
        if not w:
            continue
        if name == "ce":
            total = total + w * ce_per_token(student_logits, labels, spec.temperature)
            continue
        if pair is None:
            pair = _pair(spec, student_logits, teacher)
        t, s = pair
        if name == "fkl":
            term = kl_per_token(t, s)
        elif name == "rkl":
            term = kl_per_token(s, t)
        elif name == "jsd":
            term = jsd_per_token(t, s, spec.jsd_beta)
        elif name == "tvd":
            term = tvd_per_token(t, s)
        else:
            raise ValueError(f"unknown loss term {name!r}; one of {LOSS_NAMES}")
        total = total + w * term
    return total


def _pair(
    spec: LossSpec, student_logits: Tensor, teacher: Tensor | SparseTeacher | None
) -> tuple[Tensor, Tensor]:
    if teacher is None:
        raise ValueError("a teacher is needed for the KL/JSD/TVD terms")
    if isinstance(teacher, SparseTeacher):
        if spec.temperature != 1.0:
            raise ValueError("temperature != 1 is not defined on a top-k cache of T=1 log-probs")
        return sparse_pair(teacher, student_logits)
    return dense_pair(teacher, student_logits, spec.temperature)


def distill_loss(
    spec: LossSpec,
    student_logits: Tensor,
    labels: Tensor,
    teacher: Tensor | SparseTeacher | None,
    num_tokens: float | Tensor,
) -> Tensor:
    """Scalar: sum of `per_token_loss` divided by `num_tokens` (the global count for the optimizer step)."""
    return per_token_loss(spec, student_logits, labels, teacher).sum() / num_tokens


# ---------------------------------------------------------------------------------------------------------
# The same loss with its gradient in closed form (the train stage's fast path)

CLOSED_FORM_TERMS = frozenset({"fkl", "ce"})


def has_closed_form(spec: LossSpec, teacher: Tensor | SparseTeacher | None) -> bool:
    """True when `loss_and_logit_grad_` covers the spec: forward KL on a top-k cache, CE, or a mix of the two,
    at temperature 1."""
    names = {name for name, w in spec.weights.items() if w}
    if not names or not names <= CLOSED_FORM_TERMS or spec.temperature != 1.0:
        return False
    return "fkl" not in names or isinstance(teacher, SparseTeacher)


def loss_and_logit_grad_(
    spec: LossSpec, student_logits: Tensor, labels: Tensor, teacher: SparseTeacher | None
) -> tuple[Tensor, Tensor]:
    """`per_token_loss` [N] and its gradient with respect to the logits [N, V], without autograd.

    student_logits: float32 [N, V], OVERWRITTEN: its storage becomes the returned gradient (the memory of one
    vocabulary-sized array instead of the four that autograd's log-softmax, gather, exp and their backward keep
    or write). Only the specs of `has_closed_form`; the teacher's ids must be distinct and below V.

    With q = softmax(z), the sparse forward KL's buckets (`sparse_pair`: the teacher's top-k, probabilities p_i,
    and the rest, p_r, against the student's rest mass R = 1 - sum_top q), P = sum_top p_i + p_r (1 up to
    rounding) and the rest's normalised student probabilities e_j = q_j / R:
        d fkl / d z_j = q_j P - p_j          for j in the top-k,
                      = e_j (R P - p_r)      outside it,
    and d ce / d z_j = q_j - [j = label]. Outside the top-k e_j = exp(z_j - logsumexp over the rest) <= 1
    stays finite however small R is, where q_j / R would not.
    """
    w_fkl, w_ce = spec.weights.get("fkl", 0.0), spec.weights.get("ce", 0.0)
    z = student_logits
    log_z = torch.logsumexp(z, dim=-1)  # [N]
    loss = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)
    if w_ce:
        loss += w_ce * (log_z - z.gather(-1, labels[:, None]).squeeze(-1))
    if w_fkl:
        assert teacher is not None, "forward KL needs the cached teacher rows"
        s_top, s_rest = student_buckets(z, log_z, teacher.ids)
        t = teacher_buckets(teacher)
        loss += w_fkl * kl_per_token(t, torch.cat([s_top, s_rest[:, None]], dim=-1))
        p_top, p_rest = t[:, :-1].exp(), t[:, -1].exp()
        mass = p_top.sum(-1) + p_rest
        rest = s_rest.exp()
        # Every column first as if outside the top-k, then the top-k columns overwritten.
        outside = w_fkl * (rest * mass - p_rest) + w_ce * rest
        z.sub_((log_z + s_rest)[:, None]).exp_().mul_(outside[:, None])
        q_top = s_top.exp()
        z.scatter_(-1, teacher.ids, w_fkl * (q_top * mass[:, None] - p_top) + w_ce * q_top)
    else:
        z.sub_(log_z[:, None]).exp_().mul_(w_ce)
    if w_ce:
        z.scatter_add_(-1, labels[:, None], torch.full_like(z[:, :1], -w_ce))
    return loss, z


# ---------------------------------------------------------------------------------------------------------
# Evaluation figures


def eval_token_stats(
    student_logits: Tensor, teacher: Tensor | SparseTeacher, temperature: float
) -> tuple[Tensor, Tensor]:
    """Per counted token: (expected acceptance sum min(p, q) at `temperature`, top-1 agreement as 0/1).

    temperature 0 means greedy drafting: acceptance equals argmax agreement. Returns two float32 [N].
    """
    s_top1 = student_logits.argmax(-1)
    if isinstance(teacher, SparseTeacher):
        t_top1 = teacher.ids.gather(-1, teacher.logprobs.argmax(-1, keepdim=True)).squeeze(-1)
    else:
        t_top1 = teacher.argmax(-1)
    top1 = (s_top1 == t_top1).float()
    if temperature == 0.0:
        return top1, top1
    if isinstance(teacher, SparseTeacher):
        if temperature != 1.0:
            raise ValueError("eval temperature must be 0 or 1 with a top-k cache of T=1 log-probs")
        t, s = sparse_pair(teacher, student_logits)
    else:
        t, s = dense_pair(teacher, student_logits, temperature)
    return acceptance_per_token(t, s), top1
