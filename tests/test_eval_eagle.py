"""EAGLE-1 heads in `distill eval` (`eval.drafts[i].method: eagle`): the job, the report and the preflight
checks with a fake worker; with vLLM installed, a head on the tiny target inside real vLLM speculation."""

from __future__ import annotations

import json
import shutil

import pytest
import test_eval_stage as stage_tests
from model_folders import eagle_head

from distill.cli import main
from distill.evaluate import jobs, report
from distill.utils.subproc import vllm_available

# The eval stage tests' fixtures (configs/tiny.yaml on the tiny target; a worker that fakes vLLM) and helpers.
cfg_args = stage_tests.cfg_args
fake_worker = stage_tests.fake_worker
run_dir = stage_tests.run_dir
_assert_input_error = stage_tests._assert_input_error


def _drafts(cfg_args, drafts: str) -> list[str]:
    return [a for a in cfg_args if not a.startswith("eval.drafts=")] + [f"eval.drafts={drafts}"]


def test_build_configs_gives_each_draft_its_method():
    configs = jobs.build_configs(
        drafts=[("head", "/h"), ("small", "/s")],
        ks=[1, 2],
        temperatures=[0.0],
        draft_sample_methods=["greedy"],
        ngram_k=None,
        methods={"head": "eagle"},
    )
    got = [(c["name"], c["method"], c["k"]) for c in configs]
    assert got == [
        ("no_spec", None, 0),
        ("head", "eagle", 1),
        ("head", "eagle", 2),
        ("small", "draft_model", 1),
        ("small", "draft_model", 2),
    ]


def test_eagle_head_is_measured_beside_a_standalone_draft(cfg_args, fake_worker, tiny_target_dir, tmp_path):
    head = eagle_head(tiny_target_dir, tmp_path / "head")  # no tokenizer: the target's is used
    args = _drafts(
        cfg_args, f"[{{name: good, model: {head}, method: eagle}}, {{name: small, model: {tiny_target_dir}}}]"
    )
    assert main(["eval", *args, "eval.temperatures=[0.0,1.0]", "eval.ngram=false"]) == 0
    job = fake_worker[0]["job"]
    eagle = [c for c in job["configs"] if c["name"] == "good"]
    assert {c["method"] for c in eagle} == {"eagle"} and {c["draft"] for c in eagle} == {str(head)}
    # both drafting methods at T=1, as for a standalone draft (vLLM's proposer is shared)
    assert {(c["temperature"], c["draft_sample_method"]) for c in eagle} == {
        (0.0, "greedy"),
        (1.0, "greedy"),
        (1.0, "probabilistic"),
    }
    assert {c["method"] for c in job["configs"] if c["name"] == "small"} == {"draft_model"}

    out = run_dir(args) / "eval"
    rep = json.loads((out / "report.json").read_text())
    assert rep["complete"] is True
    rows = {(r["name"], r["k"], r["temperature"], r["draft_sample_method"]): r for r in rep["results"]}
    head_row = rows[("good", 2, 0.0, "greedy")]
    assert head_row["method"] == "eagle" and head_row["acceptance_rate"] == pytest.approx(0.9)
    # no analytic figures for the head (its cost needs the target's states); the standalone draft has them
    assert "analytic_speedup" not in head_row and "cost_ratio" not in head_row
    assert rows[("small", 2, 0.0, "greedy")]["analytic_speedup"] is not None
    assert set(rep["analytic"]["cost_ratio"]) == {"small"}
    assert any("'good' is an EAGLE head" in n for n in rep["notes"])
    rec = rep["recommendation"]
    assert rec["name"] == "good" and rec["method"] == "eagle" and rec["deploy"] is True
    assert rec["speculative_config"] == {
        "method": "eagle",
        "num_speculative_tokens": rec["k"],
        "model": str(head),
        "draft_sample_method": "greedy",
    }
    assert "| good | 2 | eagle | greedy |" in (out / "report.md").read_text()


def test_eagle_head_with_a_tokenizer_must_share_the_targets(cfg_args, capsys, tiny_target_dir, tmp_path):
    from distill.models.tiny import build_tiny_tokenizer

    head = eagle_head(tiny_target_dir, tmp_path / "head")
    other = build_tiny_tokenizer()
    other.add_tokens(["<extra-token>"])
    other.save_pretrained(head)
    _assert_input_error(
        _drafts(cfg_args, f"[{{name: h, model: {head}, method: eagle}}]"), capsys, "eval.drafts[0].model"
    )


@pytest.mark.parametrize(
    ("defect", "needles"),
    [
        ("standalone", ["eval.drafts[0].model", "no fc.weight", "method: draft_model"]),
        ("fc_shape", ["eval.drafts[0].model", "fc.weight of shape [128, 64]", "[128, 256]"]),
        ("missing_layer_tensor", ["eval.drafts[0].model", "incomplete EAGLE-1 head", "layers.1.mlp.up_proj"]),
        (
            "head_as_draft_model",
            ["eval.drafts[0].model", "holds an EAGLE head", "eval.drafts[0].method=eagle"],
        ),
    ],
)
def test_a_folder_that_does_not_match_its_method_stops_in_preflight(
    cfg_args, capsys, fake_worker, tiny_target_dir, tmp_path, defect, needles
):
    method = ", method: eagle"
    if defect == "standalone":
        folder = shutil.copytree(tiny_target_dir, tmp_path / "draft")
    elif defect == "fc_shape":
        folder = eagle_head(tiny_target_dir, tmp_path / "head", fc_shape=(128, 64))
    elif defect == "missing_layer_tensor":
        folder = eagle_head(
            tiny_target_dir, tmp_path / "head", num_layers=2, drop=("layers.1.mlp.up_proj.weight",)
        )
    else:
        folder, method = eagle_head(tiny_target_dir, tmp_path / "head"), ""
    _assert_input_error(_drafts(cfg_args, f"[{{name: h, model: {folder}{method}}}]"), capsys, *needles)
    assert not fake_worker  # the engine never started


def test_eagle_head_with_the_reference_engine_names_the_method_key(
    cfg_args, capsys, tiny_target_dir, tmp_path
):
    head = eagle_head(tiny_target_dir, tmp_path / "head")
    args = [*_drafts(cfg_args, f"[{{name: h, model: {head}, method: eagle}}]"), "eval.engine=hf"]
    _assert_input_error(args, capsys, "eval.drafts[0].method", "eval.engine=vllm")


def test_unknown_method_is_a_config_error(cfg_args, capsys, tiny_target_dir):
    args = _drafts(cfg_args, f"[{{name: h, model: {tiny_target_dir}, method: medusa}}]")
    _assert_input_error(args, capsys, "eval.drafts[0].method", "'eagle'")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_eagle_head_inside_vllm(cfg_args, tiny_target_dir, tmp_path):
    """The whole stage on real vLLM: the head drafts (counters move), and in float32 at T=0 speculation leaves
    the target's greedy output unchanged."""
    head = eagle_head(tiny_target_dir, tmp_path / "head")
    args = [
        *_drafts(cfg_args, f"[{{name: head, model: {head}, method: eagle}}]"),
        "eval.engine=vllm",
        "eval.k=[2]",
        "eval.ngram=false",
        "eval.repeats=1",
        "eval.num_prompts=3",
        "eval.max_tokens=16",
        "eval.cpu_reserved_cores=0",
        "eval.plots=false",
    ]
    assert main(["eval", *args]) == 0
    rep = json.loads((run_dir(args) / "eval" / "report.json").read_text())
    assert rep["complete"] is True, rep["error"]
    row = next(r for r in rep["results"] if r["name"] == "head")
    assert (
        row["method"] == "eagle"
        and row["num_drafts"] > 0
        and row["num_draft_tokens"] == 2 * row["num_drafts"]
    )
    assert len(row["per_position_acceptance"]) == 2
    assert row["greedy_match"] == 1.0  # float32, temperature 0: the target's own output
    assert report.speculative_config(row)["method"] == "eagle"
