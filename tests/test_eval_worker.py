"""The speculate worker's pure parts, with a fake LLM (no vLLM engine): engine grouping, vLLM arguments,
counter differences around the timed passes, token counting."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from distill.evaluate import jobs
from distill.vllm_worker import speculate


@dataclass
class Metric:
    name: str
    value: int = 0
    values: list | None = None


@dataclass
class Completion:
    token_ids: list
    text: str


@dataclass
class Output:
    outputs: list


class FakeLLM:
    """Each generate() call drafts 10 times with k=2 and accepts 12 tokens; prompt i yields i + 1 tokens."""

    def __init__(self):
        self.calls = 0

    def generate(self, inputs, params, use_tqdm=False):
        self.calls += 1
        return [Output([Completion(list(range(i + 1)), f"t{i}")]) for i in range(len(inputs))]

    def get_metrics(self):
        n = self.calls
        return [
            Metric("vllm:spec_decode_num_drafts", 10 * n),
            Metric("vllm:spec_decode_num_draft_tokens", 20 * n),
            Metric("vllm:spec_decode_num_accepted_tokens", 12 * n),
            Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[8 * n, 4 * n]),
        ]


JOB = {
    "target": "/t",
    "prompts": [[1, 2], [3], [4, 5, 6]],
    "max_tokens": 8,
    "eos_token_id": 2,
    "repeats": 3,
    "seed": 0,
    "max_num_seqs": 2,
    "max_model_len": 64,
}


def test_counters_cover_only_the_timed_passes(monkeypatch):
    monkeypatch.setattr(speculate, "_sampling_params", lambda job, t, n: [None] * n)
    llm = FakeLLM()
    cfg = {
        "name": "d",
        "method": "draft_model",
        "draft": "/d",
        "k": 2,
        "temperature": 0.0,
        "draft_sample_method": "greedy",
    }
    ticks = iter(range(100))
    res = speculate.measure_temperature(llm, cfg, JOB, clock=lambda: float(next(ticks)))
    assert llm.calls == 1 + 3  # warm-up + repeats
    assert (res["num_drafts"], res["num_draft_tokens"], res["num_accepted_tokens"]) == (30, 60, 36)
    assert res["accepted_per_pos"] == [24, 12]
    assert res["wall_s"] == [1.0, 1.0, 1.0] and len(res["load_avg"]) == 3
    assert res["output_tokens"] == 1 + 2 + 3 and res["output_tokens_per_pass"] == [6, 6, 6]
    assert res["texts"] == ["t0", "t1", "t2"] and res["token_ids"][2] == [0, 1, 2]
    assert res["error"] is None


def test_engine_groups_share_an_engine_across_temperatures_only():
    base = {"method": "draft_model", "draft": "/d", "k": 2, "draft_sample_method": "greedy"}
    cfgs = [
        {"name": "d", **base, "temperature": 0.0},
        {"name": "d", **base, "temperature": 1.0},
        {"name": "d", **base, "k": 4, "temperature": 0.0},
        {"name": "d", **base, "draft_sample_method": "probabilistic", "temperature": 1.0},
    ]
    groups = speculate.engine_groups(cfgs)
    assert [len(g) for g in groups] == [2, 1, 1]
    # parallel drafting is another engine even for the same folder and k
    par = [{**cfgs[0], "parallel_drafting": True}, {**cfgs[1], "parallel_drafting": True}]
    assert [len(g) for g in speculate.engine_groups([*cfgs, *par])] == [2, 1, 1, 2]


def test_parallel_draft_arguments_and_result():
    cfg = {
        "name": "p",
        "method": "draft_model",
        "draft": "/p",
        "k": 4,
        "temperature": 0.0,
        "draft_sample_method": "greedy",
        "parallel_drafting": True,
    }
    spec = speculate.engine_kwargs(cfg, JOB)["speculative_config"]
    assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 4
    assert spec["method"] == "draft_model" and spec["model"] == "/p"
    off = speculate.speculative_config({**cfg, "parallel_drafting": False}, JOB)
    assert off is not None and "parallel_drafting" not in off
    assert speculate.empty_result(cfg)["parallel_drafting"] is True
    assert speculate.empty_result({**cfg, "parallel_drafting": False})["parallel_drafting"] is False


def test_vllm_arguments():
    job = {
        **JOB,
        "rejection_sample_method": "standard",
        "ngram_prompt_lookup_min": 2,
        "ngram_prompt_lookup_max": 4,
    }
    draft = {
        "name": "d",
        "method": "draft_model",
        "draft": "/d",
        "k": 3,
        "temperature": 0.0,
        "draft_sample_method": "probabilistic",
    }
    kw = speculate.engine_kwargs(draft, job)
    assert kw["disable_log_stats"] is False and kw["model"] == "/t"
    assert kw["speculative_config"] == {
        "method": "draft_model",
        "model": "/d",
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "standard",
    }
    ngram = speculate.speculative_config({"method": "ngram", "k": 4}, job)
    assert ngram == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert "speculative_config" not in speculate.engine_kwargs({"method": None, "k": 0}, job)


def test_engine_start_failure_becomes_per_config_errors(monkeypatch):
    import sys
    import types

    class Boom:
        def __init__(self, **kw):
            raise RuntimeError("no memory")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=Boom))
    cfgs = [
        {"name": "d", "method": None, "draft": None, "k": 0, "temperature": t, "draft_sample_method": None}
        for t in (0.0, 1.0)
    ]
    out = speculate.run_group(cfgs, JOB)
    assert len(out) == 2 and all("no memory" in r["error"] for r in out)
    assert all(r["wall_s"] == [] for r in out)


def _res(name, k, walls, drafts, per_pos, error=None, text="a"):
    return {
        "name": name,
        "method": "draft_model" if k else None,
        "draft": "/d" if k else None,
        "k": k,
        "temperature": 0.0,
        "draft_sample_method": "greedy" if k else None,
        "parallel_drafting": False,
        "startup_s": 10.0,
        "wall_s": walls,
        "load_avg": [1.0] * len(walls),
        "foreign_cpu": [0.0] * len(walls),
        "output_tokens": 100,
        "output_tokens_per_pass": [100] * len(walls),
        "num_drafts": drafts,
        "num_draft_tokens": drafts * k,
        "num_accepted_tokens": sum(per_pos),
        "accepted_per_pos": per_pos,
        "texts": [text],
        "token_ids": [[1]],
        "error": error,
    }


def test_pool_rounds_concatenates_passes_and_sums_counters():
    first = [_res("no_spec", 0, [1.0, 1.1], 0, []), _res("d", 2, [0.8, 0.9], 10, [6, 2])]
    # the second round lists them in another order, one config failed there
    second = [_res("d", 2, [1.2], 5, [3, 1], text="b"), _res("no_spec", 0, [1.3], 0, [], error="boom")]
    no_spec, d = jobs.pool_rounds([first, second])
    assert d["wall_s"] == [0.8, 0.9, 1.2] and d["round_of_pass"] == [0, 0, 1]
    assert d["output_tokens_per_pass"] == [100, 100, 100] and d["load_avg"] == [1.0, 1.0, 1.0]
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (15, 30, 12)
    assert d["accepted_per_pos"] == [9, 3] and d["texts"] == ["a"] and d["error"] is None
    assert d["startup_s_per_round"] == [10.0, 10.0]
    assert no_spec["wall_s"] == [1.0, 1.1, 1.3] and no_spec["error"] == "round 2: boom"
    assert jobs.pool_rounds([first]) == first  # one round: as measured


def test_run_job_alternates_engines_over_rounds(monkeypatch, tmp_path):
    import json

    order = []

    def run_group(group, job):
        order.append(group[0]["name"])
        partial = json.loads((tmp_path / "partial.json").read_text())
        assert partial["complete"] is False
        return [_res(c["name"], c["k"], [1.0], 1 if c["k"] else 0, [1] * c["k"]) for c in group]

    monkeypatch.setattr(speculate, "run_group", run_group)
    monkeypatch.setattr(speculate, "environment", lambda job: {"engine": "vllm"})
    configs = [
        {"name": "no_spec", "method": None, "draft": None, "k": 0, "temperature": 0.0, "draft_sample_method": None},
        {"name": "d", "method": "draft_model", "draft": "/d", "k": 2, "temperature": 0.0, "draft_sample_method": "greedy"},
    ]  # fmt: skip
    out = speculate.run_job(
        {**JOB, "configs": configs, "rounds": 2, "partial_path": str(tmp_path / "partial.json")}
    )
    assert order == ["no_spec", "d", "no_spec", "d"]
    assert out["complete"] is True and out["measured"] == 4 and "last" not in out
    assert [r["round_of_pass"] for r in out["results"]] == [[0, 1], [0, 1]]
    assert out["results"][1]["num_drafts"] == 2


def _kept_engine_job(tmp_path, **extra):
    configs = [
        {"name": "no_spec", "method": None, "draft": None, "k": 0, "temperature": 0.0, "draft_sample_method": None},
        {"name": "d", "method": "draft_model", "draft": "/d", "k": 2, "temperature": 0.0, "draft_sample_method": "greedy"},
        {"name": "d", "method": "draft_model", "draft": "/d", "k": 2, "temperature": 1.0, "draft_sample_method": "greedy"},
    ]  # fmt: skip
    return {**JOB, "configs": configs, "rounds": 3, "partial_path": str(tmp_path / "partial.json"), **extra}


def _fake_engines(monkeypatch, fail=()):
    """start_engine/stop_engine that hand out FakeLLMs and log what happened, in order."""
    events = []

    def start_engine(group, job):
        events.append(("start", group[0]["name"]))
        if group[0]["name"] in fail:
            return [speculate.empty_result(c, "engine start failed: boom") for c in group]
        llm = FakeLLM()
        llm.name = group[0]["name"]
        return llm, 7.0

    def measure_temperature(llm, cfg, job):
        events.append(("measure", llm.name, cfg["temperature"]))
        return {**speculate.empty_result(cfg), "wall_s": [1.0]}

    monkeypatch.setattr(speculate, "start_engine", start_engine)
    monkeypatch.setattr(speculate, "stop_engine", lambda llm: events.append(("stop", llm.name)))
    monkeypatch.setattr(speculate, "measure_temperature", measure_temperature)
    monkeypatch.setattr(speculate, "environment", lambda job: {"engine": "vllm"})
    return events


def test_kept_engines_start_once_serve_every_round_and_stop_at_the_end(monkeypatch, tmp_path):
    events = _fake_engines(monkeypatch)
    out = speculate.run_job(_kept_engine_job(tmp_path, keep_engines=True))
    starts = [e for e in events if e[0] == "start"]
    assert starts == [("start", "no_spec"), ("start", "d")]
    # rounds still alternate the configurations; every engine stops after the last round only
    measures = [e[1:] for e in events if e[0] == "measure"]
    assert measures == [("no_spec", 0.0), ("d", 0.0), ("d", 1.0)] * 3
    assert events[-2:] == [("stop", "no_spec"), ("stop", "d")]
    assert all(e[0] != "stop" for e in events[:-2])
    assert out["complete"] is True and out["measured"] == 9
    for r in out["results"]:
        assert r["startup_s"] == 7.0 and r["startup_s_per_round"] == [7.0, None, None]
        assert r["round_of_pass"] == [0, 1, 2]


def test_without_kept_engines_every_round_starts_and_stops_each_engine(monkeypatch, tmp_path):
    events = _fake_engines(monkeypatch)
    out = speculate.run_job(_kept_engine_job(tmp_path))
    kinds = [e[0] for e in events if e[0] != "measure"]
    assert kinds == ["start", "stop"] * 6
    assert all(r["startup_s_per_round"] == [7.0] * 3 for r in out["results"])


def test_a_kept_engine_that_failed_to_start_is_not_retried_and_the_others_still_stop(monkeypatch, tmp_path):
    events = _fake_engines(monkeypatch, fail={"d"})
    out = speculate.run_job(_kept_engine_job(tmp_path, keep_engines=True))
    assert [e for e in events if e[0] == "start"] == [("start", "no_spec"), ("start", "d")]
    assert [e for e in events if e[0] == "stop"] == [("stop", "no_spec")]
    d = [r for r in out["results"] if r["name"] == "d"]
    assert len(d) == 2 and all(r["error"].count("engine start failed: boom") == 3 for r in d)
    assert next(r for r in out["results"] if r["name"] == "no_spec")["error"] is None


def test_kept_engines_stop_when_a_round_is_interrupted(monkeypatch, tmp_path):
    events = _fake_engines(monkeypatch)
    calls = {"n": 0}

    def interrupted(llm, cfg, job):
        calls["n"] += 1
        if calls["n"] == 4:  # round 2, first engine
            raise KeyboardInterrupt
        return {**speculate.empty_result(cfg), "wall_s": [1.0]}

    monkeypatch.setattr(speculate, "measure_temperature", interrupted)
    with pytest.raises(KeyboardInterrupt):
        speculate.run_job(_kept_engine_job(tmp_path, keep_engines=True))
    assert [e for e in events if e[0] == "stop"] == [("stop", "no_spec"), ("stop", "d")]


def test_kept_engines_split_the_gpu_memory_share():
    job = {**JOB, "device": "cuda", "gpu_memory_utilization": 0.9}
    kept = speculate.KeptEngines(job, 3)
    assert kept.job["gpu_memory_utilization"] == 0.3 and job["gpu_memory_utilization"] == 0.9
    cfg = {"name": "no_spec", "method": None, "k": 0}
    assert speculate.engine_kwargs(cfg, kept.job)["gpu_memory_utilization"] == 0.3
    assert speculate.KeptEngines({**JOB, "device": "cpu"}, 3).job.get("gpu_memory_utilization") is None
