"""Report math on canned engine results: tokens/s, speedup, acceptance, greedy match, deploy gate, markdown."""

from __future__ import annotations

import pytest

from distill.evaluate import jobs, report


def res(
    name,
    *,
    method="draft_model",
    k=2,
    temp=0.0,
    walls=(1.0, 2.0, 1.0),
    tokens=100,
    drafts=0,
    draft_tokens=0,
    accepted=0,
    per_pos=None,
    texts=("a", "b"),
    ids=((1, 2), (3, 4)),
    dsm="greedy",
    error=None,
):
    return {
        "name": name,
        "method": method,
        "draft": None if method != "draft_model" else f"/m/{name}",
        "k": k,
        "temperature": temp,
        "draft_sample_method": dsm if method == "draft_model" else None,
        "startup_s": 20.0,
        "wall_s": list(walls),
        "output_tokens": tokens,
        "output_tokens_per_pass": [tokens] * len(walls),
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": per_pos if per_pos is not None else _chain(accepted, drafts, k),
        "texts": list(texts),
        "token_ids": [list(i) for i in ids],
        "error": error,
    }


def _chain(accepted, drafts, k):
    """Accepted counts per position as a chain accepts them: each position at most `drafts`, earlier first."""
    out = []
    for _ in range(max(k, 0)):
        out.append(min(accepted, drafts))
        accepted -= out[-1]
    return out


def base(temp=0.0, walls=(2.0, 2.0, 4.0)):
    return res("no_spec", method=None, k=0, temp=temp, walls=walls)


def test_tokens_per_s_is_the_median_over_passes():
    assert report.tokens_per_s(res("x", walls=(1.0, 2.0, 4.0))) == pytest.approx(50.0)
    assert report.tokens_per_s(res("x", walls=())) is None


def test_speedup_acceptance_and_greedy_match():
    rows = report.build_rows(
        [
            base(),
            res(
                "d",
                walls=(1.0, 1.0, 1.0),
                drafts=10,
                draft_tokens=20,
                accepted=15,
                per_pos=[9, 6],
                texts=("a", "c"),
                ids=((1, 2), (1, 5)),
            ),
        ],
        dtype="float32",
    )
    nospec, d = rows
    assert nospec["speedup"] == pytest.approx(1.0) and nospec["tokens_per_s"] == pytest.approx(50.0)
    assert d["speedup"] == pytest.approx(2.0)
    assert d["acceptance_rate"] == pytest.approx(0.75)
    assert d["mean_acceptance_length"] == pytest.approx(2.5)
    assert d["per_position_acceptance"] == pytest.approx([0.9, 0.6])
    assert d["greedy_match"] == pytest.approx(0.5)
    assert d["mean_common_prefix"] == pytest.approx(1.0)  # prefixes 2 and 0
    assert d["dtype"] == "float32"
    assert "texts" not in d and "token_ids" not in d


def test_speedup_uses_the_same_temperature_baseline_and_no_greedy_match_above_zero():
    rows = report.build_rows(
        [
            base(0.0, walls=(1.0,)),
            base(1.0, walls=(4.0,)),
            res("d", temp=1.0, walls=(2.0,), drafts=1, draft_tokens=2, accepted=1),
        ],
        dtype="float32",
    )
    assert rows[2]["speedup"] == pytest.approx(2.0)
    assert "greedy_match" not in rows[2]


def test_missing_baseline_gives_no_speedup():
    rows = report.build_rows([res("d")], dtype="float32")
    assert rows[0]["speedup"] is None


def test_recommendation_picks_fastest_and_gates_deploy():
    rows = report.build_rows(
        [
            base(walls=(2.0,)),
            res("good", k=2, walls=(1.0,), drafts=10, draft_tokens=20, accepted=16),  # 2.0x, 0.8
            res("good", k=4, walls=(1.25,), drafts=10, draft_tokens=40, accepted=24),  # 1.6x
        ],
        dtype="float32",
    )
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["name"] == "good" and rec["k"] == 2 and rec["deploy"] is True
    assert rec["speedup"] == pytest.approx(2.0)


def test_slower_than_none_is_not_deployable():
    rows = report.build_rows(
        [base(walls=(1.0,)), res("slow", walls=(2.0,), drafts=10, draft_tokens=20, accepted=18)],
        dtype="float32",
    )
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["deploy"] is False and report.SLOWER_WARNING in rec["warning"]


def test_low_acceptance_is_not_deployable_even_if_faster():
    rows = report.build_rows(
        [base(walls=(2.0,)), res("lucky", walls=(1.0,), drafts=10, draft_tokens=20, accepted=4)],
        dtype="float32",
    )
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["deploy"] is False and "first drafted token accepted 0.40 < 0.50" in rec["warning"]
    assert rec["first_drafted_acceptance"] == pytest.approx(0.4)
    assert rec["acceptance_rate"] == pytest.approx(0.2)


def test_the_bar_is_on_the_first_drafted_token_so_a_longer_faster_draft_is_not_held_back():
    """The shipped demo's case: a parallel k=3 draft accepts 0.24 of its drafted tokens (later positions count only
    after every earlier one was accepted) but its first drafted token in half the rounds, and it is the fastest:
    it is recommended; by the old per-token bar it would have lost to the slower ngram."""
    rows = report.build_rows(
        [
            base(walls=(2.6,)),
            res(
                "ngram", method="ngram", walls=(2.4,), drafts=10, draft_tokens=20, per_pos=[7, 6], accepted=13
            ),
            res("distilled", k=3, walls=(2.0,), drafts=10, draft_tokens=30, per_pos=[5, 2, 0], accepted=7),
        ],
        dtype="float32",
    )
    (rec,) = report.recommend(rows, min_acceptance=0.3)
    assert rec["name"] == "distilled" and rec["deploy"] is True and "passed_over" not in rec
    assert rec["acceptance_rate"] == pytest.approx(7 / 30)
    assert rec["first_drafted_acceptance"] == pytest.approx(0.5)
    assert "first drafted token accepted 0.50 (acceptance rate 0.23)" in rec["reason"]
    # A bar above its first drafted token holds it back, and the reason names that figure.
    (held,) = report.recommend(rows, min_acceptance=0.6)
    assert held["name"] == "ngram" and held["passed_over"]["first_drafted_acceptance"] == pytest.approx(0.5)
    reason = "held back only by its first drafted token's acceptance 0.50 < eval.min_acceptance 0.60"
    assert reason in held["reason"]


def test_first_drafted_acceptance_falls_back_to_the_rate_at_k1_only():
    assert report.first_drafted_acceptance({"k": 2, "per_position_acceptance": [0.5, 0.2]}) == 0.5
    assert report.first_drafted_acceptance({"k": 1, "acceptance_rate": 0.4}) == 0.4
    assert report.first_drafted_acceptance({"k": 3, "acceptance_rate": 0.4}) is None
    assert report.first_drafted_acceptance({"k": 2, "per_position_acceptance": [None, None]}) is None


def test_a_deployable_config_beats_a_faster_gated_one():
    rows = report.build_rows(
        [
            base(walls=(2.0,)),
            res("fast_but_rarely_right", walls=(0.5,), drafts=10, draft_tokens=20, accepted=2),  # 4x, 0.1
            res("sound", walls=(1.0,), drafts=10, draft_tokens=20, accepted=16),  # 2x, 0.8
        ],
        dtype="float32",
    )
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["name"] == "sound" and rec["deploy"] is True
    # ... and says what it passed over, and why, so a user who trades acceptance for speed can pick it.
    assert rec["passed_over"] == {
        "name": "fast_but_rarely_right",
        "k": 2,
        "speedup": pytest.approx(4.0),
        "acceptance_rate": pytest.approx(0.1),
        "first_drafted_acceptance": pytest.approx(0.2),
    }
    assert "fast_but_rarely_right k=2 (greedy drafting) was faster (4.00x)" in rec["reason"]
    assert "first drafted token's acceptance 0.20 < eval.min_acceptance 0.50" in rec["reason"]
    assert rec["reason"].startswith(
        "sound k=2 (greedy drafting) is the fastest that passes eval.min_acceptance:"
    )


def test_nothing_is_passed_over_when_the_recommendation_is_the_fastest_or_the_faster_one_fails_otherwise():
    rows = report.build_rows(
        [
            base(walls=(2.0,)),
            res("sound", walls=(1.0,), drafts=10, draft_tokens=20, accepted=16),  # 2x, 0.8
            res("rarely_right", walls=(1.5,), drafts=10, draft_tokens=20, accepted=2),  # 1.33x, 0.1
        ],
        dtype="float32",
    )
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["name"] == "sound" and "passed_over" not in rec and "faster" not in rec["reason"]
    assert " is the fastest: 2.00x" in rec["reason"]
    # A faster config that also failed another condition (an errored or incomplete run is never a candidate;
    # here: changed the greedy output in float32) is not offered.
    rows = report.build_rows(
        [
            base(walls=(2.0,)),
            res("sound", walls=(1.0,), drafts=10, draft_tokens=20, accepted=16),
            res("wrong", walls=(0.5,), drafts=10, draft_tokens=20, accepted=2),
        ],
        dtype="float32",
    )
    for row in rows:
        if row["name"] == "wrong":
            row["greedy_match"] = 0.5
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["name"] == "sound" and "passed_over" not in rec


def test_errored_configs_are_never_recommended():
    rows = report.build_rows(
        [
            base(walls=(2.0,)),
            res("broken", walls=(0.1,), drafts=1, draft_tokens=2, accepted=2, error="engine start failed"),
        ],
        dtype="float32",
    )
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["name"] is None and rec["deploy"] is False


def test_analytic_speedup_beside_measured():
    rows = report.build_rows(
        [base(walls=(2.0,)), res("d", k=2, walls=(1.0,), drafts=10, draft_tokens=20, accepted=10)],
        dtype="float32",
    )

    def formula(alpha, k, c):
        return (1 - alpha ** (k + 1)) / ((1 - alpha) * (1 + k * c))

    report.add_analytic(rows, formula, {"d": 0.25})
    assert rows[1]["analytic_speedup"] == pytest.approx(1.75 / 1.5)
    assert "analytic_speedup" not in rows[0]


def test_markdown_has_one_table_per_temperature_and_flags_incomplete():
    rows = report.build_rows(
        [base(0.0), base(1.0), res("d", temp=1.0, drafts=1, draft_tokens=2, accepted=1)], dtype="float32"
    )
    rep = {
        "target": "t",
        "complete": False,
        "error": "worker timed out",
        "engine": "vllm",
        "engine_version": "0",
        "device": "cpu",
        "dtype": "float32",
        "prompts": {"source": "p", "count": 2},
        "max_tokens": 8,
        "settings": {
            "max_num_seqs": 8,
            "repeats": 3,
            "draft_sample_methods": ["greedy"],
            "rejection_sample_method": "standard",
            "vllm_env": {},
        },
        "results": rows,
        "recommendations": report.recommend(rows, min_acceptance=0.5),
    }
    md = report.markdown(rep)
    assert md.count("## Temperature") == 2 and "INCOMPLETE" in md and "worker timed out" in md


def test_build_configs_sweeps_drafting_only_above_zero():
    cfgs = jobs.build_configs(
        drafts=[("a", "/a")],
        ks=[1, 2],
        temperatures=[0.0, 0.7],
        draft_sample_methods=["greedy", "probabilistic"],
        ngram_k=2,
    )
    keys = {(c["name"], c["k"], c["temperature"], c["draft_sample_method"]) for c in cfgs}
    assert ("no_spec", 0, 0.0, None) in keys and ("ngram", 2, 0.7, None) in keys
    assert ("a", 1, 0.0, "greedy") in keys and ("a", 1, 0.7, "probabilistic") in keys
    assert ("a", 1, 0.0, "probabilistic") not in keys
    assert len(cfgs) == 2 + 2 + 2 * (2 + 1)


def _md_report(rows, **extra):
    return {
        "target": "t",
        "complete": True,
        "engine": "vllm",
        "engine_version": "0",
        "device": "cpu",
        "dtype": "float32",
        "prompts": {"source": "p", "count": 2},
        "max_tokens": 8,
        "settings": {
            "max_num_seqs": 8,
            "repeats": 1,
            "draft_sample_methods": ["greedy"],
            "rejection_sample_method": "standard",
            "vllm_env": {},
        },
        "results": rows,
        "recommendations": report.recommend(rows, min_acceptance=0.5),
        **extra,
    }


def test_incomplete_eval_never_recommends_deploy():
    """Partial rows that would pass the gate still give deploy: false, with the short reason (not the log)."""
    rows = report.build_rows(
        [base(walls=(2.0,)), res("good", walls=(1.0,), drafts=10, draft_tokens=20, accepted=16)],
        dtype="float32",
    )
    assert report.recommend(rows, min_acceptance=0.5)[0]["deploy"] is True
    error = "vLLM eval worker did not finish within 60 s and was stopped. Last log lines:\nengine 3/9 loading"
    (rec,) = report.recommend(rows, min_acceptance=0.5, incomplete=error)
    assert rec["deploy"] is False and rec["causes"] == [report.CAUSE_INCOMPLETE]
    assert "incomplete (vLLM eval worker did not finish within 60 s" in rec["reason"]
    assert "engine 3/9" not in rec["reason"]
    (none,) = report.recommend(rows[:1], min_acceptance=0.5, incomplete=error)
    assert none["deploy"] is False and report.CAUSE_INCOMPLETE in none["causes"]


def test_greedy_mismatch_in_float32_warns_and_blocks_deploy():
    runs = [
        base(walls=(2.0,)),
        res(
            "d", walls=(1.0,), drafts=10, draft_tokens=20, accepted=16, texts=("a", "c"), ids=((1, 2), (1, 5))
        ),
    ]
    rows = report.build_rows(runs, dtype="float32")
    (rec,) = report.recommend(rows, min_acceptance=0.5)
    assert rec["deploy"] is False and rec["causes"] == [report.CAUSE_GREEDY]
    (warning,) = report.greedy_warnings(rows)
    assert "changed the target's greedy output in float32" in warning and "correctness problem" in warning
    assert "d k=2: greedy_match 0.500, mean common prefix 1.0 tokens" in warning
    md = report.markdown(_md_report(rows, warnings=[warning]))
    assert f"> {warning}" in md and "| 0.50 (1.0) |" in md  # greedy match (mean common prefix)
    # bf16 may flip near-tied argmaxes: reported, neither a warning nor a deploy blocker
    bf16 = report.build_rows(runs, dtype="bfloat16")
    assert report.greedy_warnings(bf16) == [] and report.recommend(bf16, min_acceptance=0.5)[0]["deploy"]


def test_markdown_names_the_hardware():
    rows = report.build_rows([base()], dtype="float32")
    hw = {"device": "cpu", "summary": "CPU: Example CPU @ 2.0GHz, 2 cores"}
    assert "- hardware: CPU: Example CPU @ 2.0GHz, 2 cores" in report.markdown(_md_report(rows, hardware=hw))
    assert "- hardware: cpu" in report.markdown(_md_report(rows))  # older reports: the device


def test_parallel_rows_estimates_and_config():
    par = {**res("p", k=2, walls=(1.0,), drafts=10, draft_tokens=20, accepted=10), "parallel_drafting": True}
    ar = res("a", k=2, walls=(1.0,), drafts=10, draft_tokens=20, accepted=10)
    far = {**res("p", k=3, walls=(1.0,), drafts=10, draft_tokens=30, accepted=10), "parallel_drafting": True}
    rows = report.build_rows([base(walls=(2.0,)), par, ar, far], dtype="float32")
    assert [r["parallel_drafting"] for r in rows] == [False, True, False, True]

    def formula(alpha, k, c, parallel=False):
        return (1 - alpha ** (k + 1)) / ((1 - alpha) * (1 + (c if parallel else k * c)))

    report.add_analytic(rows, formula, {"p": 0.25, "a": 0.25})
    assert rows[1]["analytic_speedup"] == pytest.approx(1.75 / 1.25)  # one draft forward per round
    assert rows[2]["analytic_speedup"] == pytest.approx(1.75 / 1.5)
    est = {"parallel": True, "tokens_per_round": [1.8, 2.2]}  # estimated for K = 2
    report.add_estimates(rows, formula, {"p": 0.25}, {("p", 0.0, "greedy"): est})
    assert rows[1]["estimated_acceptance"] == pytest.approx(0.6)
    assert rows[1]["estimated_speedup"] == pytest.approx(2.2 / 1.25)
    assert "estimated_acceptance" not in rows[3]  # k=3 is past the estimate's K
    spec = report.speculative_config(rows[1])
    assert spec == {
        "method": "draft_model",
        "num_speculative_tokens": 2,
        "model": "/m/p",
        "draft_sample_method": "greedy",
        "parallel_drafting": True,
    }
    assert "parallel_drafting" not in report.speculative_config(rows[2])
    assert report.speculative_config(rows[0]) is None
    (rec,) = report.recommend(rows, min_acceptance=0.4)
    assert rec["parallel_drafting"] is True and rec["speculative_config"]["parallel_drafting"] is True
    assert "parallel draft" in rec["reason"]
    md = report.markdown(_md_report(rows))
    assert "| p | 2 | parallel | greedy |" in md and "| a | 2 | autoregressive | greedy |" in md
    assert "| no_spec | 0 | – | – |" in md


def test_build_configs_parallel_draft():
    cfgs = jobs.build_configs(
        drafts=[("p", "/p"), ("a", "/a")],
        ks=[1, 2, 4],
        temperatures=[0.0],
        draft_sample_methods=["greedy"],
        ngram_k=None,
        parallel={"p": 2},
    )
    assert [(c["name"], c["k"], c["parallel_drafting"]) for c in cfgs if c["method"]] == [
        ("p", 1, False),  # one token, no masks: ordinary drafting
        ("p", 2, True),
        ("a", 1, False),
        ("a", 2, False),
        ("a", 4, False),
    ]
    assert "parallel_drafting" not in cfgs[0]  # no_spec
    assert jobs.parallel_ks([4, 6], 3) == [3] and jobs.parallel_ks([1, 5], 0) == [1, 5]


def test_build_configs_per_draft_k():
    """A draft's own k list replaces eval.k for it (a parallel draft at k=4 beside an autoregressive one at
    k=1); a draft without one sweeps eval.k."""
    cfgs = jobs.build_configs(
        drafts=[("p", "/p"), ("a", "/a"), ("b", "/b")],
        ks=[1, 2],
        draft_ks={"p": [4], "a": [1]},
        temperatures=[0.0],
        draft_sample_methods=["greedy"],
        ngram_k=None,
        parallel={"p": 4},
    )
    assert [(c["name"], c["k"], c["parallel_drafting"]) for c in cfgs if c["method"]] == [
        ("p", 4, True),
        ("a", 1, False),
        ("b", 1, False),
        ("b", 2, False),
    ]


def test_markdown_lists_the_draft_sampling_measured():
    """A T=0-only run drafts greedily whatever eval.draft_sample_methods says; the header says what ran."""
    rows = report.build_rows(
        [base(), res("d", walls=(1.0,), drafts=10, draft_tokens=20, accepted=10)], dtype="float32"
    )
    rep = _md_report(rows)
    rep["settings"]["draft_sample_methods"] = ["greedy", "probabilistic"]
    assert "- draft sampling: greedy; rejection sampling" in report.markdown(rep)
    rows[1]["draft_sample_method"] = "probabilistic"
    assert "- draft sampling: probabilistic; rejection sampling" in report.markdown(rep)
    rep["results"] = rows[:1]  # no draft measured: the setting
    assert "- draft sampling: greedy, probabilistic; rejection sampling" in report.markdown(rep)
