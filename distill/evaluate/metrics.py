"""Speculative-decoding counters from vLLM's metrics snapshot, and the derived rates. Pure functions.

`LLM.get_metrics()` returns objects with `.name`, `.labels` and `.value` (counters) or `.values` (the
per-position vector). Counters are cumulative over the process and labelled per engine: we sum the labels and
take differences around each measured batch. Plain dicts with the same keys are accepted too (tests, JSON).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _get(metric: Any, key: str) -> Any:
    if isinstance(metric, Mapping):
        return metric.get(key)
    return getattr(metric, key, None)


def _name(metric: Any) -> str:
    name = str(_get(metric, "name") or "")
    # The Prometheus exposition format suffixes counters with `_total`; the snapshot API strips it.
    return name[: -len("_total")] if name.endswith("_total") else name


def _add_vectors(a: list[int], b: Iterable[Any]) -> list[int]:
    b = [int(x) for x in b]
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def extract_spec_counters(metrics: Iterable[Any]) -> SpecCounters:
    """Sum the four speculative-decoding counters over all label sets (engines) in a metrics snapshot.

    Counters absent from the snapshot (no speculation configured, or nothing drafted yet) count as 0.
    """
    out = SpecCounters()
    scalar = {
        NUM_DRAFTS: "num_drafts",
        NUM_DRAFT_TOKENS: "num_draft_tokens",
        NUM_ACCEPTED: "num_accepted_tokens",
    }
    for m in metrics:
        name = _name(m)
        if name in scalar:
            attr = scalar[name]
            setattr(out, attr, getattr(out, attr) + int(_get(m, "value") or 0))
        elif name == ACCEPTED_PER_POS:
            out.accepted_per_pos = _add_vectors(out.accepted_per_pos, _get(m, "values") or [])
    return out


def counters_delta(before: SpecCounters, after: SpecCounters, k: int | None = None) -> SpecCounters:
    """`after - before`; the per-position vector is padded/cut to `k` entries when `k` is given.

    Raises ValueError when a counter went backwards (the two snapshots are from different engines).
    """
    per_pos = _add_vectors(after.accepted_per_pos, [-x for x in before.accepted_per_pos])
    if k is not None:
        per_pos = (per_pos + [0] * k)[:k]
    delta = SpecCounters(
        after.num_drafts - before.num_drafts,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        per_pos,
    )
    if min([delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens, *per_pos], default=0) < 0:
        raise ValueError(f"spec-decode counters went backwards: {before} -> {after}")
    return delta


def sum_counters(parts: Iterable[SpecCounters], k: int) -> SpecCounters:
    total = SpecCounters(accepted_per_pos=[0] * k)
    for p in parts:
        total.num_drafts += p.num_drafts
        total.num_draft_tokens += p.num_draft_tokens
        total.num_accepted_tokens += p.num_accepted_tokens
        total.accepted_per_pos = _add_vectors(total.accepted_per_pos, p.accepted_per_pos)[: max(k, 0)]
    return total


def acceptance_rates(
    num_drafts: int, num_draft_tokens: int, num_accepted: int, accepted_per_pos: list[int]
) -> dict[str, Any]:
    """vLLM's definitions: acceptance_rate = accepted / draft tokens; mean_acceptance_length = 1 + accepted /
    drafts; per_position_acceptance[i] = accepted at position i / drafts. None where the denominator is 0."""
    return {
        "acceptance_rate": (num_accepted / num_draft_tokens) if num_draft_tokens else None,
        "mean_acceptance_length": (1.0 + num_accepted / num_drafts) if num_drafts else None,
        "per_position_acceptance": [a / num_drafts for a in accepted_per_pos]
        if num_drafts
        else [None] * len(accepted_per_pos),
    }
