"""Turn the engine's per-configuration results into `eval/report.json` rows, recommendations and markdown.

Pure functions of plain dicts (no engine, no files), so the report math is tested on canned results.
Definitions follow vLLM and CONTRACT.md: acceptance_rate = accepted / draft tokens; mean_acceptance_length =
1 + accepted / drafts; per_position_acceptance[i] = accepted at i / drafts; speedup = tokens_per_s / no_spec
tokens_per_s at the same temperature on the same prompts, tokens_per_s being the median over the timed passes.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

from distill.evaluate.jobs import NO_SPEC
from distill.evaluate.metrics import acceptance_rates

SLOWER_WARNING = "speculation is slower than none here"


def pass_rates_by_round(res: dict[str, Any]) -> list[tuple[int, float]]:
    """(round, tokens/s) of each timed pass with a wall time, a pass that produced no tokens included; the
    round is 0 unless the eval ran several (`round_of_pass`)."""
    walls = res.get("wall_s") or []
    per_pass = res.get("output_tokens_per_pass") or [res.get("output_tokens") or 0] * len(walls)
    rounds = res.get("round_of_pass") or [0] * len(walls)
    return [(int(r), (n or 0) / w) for r, n, w in zip(rounds, per_pass, walls, strict=False) if w and w > 0]


def pass_rates(res: dict[str, Any]) -> list[float]:
    """Tokens/s of each timed pass: what `tokens_per_s` takes the median of."""
    return [rate for _, rate in pass_rates_by_round(res)]


def tokens_per_s(res: dict[str, Any]) -> float | None:
    """Median over the timed passes of (tokens generated in the pass / wall seconds of the pass)."""
    rates = pass_rates(res)
    return statistics.median(rates) if rates else None


def rates_by_round(res: dict[str, Any]) -> dict[int, float]:
    """Median tokens/s of each round's timed passes (`round_of_pass`; one round when absent)."""
    by_round: dict[int, list[float]] = {}
    for r, rate in pass_rates_by_round(res):
        by_round.setdefault(r, []).append(rate)
    return {r: statistics.median(v) for r, v in sorted(by_round.items())}


def speedup_per_round(res: dict[str, Any], base: dict[str, Any]) -> list[float | None] | None:
    """The speedup within each round (this configuration's tokens/s over no_spec's of the same round), when
    the eval ran several rounds: how much the machine's drift moved the pooled figure."""
    mine, theirs = rates_by_round(res), rates_by_round(base)
    rounds = sorted(set(mine) | set(theirs))
    if len(rounds) < 2:
        return None
    return [mine[r] / theirs[r] if r in mine and theirs.get(r) else None for r in rounds]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Share of prompts whose text equals the no_spec text, and the mean common-prefix length in tokens."""
    texts, ref = res.get("texts") or [], base.get("texts") or []
    if not texts or len(texts) != len(ref):
        return {"greedy_match": None, "mean_common_prefix": None}
    same = sum(1 for a, b in zip(texts, ref, strict=True) if a == b)
    ids, ref_ids = res.get("token_ids") or [], base.get("token_ids") or []
    prefix = None
    if ids and len(ids) == len(ref_ids):
        prefix = statistics.fmean(common_prefix_len(a, b) for a, b in zip(ids, ref_ids, strict=True))
    return {"greedy_match": same / len(texts), "mean_common_prefix": prefix}


def _baselines(results: list[dict[str, Any]]) -> dict[float, dict[str, Any]]:
    return {float(r["temperature"]): r for r in results if r.get("name") == NO_SPEC and not r.get("error")}


def result_row(res: dict[str, Any], base: dict[str, Any] | None, *, dtype: str) -> dict[str, Any]:
    """One `results[]` entry of report.json (without the bulky texts and token ids)."""
    tps = tokens_per_s(res)
    base_tps = tokens_per_s(base) if base else None
    row: dict[str, Any] = {
        key: res.get(key)
        for key in (
            "name",
            "method",
            "draft",
            "k",
            "temperature",
            "draft_sample_method",
            "startup_s",
            "wall_s",
            "load_avg",
            "foreign_cpu",
            "output_tokens",
            "output_tokens_per_pass",
            "error",
        )
    }
    row["parallel_drafting"] = bool(res.get("parallel_drafting"))
    row["dtype"] = dtype
    row["tokens_per_s"] = tps
    row["speedup"] = (tps / base_tps) if (tps is not None and base_tps) else None
    if len(set(res.get("round_of_pass") or [])) > 1:
        row["round_of_pass"] = list(res["round_of_pass"])
    per_round = speedup_per_round(res, base) if base and res.get("method") is not None else None
    if per_round is not None:
        row["speedup_per_round"] = per_round
    if res.get("method") is not None:
        counts = {
            key: int(res.get(key) or 0) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }
        row.update(counts)
        row["accepted_per_pos"] = list(res.get("accepted_per_pos") or [])
        row.update(
            acceptance_rates(
                counts["num_drafts"],
                counts["num_draft_tokens"],
                counts["num_accepted_tokens"],
                row["accepted_per_pos"],
            )
        )
        if float(res["temperature"]) == 0.0 and base is not None and not res.get("error"):
            row.update(greedy_agreement(res, base))
    return row


def build_rows(results: list[dict[str, Any]], *, dtype: str) -> list[dict[str, Any]]:
    bases = _baselines(results)
    return [result_row(r, bases.get(float(r["temperature"])), dtype=dtype) for r in results]


def _speedup(expected_speedup: Callable[..., float], alpha: float, row: dict[str, Any], c: float) -> float:
    """expected_speedup(α, k, c), told when the row's draft proposes all k in one forward (parallel)."""
    extra = {"parallel": True} if row.get("parallel_drafting") else {}
    return float(expected_speedup(min(alpha, 1.0 - 1e-9), int(row["k"]), c, **extra))


def add_analytic(
    rows: list[dict[str, Any]],
    expected_speedup: Callable[..., float],
    cost_ratio: dict[str, float],
) -> None:
    """Beside each measured speedup, the analytic one from the measured acceptance and the cost ratio c."""
    for row in rows:
        c = cost_ratio.get(str(row.get("name")))
        alpha = row.get("acceptance_rate")
        if row.get("method") != "draft_model" or c is None or alpha is None or not row.get("k"):
            continue
        row["cost_ratio"] = c
        row["analytic_speedup"] = _speedup(expected_speedup, float(alpha), row, c)


def add_estimates(
    rows: list[dict[str, Any]],
    expected_speedup: Callable[..., float],
    cost_ratio: dict[str, float],
    estimates: dict[tuple[str, float, str], dict[str, Any]],
) -> None:
    """Beside each measured acceptance and speedup, the ones predicted from the estimated acceptance.

    A parallel draft's estimate carries `tokens_per_round` (E at k = 1..K, from per-draft-position
    acceptance): its acceptance rate is (E − 1) / k and its speedup E / (1 + c), one draft forward a round.
    """
    for row in rows:
        key = (str(row.get("name")), float(row["temperature"]), row.get("draft_sample_method") or "greedy")
        est, c = estimates.get(key), cost_ratio.get(str(row.get("name")))
        if row.get("method") != "draft_model" or est is None or not row.get("k"):
            continue
        if "tokens_per_round" in est:
            _add_parallel_estimate(row, est, c)
            continue
        if est.get("alpha") is None:
            continue
        alpha = float(est["alpha"])
        row["estimated_acceptance"] = alpha
        if c is not None:
            row["estimated_speedup"] = _speedup(expected_speedup, alpha, row, c)


def _add_parallel_estimate(row: dict[str, Any], est: dict[str, Any], c: float | None) -> None:
    k, per_k = int(row["k"]), list(est["tokens_per_round"])
    # k = 1 is one token from one forward either way (it runs without parallel_drafting, jobs.build_configs)
    if (k > 1 and not row.get("parallel_drafting")) or k > len(per_k):
        return  # measured autoregressively, or past the k the estimate covers: no matching estimate
    tokens = float(per_k[k - 1])
    row["estimated_acceptance"] = (tokens - 1.0) / k
    row["estimated_mean_acceptance_length"] = tokens
    if c is not None:
        row["estimated_speedup"] = tokens / (1.0 + c)


def recommend(
    rows: list[dict[str, Any]], *, min_acceptance: float, incomplete: str | None = None
) -> list[dict[str, Any]]:
    """The fastest speculative configuration per temperature, with the deploy gate: deploy only when the eval
    is complete (`incomplete` is None; otherwise it says why not), the first drafted token's acceptance >=
    `min_acceptance`, speedup > 1 and, in float32 at temperature 0, the output equals the target's
    (greedy_match 1)."""
    out = []
    for temp in sorted({float(r["temperature"]) for r in rows}):
        cands = [
            r
            for r in rows
            if float(r["temperature"]) == temp
            and r.get("method") is not None
            and r.get("speedup") is not None
            and not r.get("error")
        ]
        if not cands:
            out.append(
                {
                    "temperature": temp,
                    "name": None,
                    "k": None,
                    "speedup": None,
                    "deploy": False,
                    "causes": [CAUSE_NOTHING] + ([CAUSE_INCOMPLETE] if incomplete else []),
                    "min_acceptance": min_acceptance,
                    "reason": "no speculative configuration was measured at this temperature"
                    + (f" ({_incomplete_problem(incomplete)})" if incomplete else ""),
                    "warning": "nothing to recommend",
                }
            )
            continue
        # The fastest configuration that passes the gate; when none does, the fastest one, flagged.
        passing = [r for r in cands if not _problems(r, min_acceptance)]
        best = max(passing or cands, key=lambda r: r["speedup"])
        passed_over = faster_below_acceptance_bar(cands, best, min_acceptance)
        rec = _gate(best, min_acceptance, incomplete, gated=passed_over is not None)
        if passed_over is not None:
            first = first_drafted_acceptance(passed_over)
            rec["passed_over"] = {
                "name": passed_over["name"],
                "k": passed_over["k"],
                "speedup": float(passed_over["speedup"]),
                "acceptance_rate": passed_over.get("acceptance_rate"),
                "first_drafted_acceptance": first,
            }
            rec["reason"] += (
                f" {_label(passed_over)} was faster ({float(passed_over['speedup']):.2f}x) but is held back only "
                f"by its first drafted token's acceptance {first:.2f} < eval.min_acceptance "
                f"{min_acceptance:.2f}; lower eval.min_acceptance to recommend it."
            )
        out.append(rec)
    return out


def faster_below_acceptance_bar(
    cands: list[dict[str, Any]], best: dict[str, Any], min_acceptance: float
) -> dict[str, Any] | None:
    """The fastest configuration faster than `best` whose only failed deploy condition is acceptance below
    `min_acceptance` (a user trading acceptance for speed would pick it), or None."""
    held_back = [
        r
        for r in cands
        if float(r["speedup"]) > float(best["speedup"])
        and set(_problems(r, min_acceptance)) == {CAUSE_LOW_ACCEPTANCE}
        and first_drafted_acceptance(r) is not None
    ]
    return max(held_back, key=lambda r: r["speedup"]) if held_back else None


def _label(row: dict[str, Any]) -> str:
    """`name k=K`, with the drafting mode: how a recommendation names a configuration."""
    label = f"{row['name']} k={row['k']}" + (
        f" ({row['draft_sample_method']} drafting)" if row.get("draft_sample_method") else ""
    )
    if row.get("parallel_drafting"):
        label += " (parallel draft: one forward pass proposes all k)"
    return label


# Why a recommendation says deploy: false, as codes (`causes`) for readers such as the model card.
CAUSE_INCOMPLETE = "incomplete"
CAUSE_SLOWER = "not_faster"
CAUSE_LOW_ACCEPTANCE = "low_acceptance"
CAUSE_GREEDY = "greedy_mismatch"
CAUSE_NOTHING = "nothing_measured"


def greedy_mismatch(row: dict[str, Any]) -> bool:
    """Speculation changed the output where it must not: temperature 0, float32, greedy_match < 1."""
    gm = row.get("greedy_match")
    return (
        row.get("method") is not None
        and float(row.get("temperature", 0.0)) == 0.0
        and row.get("dtype") == "float32"
        and gm is not None
        and float(gm) < 1.0
    )


def first_drafted_acceptance(row: dict[str, Any]) -> float | None:
    """The share of rounds whose first drafted token the target accepted (per_position_acceptance[0]): how often
    the draft's next token is the target's, whatever k is. vLLM's acceptance_rate (accepted / drafted tokens)
    falls as k grows, since a later position counts only when every one before it was accepted, so a bar on it
    would hold back a longer draft (a parallel one above all) that measured faster. None when unmeasured."""
    per_pos = row.get("per_position_acceptance")
    if isinstance(per_pos, list) and per_pos and per_pos[0] is not None:
        return float(per_pos[0])
    acc = row.get("acceptance_rate")
    if acc is not None and int(row.get("k") or 0) == 1:  # one position: the same figure
        return float(acc)
    return None


def _problems(row: dict[str, Any], min_acceptance: float) -> dict[str, str]:
    """cause code -> message, for each deploy condition `row` fails."""
    first, speedup = first_drafted_acceptance(row), float(row["speedup"])
    problems = {}
    if speedup <= 1.0:
        problems[CAUSE_SLOWER] = f"{SLOWER_WARNING} (best speedup {speedup:.2f}x)"
    if first is None or first < min_acceptance:
        shown = "n/a" if first is None else f"{first:.2f}"
        problems[CAUSE_LOW_ACCEPTANCE] = (
            f"first drafted token accepted {shown} < {min_acceptance:.2f}: the draft rarely matches the target"
        )
    if greedy_mismatch(row):
        problems[CAUSE_GREEDY] = (
            f"greedy_match {float(row['greedy_match']):.3f} < 1 in float32: speculation changed the output"
        )
    return problems


def _incomplete_problem(incomplete: str) -> str:
    # Only the first line: a worker error carries its whole log tail, which belongs in report.error.
    first = incomplete.strip().splitlines()[0] if incomplete.strip() else "partial results"
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"the eval is incomplete ({first}): figures cover only part of the sweep"


def _gate(
    best: dict[str, Any], min_acceptance: float, incomplete: str | None = None, *, gated: bool = False
) -> dict[str, Any]:
    """The recommendation of `best`; `gated`: a faster configuration was held back by the acceptance bar."""
    acc, speedup = best.get("acceptance_rate"), float(best["speedup"])
    problems = _problems(best, min_acceptance)
    if incomplete is not None:
        problems = {CAUSE_INCOMPLETE: _incomplete_problem(incomplete), **problems}
    label = _label(best)
    rec = {
        "temperature": float(best["temperature"]),
        "name": best["name"],
        "method": best.get("method"),
        "draft": best.get("draft"),
        "k": best["k"],
        "draft_sample_method": best.get("draft_sample_method"),
        "parallel_drafting": bool(best.get("parallel_drafting")),
        "speculative_config": speculative_config(best),
        "speedup": speedup,
        "acceptance_rate": acc,
        "first_drafted_acceptance": first_drafted_acceptance(best),
        "min_acceptance": min_acceptance,
        "deploy": not problems,
        "causes": list(problems),
    }
    if problems:
        rec["reason"] = (
            f"best measured is {label}, but " + "; ".join(problems.values()) + ". Do not deploy it."
        )
        rec["warning"] = "; ".join(problems.values())
    else:
        fastest = "the fastest that passes eval.min_acceptance" if gated else "the fastest"
        rec["reason"] = (
            f"{label} is {fastest}: {speedup:.2f}x the target alone, first drafted token accepted "
            f"{rec['first_drafted_acceptance']:.2f} (acceptance rate {acc:.2f})."
        )
    return rec


def speculative_config(row: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for a measured row (None for no speculation), as the worker ran it (for
    ngram, the prompt-lookup bounds are in the report's settings)."""
    if row.get("method") is None:
        return None
    spec: dict[str, Any] = {"method": row["method"], "num_speculative_tokens": int(row["k"])}
    if row["method"] != "ngram":  # draft_model or eagle: a folder, drafting greedily or by sampling
        spec["model"] = row.get("draft")
        spec["draft_sample_method"] = row.get("draft_sample_method") or "greedy"
        if row.get("parallel_drafting"):
            spec["parallel_drafting"] = True
        if row.get("heterogeneous_vocab"):  # a trimmed-vocabulary draft (draft.vocab_size)
            spec["use_heterogeneous_vocab"] = True
    return spec


def greedy_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """A warning when a float32 run at temperature 0 did not reproduce the target's output."""
    bad = [r for r in rows if greedy_mismatch(r)]
    if not bad:
        return []
    detail = "; ".join(
        f"{r['name']} k={r.get('k')}: greedy_match {float(r['greedy_match']):.3f}, mean common prefix "
        f"{_fmt(r.get('mean_common_prefix'), '.1f')} tokens"
        for r in bad
    )
    return [
        "WARNING: speculation changed the target's greedy output in float32 ("
        + detail
        + "). At temperature 0 in float32 speculative decoding must reproduce the target alone exactly, so this "
        "is a correctness problem (an engine defect or broken verification), not a quality trade-off: do not "
        "deploy these configurations; the texts are in eval/raw_results.json."
    ]


# ---------------------------------------------------------------------------------------------------------
# Markdown


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Speculative decoding eval — {report.get('target')}", ""]
    if not report.get("complete", False):
        lines += [
            "> **INCOMPLETE**: "
            + str(report.get("error") or "the run did not finish")
            + " Figures below cover only the configurations that finished.",
            "",
        ]
    for note in [*(report.get("warnings") or []), *(report.get("notes") or [])]:
        lines += [f"> {note}", ""]
    lines += [
        f"- engine: {report.get('engine')} {report.get('engine_version')} on {report.get('device')}, "
        f"dtype {report.get('dtype')}",
        f"- hardware: {hardware_summary(report)}",
        f"- prompts: {report['prompts']['count']} from `{report['prompts']['source']}`, max_tokens "
        f"{report.get('max_tokens')} (stop at EOS), batch (max_num_seqs) {report['settings'].get('max_num_seqs')}, "
        f"{report['settings'].get('repeats')} timed repeats after a warm-up (median)" + _rounds_note(report),
        f"- draft sampling: {_measured_sample_methods(report)}; rejection sampling: "
        f"{report['settings'].get('rejection_sample_method')}",
        f"- vLLM CPU settings: {report['settings'].get('vllm_env')}"
        if report.get("engine") == "vllm" and report.get("device") == "cpu"
        else f"- engine settings: tensor_parallel_size {report['settings'].get('tensor_parallel_size')}",
        "",
    ]
    for rec in report.get("recommendations", []):
        verdict = "deploy" if rec["deploy"] else "**do not deploy**"
        spec = rec.get("speculative_config")
        serve = f" `--speculative-config '{json.dumps(spec)}'`" if spec and rec["deploy"] else ""
        lines.append(f"- T={rec['temperature']}: {verdict} — {rec['reason']}{serve}")
    if any(r.get("parallel_drafting") for r in report.get("results", [])):
        lines.append(
            "- parallel drafting: a parallel draft proposes all k tokens in ONE forward pass (its input ends "
            "with k − 1 mask tokens; vLLM `parallel_drafting: true`), so a round costs about one draft step "
            "instead of k; it is measured only at k up to the k it was trained for."
        )
    lines.append("")
    for temp in sorted({float(r["temperature"]) for r in report["results"]}):
        lines += _table(temp, [r for r in report["results"] if float(r["temperature"]) == temp])
    mem = report.get("memory")
    if mem:
        lines += ["## Memory estimate", "", "| part | GiB |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in mem.get("gib", {}).items()]
        lines += ["", str(mem.get("note", "")), ""]
    return "\n".join(lines) + "\n"


def _measured_sample_methods(report: dict[str, Any]) -> str:
    """The draft sampling methods the results used (temperature 0 always drafts greedily, so a T=0-only run
    lists greedy even when eval.draft_sample_methods names more); the setting when no draft row ran."""
    used = {r["draft_sample_method"] for r in report.get("results", []) if r.get("draft_sample_method")}
    configured = list(report["settings"].get("draft_sample_methods", []))
    ordered = [m for m in configured if m in used] + sorted(used - set(configured))
    return ", ".join(ordered or configured) or "–"


def hardware_summary(report: dict[str, Any]) -> str:
    """One line for the hardware: `report["hardware"]["summary"]`, else the bare device (older reports)."""
    hw = report.get("hardware")
    if isinstance(hw, dict) and hw.get("summary"):
        return str(hw["summary"])
    return str(hw or report.get("device") or "unknown")


def _prefix(row: dict[str, Any]) -> str:
    return f" ({row['mean_common_prefix']:.1f})" if row.get("mean_common_prefix") is not None else ""


def _est(row: dict[str, Any], key: str) -> str:
    return f" ({row[key]:.2f})" if row.get(key) is not None else ""


def _drafting(row: dict[str, Any]) -> str:
    """How the draft proposes: one forward per token (autoregressive) or all k in one (parallel)."""
    if row.get("method") != "draft_model":
        return row.get("method") or "–"
    return "parallel" if row.get("parallel_drafting") else "autoregressive"


def _rounds_note(report: dict[str, Any]) -> str:
    rounds = int(report["settings"].get("rounds") or 1)
    if rounds < 2:
        return ""
    engines = "; engines kept running across rounds" if report["settings"].get("keep_engines") else ""
    return f", in each of {rounds} rounds over all configurations in turn (passes pooled{engines})"


def _per_round(rows: list[dict[str, Any]]) -> list[str]:
    """One line per speculative row measured in several rounds: its speedup in each round."""
    lines = [
        f"- {r['name']} k={r.get('k')}: " + ", ".join(_fmt(x) for x in r["speedup_per_round"])
        for r in rows
        if r.get("speedup_per_round")
    ]
    return ["Speedup in each round (same-round no_spec as the base):", "", *lines, ""] if lines else []


def _table(temp: float, rows: list[dict[str, Any]]) -> list[str]:
    out = [
        f"## Temperature {temp}",
        "",
        "| config | k | drafting | draft sampling | acceptance rate (est.) | mean acceptance length | tokens/s "
        "| speedup | analytic speedup: measured a (est. a) | greedy match (mean common prefix) | start-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["name"] + (" (error)" if r.get("error") else "")
        out.append(
            f"| {name} | {r.get('k')} | {_drafting(r)} | {r.get('draft_sample_method') or '–'} "
            f"| {_fmt(r.get('acceptance_rate'))}{_est(r, 'estimated_acceptance')} "
            f"| {_fmt(r.get('mean_acceptance_length'))} | {_fmt(r.get('tokens_per_s'), '.1f')} "
            f"| {_fmt(r.get('speedup'))} | {_fmt(r.get('analytic_speedup'))}{_est(r, 'estimated_speedup')} | {_fmt(r.get('greedy_match'))}{_prefix(r)} "
            f"| {_fmt(r.get('startup_s'), '.1f')} |"
        )
    errors = [r for r in rows if r.get("error")]
    out += [""] + [f"- {r['name']} k={r.get('k')}: {r['error']}" for r in errors] + ([""] if errors else [])
    return out + _per_round(rows)
