"""Extraction of vLLM's speculative-decoding counters from metrics snapshots (canned objects and dicts)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from distill.evaluate.metrics import (
    SpecCounters,
    acceptance_rates,
    counters_delta,
    extract_spec_counters,
    sum_counters,
)


@dataclass
class Counter:  # the shape of vllm.v1.metrics.reader.Counter
    name: str
    labels: dict
    value: int


@dataclass
class Vector:  # vllm.v1.metrics.reader.Vector
    name: str
    labels: dict
    values: list


@dataclass
class Gauge:
    name: str
    labels: dict
    value: float


def snapshot(drafts, draft_tokens, accepted, per_pos, engines=1):
    out = [Gauge("vllm:num_requests_running", {}, 3.0), Counter("vllm:prompt_tokens", {}, 999)]
    for e in range(engines):
        labels = {"engine": str(e), "model_name": "m"}
        out += [
            Counter("vllm:spec_decode_num_drafts", labels, drafts),
            Counter("vllm:spec_decode_num_draft_tokens", labels, draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, per_pos),
        ]
    return out


def test_extracts_the_four_counters_and_ignores_others():
    c = extract_spec_counters(snapshot(238, 714, 10, [8, 1, 1]))
    assert c == SpecCounters(238, 714, 10, [8, 1, 1])


def test_sums_over_engines():
    c = extract_spec_counters(snapshot(10, 30, 12, [6, 4, 2], engines=2))
    assert c == SpecCounters(20, 60, 24, [12, 8, 4])


def test_accepts_dicts_and_total_suffix():
    c = extract_spec_counters(
        [
            {"name": "vllm:spec_decode_num_drafts_total", "value": 5},
            {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "values": [3, 1]},
        ]
    )
    assert c.num_drafts == 5 and c.accepted_per_pos == [3, 1] and c.num_draft_tokens == 0


def test_no_speculation_gives_zeros():
    assert extract_spec_counters(snapshot(0, 0, 0, [])[:2]) == SpecCounters()


def test_delta_and_padding_to_k():
    before = extract_spec_counters(snapshot(100, 300, 50, [30, 20]))
    after = extract_spec_counters(snapshot(160, 480, 110, [60, 40, 10]))
    d = counters_delta(before, after, k=3)
    assert d == SpecCounters(60, 180, 60, [30, 20, 10])
    assert counters_delta(SpecCounters(), SpecCounters(1, 2, 1, [1]), k=3).accepted_per_pos == [1, 0, 0]


def test_delta_refuses_counters_going_backwards():
    with pytest.raises(ValueError):
        counters_delta(SpecCounters(10, 10, 10, [10]), SpecCounters(5, 5, 5, [5]))


def test_sum_counters():
    total = sum_counters([SpecCounters(1, 3, 2, [1, 1, 0]), SpecCounters(2, 6, 3, [2, 1, 0])], k=3)
    assert total == SpecCounters(3, 9, 5, [3, 2, 0])


def test_acceptance_rates_use_vllm_definitions():
    r = acceptance_rates(num_drafts=10, num_draft_tokens=40, num_accepted=20, accepted_per_pos=[8, 6, 4, 2])
    assert r["acceptance_rate"] == pytest.approx(0.5)
    assert r["mean_acceptance_length"] == pytest.approx(3.0)
    assert r["per_position_acceptance"] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    empty = acceptance_rates(0, 0, 0, [0, 0])
    assert empty["acceptance_rate"] is None and empty["per_position_acceptance"] == [None, None]
