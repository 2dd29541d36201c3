"""Analytic estimates beside the measurements: what acceptance and speedup *should* be.

With an acceptance rate α per drafted token (treated as independent across positions), k drafted tokens and a
draft step costing c target steps (Leviathan et al. 2023):
- expected tokens per round (mean acceptance length) = (1 − α^(k+1)) / (1 − α);
- expected speedup = (1 − α^(k+1)) / ((1 − α)(1 + k·c));
- expected acceptance at draft position i (0-based) = α^(i+1).
α itself is estimated from the two models' distributions: α = E[Σ_x min(p(x), q(x))] = 1 − TVD(p, q).

A parallel (PARD) draft proposes all k tokens in ONE forward pass, so a round costs 1 + c target steps, not
1 + k·c, and its positions differ a lot (mask j predicts j tokens further ahead without seeing them):
- expected tokens per round E = 1 + Σ_{i=1..k} Π_{j<i} α_j, α_j = acceptance at draft position j given that
  positions 0..j-1 were accepted (`parallel_tokens_per_round`);
- expected speedup = E / (1 + c).
The α_j are estimated with one packed draft forward per prompt (`estimate_parallel_acceptance`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from distill.evaluate.reference import Sampling, crop_cache, forward_new, new_cache, target_generate, warp

# Below this distance from 1, α is treated as 1 and the closed-form limits are used (avoids 0/0).
_ALPHA_ONE_TOL = 1e-9


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over positions of Σ_x min(p(x), q(x)): p, q [N, V] probabilities -> α in [0, 1]."""
    if p.shape != q.shape or p.dim() != 2:
        raise ValueError(f"p and q must both be [N, V]; got {tuple(p.shape)} and {tuple(q.shape)}")
    return float(torch.minimum(p.double(), q.double()).sum(dim=-1).mean())


def top1_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    """Share of positions where the argmaxes agree: p, q [N, V] (probabilities or logits) -> [0, 1]."""
    if p.shape != q.shape or p.dim() != 2:
        raise ValueError(f"p and q must both be [N, V]; got {tuple(p.shape)} and {tuple(q.shape)}")
    return float((p.argmax(dim=-1) == q.argmax(dim=-1)).double().mean())


def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def expected_acceptance_length(alpha: float, k: int) -> float:
    """Expected tokens emitted per target pass: (1 − α^(k+1)) / (1 − α), k + 1 at α = 1."""
    _check_alpha_k(alpha, k)
    if 1.0 - alpha < _ALPHA_ONE_TOL:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, *, parallel: bool = False) -> float:
    """Expected walltime speedup over plain decoding: (1 − α^(k+1)) / ((1 − α)(1 + k·c)); a parallel draft
    drafts all k in one forward, so (1 + c) replaces (1 + k·c)."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_acceptance_length(alpha, k) / (1.0 + draft_cost(k, c, parallel=parallel))


def draft_cost(k: int, c: float, *, parallel: bool = False) -> float:
    """Draft cost of one round in target steps: k·c, or c for a parallel draft (one forward); 0 at k = 0."""
    if k <= 0:
        return 0.0
    return c if parallel else k * c


def parallel_tokens_per_round(alphas: Sequence[float], k: int) -> float:
    """E[tokens per round] of a parallel draft: 1 + Σ_{i=1..k} Π_{j<i} α_j.

    alphas[j] is the acceptance at draft position j given that positions 0..j-1 were accepted, so the product
    is the chance that at least i proposals are accepted; the 1 is the target's own token.
    """
    if k < 0 or k > len(alphas):
        raise ValueError(f"k must be in [0, {len(alphas)}] (one alpha per draft position), got {k}")
    if any(not 0.0 <= a <= 1.0 for a in alphas[:k]):
        raise ValueError(f"alphas must be in [0, 1], got {list(alphas[:k])}")
    total, reach = 1.0, 1.0
    for a in alphas[:k]:
        reach *= a
        total += reach
    return total


def expected_parallel_speedup(alphas: Sequence[float], k: int, c: float) -> float:
    """Expected speedup of a parallel draft at k: parallel_tokens_per_round / (1 + c)."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return parallel_tokens_per_round(alphas, k) / (1.0 + draft_cost(k, c, parallel=True))


def expected_per_position_acceptance(alpha: float, k: int) -> list[float]:
    """Expected share of drafts whose position i (0-based) is accepted: α^(i+1), i < k."""
    _check_alpha_k(alpha, k)
    return [alpha ** (i + 1) for i in range(k)]


def best_k(alpha: float, c: float, ks: Sequence[int]) -> tuple[int, float]:
    """The k in `ks` with the highest expected speedup, and that speedup (ties go to the smaller k)."""
    if not ks:
        raise ValueError("ks is empty")
    scored = [(expected_speedup(alpha, k, c), -k) for k in ks]
    speedup, neg_k = max(scored)
    return -neg_k, speedup


# ---------------------------------------------------------------------------------------------------------
# Measurements on real models
# ---------------------------------------------------------------------------------------------------------


def _as_model(model_or_path: Any, dtype: str) -> Any:
    if isinstance(model_or_path, (str, Path)):
        from distill.models.draft import load_causal_lm

        return load_causal_lm(model_or_path, dtype=dtype).eval()
    return model_or_path


@torch.inference_mode()
def measure_decode_step_s(
    model: Any, *, context_len: int = 64, steps: int = 16, repeats: int = 5, seed: int = 0
) -> float:
    """Median seconds of one KV-cached decode step at batch 1, after `context_len` tokens of context."""
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (1, context_len), generator=g).to(device)
    step_ids = torch.randint(0, vocab, (steps + 1,), generator=g).to(device)
    cache = new_cache(model)
    forward_new(model, cache, context, 1)
    times = []
    for r in range(repeats + 1):
        crop_cache(cache, context_len)
        t0 = time.perf_counter()
        for i in range(steps):
            forward_new(model, cache, step_ids[i : i + 1].unsqueeze(0), 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if r > 0:  # the first pass is a warm-up
            times.append((time.perf_counter() - t0) / steps)
    return float(statistics.median(times))


def measure_cost_ratio(
    target: Any,
    draft: Any,
    *,
    dtype: str = "float32",
    context_len: int = 64,
    steps: int = 16,
    repeats: int = 5,
) -> float:
    """c = draft decode step time / target decode step time (KV-cached, batch 1, medians of repeats).

    `target` and `draft` are loaded models or HF folders.
    """
    t = measure_decode_step_s(_as_model(target, dtype), context_len=context_len, steps=steps, repeats=repeats)
    d = measure_decode_step_s(_as_model(draft, dtype), context_len=context_len, steps=steps, repeats=repeats)
    return d / t


@torch.inference_mode()
def continuation_distributions(
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int],
    continuation: Sequence[int],
    sampling: Sampling,
    draft_sample_method: str = "probabilistic",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's p and the draft's proposal q at each continuation position: two [n, V] tensors.

    Greedy drafting proposes deterministically, so its q is the one-hot of the draft argmax (matching the
    reference engine); p and q are warped with the same temperature / top-p.
    """
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(continuation)], device=device)
    n = len(continuation)
    p = warp(target(input_ids=ids).logits[0, -n - 1 : -1], sampling)
    draft_logits = draft(input_ids=ids).logits[0, -n - 1 : -1]
    q_sampling = Sampling(0.0) if draft_sample_method == "greedy" else sampling
    return p, warp(draft_logits, q_sampling)


def estimate_acceptance(
    target: Any,
    draft: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 32,
    eos_token_id: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    draft_sample_method: str = "probabilistic",
    dtype: str = "float32",
) -> dict[str, Any]:
    """α estimated on the target's greedy continuations of `prompts`: Σ min(p, q) per position.

    Returns {"alpha", "top1_agreement", "num_positions", "alpha_per_position": mean α at continuation
    position j over the prompts that reach it}. `target` / `draft` are loaded models or HF folders.
    """
    target, draft = _as_model(target, dtype), _as_model(draft, dtype)
    sampling = Sampling(temperature, top_p)
    ps, qs, per_pos = [], [], []
    for prompt in prompts:
        cont = target_generate(
            target, prompt, max_tokens=max_tokens, eos_token_id=eos_token_id, sampling=Sampling(0.0)
        )
        p, q = continuation_distributions(target, draft, prompt, cont, sampling, draft_sample_method)
        ps.append(p)
        qs.append(q)
        per_pos.append(torch.minimum(p.double(), q.double()).sum(dim=-1))
    p_all, q_all = torch.cat(ps), torch.cat(qs)
    return {
        "alpha": expected_acceptance(p_all, q_all),
        "top1_agreement": top1_agreement(p_all, q_all),
        "num_positions": int(p_all.shape[0]),
        "alpha_per_position": _ragged_mean(per_pos),
        "temperature": temperature,
        "draft_sample_method": draft_sample_method,
    }


def _ragged_mean(rows: list[torch.Tensor]) -> list[float]:
    """Mean at each index over the 1-d tensors long enough to have it."""
    longest = max((len(r) for r in rows), default=0)
    out = []
    for j in range(longest):
        vals = [float(r[j]) for r in rows if len(r) > j]
        out.append(sum(vals) / len(vals))
    return out


# ---------------------------------------------------------------------------------------------------------
# Parallel (PARD) drafts
# ---------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def parallel_proposal_acceptance(
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int],
    continuation: Sequence[int],
    *,
    k: int,
    mask_id: int,
    sampling: Sampling,
    draft_sample_method: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance probability Σ min(p, q) of every proposal a k-token parallel draft makes along the target's
    continuation, from ONE packed draft forward (`distill.train.parallel.build_parallel_view`), and whether
    the draft's argmax is the target's: two [R, k] tensors (float64, bool), a row per round (anchored at each
    continuation token but the last k), column j = draft position j.

    A round anchored at continuation token a (vLLM's "next token") proposes a+1..a+k: position 0 from the
    logits at a, position j from mask j. p is the target's warped distribution at the proposed token on the
    continuation; q the draft's (the one-hot of its argmax for greedy drafting), as in the reference engine.
    Rounds whose k proposals would run past the continuation are left out.
    """
    from distill.train.parallel import build_parallel_view

    device = next(target.parameters()).device
    n_prompt, ids = len(prompt_ids), [*prompt_ids, *continuation]
    if len(continuation) < k + 1:
        return torch.zeros(0, k, dtype=torch.float64), torch.zeros(0, k, dtype=torch.bool)
    # Counted tokens start after the first continuation token: every anchor is a generated token, as in vLLM.
    loss_mask = torch.tensor([[0] * (n_prompt + 1) + [1] * (len(continuation) - 1)])
    input_ids = torch.tensor([ids])
    view = build_parallel_view(
        input_ids, torch.ones_like(input_ids), loss_mask, k=k, mask_token_id=mask_id, pad_id=0
    ).to(device)
    hidden = draft.get_decoder()(
        input_ids=view.input_ids, attention_mask=view.attention, position_ids=view.position_ids
    ).last_hidden_state
    draft_logits = draft.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])[view.predict_at])
    # Counted token i sits at n_prompt + 1 + i; the target predicts it from the position before.
    target_logits = target(input_ids=input_ids.to(device)).logits[0]
    vocab = min(target_logits.shape[-1], draft_logits.shape[-1])  # embedding tables may be padded
    t_logits, d_logits = target_logits[n_prompt + view.target_index, :vocab], draft_logits[:, :vocab]
    p = warp(t_logits, sampling)
    q = warp(d_logits, Sampling(0.0) if draft_sample_method == "greedy" else sampling)
    accept = torch.minimum(p.double(), q.double()).sum(dim=-1)
    match = (t_logits.argmax(dim=-1) == d_logits.argmax(dim=-1)).double()
    table = torch.full((len(continuation), k, 2), float("nan"), dtype=torch.float64, device=accept.device)
    table[view.anchor, view.draft_position] = torch.stack([accept, match], dim=-1)
    table = table[~table.isnan().any(dim=2).any(dim=1)].cpu()
    return table[..., 0], table[..., 1].bool()


def estimate_parallel_acceptance(
    target: Any,
    draft: Any,
    prompts: Sequence[Sequence[int]],
    *,
    k: int | None = None,
    max_tokens: int = 32,
    eos_token_id: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    draft_sample_method: str = "greedy",
    dtype: str = "float32",
) -> dict[str, Any]:
    """Per-draft-position acceptance of a parallel draft on the target's greedy continuations of `prompts`.

    Returns {"alpha_per_draft_position": α_j given positions < j accepted, "accept_at_least": P(at least i
    accepted), i = 1..k, "tokens_per_round": E at each k' = 1..k (`parallel_tokens_per_round`),
    "top1_agreement_per_draft_position", "num_rounds", "num_positions", "parallel": True}. At temperature 0
    with greedy drafting the per-round products are 0/1 and E is exact on these continuations; otherwise each
    round's positions are taken as independent given the continuation. `k` defaults to the K in the draft's
    config; the mask id is its `pard_token`.
    """
    from distill.models.draft import parallel_tokens_of

    target, draft = _as_model(target, dtype), _as_model(draft, dtype)
    k = k or parallel_tokens_of(draft.config)
    if not k or getattr(draft.config, "pard_token", None) is None:
        raise ValueError("estimate_parallel_acceptance needs a parallel draft (pard_token in its config)")
    sampling = Sampling(temperature, top_p)
    mask_id = int(draft.config.pard_token)
    accepts, matches = [], []
    for prompt in prompts:
        cont = target_generate(
            target, prompt, max_tokens=max_tokens, eos_token_id=eos_token_id, sampling=Sampling(0.0)
        )
        accept, match = parallel_proposal_acceptance(
            target,
            draft,
            prompt,
            cont,
            k=k,
            mask_id=mask_id,
            sampling=sampling,
            draft_sample_method=draft_sample_method,
        )
        accepts.append(accept)
        matches.append(match)
    table = torch.cat(accepts)
    if table.shape[0] == 0:
        raise ValueError(f"no continuation is longer than k + 1 = {k + 1} tokens: raise max_tokens")
    at_least = table.cumprod(dim=1).mean(dim=0).tolist()  # P(positions 0..i-1 all accepted)
    before = [1.0, *at_least[:-1]]
    alphas = [a / b if b > 0 else 0.0 for a, b in zip(at_least, before, strict=True)]
    return {
        "parallel": True,
        "k": k,
        "alpha_per_draft_position": alphas,
        "accept_at_least": at_least,
        "tokens_per_round": [1.0 + sum(at_least[:i]) for i in range(1, k + 1)],
        "top1_agreement_per_draft_position": torch.cat(matches).double().mean(dim=0).tolist(),
        "num_rounds": int(table.shape[0]),
        "num_positions": int(table.numel()),
        "temperature": temperature,
        "draft_sample_method": draft_sample_method,
    }
