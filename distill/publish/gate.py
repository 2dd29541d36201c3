"""The publish gate: a draft is released only when its measured eval says it is worth serving.

Refused (exit 2 unless `publish.force`): no `eval/report.json`, a partial report (`"complete": false`), a
report the latest `distill eval` did not finish rewriting (no `stages/eval.json`: eval removes it when it
starts and writes it when it ends, so an interrupted eval leaves an older report behind without one), no
acceptance gain over the base (undistilled) draft at matching (k, temperature) (when the two share no k, of
the first drafted token at matching temperature), a failed `greedy_match`
at temperature 0 in float32 (speculation must not change the target's greedy output), or a draft that is not
faster than the target alone (speedup <= 1) at every setting eval measured it at. A first drafted token
accepted less often than eval.min_acceptance at the fastest setting is a warning, not a refusal: a faster draft
is worth serving even when it matches the target less often than eval's bar.
A parallel (PARD) draft that eval measured only as an ordinary draft (an older report) gets a warning: its
card serves it in parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.evaluate.report import first_drafted_acceptance
from distill.rundir import completion_path
from distill.utils.fs import read_json

REPORT = Path("eval") / "report.json"


@dataclass
class GateResult:
    report: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    distilled: list[dict[str, Any]] = field(default_factory=list)
    base: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def _same_path(a: Any, b: Path) -> bool:
    if not isinstance(a, str) or not a:
        return False
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def select_rows(report: dict[str, Any], name: str, path: Path) -> list[dict[str, Any]]:
    """Speculative result rows for one draft: matched by its folder, else by its label in the report."""
    rows = [r for r in report.get("results", []) if isinstance(r, dict) and r.get("method") == "draft_model"]
    by_path = [r for r in rows if _same_path(r.get("draft"), path)]
    return by_path or [r for r in rows if r.get("name") == name]


def _key(row: dict[str, Any]) -> tuple[int, float, str]:
    return int(row.get("k", 0)), float(row.get("temperature", 0.0)), str(row.get("draft_sample_method"))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def acceptance_gain(distilled: list[dict[str, Any]], base: list[dict[str, Any]]) -> tuple[float, float, int]:
    """Mean acceptance rate of each draft over the (k, temperature) pairs both were measured at."""
    base_by_key = {_key(r): r for r in base if r.get("acceptance_rate") is not None}
    pairs = [
        (r, base_by_key[_key(r)])
        for r in distilled
        if r.get("acceptance_rate") is not None and _key(r) in base_by_key
    ]
    if not pairs:
        return float("nan"), float("nan"), 0
    return (
        _mean([float(d["acceptance_rate"]) for d, _ in pairs]),
        _mean([float(b["acceptance_rate"]) for _, b in pairs]),
        len(pairs),
    )


def first_position_gain(
    distilled: list[dict[str, Any]], base: list[dict[str, Any]]
) -> tuple[float, float, int]:
    """Mean first-drafted-token acceptance of each draft over the (temperature, drafting) pairs both were
    measured at, whatever their k: for drafts measured at different k (a parallel draft at k=4 beside its base
    at k=1), where acceptance rates per drafted token are not comparable but the first token's are."""

    def by_setting(rows: list[dict[str, Any]]) -> dict[tuple[float, str], list[float]]:
        out: dict[tuple[float, str], list[float]] = {}
        for r in rows:
            first = first_drafted_acceptance(r)
            if first is not None:
                out.setdefault(_key(r)[1:], []).append(first)
        return out

    ours, theirs = by_setting(distilled), by_setting(base)
    common = sorted(set(ours) & set(theirs))
    if not common:
        return float("nan"), float("nan"), 0
    return _mean([_mean(ours[c]) for c in common]), _mean([_mean(theirs[c]) for c in common]), len(common)


def _gain_problem(distilled: list[dict[str, Any]], base: list[dict[str, Any]]) -> str | None:
    """Why the distilled draft shows no gain over the base draft, or None when it does."""
    ours, theirs, n = acceptance_gain(distilled, base)
    if n:
        if ours > theirs:
            return None
        return (
            f"no acceptance gain over the base draft: mean acceptance rate {ours:.4f} vs base {theirs:.4f} "
            f"over {n} (k, temperature, drafting) settings"
        )
    ours, theirs, n = first_position_gain(distilled, base)
    if n == 0:
        return "the distilled and base drafts were not measured at any common (temperature, drafting) setting"
    if ours > theirs:
        return None
    return (
        f"no acceptance gain over the base draft: first drafted token accepted {ours:.4f} vs base {theirs:.4f} "
        f"over {n} (temperature, drafting) settings (the drafts share no k)"
    )


def measured_speedup(row: dict[str, Any]) -> float | None:
    """The row's speedup over no speculation at its temperature; None when eval could not time it (an
    errored setting, or no no_spec baseline at that temperature)."""
    value = row.get("speedup")
    if row.get("error") or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return None if math.isnan(value) else float(value)


def fastest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row with the highest measured speedup, None when no row has one."""
    timed = [r for r in rows if measured_speedup(r) is not None]
    return max(timed, key=lambda r: measured_speedup(r) or 0.0) if timed else None


def _setting(row: dict[str, Any]) -> str:
    dsm = f", {row['draft_sample_method']} drafting" if row.get("draft_sample_method") else ""
    return f"k={row.get('k')}, temperature {float(row.get('temperature', 0.0)):.2f}{dsm}"


def _speed_problem(rows: list[dict[str, Any]]) -> str | None:
    """Why serving the draft would not pay: no setting faster than the target alone (or none timed)."""
    best = fastest(rows)
    if best is None:
        return (
            "eval timed the draft at no setting (no speedup: an error, or no no_spec baseline at its "
            "temperature): rerun `distill eval`"
        )
    speedup = measured_speedup(best) or 0.0
    if speedup > 1.0:
        return None
    timed = sum(measured_speedup(r) is not None for r in rows)
    return (
        f"speculation with this draft is not faster than the target alone at any of the {timed} measured "
        f"settings: best speedup {speedup:.2f}x ({_setting(best)})"
    )


def section(report: dict[str, Any], key: str) -> dict[str, Any]:
    """A report's dict-valued entry (`settings`, `recommendation`), empty when absent or malformed."""
    value = report.get(key)
    return value if isinstance(value, dict) else {}


def _min_acceptance(report: dict[str, Any]) -> float | None:
    candidates = (section(report, "settings"), section(report, "recommendation"))
    for value in (c.get("min_acceptance") for c in candidates):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _acceptance_warning(rows: list[dict[str, Any]], report: dict[str, Any]) -> list[str]:
    """A warning (not a refusal) when the fastest setting's first drafted token is accepted less often than
    eval.min_acceptance: eval's bar is about how often the draft matches, but a faster draft is worth serving
    all the same."""
    best, floor = fastest(rows), _min_acceptance(report)
    if best is None or floor is None or (measured_speedup(best) or 0.0) <= 1.0:
        return []
    first = first_drafted_acceptance(best)
    if first is not None and first >= floor:
        return []
    shown = "n/a" if first is None else f"{first:.2f}"
    return [
        f"first drafted token accepted {shown} at the fastest setting ({_setting(best)}) is below "
        f"eval.min_acceptance {floor:.2f}, so eval does not recommend deploying it; it is published because it is "
        f"{measured_speedup(best):.2f}x faster than the target alone there"
    ]


def _greedy_failures(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    failures, unchecked = [], []
    for r in rows:
        if float(r.get("temperature", 0.0)) != 0.0 or r.get("dtype", "float32") != "float32":
            continue  # bf16 verification may flip near-tied argmaxes: reported, not a gate
        gm = r.get("greedy_match")
        if gm is None:
            unchecked.append(f"k={r.get('k')}")
        elif float(gm) < 1.0:
            failures.append(f"k={r.get('k')}: greedy_match {float(gm):.3f}")
    return failures, unchecked


def load_report(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = run_dir / REPORT
    if not path.is_file():
        return None, f"{path} not found: run `distill eval` on this run first"
    try:
        report = read_json(path)
    except (OSError, ValueError) as exc:
        return None, f"{path} is unreadable ({exc}): rerun `distill eval`"
    if not isinstance(report, dict):
        return None, f"{path} is not a JSON object: rerun `distill eval`"
    return report, None


def check(run_dir: Path) -> GateResult:
    """Evaluate every gate condition for the draft in `run_dir/draft` (all problems, not just the first)."""
    report, error = load_report(run_dir)
    result = GateResult(report)
    if report is None:
        result.problems.append(error or "eval report missing")
        return result
    if report.get("complete", True) is False:
        why = report.get("error") or report.get("incomplete_reason") or "partial results"
        result.problems.append(f"{run_dir / REPORT} is incomplete ({why}): rerun `distill eval`")
    elif not completion_path(run_dir, "eval").is_file():
        result.problems.append(
            f"the latest `distill eval` on {run_dir} did not finish ({completion_path(run_dir, 'eval')} is "
            f"missing), so {run_dir / REPORT} may describe an earlier eval: rerun `distill eval`"
        )
    result.distilled = select_rows(report, "distilled", run_dir / "draft")
    result.base = select_rows(report, "base", run_dir / "draft_init")
    if not result.distilled:
        result.problems.append(f"{run_dir / REPORT} has no draft_model results for {run_dir / 'draft'}")
    elif not result.base:
        result.problems.append(
            f"{run_dir / REPORT} has no results for the base draft ({run_dir / 'draft_init'}), so no gain can be "
            "shown: keep the `base` entry in eval.drafts"
        )
    else:
        gain_problem = _gain_problem(result.distilled, result.base)
        if gain_problem:
            result.problems.append(gain_problem)
    if result.distilled:
        slower = _speed_problem(result.distilled)
        if slower:
            result.problems.append(slower)
        result.warnings.extend(_acceptance_warning(result.distilled, report))
    failures, unchecked = _greedy_failures(result.distilled)
    if failures:
        result.problems.append(
            "greedy_match failed at temperature 0 in float32 (speculation changed the "
            "target's output): " + "; ".join(failures)
        )
    if unchecked:
        result.warnings.append("greedy_match not reported at temperature 0 for " + ", ".join(unchecked))
    result.warnings.extend(_parallel_unmeasured(run_dir, result.distilled))
    result.warnings.extend(_staleness(run_dir))
    return result


def draft_parallel_tokens(draft_dir: str | Path | None) -> int:
    """K of a parallel (PARD) draft from its config.json (`pard_token` + `distill_parallel_tokens`), else 0."""
    if not draft_dir:
        return 0
    try:
        config = read_json(Path(draft_dir) / "config.json")
    except (OSError, ValueError):
        return 0
    if not isinstance(config, dict) or config.get("pard_token") is None:
        return 0
    k = config.get("distill_parallel_tokens")
    return k if isinstance(k, int) and not isinstance(k, bool) else 0


def _parallel_unmeasured(run_dir: Path, rows: list[dict[str, Any]]) -> list[str]:
    big_k = draft_parallel_tokens(run_dir / "draft")
    if not big_k or not rows or any(r.get("parallel_drafting") for r in rows):
        return []
    return [
        f"{run_dir / 'draft'} is a parallel draft (k <= {big_k} in one forward pass) but {run_dir / REPORT} "
        "measured it only as an ordinary draft; rerun `distill eval` to measure it with parallel_drafting"
    ]


def _staleness(run_dir: Path) -> list[str]:
    weights = sorted((run_dir / "draft").glob("*.safetensors"))
    report = run_dir / REPORT
    if weights and report.is_file() and max(p.stat().st_mtime for p in weights) > report.stat().st_mtime:
        return [f"{run_dir / 'draft'} was written after {report}; the eval may describe an earlier draft"]
    return []


def summary(result: GateResult) -> dict[str, Any]:
    ours, theirs, n = acceptance_gain(result.distilled, result.base)
    first, base_first, n_first = first_position_gain(result.distilled, result.base)
    best = fastest(result.distilled)
    return {
        "passed": result.passed,
        "problems": result.problems,
        "warnings": result.warnings,
        "mean_acceptance_rate": None if n == 0 else ours,
        "base_mean_acceptance_rate": None if n == 0 else theirs,
        "compared_settings": n,
        "first_token_acceptance": None if n_first == 0 else first,
        "base_first_token_acceptance": None if n_first == 0 else base_first,
        "first_token_compared_settings": n_first,
        "best_speedup": None if best is None else measured_speedup(best),
    }
