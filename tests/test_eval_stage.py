"""`distill eval` end to end with a canned engine: preflight errors (exit 2, nothing written), the report files,
the vLLM → reference fallback, and partial results after a worker timeout (exit 1, marked incomplete)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from model_folders import model_copy

from distill.cli import main
from distill.errors import RuntimeFailure
from distill.evaluate import report

CONTRACT_TOP = {
    "engine",
    "engine_version",
    "device",
    "target",
    "prompts",
    "max_tokens",
    "results",
    "recommendation",
}
CONTRACT_SPEC = {
    "name",
    "method",
    "draft",
    "k",
    "temperature",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "acceptance_rate",
    "mean_acceptance_length",
    "per_position_acceptance",
    "tokens_per_s",
    "speedup",
    "dtype",
    "greedy_match",
}


def fake_results(job, *, n=None):
    """Engine output for a job: drafts named 'good' accept 90% and run 2x faster, others 10% and slower."""
    out = []
    for c in job["configs"][:n]:
        k, good = c["k"], c["name"] in ("good", "no_spec")
        drafts = 50 if c["method"] else 0
        accepted = int(0.9 * drafts * k) if good else int(0.1 * drafts * k)
        wall = 1.0 if c["method"] is None else (0.5 if good else 1.5)
        out.append(
            {
                **c,
                "startup_s": 12.0,
                "wall_s": [wall] * job["repeats"],
                "output_tokens": 200,
                "output_tokens_per_pass": [200] * job["repeats"],
                "num_drafts": drafts,
                "num_draft_tokens": drafts * k,
                "num_accepted_tokens": accepted,
                "accepted_per_pos": [accepted // k] * k if k else [],
                "texts": ["x"] * len(job["prompts"]),
                "token_ids": [[1]] * len(job["prompts"]),
                "error": None,
            }
        )
    return out


@pytest.fixture()
def cfg_args(tiny_config_overrides, tiny_target_dir, tmp_path):
    """configs/tiny.yaml with the target also used as the draft 'good' (same vocabulary), small sweep."""
    good = tmp_path / "good"
    shutil.copytree(tiny_target_dir, good)
    return [
        "-c",
        "configs/tiny.yaml",
        *tiny_config_overrides,
        f"eval.drafts=[{{name: good, model: {good}}}]",
        "eval.k=[1,2]",
        "eval.repeats=2",
        "eval.num_prompts=4",
        "eval.cost_ratio=0.2",
        "eval.analytic_prompts=0",
        "data.test_fraction=0.5",
    ]


def run_dir(args):
    return Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.dir=")))


@pytest.fixture()
def fake_worker(monkeypatch):
    calls = []

    def run_worker(job, *, log_path, timeout_s, env=None, what="", poll=None):
        calls.append({"job": job, "env": env, "timeout_s": timeout_s})
        return {
            "engine": "vllm",
            "engine_version": "0.32.0",
            "device": "cpu",
            "complete": True,
            "results": fake_results(job),
            "plugin": {"patched": True},
        }

    monkeypatch.setattr("distill.utils.subproc.run_worker", run_worker)
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    return calls


def test_eval_writes_contract_report(cfg_args, fake_worker):
    assert main(["eval", *cfg_args, "eval.temperatures=[0.0,1.0]", "eval.cpu_reserved_cores=0"]) == 0
    out = run_dir(cfg_args) / "eval"
    rep = json.loads((out / "report.json").read_text())
    assert set(rep) >= CONTRACT_TOP and rep["complete"] is True
    spec = [r for r in rep["results"] if r["method"] == "draft_model" and r["temperature"] == 0.0]
    assert spec and all(set(r) >= CONTRACT_SPEC for r in spec)
    assert all(r["speedup"] == pytest.approx(2.0) for r in spec)
    assert rep["recommendation"]["deploy"] is True and rep["recommendation"]["name"] == "good"
    assert {r["temperature"] for r in rep["recommendations"]} == {0.0, 1.0}
    assert (out / "report.md").read_text().count("## Temperature") == 2
    assert (out / "acceptance_per_position.png").stat().st_size > 0 and (out / "speedup_vs_k.png").is_file()
    assert rep["memory"]["gib"]["target weights"] > 0
    assert rep["settings"]["vllm_env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    job = fake_worker[0]["job"]
    assert job["prompts"] and all(isinstance(t, int) for t in job["prompts"][0])
    # both drafting methods at T=1, greedy only at T=0; ngram at the largest k
    dsm = {
        (c["temperature"], c["draft_sample_method"]) for c in job["configs"] if c["method"] == "draft_model"
    }
    assert dsm == {(0.0, "greedy"), (1.0, "greedy"), (1.0, "probabilistic")}
    assert any(c["method"] == "ngram" and c["k"] == 2 for c in job["configs"])
    assert json.loads((run_dir(cfg_args) / "stages" / "eval.json").read_text())["stage"] == "eval"
    # the machine, not just "cpu": CPU model and cores, in report.json and report.md
    hw = rep["hardware"]
    assert hw["device"] == "cpu" and hw["cpu_cores"] >= 1 and hw["summary"].startswith("CPU: ")
    assert f"- hardware: {hw['summary']}" in (out / "report.md").read_text()


def test_a_draft_sweeps_its_own_k(cfg_args, fake_worker, tiny_target_dir):
    """eval.drafts[i].k replaces eval.k for that draft; the engine's max_model_len leaves room for it."""
    args = [a for a in cfg_args if not a.startswith("eval.drafts=")] + [
        f"eval.drafts=[{{name: good, model: {tiny_target_dir}, k: [5]}}, {{name: other, model: {tiny_target_dir}}}]",
        "eval.ngram=false",
    ]
    assert main(["eval", *args]) == 0
    job = fake_worker[0]["job"]
    swept = [(c["name"], c["k"]) for c in job["configs"] if c["method"] == "draft_model"]
    assert swept == [("good", 5), ("other", 1), ("other", 2)]
    assert job["max_model_len"] >= max(map(len, job["prompts"])) + job["max_tokens"] + 5


def test_bad_per_draft_k_is_an_input_error(cfg_args, capsys, tiny_target_dir):
    args = [a for a in cfg_args if not a.startswith("eval.drafts=")] + [
        f"eval.drafts=[{{name: good, model: {tiny_target_dir}, k: [0]}}]"
    ]
    _assert_input_error(args, capsys, "eval.drafts[0].k")


def test_bad_draft_is_flagged_do_not_deploy(cfg_args, fake_worker, tiny_target_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_target_dir, bad)
    args = [a for a in cfg_args if not a.startswith("eval.drafts=")] + [
        f"eval.drafts=[{{name: bad, model: {bad}}}]",
        "eval.ngram=false",
    ]
    assert main(["eval", *args]) == 0
    rep = json.loads((run_dir(args) / "eval" / "report.json").read_text())
    assert rep["recommendation"]["deploy"] is False
    assert "slower than none" in rep["recommendation"]["warning"]


def test_timeout_keeps_partial_results_marked_incomplete(cfg_args, monkeypatch):
    def run_worker(job, *, log_path, timeout_s, env=None, what="", poll=None):
        Path(job["partial_path"]).write_text(
            json.dumps({"engine": "vllm", "results": fake_results(job, n=2), "complete": False})
        )
        raise RuntimeFailure(f"{what} did not finish within {timeout_s:.0f} s and was stopped.")

    monkeypatch.setattr("distill.utils.subproc.run_worker", run_worker)
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    assert main(["eval", *cfg_args, "eval.timeout_s=5"]) == 1
    rd = run_dir(cfg_args)
    rep = json.loads((rd / "eval" / "report.json").read_text())
    assert rep["complete"] is False and "did not finish" in rep["error"]
    assert len(rep["results"]) == 2
    assert "INCOMPLETE" in (rd / "eval" / "report.md").read_text()
    assert not (rd / "stages" / "eval.json").exists()


def test_auto_falls_back_to_reference_engine_without_vllm(cfg_args, monkeypatch):
    seen = {}

    def reference(job):
        seen["job"] = job
        return {"engine": "hf", "engine_version": "torch", "device": "cpu", "results": fake_results(job)}

    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: False)
    monkeypatch.setattr("distill.evaluate.reference.run_reference_job", reference)
    assert main(["eval", *cfg_args, "eval.engine=auto"]) == 0
    rep = json.loads((run_dir(cfg_args) / "eval" / "report.json").read_text())
    assert rep["engine"] == "hf" and rep["complete"] is True and "fell back" in rep["notes"][0]
    assert {"target", "dtype", "prompts", "max_tokens", "eos_token_id", "configs", "repeats", "seed"} <= set(
        seen["job"]
    )


def _assert_input_error(args, capsys, *needles):
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert not run_dir(args).exists()  # nothing written


def test_missing_draft_folder(cfg_args, capsys, tmp_path):
    args = [a for a in cfg_args if not a.startswith("eval.drafts=")] + [
        f"eval.drafts=[{{name: gone, model: {tmp_path / 'nope' / 'draft'}}}]"
    ]
    _assert_input_error(args, capsys, "eval.drafts[0].model")


def test_default_drafts_missing_before_training(cfg_args, capsys):
    args = [a for a in cfg_args if not a.startswith("eval.drafts=")]
    _assert_input_error(args, capsys, "eval.drafts[0].model", "distill train")


def test_draft_with_other_vocabulary(cfg_args, capsys, tmp_path):
    from distill.models.tiny import build_tiny_tokenizer, save_tiny_model

    other = save_tiny_model(
        tmp_path / "other", seed=1, tokenizer=build_tiny_tokenizer(vocab_size=600), num_layers=1
    )
    args = [a for a in cfg_args if not a.startswith("eval.drafts=")] + [
        f"eval.drafts=[{{name: o, model: {other}}}]"
    ]
    _assert_input_error(args, capsys, "eval.drafts[0].model", "vocabulary")


def test_k_must_be_positive(cfg_args, capsys):
    _assert_input_error([*cfg_args, "eval.k=[0,2]"], capsys, "eval.k")


def test_vllm_missing_names_the_extra(cfg_args, capsys, monkeypatch):
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: False)
    _assert_input_error([*cfg_args, "eval.engine=vllm"], capsys, "distill[cpu]", "distill[gpu]")


def test_plugin_warning_when_entry_point_missing_at_positive_temperature():
    from distill.evaluate.stage import plugin_warnings

    hot = [{"method": "draft_model", "temperature": 1.0}]
    out = {"engine": "vllm", "device": "cpu", "plugin": {"patched": True, "entry_point": False}}
    assert "#55005" in plugin_warnings(out, hot)[0]
    assert plugin_warnings({**out, "plugin": {"patched": True, "entry_point": True}}, hot) == []
    assert plugin_warnings(out, [{"method": "draft_model", "temperature": 0.0}]) == []


def test_analytic_estimate_beside_measured(cfg_args, fake_worker):
    """The real analytic module (tiny models): measured c, Σ min(p, q) of a draft equal to the target = 1."""
    args = [a for a in cfg_args if not a.startswith(("eval.cost_ratio", "eval.analytic_prompts"))]
    assert (
        main(
            ["eval", *args, "eval.analytic_prompts=2", "eval.max_tokens=8", "eval.k=[2]", "eval.ngram=false"]
        )
        == 0
    )
    rep = json.loads((run_dir(args) / "eval" / "report.json").read_text())
    assert rep["analytic"]["available"] is True and rep["analytic"]["cost_ratio"]["good"] > 0
    (row,) = [r for r in rep["results"] if r["method"] == "draft_model"]
    assert row["estimated_acceptance"] == pytest.approx(1.0, abs=1e-4)
    assert row["analytic_speedup"] > 0 and row["estimated_speedup"] > 0


def test_busy_machine_warning():
    from distill.evaluate.stage import load_warnings

    assert load_warnings({"cpu_count": 2}, [{"load_avg": [1.0, 1.5]}]) == []
    (msg,) = load_warnings({"cpu_count": 2}, [{"load_avg": [1.0]}, {"load_avg": [8.5]}])
    assert "8.5 on 2 cores" in msg
    # The worker's own measure wins: vLLM's engine processes alone load an idle 2-core machine to ~3.
    assert load_warnings({"cpu_count": 2}, [{"load_avg": [3.2], "foreign_cpu": [0.02, 0.05]}]) == []
    (msg,) = load_warnings({"cpu_count": 2}, [{"load_avg": [3.2], "foreign_cpu": [0.02, 0.4]}])
    assert "used up to 40% of the machine's CPU" in msg


def test_foreign_cpu_share_counts_only_other_processes(tmp_path):
    from distill.vllm_worker import speculate

    assert speculate._proc_busy_ticks("cpu  100 5 50 1000 7 3 2 10 0 0\ncpu0 1 2 3") == 170
    proc = tmp_path / "proc"
    for pid, session, utime, stime in ((10, 42, 30, 5), (11, 42, 7, 1), (12, 99, 500, 500)):
        (proc / str(pid)).mkdir(parents=True)
        fields = ["S", "1", str(pid), str(session)] + ["0"] * 7 + [str(utime), str(stime)] + ["0"] * 10
        (proc / str(pid) / "stat").write_text(f"{pid} (vllm (engine)) " + " ".join(fields))
    (proc / "self").mkdir()
    assert speculate._session_ticks(42, proc) == 43
    ticks = os.sysconf("SC_CLK_TCK")
    cores = os.cpu_count() or 1
    # 10 s on all cores: the machine was busy 50% of it, this eval's session took 30% -> 20% foreign.
    capacity = 10 * ticks * cores
    before, after = (0, 0), (int(0.5 * capacity), int(0.3 * capacity))
    assert speculate.foreign_cpu_share(before, after, 10.0) == pytest.approx(0.2, abs=0.002)
    assert speculate.foreign_cpu_share(None, after, 10.0) is None
    snap = speculate.cpu_snapshot()
    assert snap is None or (snap[0] > 0 and snap[1] >= 0)


def _worker_failing_after(n_done):
    def run_worker(job, *, log_path, timeout_s, env=None, what="", poll=None):
        Path(job["partial_path"]).write_text(
            json.dumps({"engine": "vllm", "results": fake_results(job, n=n_done), "complete": False})
        )
        raise RuntimeFailure(f"{what} did not finish within {timeout_s:.0f} s and was stopped.\nlog tail")

    return run_worker


def test_incomplete_eval_never_says_deploy(cfg_args, monkeypatch):
    """Partial rows that include a deployable configuration: still deploy false, the reason says why."""
    monkeypatch.setattr(
        "distill.utils.subproc.run_worker", _worker_failing_after(3)
    )  # no_spec, ngram, good k=1
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    assert main(["eval", *cfg_args]) == 1
    rep = json.loads((run_dir(cfg_args) / "eval" / "report.json").read_text())
    assert rep["complete"] is False and any(r["name"] == "good" for r in rep["results"])
    rec = rep["recommendation"]
    assert rec["deploy"] is False and rec["name"] == "good" and rec["causes"] == ["incomplete"]
    assert "eval is incomplete" in rec["reason"] and "log tail" not in rec["reason"]
    assert all(r["deploy"] is False for r in rep["recommendations"])


def test_greedy_mismatch_in_float32_is_a_report_warning(cfg_args, monkeypatch):
    def run_worker(job, *, log_path, timeout_s, env=None, what="", poll=None):
        results = fake_results(job)
        for r in results:
            if r["name"] == "good" and r["k"] == 2:
                r["texts"] = ["y", *r["texts"][1:]]  # one prompt's output changed by speculation
        return {"engine": "vllm", "device": "cpu", "complete": True, "results": results}

    monkeypatch.setattr("distill.utils.subproc.run_worker", run_worker)
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    assert main(["eval", *cfg_args, "eval.dtype=float32"]) == 0
    out = run_dir(cfg_args) / "eval"
    rep = json.loads((out / "report.json").read_text())
    (warning,) = [w for w in rep["warnings"] if "greedy output" in w]
    assert "good k=2: greedy_match 0.750" in warning and "correctness problem" in warning
    assert warning in (out / "report.md").read_text()
    assert rep["recommendation"]["name"] == "good" and rep["recommendation"]["k"] == 1  # k=2 is gated


# A stand-in for the vLLM worker: writes partial results for the first 3 configurations (no_spec, ngram,
# good k=1: a deployable one), logs a line, then crashes (exit 3) or hangs.
FAKE_WORKER = r"""
import json, sys, time
mode, job_file = sys.argv[1], sys.argv[2]
job = json.load(open(job_file))
done = []
for c in job["configs"][:3]:
    k, n = c["k"], len(job["prompts"])
    done.append(dict(c, startup_s=1.0, wall_s=[1.0 if c["method"] is None else 0.5], output_tokens=64,
                     output_tokens_per_pass=[64], num_drafts=10, num_draft_tokens=10 * k,
                     num_accepted_tokens=9 * k, accepted_per_pos=[9] * k, texts=["x"] * n,
                     token_ids=[[1]] * n, error=None))
json.dump({"engine": "vllm", "results": done, "complete": False}, open(job["partial_path"], "w"))
print("engine 4/4: good k=2 greedy", flush=True)
if mode == "crash":
    print("RuntimeError: CPU KV cache exhausted", flush=True)
    sys.exit(3)
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("crash", "failed (exit 3)"), ("hang", "did not finish within 2 s and was stopped")],
)
def test_real_worker_crash_or_hang_keeps_partial_results_marked_incomplete(
    cfg_args, monkeypatch, mode, expected
):
    monkeypatch.setattr(
        "distill.utils.subproc.worker_command", lambda: [sys.executable, "-c", FAKE_WORKER, mode]
    )
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    assert main(["eval", *cfg_args, "eval.timeout_s=1.5"]) == 1
    out = run_dir(cfg_args) / "eval"
    rep = json.loads((out / "report.json").read_text())
    assert rep["complete"] is False and len(rep["results"]) == 3
    assert expected in rep["error"] and "engine 4/4: good k=2 greedy" in rep["error"]  # the log tail
    if mode == "crash":
        assert "CPU KV cache exhausted" in rep["error"]
    assert rep["recommendation"]["deploy"] is False and "incomplete" in rep["recommendation"]["reason"]
    md = (out / "report.md").read_text()
    assert "INCOMPLETE" in md and "**do not deploy**" in md
    assert "engine 4/4" in (out / "worker.log").read_text()
    assert not (run_dir(cfg_args) / "stages" / "eval.json").exists()


# ---- parallel (PARD) drafts -------------------------------------------------------------------------------


def _parallel_draft(src: Path, dst: Path, k: int, mask: int = 0) -> Path:
    """A copy of `src` marked as a k-token parallel draft (what `mark_parallel` writes to config.json)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(pard_token=mask, distill_parallel_tokens=k)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _with_drafts(cfg_args, drafts: str) -> list[str]:
    return [a for a in cfg_args if not a.startswith(("eval.drafts=", "eval.k="))] + [f"eval.drafts={drafts}"]


def test_parallel_draft_sweeps_k_up_to_its_trained_k(cfg_args, fake_worker, tiny_target_dir, tmp_path):
    pard = _parallel_draft(tiny_target_dir, tmp_path / "pard", k=2)
    args = _with_drafts(cfg_args, f"[{{name: good, model: {pard}}}, {{name: ar, model: {tiny_target_dir}}}]")
    assert main(["eval", *args, "eval.k=[1,2,4]", "eval.ngram=false"]) == 0
    job = fake_worker[0]["job"]
    par = [c for c in job["configs"] if c["name"] == "good"]
    assert [(c["k"], c["parallel_drafting"]) for c in par] == [(1, False), (2, True)]  # k=1: no masks
    ar = [c for c in job["configs"] if c["name"] == "ar"]
    assert sorted(c["k"] for c in ar) == [1, 2, 4] and not any(c["parallel_drafting"] for c in ar)
    out = run_dir(args) / "eval"
    rep = json.loads((out / "report.json").read_text())
    rows = {(r["name"], r["k"]): r for r in rep["results"]}
    assert rows[("good", 2)]["parallel_drafting"] is True and rows[("ar", 4)]["parallel_drafting"] is False
    assert rows[("no_spec", 0)]["parallel_drafting"] is False
    assert any(
        "'good' is a parallel draft trained for k <= 2" in n and "not at k=[4]" in n for n in rep["notes"]
    )
    rec = rep["recommendation"]
    assert rec["name"] == "good" and rec["parallel_drafting"] is (rec["k"] >= 2)
    assert rec["speculative_config"] == report.speculative_config(rows[("good", rec["k"])])
    assert report.speculative_config(rows[("good", 2)]) == {
        "method": "draft_model",
        "num_speculative_tokens": 2,
        "model": str(pard),
        "draft_sample_method": "greedy",
        "parallel_drafting": True,
    }
    assert "parallel_drafting" not in report.speculative_config(rows[("good", 1)])
    md = (out / "report.md").read_text()
    assert "| good | 2 | parallel | greedy |" in md and "| good | 1 | autoregressive | greedy |" in md
    assert "| ar | 4 | autoregressive | greedy |" in md and "ONE forward pass" in md
    # analytic speedup from the measured acceptance: one draft forward per round for the parallel draft
    c, acc = rows[("good", 2)]["cost_ratio"], rows[("good", 2)]["acceptance_rate"]
    assert rows[("good", 2)]["analytic_speedup"] == pytest.approx((1 + acc + acc**2) / (1 + c))


def test_parallel_draft_measured_at_its_k_when_eval_k_is_larger(
    cfg_args, fake_worker, tiny_target_dir, tmp_path
):
    pard = _parallel_draft(tiny_target_dir, tmp_path / "pard", k=2)
    args = _with_drafts(cfg_args, f"[{{name: good, model: {pard}}}]")
    assert main(["eval", *args, "eval.k=[3,4]", "eval.ngram=false"]) == 0
    job = fake_worker[0]["job"]
    assert {c["k"] for c in job["configs"] if c["method"]} == {2}
    rep = json.loads((run_dir(args) / "eval" / "report.json").read_text())
    assert any("has no such k: measured at k=2 instead" in n for n in rep["notes"])


def test_parallel_draft_with_mask_outside_the_vocabulary(cfg_args, capsys, tiny_target_dir, tmp_path):
    pard = _parallel_draft(tiny_target_dir, tmp_path / "pard", k=2, mask=10_000)
    _assert_input_error(_with_drafts(cfg_args, f"[{{name: p, model: {pard}}}]"), capsys, "pard_token 10000")


def test_parallel_analytic_estimate(cfg_args, fake_worker, tiny_target_dir, tmp_path):
    """The target marked as a parallel draft: its position 0 is the target's own next token (α_0 = 1), the
    estimate uses one draft forward per round (E / (1 + c))."""
    pard = _parallel_draft(tiny_target_dir, tmp_path / "pard", k=2)
    args = [
        a
        for a in _with_drafts(cfg_args, f"[{{name: good, model: {pard}}}]")
        if not a.startswith("eval.analytic")
    ]
    assert (
        main(
            [
                "eval",
                *args,
                "eval.analytic_prompts=2",
                "eval.max_tokens=8",
                "eval.k=[1,2]",
                "eval.ngram=false",
            ]
        )
        == 0
    )
    rep = json.loads((run_dir(args) / "eval" / "report.json").read_text())
    (est,) = rep["analytic"]["estimated_acceptance"]
    assert (
        est["parallel"] is True and est["k"] == 2 and est["alpha_per_draft_position"][0] == pytest.approx(1.0)
    )
    rows = {r["k"]: r for r in rep["results"] if r["method"] == "draft_model"}
    e1, e2 = est["tokens_per_round"]
    assert e1 == pytest.approx(2.0) and rows[1]["estimated_acceptance"] == pytest.approx(1.0)
    assert rows[2]["estimated_acceptance"] == pytest.approx((e2 - 1) / 2)
    assert rows[2]["estimated_speedup"] == pytest.approx(e2 / 1.2)  # eval.cost_ratio=0.2


def test_num_prompts_counts_evaluated_prompts_not_prompts_read():
    """Prompts too long for data.max_prompt_tokens are skipped, and eval reads on until it has num_prompts."""
    from types import SimpleNamespace

    from distill.evaluate.stage import tokenize_prompts

    class WordTokenizer:
        chat_template = None

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": [len(w) for w in text.split()]}

    records = [SimpleNamespace(text=" ".join(["w"] * n), messages=[]) for n in (3, 9, 2, 9, 4, 1)]
    prompts, skipped = tokenize_prompts(records, WordTokenizer(), max_prompt_tokens=5, limit=3)
    assert [len(p) for p in prompts] == [3, 2, 4] and skipped == 2
    prompts, skipped = tokenize_prompts(records, WordTokenizer(), max_prompt_tokens=5)
    assert len(prompts) == 4 and skipped == 2


def test_compiled_eval_without_a_cpp_compiler_stops_before_writing(
    cfg_args, fake_worker, monkeypatch, capsys
):
    """eval.enforce_eager=false on CPU needs inductor's C++ compiler: one message naming the key, exit 2."""
    monkeypatch.setattr("distill.utils.subproc.cpp_compiler", lambda: None)
    assert main(["eval", *cfg_args, "eval.enforce_eager=false"]) == 2
    err = capsys.readouterr().err
    assert "eval.enforce_eager" in err and "C++ compiler" in err and "Traceback" not in err
    assert not fake_worker and not (run_dir(cfg_args) / "eval").exists()
    assert main(["eval", *cfg_args, "eval.enforce_eager=true", "eval.cpu_reserved_cores=0"]) == 0


# ---- interruption and stale completion records ----------------------------------------------------------


def _load(args):
    from distill.config import load_config

    return load_config(args[args.index("-c") + 1], [a for a in args[2:] if "=" in a])


def test_sigterm_during_reference_eval_is_an_interruption(cfg_args, fake_worker, monkeypatch):
    """SIGTERM raises Interrupted inside the reference engine: exit 130 (not a runtime failure), and the
    completion record of an earlier eval is gone (eval/ is no longer what it vouched for)."""
    from distill import rundir
    from distill.errors import Interrupted
    from distill.evaluate import stage

    assert main(["eval", *cfg_args]) == 0
    cfg = _load(cfg_args)
    assert rundir.is_complete(cfg, "eval")

    def terminated(job):
        raise Interrupted("received signal 15; state saved, rerun the same command to resume.")

    monkeypatch.setattr("distill.evaluate.reference.run_reference_job", terminated)
    assert main(["eval", *cfg_args, "eval.engine=hf"]) == 130
    with pytest.raises(Interrupted):  # what `distill run` records as "interrupted", not "failed"
        stage.run(_load([*cfg_args, "eval.engine=hf"]))
    assert not (run_dir(cfg_args) / "stages" / "eval.json").exists()


def test_failed_eval_clears_the_earlier_completion_record(cfg_args, fake_worker, monkeypatch):
    """A failed eval rewrites eval/report.json (incomplete): `distill run` must not skip eval afterwards."""
    from distill import pipeline, rundir

    assert main(["eval", *cfg_args]) == 0
    cfg = _load(cfg_args)
    assert rundir.is_complete(cfg, "eval")
    monkeypatch.setattr("distill.utils.subproc.run_worker", _worker_failing_after(2))
    assert main(["eval", *cfg_args]) == 1
    assert json.loads((run_dir(cfg_args) / "eval" / "report.json").read_text())["complete"] is False
    assert not (run_dir(cfg_args) / "stages" / "eval.json").exists()
    assert not rundir.is_complete(cfg, "eval")
    assert dict(pipeline.plan(cfg))["eval"] != "skip"


def test_an_incomplete_report_is_not_complete_whatever_its_record_says(cfg_args, fake_worker):
    """A record left by an older version (or written before the report was overwritten) does not vouch for a
    report that says complete: false."""
    from distill import rundir

    assert main(["eval", *cfg_args]) == 0
    cfg = _load(cfg_args)
    path = run_dir(cfg_args) / "eval" / "report.json"
    rep = json.loads(path.read_text())
    path.write_text(json.dumps({**rep, "complete": False}))
    assert not rundir.is_complete(cfg, "eval")
    path.write_text("{truncated")
    assert not rundir.is_complete(cfg, "eval")
    path.write_text(json.dumps(rep))
    assert rundir.is_complete(cfg, "eval")


# ---- preflight: config values and draft folders (exit 2, nothing written) --------------------------------


def test_empty_temperatures_is_a_config_error(cfg_args, capsys, fake_worker):
    _assert_input_error([*cfg_args, "eval.temperatures=[]"], capsys, "eval.temperatures")
    _assert_input_error([*cfg_args, "eval.temperatures=[]", "eval.engine=hf"], capsys, "eval.temperatures")


def _no_weights(src: Path, dst: Path) -> Path:
    return model_copy(src, dst, weights="missing")


def _truncated(src: Path, dst: Path) -> Path:
    return model_copy(src, dst, weights="truncated")


def _rows(n: int, *, config_rows: int | None = None):
    """A draft on the target's tokenizer whose embedding table has `n` rows (config.json may claim others)."""

    def make(src: Path, dst: Path) -> Path:
        from transformers import AutoTokenizer, LlamaForCausalLM

        from distill.models.tiny import tiny_llama_config

        LlamaForCausalLM(tiny_llama_config(n, num_layers=1, hidden_size=32)).save_pretrained(dst)
        AutoTokenizer.from_pretrained(src).save_pretrained(dst)
        if config_rows is not None:
            config = json.loads((dst / "config.json").read_text())
            (dst / "config.json").write_text(json.dumps({**config, "vocab_size": config_rows}))
        return dst

    return make


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (_no_weights, ("holds no weights (*.safetensors)", "save_pretrained")),
        (_truncated, ("truncated or corrupt", "model.safetensors")),
        (_rows(640), ("640 rows", "target (", "has 512", "resize_token_embeddings(512)")),
        (_rows(500), ("500 rows", "has 512", "resize_token_embeddings(512)")),
        (_rows(640, config_rows=512), ("vocab_size 512", "640", "inconsistent")),
    ],
    ids=["no-weights", "truncated", "bigger-embedding", "smaller-embedding", "config-disagrees"],
)
def test_broken_draft_folder_stops_in_preflight(
    cfg_args, capsys, fake_worker, tiny_target_dir, tmp_path, make, needles
):
    draft = make(tiny_target_dir, tmp_path / "broken")
    _assert_input_error(
        _with_drafts(cfg_args, f"[{{name: x, model: {draft}}}]"), capsys, "eval.drafts[0].model", *needles
    )
    assert not fake_worker


@pytest.mark.parametrize("damage", ["custom-code", "truncated"])
def test_broken_target_folder_stops_in_preflight(
    cfg_args, capsys, fake_worker, tiny_target_dir, tmp_path, damage
):
    if damage == "custom-code":
        target, needle = (
            model_copy(tiny_target_dir, tmp_path / "custom", remote_code=True),
            "target.trust_remote_code",
        )
    else:
        target, needle = _truncated(tiny_target_dir, tmp_path / "cut"), "target.model: "
    args = [a for a in cfg_args if not a.startswith("target.model=")] + [f"target.model={target}"]
    _assert_input_error(args, capsys, needle)
    assert not fake_worker


def test_custom_code_draft_names_draft_trust_remote_code(
    cfg_args, capsys, fake_worker, tiny_target_dir, tmp_path
):
    draft = model_copy(tiny_target_dir, tmp_path / "custom", remote_code=True)
    args = _with_drafts(cfg_args, f"[{{name: x, model: {draft}}}]")
    _assert_input_error(args, capsys, "draft.trust_remote_code", "only if you trust this code")
    assert not fake_worker


def test_a_chat_template_that_refuses_an_eval_prompt_names_eval_prompts(
    cfg_args, capsys, fake_worker, tiny_target_dir, tmp_path
):
    target = model_copy(tiny_target_dir, tmp_path / "no_system")
    refuse_system = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    (target / "chat_template.jinja").write_text(refuse_system)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = tmp_path / "eval.jsonl"
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    prompts.write_text(json.dumps({"messages": turns}) + "\n")
    args = [a for a in cfg_args if not a.startswith("target.model=")]
    args += [f"target.model={target}", f"eval.prompts={prompts}"]
    _assert_input_error(
        args, capsys, "eval.prompts: the target's chat template rejects", "System role not supported"
    )
    assert not fake_worker


def test_second_broken_draft_is_named_by_its_index(cfg_args, capsys, fake_worker, tiny_target_dir, tmp_path):
    bad = _no_weights(tiny_target_dir, tmp_path / "bad")
    drafts = f"[{{name: ok, model: {tiny_target_dir}}}, {{name: bad, model: {bad}}}]"
    _assert_input_error(_with_drafts(cfg_args, drafts), capsys, "eval.drafts[1].model", "'bad'")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["eval.k=[5000]"], "eval.k"),
        (["eval.ngram_k=3000"], "eval.ngram_k"),
        (["eval.drafts=[{name: good, model: TARGET, k: [4000]}]", "eval.ngram=false"], "eval.drafts[0].k"),
    ],
    ids=["eval.k", "ngram_k", "per-draft-k"],
)
def test_a_huge_k_is_blamed_on_its_key_not_on_max_tokens(
    cfg_args, capsys, fake_worker, tiny_target_dir, overrides, key
):
    args = [*cfg_args, *(o.replace("TARGET", str(tiny_target_dir)) for o in overrides)]
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert f"error: {key}: k=" in err and "positions" in err and f"lower {key}" in err, err
    assert not run_dir(args).exists()


def test_too_many_new_tokens_is_still_blamed_on_max_tokens(cfg_args, capsys, fake_worker):
    _assert_input_error([*cfg_args, "eval.max_tokens=3000"], capsys, "error: eval.max_tokens:", "k=2")


def test_fewer_prompts_than_num_prompts_is_noted(cfg_args, fake_worker):
    assert main(["eval", *cfg_args, "eval.num_prompts=1000"]) == 0
    rep = json.loads((run_dir(cfg_args) / "eval" / "report.json").read_text())
    n = rep["prompts"]["count"]
    assert 0 < n < 1000
    assert any(f"eval.num_prompts=1000, but only {n} prompts were available" in note for note in rep["notes"])


def test_enough_prompts_adds_no_note(cfg_args, fake_worker):
    assert main(["eval", *cfg_args]) == 0
    rep = json.loads((run_dir(cfg_args) / "eval" / "report.json").read_text())
    assert rep["prompts"]["count"] == 4 and not any("num_prompts" in n for n in rep["notes"])


# ---- the reference engine reports how busy the machine was -----------------------------------------------


def test_reference_engine_records_machine_load(tiny_target_dir):
    """load_avg and foreign_cpu per timed pass, as the vLLM worker records them, so hf reports get the
    busy-machine warning too; a pass too short for 10 ms clock ticks records no share."""
    from distill.evaluate import reference
    from distill.evaluate.stage import load_warnings

    job = {
        "target": str(tiny_target_dir),
        "prompts": [[5, 6, 7]],
        "max_tokens": 2,
        "repeats": 2,
        "eos_token_id": 2,
        "device": "cpu",
        "configs": [{"name": "no_spec", "method": None, "k": 0, "temperature": 0.0}],
    }
    (row,) = reference.run_reference_job(job)["results"]
    assert len(row["load_avg"]) == 2 and row["foreign_cpu"] == [None, None]  # millisecond passes
    snap = reference.cpu_snapshot()
    assert snap is None or (snap[0] > 0 and snap[1] >= 0)
    ticks, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    # 10 s: the machine was busy 50% of it, this process took 30% -> 20% foreign.
    after = (int(5 * ticks * cores), int(3 * ticks * cores))
    assert reference.foreign_share((0, 0), after, 10.0) == pytest.approx(0.2, abs=0.002)
    assert reference.foreign_share((0, 0), after, 0.05) is None
    busy = {**row, "foreign_cpu": [0.5, 0.6]}
    assert "used up to 60%" in load_warnings({"engine": "hf"}, [busy])[0]


def test_rounds_reach_the_worker_and_the_report_shows_each_rounds_speedup(cfg_args, monkeypatch):
    """eval.rounds=2: the job asks for two rounds; the report's speedup pools the passes, and each round's
    own speedup (against that round's no_spec) is in report.json and report.md."""
    from distill.evaluate import jobs as eval_jobs

    calls = []

    def run_worker(job, *, log_path, timeout_s, env=None, what="", poll=None):
        calls.append(job)
        first = fake_results(job)
        # a slow spell in round 2 hits the good draft only: 1.5 s per pass instead of 0.5
        second = [{**r, "wall_s": [1.5 if r["name"] == "good" else 1.0] * job["repeats"]} for r in first]
        return {
            "engine": "vllm",
            "device": "cpu",
            "complete": True,
            "results": eval_jobs.pool_rounds([first, second]),
            "plugin": {"patched": True},
        }

    monkeypatch.setattr("distill.utils.subproc.run_worker", run_worker)
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    assert main(["eval", *cfg_args, "eval.rounds=2", "eval.ngram=false", "eval.k=[2]"]) == 0
    assert calls[0]["rounds"] == 2 and calls[0]["keep_engines"] is False
    out = run_dir(cfg_args) / "eval"
    rep = json.loads((out / "report.json").read_text())
    row = next(r for r in rep["results"] if r["name"] == "good")
    assert row["speedup_per_round"] == [pytest.approx(2.0), pytest.approx(2 / 3)]
    assert row["round_of_pass"] == [0, 0, 1, 1] and rep["settings"]["rounds"] == 2
    md = (out / "report.md").read_text()
    assert "in each of 2 rounds over all configurations in turn" in md and "engines kept running" not in md
    assert "- good k=2: 2.00, 0.67" in md


def test_keep_engines_reaches_the_worker_and_the_report_says_so(cfg_args, monkeypatch):
    from distill.evaluate import jobs as eval_jobs

    calls = []

    def run_worker(job, *, log_path, timeout_s, env=None, what="", poll=None):
        calls.append(job)
        first = fake_results(job)
        results = eval_jobs.pool_rounds([first, [{**r, "startup_s": None} for r in first]])
        return {
            "engine": "vllm",
            "device": "cpu",
            "complete": True,
            "results": results,
            "plugin": {"patched": True},
        }

    monkeypatch.setattr("distill.utils.subproc.run_worker", run_worker)
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    args = [*cfg_args, "eval.rounds=2", "eval.ngram=false", "eval.k=[2]"]
    assert main(["eval", *args, "eval.keep_engines=true"]) == 0
    assert calls[-1]["keep_engines"] is True
    out = run_dir(cfg_args) / "eval"
    rep = json.loads((out / "report.json").read_text())
    assert rep["settings"]["keep_engines"] is True
    assert "passes pooled; engines kept running across rounds" in (out / "report.md").read_text()
