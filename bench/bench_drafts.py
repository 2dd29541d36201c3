"""Candidate-draft study: which draft shape can give ≥ 1.5x inside vLLM on this CPU, before any distillation.

For each candidate draft (truncations of the target to `--layers` layers, plus any `--draft NAME=FOLDER`):
- `c_hf`: draft / target KV-cached decode step time in PyTorch, batch 1 (`analytic.measure_cost_ratio`);
- `c_vllm`: seconds per generated token of the candidate run ALONE in vLLM (plain decoding, batch 1), divided
  by the same for the target; every model runs in the product's vLLM worker, one after another in this run,
  on the same prompts, median of `--repeats` timed passes each. The target is timed first and again last, so
  the candidates run between its two timings: c_vllm divides by the mean of its two medians, and the table
  shows how far the machine drifted between them. A pass that stops at EOS before `--timing-tokens` per prompt
  is flagged (‡), not hidden;
- `alpha_hat`: acceptance at T=0 (top-1 agreement on the target's greedy continuations of held-out ShareGPT
  `test` prompts, `analytic.estimate_acceptance`);
- the expected speedup for k = 1..6 (`analytic.expected_speedup` with c_vllm, or c_hf where vLLM failed), the
  best k, and the α a draft of this cost needs for 1.5x at its best k.

    python -m bench.bench_drafts --target smollm2-135m-instruct --layers 1,2,3,4,6 --prompts 32 --repeats 3
    python -m bench.bench_drafts --draft distilled=checkpoints/smollm2-sharegpt/draft   # add trained drafts
    python -m bench.bench_drafts --quick            # tiny target, seconds (plus tiny vLLM engines)
    python -m bench.bench_drafts --quick --no-vllm  # HF timing only

Writes bench/out/drafts.json and bench/out/drafts.md (or `--name`). Every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    OUT_DIR,
    REPO,
    fmt,
    markdown_table,
    run_study,
    spread,
)

log = logging.getLogger("bench.drafts")

CONFIG = REPO / "configs" / "smollm2-sharegpt.yaml"
TARGET_SPEEDUP = 1.5
KS = (1, 2, 3, 4, 5, 6)
FULL = {"target": "smollm2-135m-instruct", "layers": "1,2,3,4,6", "prompts": 32}
QUICK = {
    "target": "tiny-llama",
    "layers": "1,2",
    "prompts": 4,
    "alpha_tokens": 16,
    "timing_prompts": 2,
    "timing_tokens": 32,
    "max_prompt_tokens": 128,
}


# ---------------------------------------------------------------------------------------------------------
# Pure parts: the speedup model, the α needed, the table


def speedup_table(alpha: float, c: float, ks: Sequence[int] = KS) -> dict[int, float]:
    """Expected speedup at each k for acceptance `alpha` and cost ratio `c`."""
    from distill.evaluate.analytic import expected_speedup

    return {k: expected_speedup(alpha, k, c) for k in ks}


def alpha_needed(target: float, c: float, k: int, tol: float = 1e-7) -> float | None:
    """Smallest α with expected_speedup(α, k, c) ≥ `target`; None if even α = 1 falls short.

    The speedup grows monotonically with α (it is Σ_{i≤k} α^i / (1 + k c)), so bisection finds it.
    """
    from distill.evaluate.analytic import expected_speedup

    if expected_speedup(1.0, k, c) < target:
        return None
    if expected_speedup(0.0, k, c) >= target:
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_speedup(mid, k, c) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def alpha_needed_best_k(target: float, c: float, ks: Sequence[int] = KS) -> tuple[float | None, int | None]:
    """The smallest α reaching `target` at any k in `ks`, and that k (ties go to the smaller k)."""
    best: tuple[float | None, int | None] = (None, None)
    for k in ks:
        a = alpha_needed(target, c, k)
        if a is not None and (best[0] is None or a < best[0] - 1e-9):
            best = (a, k)
    return best


def plan_for(
    alpha: float, c: float, ks: Sequence[int] = KS, target: float = TARGET_SPEEDUP
) -> dict[str, Any]:
    """Best k and expected speedup for a candidate, the per-k table, and the α it would need for `target`."""
    table = speedup_table(alpha, c, ks)
    k_best = max(table, key=lambda k: (table[k], -k))
    need, need_k = alpha_needed_best_k(target, c, ks)
    return {
        "best_k": k_best,
        "expected_speedup": table[k_best],
        "speedup_by_k": {str(k): v for k, v in table.items()},
        "alpha_needed": need,
        "alpha_needed_k": need_k,
    }


def per_token_seconds(result: dict[str, Any]) -> dict[str, Any]:
    """Seconds per generated token of each timed pass of a worker result, as a spread (median, min, max)."""
    walls, tokens = result.get("wall_s") or [], result.get("output_tokens_per_pass") or []
    if not walls or len(walls) != len(tokens) or min(tokens) <= 0:
        raise ValueError(f"no usable timed passes (wall_s={walls}, output_tokens_per_pass={tokens})")
    return spread([w / n for w, n in zip(walls, tokens, strict=True)])


def short_passes(result: dict[str, Any], asked: int) -> list[int]:
    """Indices of the timed passes that generated fewer than `asked` tokens (a prompt stopped at EOS): their
    ms/token spreads each prompt's prefill over fewer tokens, so they are not like for like with full passes."""
    return [i for i, n in enumerate(result.get("output_tokens_per_pass") or []) if n < asked]


def is_short(timing: dict[str, Any] | None) -> bool:
    return bool(timing and not timing.get("error") and timing.get("short_passes"))


SHORT_NOTE = (
    "‡ = some timed passes of this model (or of the target) stopped at EOS before the tokens asked: its ms/token "
    "spreads the prompts' prefill over fewer tokens, so c_vllm is not like for like."
)

HEADER = [
    "candidate",
    "layers",
    "params (M)",
    "c_hf",
    "c_vllm",
    "α̂ (T=0)",
    "best k",
    "expected speedup",
    f"α needed for {TARGET_SPEEDUP}x (k)",
]


def timing_table(
    rows: Sequence[dict[str, Any]],
    target_vllm: dict[str, Any] | None,
    target_after: dict[str, Any] | None = None,
) -> str:
    """vLLM ms per generated token of each model alone: median [min–max] over the timed passes, in the order
    they ran (the target first and, when timed again, last)."""
    body = []
    timed = [("target", target_vllm), *((r["name"], r.get("vllm")) for r in rows)]
    for name, t in [*timed, ("target (again, last)", target_after)]:
        if not t:
            continue
        if t.get("error"):
            body.append([name, "failed", "—", "—", f"see {t.get('log', 'the log')}"])
            continue
        s = t["s_per_token"]
        tokens = str(min(t["output_tokens_per_pass"]))
        if is_short(t):
            tokens += f" of {t['tokens_asked_per_pass']} ‡ (passes {t['short_passes']})"
        body.append(
            [
                name,
                f"{1e3 * s['median']:.2f}",
                f"{1e3 * s['min']:.2f}–{1e3 * s['max']:.2f}",
                f"{s['spread_pct']}%",
                tokens,
            ]
        )
    header = ["model (alone in vLLM)", "ms/token", "min–max", "spread", "tokens/pass"]
    return markdown_table(header, body) if body else ""


def render_markdown(
    rows: Sequence[dict[str, Any]],
    settings: dict[str, Any],
    target_vllm: dict[str, Any] | None = None,
    target_after: dict[str, Any] | None = None,
) -> str:
    """The study as a markdown fragment: the summary table, expected speedup per k, the vLLM timings."""
    body = []
    for r in rows:
        need = (
            "unreachable"
            if r["alpha_needed"] is None
            else f"{r['alpha_needed']:.3f} (k={r['alpha_needed_k']})"
        )
        c_mark = "" if r["c_source"] == "vllm" else " †"
        short = r["c_vllm"] is not None and (
            is_short(r.get("vllm")) or is_short(target_vllm) or is_short(target_after)
        )
        body.append(
            [
                r["name"],
                str(r["layers"]),
                f"{r['params'] / 1e6:.1f}",
                fmt(r["c_hf"]),
                fmt(r["c_vllm"]) + (" ‡" if short else ""),
                fmt(r["alpha_hat"]),
                str(r["best_k"]),
                fmt(r["expected_speedup"], 2) + c_mark,
                need,
            ]
        )
    per_k = [[r["name"], *(fmt(r["speedup_by_k"][str(k)], 2) for k in KS)] for r in rows]
    notes = [
        f"Target `{settings['target']}`; α̂ = top-1 agreement with the target's greedy continuations "
        f"({settings['alpha_prompts']} held-out prompts of `{settings['prompt_source']}`, "
        f"{settings['alpha_tokens']} tokens each).",
        f"c_vllm = vLLM seconds per generated token of the candidate alone / of the target (batch 1, "
        f"{settings['timing_prompts']} prompts × ≤{settings['timing_tokens']} tokens, median of "
        f"{settings['repeats']} passes; the target's figure is the mean of its medians timed first and last, "
        "the candidates ran in between); c_hf = PyTorch KV-cached decode step ratio.",
        "Expected speedup = (1 − α^(k+1)) / ((1 − α)(1 + k·c)) with c = c_vllm († = c_hf: vLLM timing "
        "missing for that candidate).",
    ]
    drift = target_drift_pct(target_vllm, target_after)
    if drift is not None:
        notes.append(
            f"The target decoded {abs(drift):.1f}% {'slower' if drift >= 0 else 'faster'} when timed last than "
            "first: the machine's drift over the run, within which each candidate's c_vllm is uncertain."
        )
    if is_short(target_vllm) or is_short(target_after) or any(is_short(r.get("vllm")) for r in rows):
        notes.append(SHORT_NOTE)
    return "\n\n".join(
        [
            "### Candidate drafts: cost ratio, acceptance, expected speedup",
            markdown_table(HEADER, body),
            "Expected speedup by k:",
            markdown_table(["candidate", *(f"k={k}" for k in KS)], per_k),
            "\n".join(f"- {n}" for n in notes),
        ]
        + (
            [f"vLLM timing (batch 1, plain decoding):\n\n{timing}"]
            if (timing := timing_table(rows, target_vllm, target_after))
            else []
        )
    )


# ---------------------------------------------------------------------------------------------------------
# Candidates


@dataclass
class Candidate:
    name: str
    folder: str
    source: str  # "truncate" | "given"
    layers: int
    params: int
    hidden_size: int
    tied_embeddings: bool


def parse_layers(text: str, n_target: int) -> list[int]:
    from distill.errors import InputError

    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InputError(
            f"--layers: '{text}' is not a comma-separated list of integers (e.g. 1,2,4)."
        ) from None
    bad = [n for n in layers if not 1 <= n <= n_target]
    if bad:
        raise InputError(f"--layers: {bad} outside 1..{n_target} (the target has {n_target} layers).")
    return layers


def parse_draft_specs(specs: Sequence[str]) -> list[tuple[str, str]]:
    from distill.errors import InputError

    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not re.fullmatch(r"[\w.\-]+", name) or not folder:
            raise InputError(f"--draft: '{spec}' must be NAME=FOLDER (NAME of letters, digits, . _ -).")
        if name in {n for n, _ in out} or name.startswith("truncate-"):
            raise InputError(
                f"--draft: name '{name}' is used twice or clashes with the truncate-N candidates."
            )
        out.append((name, folder))
    return out


def describe(model: Any, name: str, folder: Path, source: str) -> Candidate:
    cfg = model.config
    return Candidate(
        name=name,
        folder=str(folder),
        source=source,
        layers=int(cfg.num_hidden_layers),
        params=int(model.num_parameters()),
        hidden_size=int(cfg.hidden_size),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


def build_truncations(
    target_ref: str, target_dir: Path, tok: Any, layers: Sequence[int], work: Path
) -> list[Candidate]:
    """Save the target's first N layers as an HF folder per N (the undistilled `truncate` starting draft)."""
    from distill.config import load_config
    from distill.models.draft import build_initial_draft, save_hf_folder

    out = []
    for n in layers:
        cfg = load_config(
            CONFIG,
            [
                f"target.model={target_ref}",
                "draft.init=truncate",
                f"draft.num_layers={n}",
                "draft.layers=null",
            ],
        )
        model = build_initial_draft(cfg, target_dir)
        folder = save_hf_folder(model, tok, work / f"truncate-{n}", generation_source=target_dir)
        out.append(describe(model, f"truncate-{n}", folder, "truncate"))
        del model
    return out


def given_drafts(specs: Sequence[tuple[str, str]], target_tok: Any, target_ref: str) -> list[Candidate]:
    from distill.models.draft import check_same_vocab, load_causal_lm, load_tokenizer
    from distill.models.resolve import resolve_model

    out = []
    for name, ref in specs:
        folder = resolve_model(ref, key=f"--draft {name}")
        check_same_vocab(
            target_tok, load_tokenizer(folder), target_name=target_ref, draft_name=ref, key="--draft"
        )
        out.append(describe(load_causal_lm(folder), name, folder, "given"))
    return out


def load_prompt_ids(tok: Any, n: int, max_prompt_tokens: int, source: str) -> list[list[int]]:
    """The first `n` held-out `test` prompts of `source` (same split as the pipeline), chat-templated ids."""
    from distill.config import load_config
    from distill.errors import InputError
    from distill.evaluate.stage import tokenize_prompts
    from distill.prompts.sources import load_split

    d = load_config(CONFIG, []).data
    # Over-fetch: prompts longer than max_prompt_tokens are skipped.
    records, _ = load_split(
        source,
        "test",
        val_fraction=d.val_fraction,
        test_fraction=d.test_fraction,
        limit=4 * n + 16,
        key="--source",
    )
    ids, _ = tokenize_prompts(records, tok, max_prompt_tokens)
    if len(ids) < n:
        raise InputError(
            f"--prompts: only {len(ids)} test prompts of '{source}' fit {max_prompt_tokens} tokens."
        )
    return ids[:n]


# ---------------------------------------------------------------------------------------------------------
# Measurements


def measure_hf(
    target: Any, cand: Candidate, prompts: list[list[int]], eos: int, args: argparse.Namespace
) -> dict:
    """c_hf and α̂ at T=0 for one candidate (the target model is already loaded)."""
    from distill.evaluate.analytic import estimate_acceptance, measure_cost_ratio
    from distill.models.draft import load_causal_lm

    draft = load_causal_lm(cand.folder, dtype=args.dtype).eval()
    t0 = time.perf_counter()
    c_hf = measure_cost_ratio(target, draft, dtype=args.dtype, repeats=max(5, args.repeats))
    est = estimate_acceptance(
        target,
        draft,
        prompts,
        max_tokens=args.alpha_tokens,
        eos_token_id=eos,
        temperature=0.0,
        draft_sample_method="greedy",
        dtype=args.dtype,
    )
    del draft
    gc.collect()
    return {
        "c_hf": c_hf,
        "alpha_hat": est["alpha"],
        "top1_agreement": est["top1_agreement"],
        "alpha_positions": est["num_positions"],
        "alpha_per_position": est["alpha_per_position"][:8],
        "hf_wall_s": round(time.perf_counter() - t0, 1),
    }


def vllm_job(model_dir: str, prompts: list[list[int]], args: argparse.Namespace, partial: Path) -> dict:
    """A "speculate" worker job that times `model_dir` alone: plain decoding, batch 1, no stop tokens."""
    return {
        "kind": "speculate",
        "target": model_dir,
        "dtype": args.dtype,
        "trust_remote_code": False,
        "prompts": prompts,
        "max_tokens": args.timing_tokens,
        # Timing only: no stop ids. vLLM still stops at the tokenizer's EOS (the worker has no ignore_eos), so
        # the cost is taken per generated token and passes that stop short are flagged (short_passes).
        "eos_token_id": None,
        "stop_token_ids": [],
        "max_model_len": max(map(len, prompts)) + args.timing_tokens + 8,
        "configs": [
            {
                "name": "alone",
                "method": None,
                "draft": None,
                "k": 0,
                "temperature": 0.0,
                "draft_sample_method": None,
            }
        ],
        "repeats": args.repeats,
        "seed": 0,
        "max_num_seqs": 1,
        "tensor_parallel_size": 1,
        "enforce_eager": True,
        "device": "cpu",
        "partial_path": str(partial),
    }


def measure_vllm_one(
    name: str, model_dir: str, prompts: list[list[int]], args: argparse.Namespace, logs: Path
) -> dict:
    """Seconds per generated token of one model alone in vLLM; {"error": ...} when the worker fails."""
    from distill.errors import RuntimeFailure
    from distill.utils.subproc import run_worker

    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib)}
    job = vllm_job(model_dir, prompts, args, logs / f"{name}.partial.json")
    t0 = time.perf_counter()
    try:
        out = run_worker(
            job, log_path=logs / f"{name}.log", timeout_s=args.timeout_s, env=env, what=f"vLLM ({name})"
        )
        res = out["results"][0]
        if res.get("error"):
            raise RuntimeFailure(res["error"])
        per_tok = per_token_seconds(res)
    except (RuntimeFailure, ValueError, KeyError, IndexError) as exc:
        log.warning("vLLM timing of %s failed: %s", name, exc)
        return {"error": str(exc)[-2000:], "log": str(logs / f"{name}.log")}
    asked = len(prompts) * args.timing_tokens
    short = short_passes(res, asked)
    if short:
        log.warning(
            "vLLM timing of %s: passes %s generated fewer than the %d tokens asked", name, short, asked
        )
    return {
        "s_per_token": per_tok,
        "output_tokens_per_pass": res["output_tokens_per_pass"],
        "tokens_asked_per_pass": asked,
        "short_passes": short,
        "prompts_stopped_early": sum(len(t) < args.timing_tokens for t in res.get("token_ids") or []),
        "wall_s": res["wall_s"],
        "startup_s": res.get("startup_s"),
        "engine_version": out.get("engine_version"),
        "job_wall_s": round(time.perf_counter() - t0, 1),
        "error": None,
    }


def target_seconds(*timings: dict[str, Any] | None) -> float | None:
    """The target's vLLM seconds per token that the candidates are divided by: the mean of the medians of its
    timings that worked (first and last: the candidates ran in between), None when none did."""
    medians = [float(t["s_per_token"]["median"]) for t in timings if t and not t.get("error")]
    return sum(medians) / len(medians) if medians else None


def target_drift_pct(first: dict[str, Any] | None, last: dict[str, Any] | None) -> float | None:
    """How much slower (+) or faster (−) the target decoded at the end of the run than at its start."""
    a, b = target_seconds(first), target_seconds(last)
    return None if a is None or b is None else round(100.0 * (b / a - 1.0), 1)


def c_vllm_of(cand: dict[str, Any], target_s: float | None) -> float | None:
    if cand.get("error") or target_s is None:
        return None
    return float(cand["s_per_token"]["median"] / target_s)


# ---------------------------------------------------------------------------------------------------------
# Driver


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--target", default=None, help=f"target model (default {FULL['target']}; --quick: tiny-llama)"
    )
    p.add_argument("--layers", default=None, help=f"truncation depths (default {FULL['layers']})")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts for α̂ (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per model (median taken), ≥ 3")
    p.add_argument(
        "--draft", action="append", default=[], metavar="NAME=FOLDER", help="extra candidate drafts"
    )
    p.add_argument("--quick", action="store_true", help="tiny target, few prompts: a fast self-check")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM timing (c from PyTorch only)")
    p.add_argument("--source", default="sharegpt", help="prompt source (its `test` split is used)")
    p.add_argument(
        "--alpha-tokens", type=int, default=None, help="greedy target tokens per prompt for α̂ (32)"
    )
    p.add_argument("--timing-prompts", type=int, default=None, help="prompts per vLLM timing pass (8)")
    p.add_argument("--timing-tokens", type=int, default=None, help="max new tokens per vLLM prompt (128)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="skip longer prompts (256)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kvcache-gib", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per vLLM engine")
    p.add_argument("--name", default="drafts", help="output name: bench/out/NAME.json and NAME.md")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--workdir", type=Path, default=None, help="candidate folders (default OUT_DIR/work/NAME)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    defaults = {"alpha_tokens": 32, "timing_prompts": 8, "timing_tokens": 128, "max_prompt_tokens": 256}
    for key in (
        "target",
        "layers",
        "prompts",
        "alpha_tokens",
        "timing_prompts",
        "timing_tokens",
        "max_prompt_tokens",
    ):
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, defaults.get(key)))
    return args


def check_args(args: argparse.Namespace) -> None:
    from distill.errors import InputError

    if args.repeats < 3:
        raise InputError("--repeats: at least 3 timed passes (medians of ≥ 3 repeats).")
    for key in ("prompts", "alpha_tokens", "timing_prompts", "timing_tokens", "max_prompt_tokens"):
        if getattr(args, key) < 1:
            raise InputError(f"--{key.replace('_', '-')}: must be ≥ 1.")


def assemble_rows(
    cands: Sequence[Candidate], hf: dict[str, dict[str, Any]], vllm: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per candidate: its description, HF figures, c_vllm (None without a vLLM timing of both the
    candidate and the target: `vllm["target"]`, and `vllm["target_after"]` when it was timed again last) and
    the plan from the c used (c_vllm, else c_hf)."""
    target_s = target_seconds(vllm.get("target"), vllm.get("target_after"))
    rows = []
    for c in cands:
        c_vllm = c_vllm_of(vllm[c.name], target_s) if c.name in vllm else None
        c_used = c_vllm if c_vllm is not None else hf[c.name]["c_hf"]
        row = {
            **asdict(c),
            **hf[c.name],
            "c_vllm": c_vllm,
            "c_source": "vllm" if c_vllm is not None else "hf",
            "vllm": vllm.get(c.name),
        }
        row.update(plan_for(row["alpha_hat"], c_used))
        rows.append(row)
    return rows


def study(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from distill.errors import InputError
    from distill.models.draft import load_causal_lm, load_model_config, load_tokenizer
    from distill.models.resolve import resolve_model
    from distill.utils.subproc import vllm_available

    check_args(args)
    if not args.no_vllm and not vllm_available():
        raise InputError(
            "--no-vllm: vLLM is not installed here, so c_vllm cannot be measured; install `distill[cpu]` "
            "or pass --no-vllm to rank by the PyTorch cost ratio c_hf."
        )
    specs = parse_draft_specs(args.draft)
    target_dir = resolve_model(args.target, key="--target")
    tok = load_tokenizer(target_dir)
    layers = parse_layers(args.layers, int(load_model_config(target_dir).num_hidden_layers))
    n_prompts = max(args.prompts, args.timing_prompts)
    prompts = load_prompt_ids(tok, n_prompts, args.max_prompt_tokens, args.source)
    work = args.workdir or args.out_dir / "work" / args.name
    cands = given_drafts(specs, tok, args.target) + build_truncations(
        args.target, target_dir, tok, layers, work
    )
    log.info("candidates: %s", ", ".join(c.name for c in cands))

    target = load_causal_lm(target_dir, dtype=args.dtype).eval()
    hf = {c.name: measure_hf(target, c, prompts[: args.prompts], int(tok.eos_token_id), args) for c in cands}
    target_params = int(target.num_parameters())
    del target
    gc.collect()

    timing_prompts = prompts[: args.timing_prompts]
    vllm: dict[str, dict[str, Any]] = {}
    if not args.no_vllm:
        logs = args.out_dir / "logs" / args.name
        # The target first and again last: the candidates' costs are taken against both (drift shown).
        order = [("target", str(target_dir)), *((c.name, c.folder) for c in cands)]
        for name, folder in [*order, ("target_after", str(target_dir))]:
            log.info("vLLM timing: %s", name)
            vllm[name] = measure_vllm_one(name, folder, timing_prompts, args, logs)

    rows = assemble_rows(cands, hf, vllm)
    settings = {
        "target": args.target,
        "target_folder": str(target_dir),
        "target_params": target_params,
        "prompt_source": f"{args.source} (test split)",
        "alpha_prompts": args.prompts,
        "alpha_tokens": args.alpha_tokens,
        "timing_prompts": len(timing_prompts),
        "timing_tokens": args.timing_tokens,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "vllm_timing": not args.no_vllm,
        "target_speedup": TARGET_SPEEDUP,
    }
    return {
        "settings": settings,
        "target_vllm": vllm.get("target"),
        "target_vllm_after": vllm.get("target_after"),
        "target_drift_pct": target_drift_pct(vllm.get("target"), vllm.get("target_after")),
        "candidates": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def render(payload: dict[str, Any]) -> str:
        return render_markdown(
            payload["candidates"], payload["settings"], payload["target_vllm"], payload["target_vllm_after"]
        )

    _, rc = run_study("bench.bench_drafts", study, render, parse_args(argv), argv)
    return rc


if __name__ == "__main__":
    sys.exit(main())
