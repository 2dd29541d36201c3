"""Analytic estimates beside the measurements: what acceptance and speedup *should* be.

With an acceptance rate α per drafted token (treated as independent across positions), k drafted tokens and a
draft step costing c target steps (Leviathan et al. 2023):
- expected tokens per round (mean acceptance length) = (1 − α^(k+1)) / (1 − α);
- expected speedup = (1 − α^(k+1)) / ((1 − α)(1 + k·c));
- expected acceptance at draft position i (0-based) = α^(i+1).
α itself is estimated from the two models' distributions: α = E[Σ_x min(p(x), q(x))] = 1 − TVD(p, q).
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


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Expected walltime speedup over plain decoding: (1 − α^(k+1)) / ((1 − α)(1 + k·c))."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_acceptance_length(alpha, k) / (1.0 + k * c)


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
