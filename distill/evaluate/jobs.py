"""The eval job: one plain dict (JSON-safe) that both engines take.

`distill.vllm_worker.speculate.run_job(job)` (vLLM, in the worker subprocess) and
`distill.evaluate.reference.run_reference_job(job)` (the PyTorch reference engine) receive the same dict and
return the same shape.

Job keys:
    kind: "speculate"
    target: str — local HF folder of the target.
    dtype: "float32" | "bfloat16" | "float16" — precision of target and drafts.
    trust_remote_code: bool
    prompts: list[list[int]] — token ids, chat template already applied (add_generation_prompt=True).
    max_tokens: int — new tokens per prompt at most; generation stops earlier at EOS (no ignore_eos).
    eos_token_id: int — the target tokenizer's EOS id.
    stop_token_ids: list[int] — every id that ends generation (EOS of tokenizer and generation config).
    max_model_len: int — longest prompt + max_tokens + largest k + margin.
    configs: list of {name: str, method: None | "ngram" | "draft_model" | "eagle", draft: str | None (folder;
             for "eagle" an EAGLE-1 head on the target's hidden states),
             k: int (0 for no_spec), temperature: float, draft_sample_method: None | "greedy" | "probabilistic",
             parallel_drafting: bool (only on draft_model configs; true for a parallel (PARD) draft: one draft
             forward proposes all k tokens from [next token, mask * (k - 1)], the mask id being the draft
             config's `pard_token`; vLLM's `speculative_config.parallel_drafting`),
             heterogeneous_vocab: bool (present and true only for a trimmed-vocabulary draft, `draft.vocab_size`:
             vLLM's `speculative_config.use_heterogeneous_vocab`, greedy drafting only)}
    repeats: int — timed passes over all prompts (after one warm-up pass).
    rounds: int (default 1) — sweeps over all configurations, one after another (A B C, A B C): each
        configuration's passes and counters are pooled over the rounds (`pool_rounds`), so a slow spell of a
        shared machine that hits one configuration in one round moves the ratios less.
    keep_engines: bool (default false) — with rounds > 1, start each engine once and keep every one running
        until the last round (on a GPU they split gpu_memory_utilization) instead of starting it again each round.
    seed: int — prompt i is sampled with seed + i (same work in every repeat and configuration).
    rejection_sample_method: "standard" | "block"
    ngram_prompt_lookup_min, ngram_prompt_lookup_max: int
    max_num_seqs: int — prompts decoded concurrently.
    tensor_parallel_size: int; enforce_eager: bool; gpu_memory_utilization: float
    device: "cpu" | "cuda"
    partial_path: str | None — where the worker rewrites {"results": [...], "complete": false} after each
        engine, so a crash or timeout keeps what was measured.

Result: {"results": [per-config dict], "complete": bool, "engine": str, "engine_version": str, "device": str,
...}. Per-config dict:
    {name, method, draft, k, temperature, draft_sample_method, parallel_drafting: bool, heterogeneous_vocab:
     bool, startup_s: float | None,
     wall_s: [float per timed pass], load_avg: [1-min load average before each timed pass],
     foreign_cpu: [share of the machine's CPU used by other processes during each timed pass, or None],
     output_tokens: int (tokens generated in one pass over all prompts),
     output_tokens_per_pass: [int], num_drafts, num_draft_tokens, num_accepted_tokens: int (summed over the
     timed passes), accepted_per_pos: [int] * k (same passes), texts: [str per prompt],
     token_ids: [[int] per prompt], error: str | None}
    With rounds > 1 the lists run over every round's passes and each dict adds round_of_pass: [round index per
    timed pass] and startup_s_per_round; counters are summed over all rounds; texts and token ids are the first
    round's.
"""

from __future__ import annotations

from itertools import zip_longest
from typing import Any

NO_SPEC = "no_spec"
NGRAM = "ngram"


def build_configs(
    *,
    drafts: list[tuple[str, str]],
    ks: list[int],
    draft_ks: dict[str, list[int]] | None = None,
    temperatures: list[float],
    draft_sample_methods: list[str],
    ngram_k: int | None,
    parallel: dict[str, int] | None = None,
    methods: dict[str, str] | None = None,
    trimmed: set[str] | None = None,
) -> list[dict[str, Any]]:
    """Every configuration, grouped so configurations sharing an engine are adjacent.

    At temperature 0 only greedy drafting is measured (probabilistic drafting changes nothing there);
    at temperature > 0 every method in `draft_sample_methods` is. `draft_ks` maps a draft name to its own k
    list (a draft not in it sweeps `ks`). `parallel` maps a draft name to the K it was trained to propose in
    one pass: such a draft runs with `parallel_drafting` at the k of its sweep that are <= K (at K when none
    is, see `parallel_ks`); at k = 1 it drafts as an ordinary draft (one token, no masks). `methods` maps a
    draft name to its vLLM method ("draft_model" when absent, or "eagle"). `trimmed` names the drafts with a
    trimmed vocabulary: they run with vLLM's `use_heterogeneous_vocab`, which drafts greedily only, so their
    probabilistic-drafting configurations are left out (and they draft greedily at every temperature when
    `draft_sample_methods` has no greedy).
    """
    parallel = parallel or {}
    draft_ks = draft_ks or {}
    methods = methods or {}
    trimmed = trimmed or set()
    temps = sorted(set(temperatures))
    out: list[dict[str, Any]] = []

    def add(
        name: str, method: str | None, draft: str | None, k: int, dsm: str | None, ts: list[float]
    ) -> None:
        # At k = 1 a parallel draft's proposal is its ordinary next-token proposal (no mask tokens), so it
        # runs, and is labelled, as ordinary drafting.
        extra = {"parallel_drafting": bool(parallel.get(name)) and k >= 2} if method == "draft_model" else {}
        if name in trimmed:
            extra["heterogeneous_vocab"] = True
        out.extend(
            {
                "name": name,
                "method": method,
                "draft": draft,
                "k": k,
                "temperature": float(t),
                "draft_sample_method": dsm,
                **extra,
            }
            for t in ts
        )

    add(NO_SPEC, None, None, 0, None, temps)
    if ngram_k:
        add(NGRAM, "ngram", None, ngram_k, None, temps)
    hot = [t for t in temps if t > 0]
    for name, path in drafts:
        method = methods.get(name, "draft_model")
        for k in parallel_ks(draft_ks.get(name) or ks, parallel.get(name, 0)):
            for dsm in draft_sample_methods:
                if dsm != "greedy" and name in trimmed:
                    continue
                ts = ([t for t in temps if t == 0] if dsm == "greedy" else []) + hot
                if dsm != "greedy" and not hot:
                    continue
                add(name, method, path, k, dsm, ts)
            if "greedy" not in draft_sample_methods and (0.0 in temps or name in trimmed):
                add(name, method, path, k, "greedy", [0.0] if name not in trimmed else temps)
    return out


def parallel_ks(ks: list[int], parallel_tokens: int) -> list[int]:
    """The k to sweep for a draft: all of `ks` for an ordinary draft (parallel_tokens 0); for a parallel one
    trained to propose K = parallel_tokens tokens, those <= K (its masks past K were never trained), else [K]."""
    if not parallel_tokens:
        return list(ks)
    return [k for k in ks if k <= parallel_tokens] or [parallel_tokens]


# What identifies a configuration's result across rounds.
RESULT_KEY = ("name", "method", "draft", "k", "temperature", "draft_sample_method", "parallel_drafting")
PER_PASS = ("wall_s", "load_avg", "foreign_cpu", "output_tokens_per_pass")
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def pool_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per configuration from the results of several rounds (each a list in any order): per-pass
    lists concatenated with `round_of_pass` saying which round each pass ran in, counters summed, the first
    round's texts and token ids kept. A configuration that failed in any round keeps the error, labelled.
    One round's results come back as they are."""
    if len(rounds) == 1:
        return list(rounds[0])
    pooled: dict[tuple, dict[str, Any]] = {}
    for i, results in enumerate(rounds):
        for res in results:
            key = tuple(bool(res.get(k)) if k == "parallel_drafting" else res.get(k) for k in RESULT_KEY)
            error = f"round {i + 1}: {res['error']}" if res.get("error") else None
            passes = len(res.get("wall_s") or [])
            if key not in pooled:
                pooled[key] = {
                    **res,
                    **{f: list(res.get(f) or []) for f in PER_PASS},
                    "round_of_pass": [i] * passes,
                    "startup_s_per_round": [res.get("startup_s")],
                    "accepted_per_pos": list(res.get("accepted_per_pos") or []),
                    "error": error,
                }
                continue
            p = pooled[key]
            for f in PER_PASS:
                p[f] += list(res.get(f) or [])
            p["round_of_pass"] += [i] * passes
            p["startup_s_per_round"].append(res.get("startup_s"))
            for f in COUNTERS:
                p[f] = int(p.get(f) or 0) + int(res.get(f) or 0)
            p["accepted_per_pos"] = [
                a + b
                for a, b in zip_longest(p["accepted_per_pos"], res.get("accepted_per_pos") or [], fillvalue=0)
            ]
            p["error"] = "; ".join(e for e in (p["error"], error) if e) or None
    return list(pooled.values())
