"""Reference speculative decoding in PyTorch (`eval.engine: hf`, and the cross-check of vLLM's numbers).

The exact rejection rule of Leviathan et al. / Chen et al.: the draft proposes k tokens x_i ~ q_i, the target
scores all k+1 positions in one forward pass, x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); the
first rejection is replaced by a sample of norm(max(0, p_i − q_i)), and when all k are accepted a bonus token
is sampled from p_{k+1}. The output then has exactly the target's distribution, whatever the draft.

Conventions that keep that true in every mode:
- temperature 0 turns every distribution into the one-hot of its argmax, so the same rule accepts a draft token
  iff it is the target's argmax and the replacement is the target's argmax;
- greedy drafting (`draft_sample_method: greedy`) proposes the draft's argmax deterministically, so its q is
  that one-hot (not the draft's softmax): the rule then accepts x with probability p(x);
- prompt-lookup drafting (`method: ngram`) proposes deterministic tokens too: q is one-hot as well;
- temperature and top-p are applied identically to p and q.

A parallel (PARD) draft (`parallel_drafting` in the job's config) proposes its k tokens in one forward pass
over [new tokens, mask * (k - 1)], exactly as vLLM runs it; the rule above is unchanged.

Both models keep a KV cache (`DynamicCache`); after verification the caches are cropped back to the tokens
that survived, so each round feeds only the new tokens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from distill.errors import InputError
from distill.evaluate import hardware
from distill.evaluate.jobs import pool_rounds
from distill.utils.fs import atomic_write_json
from distill.vllm_worker.speculate import cpu_snapshot as machine_snapshot
from distill.vllm_worker.speculate import foreign_cpu_share

log = logging.getLogger("distill.evaluate")

METHODS = (None, "draft_model", "ngram")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn from a model's logits. temperature 0 = greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SpecStats:
    """vLLM-compatible counters: a draft = one proposal of one or more tokens."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.accepted_per_pos = [
            a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos, strict=True)
        ]


# ---------------------------------------------------------------------------------------------------------
# Distributions and the rejection rule (pure tensor functions)
# ---------------------------------------------------------------------------------------------------------


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`, renormalised.

    probs: [..., V] -> [..., V]. The most likely token is always kept.
    """
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Sampling distribution from logits: logits [..., V] -> float32 probabilities [..., V].

    temperature 0 gives the one-hot of the argmax (ties go to the lowest id, as `argmax` does everywhere here).
    """
    logits = logits.float()
    if sampling.greedy:
        return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    return top_p_filter(probs, sampling.top_p)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: probs [B, V] -> ids [B] (long)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def propose(
    logits: torch.Tensor, sampling: Sampling, draft_sample_method: str, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's proposal and the distribution it was drawn from: logits [B, V] -> (ids [B], q [B, V]).

    Greedy drafting is deterministic, so its q is the one-hot of the proposal; that is what makes the
    min(1, p/q) rule exact for it at any temperature.
    """
    if draft_sample_method == "greedy" or sampling.greedy:
        ids = logits.argmax(dim=-1)
        return ids, F.one_hot(ids, logits.shape[-1]).float()
    q = warp(logits, sampling)
    return sample(q, generator), q


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) elementwise; q(x) > 0 because x was drawn from q. Shapes [B, k]."""
    return torch.clamp(p_x / q_x, max=1.0)


def verify(
    draft_ids: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's proposal and draw the token that follows it.

    Args:
        draft_ids: [B, k] proposed ids.
        q: [B, k, V] distributions the proposals were drawn from.
        p: [B, k + 1, V] the target's (warped) distributions at the k + 1 positions.
    Returns:
        num_accepted [B] (0..k) and next_token [B]: the residual sample at the first rejection, or the bonus
        token from p[:, k] when all k were accepted.
    """
    batch, k = draft_ids.shape
    p_x = p[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(batch, k, generator=generator, device=p.device)
    accepted = u < acceptance_probability(p_x, q_x)
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    rows = torch.arange(batch, device=p.device)
    p_next = p[rows, num_accepted]
    # Position k has no proposal: q = 0 there, so the "residual" is p itself (the bonus token).
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, num_accepted]
    residual = (p_next - q_next).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass is 0 only if p == q, where rejection has probability 0; fall back to p to stay well defined.
    dist = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_next)
    return num_accepted, sample(dist, generator)


# ---------------------------------------------------------------------------------------------------------
# KV-cached model calls
# ---------------------------------------------------------------------------------------------------------


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_len(cache: Any) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: Any, length: int) -> None:
    """Drop cached positions beyond `length` (transformers 5 `crop` takes a negative count to remove)."""
    extra = cache_len(cache) - length
    if extra > 0:
        cache.crop(-extra)


def forward_new(model: Any, cache: Any, new_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Feed ids not yet in the cache; return the logits of the last `keep` positions: [B, keep, V]."""
    out = model(input_ids=new_ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[:, -keep:]


def speculative_round(
    target: Any,
    draft: Any,
    tokens: torch.Tensor,
    target_cache: Any,
    draft_cache: Any,
    *,
    k: int,
    sampling: Sampling,
    draft_sample_method: str,
    generator: torch.Generator | None,
    parallel_mask_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft-then-verify round on B sequences of equal length.

    Args:
        tokens: [B, L] every token so far; both caches hold a common prefix shorter than L.
        parallel_mask_id: the mask id of a parallel (PARD) draft, which proposes all k in one forward pass
            (`propose_parallel`); None for an ordinary draft, which proposes one token per forward.
    Returns:
        draft_ids [B, k], num_accepted [B], next_token [B]. The caches then hold L + k (target) and
        L + k - 1 (ordinary draft) or L (parallel draft) positions: the caller crops them to the tokens that
        survived.
    """
    if parallel_mask_id is None:
        draft_ids, q = propose_autoregressive(
            draft,
            tokens,
            draft_cache,
            k=k,
            sampling=sampling,
            draft_sample_method=draft_sample_method,
            generator=generator,
        )
    else:
        draft_ids, q = propose_parallel(
            draft,
            tokens,
            draft_cache,
            k=k,
            mask_id=parallel_mask_id,
            sampling=sampling,
            draft_sample_method=draft_sample_method,
            generator=generator,
        )
    target_feed = torch.cat([tokens[:, cache_len(target_cache) :], draft_ids], dim=1)
    p = warp(forward_new(target, target_cache, target_feed, k + 1), sampling)
    num_accepted, next_token = verify(draft_ids, q, p, generator)
    return draft_ids, num_accepted, next_token


def propose_autoregressive(
    draft: Any,
    tokens: torch.Tensor,
    draft_cache: Any,
    *,
    k: int,
    sampling: Sampling,
    draft_sample_method: str,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k draft forwards, each fed the previous proposal: (draft_ids [B, k], q [B, k, V])."""
    feed = tokens[:, cache_len(draft_cache) :]
    ids_list, q_list = [], []
    for _ in range(k):
        logits = forward_new(draft, draft_cache, feed, 1)[:, -1]
        ids, q = propose(logits, sampling, draft_sample_method, generator)
        ids_list.append(ids)
        q_list.append(q)
        feed = ids.unsqueeze(-1)
    return torch.stack(ids_list, dim=1), torch.stack(q_list, dim=1)


def propose_parallel(
    draft: Any,
    tokens: torch.Tensor,
    draft_cache: Any,
    *,
    k: int,
    mask_id: int,
    sampling: Sampling,
    draft_sample_method: str,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parallel drafting (PARD), as vLLM's `parallel_drafting` does it: ONE draft forward over the tokens not
    yet cached (ending with the newest token) followed by k - 1 mask tokens at the positions after it, with
    causal attention; proposal i comes from the logits at the newest token (i = 0) or at mask i, each drawn
    from its own q. The mask entries are then cropped from the draft's cache: the next round writes the real
    tokens there. Returns (draft_ids [B, k], q [B, k, V])."""
    start = cache_len(draft_cache)
    feed = tokens[:, start:]
    masks = torch.full((feed.shape[0], k - 1), mask_id, dtype=feed.dtype, device=feed.device)
    logits = forward_new(draft, draft_cache, torch.cat([feed, masks], dim=1), k)
    crop_cache(draft_cache, tokens.shape[1])
    ids_list, q_list = [], []
    for i in range(k):
        ids, q = propose(logits[:, i], sampling, draft_sample_method, generator)
        ids_list.append(ids)
        q_list.append(q)
    return torch.stack(ids_list, dim=1), torch.stack(q_list, dim=1)


def ngram_proposal(tokens: Sequence[int], k: int, ngram_min: int = 1, ngram_max: int = 4) -> list[int]:
    """Prompt lookup: the up-to-k tokens that followed the most recent earlier occurrence of the last n tokens.

    Longer suffixes are tried first (n = ngram_max .. ngram_min); no match gives an empty proposal.
    """
    seq = list(tokens)
    for n in range(min(ngram_max, len(seq) - 1), ngram_min - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def _one_hot(ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    return F.one_hot(torch.tensor(ids, device=device), vocab).float()


@dataclass
class Generation:
    token_ids: list[int]
    stats: SpecStats


EosIds = int | Sequence[int] | None


def _stop_ids(eos_token_id: EosIds) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _append_until_stop(out: list[int], new: Sequence[int], *, max_tokens: int, eos_token_id: EosIds) -> bool:
    """Append tokens up to a stop id (kept, as vLLM does) or `max_tokens`; True when generation is over."""
    stop = _stop_ids(eos_token_id)
    for t in new:
        out.append(int(t))
        if int(t) in stop or len(out) >= max_tokens:
            return True
    return False


@torch.inference_mode()
def target_generate(
    target: Any,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    eos_token_id: EosIds,
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Plain autoregressive decoding with the same sampling as the speculative path (`no_spec`)."""
    device = next(target.parameters()).device
    tokens = list(prompt_ids)
    out: list[int] = []
    cache = new_cache(target)
    while True:
        feed = torch.tensor([tokens[cache_len(cache) :]], device=device)
        probs = warp(forward_new(target, cache, feed, 1)[:, -1], sampling)
        t = int(probs.argmax(-1)) if sampling.greedy else int(sample(probs, generator))
        tokens.append(t)
        if _append_until_stop(out, [t], max_tokens=max_tokens, eos_token_id=eos_token_id):
            return out


def _ngram_round(
    target: Any,
    tokens: list[int],
    target_cache: Any,
    *,
    k: int,
    sampling: Sampling,
    generator: torch.Generator | None,
    ngram_min: int,
    ngram_max: int,
) -> tuple[list[int], int, int]:
    """One prompt-lookup round at batch 1: (proposal, num_accepted, next_token)."""
    device = next(target.parameters()).device
    proposal = ngram_proposal(tokens, k, ngram_min, ngram_max)
    feed = torch.tensor([tokens[cache_len(target_cache) :] + proposal], device=device)
    p = warp(forward_new(target, target_cache, feed, len(proposal) + 1), sampling)
    if not proposal:
        return [], 0, int(sample(p[:, 0], generator))
    q = _one_hot(proposal, p.shape[-1], device).unsqueeze(0)
    num_accepted, next_token = verify(torch.tensor([proposal], device=device), q, p, generator)
    return proposal, int(num_accepted), int(next_token)


@torch.inference_mode()
def speculative_generate(
    target: Any,
    draft: Any | None,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    eos_token_id: EosIds,
    k: int,
    sampling: Sampling,
    method: str = "draft_model",
    draft_sample_method: str = "greedy",
    generator: torch.Generator | None = None,
    ngram_min: int = 1,
    ngram_max: int = 4,
    parallel_mask_id: int | None = None,
) -> Generation:
    """Speculative decoding of one prompt (batch 1) with KV caches on both models.

    `method` is "draft_model" (needs `draft`) or "ngram" (prompt lookup in the prompt and output so far);
    `parallel_mask_id` set = the draft is a parallel (PARD) draft with that mask id (`propose_parallel`).
    """
    if method not in ("draft_model", "ngram") or (method == "draft_model" and draft is None):
        raise ValueError(f"speculative_generate: method {method!r} with draft {type(draft).__name__}")
    device = next(target.parameters()).device
    tokens = list(prompt_ids)
    out: list[int] = []
    stats = SpecStats(k)
    target_cache = new_cache(target)
    draft_cache = new_cache(draft) if draft is not None else None
    done = False
    while not done:
        if method == "draft_model":
            ids, acc, nxt = speculative_round(
                target,
                draft,
                torch.tensor([tokens], device=device),
                target_cache,
                draft_cache,
                k=k,
                sampling=sampling,
                draft_sample_method=draft_sample_method,
                generator=generator,
                parallel_mask_id=parallel_mask_id,
            )
            proposal, num_accepted, next_token = ids[0].tolist(), int(acc[0]), int(nxt[0])
        else:
            proposal, num_accepted, next_token = _ngram_round(
                target,
                tokens,
                target_cache,
                k=k,
                sampling=sampling,
                generator=generator,
                ngram_min=ngram_min,
                ngram_max=ngram_max,
            )
        stats.record(len(proposal), num_accepted)
        new = [*proposal[:num_accepted], next_token]
        done = _append_until_stop(out, new, max_tokens=max_tokens, eos_token_id=eos_token_id)
        tokens.extend(new)
        # Keep only positions whose tokens survived; the newest token is fed next round.
        crop_cache(target_cache, len(tokens) - 1)
        if draft_cache is not None:
            crop_cache(draft_cache, len(tokens) - 1)
    return Generation(out, stats)


def _shared_prefix_cache(model: Any, prompt: torch.Tensor, batch: int) -> Any:
    """A cache holding prompt[:-1] for `batch` rows, computed once at batch 1 (the rows share the prompt)."""
    cache = new_cache(model)
    if len(prompt) > 1:
        forward_new(model, cache, prompt[:-1].unsqueeze(0), 1)
        cache.batch_repeat_interleave(batch)
    return cache


@torch.inference_mode()
def sample_speculative_batch(
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int],
    *,
    num_samples: int,
    num_tokens: int,
    k: int,
    sampling: Sampling,
    draft_sample_method: str,
    generator: torch.Generator | None,
    parallel_mask_id: int | None = None,
) -> torch.Tensor:
    """`num_samples` independent speculative continuations of one prompt, `num_tokens` each: [S, num_tokens].

    Rows are advanced in groups of equal length (no padding) on caches that hold the shared prompt, so
    thousands of independent samples cost a few batched forward passes: the statistical test of the rule.
    """
    device = next(target.parameters()).device
    prompt = torch.tensor(list(prompt_ids), device=device)
    out = torch.full((num_samples, num_tokens), -1, dtype=torch.long, device=device)
    filled = torch.zeros(num_samples, dtype=torch.long, device=device)
    while bool((filled < num_tokens).any()):
        n = int(filled[filled < num_tokens].min())
        rows = (filled == n).nonzero().squeeze(-1)
        ctx = torch.cat([prompt.unsqueeze(0).expand(len(rows), -1), out[rows, :n]], dim=1)
        ids, acc, nxt = speculative_round(
            target,
            draft,
            ctx,
            _shared_prefix_cache(target, prompt, len(rows)),
            _shared_prefix_cache(draft, prompt, len(rows)),
            k=k,
            sampling=sampling,
            draft_sample_method=draft_sample_method,
            generator=generator,
            parallel_mask_id=parallel_mask_id,
        )
        new = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1)
        new[torch.arange(len(rows), device=device), acc] = nxt
        take = torch.clamp(acc + 1, max=num_tokens - n)
        for j in range(min(k + 1, num_tokens - n)):
            sel = take > j
            out[rows[sel], n + j] = new[sel, j]
        filled[rows] = n + take
    return out


# ---------------------------------------------------------------------------------------------------------
# The job entry point (called by the eval stage)
# ---------------------------------------------------------------------------------------------------------


def _validate_job(job: dict[str, Any]) -> None:
    """All problems at once, naming the job key (the stage maps them to `eval.*` keys)."""
    problems = []
    if not Path(str(job.get("target", ""))).is_dir():
        problems.append(f"target: {job.get('target')!r} is not a model folder")
    prompts = job.get("prompts")
    if not prompts or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
    ):
        problems.append("prompts: need a non-empty list of non-empty token id lists")
    if int(job.get("max_tokens", 0)) < 1:
        problems.append(f"max_tokens: {job.get('max_tokens')!r} must be >= 1")
    if int(job.get("repeats", 1)) < 1:
        problems.append(f"repeats: {job.get('repeats')!r} must be >= 1")
    if int(job.get("rounds", 1)) < 1:
        problems.append(f"rounds: {job.get('rounds')!r} must be >= 1")
    for c in job.get("configs", []):
        problems += _config_problems(c)
    if not job.get("configs"):
        problems.append("configs: nothing to run")
    if problems:
        raise InputError("reference engine job is invalid:\n" + "\n".join(f"  - {p}" for p in problems))


def _config_problems(c: dict[str, Any]) -> list[str]:
    name = c.get("name", "?")
    out = []
    method = c.get("method")
    if method not in METHODS:
        out.append(f"configs[{name}].method: {method!r} is not one of {list(METHODS)}")
    if method is not None and int(c.get("k", 0)) < 1:
        out.append(f"configs[{name}].k: {c.get('k')!r} must be >= 1 for speculation")
    if method == "draft_model" and not Path(str(c.get("draft") or "")).is_dir():
        out.append(f"configs[{name}].draft: {c.get('draft')!r} is not a model folder")
    if (c.get("draft_sample_method") or "greedy") not in DRAFT_SAMPLE_METHODS:
        out.append(
            f"configs[{name}].draft_sample_method: {c.get('draft_sample_method')!r} is not one of "
            f"{list(DRAFT_SAMPLE_METHODS)}"
        )
    if float(c.get("temperature", 0.0)) < 0 or not 0 < float(c.get("top_p", 1.0)) <= 1:
        out.append(f"configs[{name}]: temperature must be >= 0 and top_p in (0, 1]")
    return out


def _pick_device(job: dict[str, Any]) -> torch.device:
    wanted = job.get("device", "auto")
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


class _ModelCache:
    """Loads each folder once per job; remembers how long each load took (the configs' `startup_s`)."""

    def __init__(self, dtype: str, device: torch.device, trust_remote_code: bool):
        self.dtype, self.device, self.trust = dtype, device, trust_remote_code
        self.models: dict[str, tuple[Any, float]] = {}

    def get(self, path: str) -> tuple[Any, float]:
        if path not in self.models:
            from distill.models.draft import load_causal_lm

            t0 = time.perf_counter()
            model = (
                load_causal_lm(path, dtype=self.dtype, trust_remote_code=self.trust).to(self.device).eval()
            )
            self.models[path] = (model, time.perf_counter() - t0)
        return self.models[path]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _one_pass(
    run_one: Callable[[Sequence[int], torch.Generator], Generation],
    prompts: list[list[int]],
    seed: int,
    device: torch.device,
    k: int,
) -> tuple[list[list[int]], SpecStats]:
    """Every prompt once; prompt i samples with seed + i (as the vLLM worker does), so repeats are identical."""
    stats = SpecStats(max(k, 0))
    outs = []
    for i, prompt in enumerate(prompts):
        gen = run_one(prompt, _generator(device, seed + i))
        stats.merge(gen.stats)
        outs.append(gen.token_ids)
    return outs, stats


def _runner(
    job: dict[str, Any], c: dict[str, Any], target: Any, draft: Any | None
) -> Callable[[Sequence[int], torch.Generator], Generation]:
    sampling = Sampling(float(c.get("temperature", 0.0)), float(c.get("top_p", job.get("top_p", 1.0))))
    max_tokens, eos = int(job["max_tokens"]), job.get("eos_token_id")
    method = c.get("method")
    k = int(c.get("k") or 0)
    mask_id = parallel_mask_of(draft) if method == "draft_model" and c.get("parallel_drafting") else None

    def run_one(prompt: Sequence[int], g: torch.Generator) -> Generation:
        if method is None:
            ids = target_generate(
                target, prompt, max_tokens=max_tokens, eos_token_id=eos, sampling=sampling, generator=g
            )
            return Generation(ids, SpecStats(0))
        return speculative_generate(
            target,
            draft,
            prompt,
            k=k,
            sampling=sampling,
            method=method,
            generator=g,
            draft_sample_method=c.get("draft_sample_method") or "greedy",
            ngram_min=int(job.get("ngram_min", 1)),
            ngram_max=int(job.get("ngram_max", 4)),
            max_tokens=max_tokens,
            eos_token_id=eos,
            parallel_mask_id=mask_id,
        )

    return run_one


def parallel_mask_of(draft: Any) -> int:
    """The mask id of a parallel draft (`pard_token` in its config, where vLLM reads it too)."""
    mask = getattr(draft.config, "pard_token", None)
    if mask is None:
        raise ValueError(
            "parallel_drafting is set but the draft's config.json has no `pard_token` (its mask id): "
            "it is not a parallel draft"
        )
    return int(mask)


def _empty_result(c: dict[str, Any]) -> dict[str, Any]:
    k = int(c.get("k") or 0) if c.get("method") is not None else 0
    return {
        "name": c.get("name"),
        "method": c.get("method"),
        "draft": str(c["draft"]) if c.get("draft") else None,
        "k": k,
        "temperature": float(c.get("temperature", 0.0)),
        "draft_sample_method": c.get("draft_sample_method"),
        "parallel_drafting": bool(c.get("parallel_drafting")),
        "heterogeneous_vocab": bool(c.get("heterogeneous_vocab")),
        "startup_s": 0.0,
        "wall_s": [],
        "load_avg": [],
        "foreign_cpu": [],
        "output_tokens": 0,
        "output_tokens_per_pass": [],
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_pos": [0] * k,
        "texts": [],
        "token_ids": [],
        "error": None,
    }


def cpu_snapshot() -> tuple[int, int] | None:
    """(machine busy ticks, this process's ticks), for the share of the CPU other processes took during a
    timed pass (`foreign_cpu`, as the vLLM worker reports it). The reference engine runs in this process
    alone, so its own time is this process's, not its session's (a shell's other jobs share the session).
    This process is read first: the /proc walk for the machine's count then falls inside both intervals."""
    t = os.times()
    own = round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))
    machine = machine_snapshot()
    return None if machine is None else (machine[0], own)


# CPU time is counted in clock ticks (10 ms): over a shorter pass one stray tick of another process reads as
# a large share, so such passes record no share (the report then falls back to the load average).
MIN_SHARE_WALL_S = 1.0


def foreign_share(
    before: tuple[int, int] | None, after: tuple[int, int] | None, wall_s: float
) -> float | None:
    """Share of the machine's CPU other processes used during a timed pass, None where too short to tell."""
    return foreign_cpu_share(before, after, wall_s) if wall_s >= MIN_SHARE_WALL_S else None


def run_config(job: dict[str, Any], c: dict[str, Any], models: _ModelCache, tokenizer: Any) -> dict[str, Any]:
    """One configuration: load (timed as start-up), a warm-up prompt, then `repeats` timed passes."""
    res = _empty_result(c)
    target, startup = models.get(str(job["target"]))
    draft = None
    if c.get("method") == "draft_model":
        draft, draft_load = models.get(str(c["draft"]))
        startup += draft_load
    res["startup_s"] = startup
    run_one = _runner(job, c, target, draft)
    prompts, seed, device = job["prompts"], int(job.get("seed", 0)), models.device
    _one_pass(run_one, prompts[:1], seed, device, res["k"])  # warm-up: allocator, kernels, lazy inits
    token_ids: list[list[int]] = []
    stats = SpecStats(res["k"])
    for r in range(int(job.get("repeats", 1))):
        res["load_avg"].append(hardware.load_avg())
        cpu0 = cpu_snapshot()
        t0 = time.perf_counter()
        outs, pass_stats = _one_pass(run_one, prompts, seed, device, res["k"])
        res["wall_s"].append(time.perf_counter() - t0)
        res["foreign_cpu"].append(foreign_share(cpu0, cpu_snapshot(), res["wall_s"][-1]))
        res["output_tokens_per_pass"].append(sum(len(t) for t in outs))
        stats.merge(pass_stats)  # counters summed over the timed passes, as the vLLM worker reports them
        if r == 0:
            token_ids = outs
    res.update(
        output_tokens=res["output_tokens_per_pass"][0],
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        accepted_per_pos=stats.accepted_per_pos,
        token_ids=token_ids,
        texts=[tokenizer.decode(t, skip_special_tokens=True) for t in token_ids],
    )
    return res


def run_reference_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run every configuration of an eval job with the reference engine.

    The job dict is documented in `distill/evaluate/jobs.py`; this engine reads target, dtype, prompts,
    max_tokens, eos_token_id (int or list), configs, repeats, seed and the optional rounds, device, top_p,
    ngram_min, ngram_max, trust_remote_code, threads, partial_path; other keys (vLLM settings) are ignored. With
    rounds > 1 the configurations run that many times in turn, their passes pooled (`jobs.pool_rounds`). The rejection
    rule is always the standard one. A configuration that fails at run time gets its `error` set and empty
    results; the others still run. Counters are summed over the timed passes (identical passes: every prompt
    is reseeded), texts and token ids come from the first.
    """
    import transformers

    from distill.errors import DistillError
    from distill.models.draft import load_tokenizer

    _validate_job(job)
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    device = _pick_device(job)
    models = _ModelCache(str(job.get("dtype", "float32")), device, bool(job.get("trust_remote_code", False)))
    tokenizer = load_tokenizer(job["target"], trust_remote_code=bool(job.get("trust_remote_code", False)))
    head: dict[str, Any] = {
        "engine": "hf",
        "engine_version": f"torch {torch.__version__}, transformers {transformers.__version__}",
        "device": device.type,
        "results": [],
    }
    done: list[list[dict[str, Any]]] = []
    for _ in range(int(job.get("rounds", 1))):
        done.append([])
        for c in job["configs"]:
            log.info("reference engine: %s (k=%s, T=%s)", c.get("name"), c.get("k"), c.get("temperature"))
            try:
                done[-1].append(run_config(job, c, models, tokenizer))
            except DistillError:
                raise
            except (RuntimeError, ValueError, OSError) as exc:
                log.exception("reference engine: %s failed", c.get("name"))
                done[-1].append({**_empty_result(c), "error": f"{type(exc).__name__}: {exc}"})
            head["results"] = pool_rounds(done)
            if job.get("partial_path"):  # what was measured survives an interruption, marked incomplete
                atomic_write_json(Path(job["partial_path"]), {**head, "complete": False})
    return head
