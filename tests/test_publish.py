"""`distill publish` on a fabricated tiny run: release contents, checksums, versions, the gate, force, hub."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import ClassVar

import pytest

from distill import rundir
from distill.cli import main
from distill.config import load_config, to_yaml
from distill.publish import card
from distill.publish.release import format_sums, parse_sums, read_latest, verify_release

CONFIG = "configs/tiny.yaml"


def _row(
    name: str, draft: Path | None, k: int, acc: float, *, greedy: float = 1.0, speedup: float = 1.2
) -> dict:
    drafts = 100
    return {
        "name": name,
        "method": "draft_model",
        "draft": str(draft),
        "k": k,
        "temperature": 0.0,
        "num_drafts": drafts,
        "num_draft_tokens": drafts * k,
        "num_accepted_tokens": int(acc * drafts * k),
        "acceptance_rate": acc,
        "mean_acceptance_length": 1 + acc * k,
        "per_position_acceptance": [acc] * k,
        "tokens_per_s": 50.0 * speedup,
        "speedup": speedup,
        "dtype": "float32",
        "greedy_match": greedy,
    }


def write_report(
    run_dir: Path,
    *,
    base_acc: float = 0.1,
    ours_acc: float = 0.6,
    greedy: float = 1.0,
    complete: bool | None = None,
    with_base: bool = True,
    speedup: float | None = 1.0,
    min_acceptance: float | None = None,
    eval_finished: bool = True,
) -> dict:
    """A report of base and distilled at k = 2, 4; distilled's speedups are `speedup` + k / 10 (None: untimed).
    With `eval_finished`, also the completion record a finished `distill eval` leaves beside it."""
    results = [
        {
            "name": "no_spec",
            "method": None,
            "k": 0,
            "temperature": 0.0,
            "output_tokens": 512,
            "tokens_per_s": 50.0,
            "speedup": 1.0,
        }
    ]
    for k in (2, 4):
        if with_base:
            results.append(_row("base", run_dir / "draft_init", k, base_acc, speedup=0.9))
        ours = _row("distilled", run_dir / "draft", k, ours_acc, greedy=greedy, speedup=1.0)
        results.append(ours | {"speedup": None if speedup is None else speedup + k / 10})
    report: dict = {
        "engine": "hf",
        "engine_version": "reference",
        "device": "cpu",
        "target": "tiny",
        "prompts": {"source": "data/prompts/tiny.jsonl", "count": 16},
        "max_tokens": 32,
        "results": results,
        "recommendation": {
            "name": "distilled",
            "k": 4,
            "temperature": 0.0,
            "speedup": 1.4,
            "deploy": True,
            "reason": "fastest measured setting",
        },
    }
    if complete is not None:
        report["complete"] = complete
    if min_acceptance is not None:
        report["settings"] = {"min_acceptance": min_acceptance, "rejection_sample_method": "standard"}
    (run_dir / "eval").mkdir(parents=True, exist_ok=True)
    (run_dir / "eval" / "report.json").write_text(json.dumps(report))
    record = rundir.completion_path(run_dir, "eval")
    record.parent.mkdir(parents=True, exist_ok=True)
    if eval_finished:
        record.write_text(json.dumps({"stage": "eval", "summary": {}}))
    else:
        record.unlink(missing_ok=True)
    return report


@pytest.fixture()
def overrides(tiny_config_overrides, tmp_path) -> list[str]:
    return [*tiny_config_overrides, f"publish.dir={tmp_path / 'releases'}"]


@pytest.fixture()
def run_dir(overrides, tiny_tokenizer) -> Path:
    """A finished tiny run as the other stages leave it: draft, draft_init, data manifest, metrics, report."""
    from distill.models.tiny import save_tiny_model

    cfg = load_config(CONFIG, overrides)
    run = cfg.run_dir
    save_tiny_model(run / "draft", seed=7, tokenizer=tiny_tokenizer, num_layers=1)
    save_tiny_model(run / "draft_init", seed=8, tokenizer=tiny_tokenizer, num_layers=1)
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "data").mkdir()
    (run / "data" / "manifest.json").write_text(json.dumps({"train_examples": 160, "response_tokens": 4800}))
    (run / "train").mkdir()
    with open(run / "train" / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "train/loss", "val/expected_acceptance", "val/top1_agreement"])
        w.writerow([20, 2.5, 0.3, 0.35])
        w.writerow([60, 1.25, 0.55, 0.61])
    rundir.mark_complete(cfg, "train", {"steps": 60})
    write_report(run)
    return run


def publish(overrides: list[str], *extra: str) -> int:
    return main(["publish", "-c", CONFIG, *overrides, *extra])


def release_dir(tmp_path: Path, version: str = "1") -> Path:
    return tmp_path / "releases" / "tiny-draft" / version


def test_release_loads_verifies_and_carries_the_card(run_dir, overrides, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert publish(overrides) == 0
    rel = release_dir(tmp_path)
    assert verify_release(rel) == []
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=rel, check=True)
    released = AutoModelForCausalLM.from_pretrained(rel)
    original = AutoModelForCausalLM.from_pretrained(run_dir / "draft")
    ids = torch.tensor([[1, 5, 9, 40, 2]])
    with torch.no_grad():
        assert torch.equal(released(ids).logits, original(ids).logits)
    assert len(AutoTokenizer.from_pretrained(rel)) == 512
    readme = (rel / "README.md").read_text()
    assert readme.startswith("---\n") and "license:" in readme and '- "speculative-decoding"' in readme
    assert "| distilled | draft_model | 4 | 0.00 | – | autoregressive | 0.600 | 3.400 |" in readme  # measured
    assert "Engine: **hf reference**" in readme and "data/prompts/tiny.jsonl" in readme
    spec = {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "model": str(rel.resolve()),
        "draft_sample_method": "greedy",
    }
    target = load_config(CONFIG, overrides).target.model
    assert f"vllm serve {Path(target).resolve()} --speculative-config '{json.dumps(spec)}'" in readme
    assert "Setting: eval's recommendation, measured at **temperature 0.00**" in readme
    assert "Loss `fkl`, 60 optimizer steps" in readme and "val/expected_acceptance = 0.5500" in readme
    prov = json.loads((rel / "provenance.json").read_text())
    assert prov["release"]["version"] == "1" and prov["forced"] is False and prov["gate"]["passed"] is True
    assert prov["gate"]["compared_settings"] >= 1 and prov["gate"]["first_token_compared_settings"] >= 1
    assert prov["gate"]["first_token_acceptance"] > prov["gate"]["base_first_token_acceptance"]
    assert prov["source"]["draft_files"]["model.safetensors"]
    assert read_latest(rel.parent) == "1" and (rel.parent / "latest").resolve() == rel.resolve()
    assert json.loads((run_dir / "stages" / "publish.json").read_text())["summary"]["version"] == "1"


def _mark_parallel(draft_dir: Path, k: int) -> None:
    config = json.loads((draft_dir / "config.json").read_text())
    config.update(pard_token=0, distill_parallel_tokens=k)
    (draft_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("row_says", [True, None])
def test_parallel_draft_card_serves_parallel_drafting(run_dir, overrides, tmp_path, row_says):
    """The card's speculative_config and serve line carry parallel_drafting for a parallel draft: from the
    report row, or (reports from before parallel drafts) from the draft's config, with a warning then."""
    _mark_parallel(run_dir / "draft", 4)
    path = run_dir / "eval" / "report.json"
    report = json.loads(path.read_text())
    for r in report["results"]:
        if r["method"] and row_says is not None:
            r["parallel_drafting"] = row_says
    path.write_text(json.dumps(report))
    assert publish(overrides) == 0
    rel = release_dir(tmp_path)
    readme = (rel / "README.md").read_text()
    spec = {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "model": str(rel.resolve()),
        "draft_sample_method": "greedy",
        "parallel_drafting": True,
    }
    assert json.dumps(spec, indent=2) in readme and f"--speculative-config '{json.dumps(spec)}'" in readme
    assert "## Parallel drafting" in readme and "ONE forward pass proposes all k tokens" in readme
    assert "k must be ≤ K = 4" in readme
    measured = "parallel" if row_says else "autoregressive"
    assert f"| distilled | draft_model | 4 | 0.00 | – | {measured} | 0.600 |" in readme
    unmeasured = "measured it only as an ordinary draft"
    assert (unmeasured in readme) is (row_says is None)


def test_card_parallel_setting(tmp_path):
    draft = tmp_path / "d"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"pard_token": 3, "distill_parallel_tokens": 6}))
    assert card.parallel_setting({"draft": str(draft)}) == (True, 6)
    assert card.parallel_setting({"draft": str(draft), "parallel_drafting": False}) == (False, 6)
    assert card.parallel_setting({"draft": str(tmp_path / "missing")}) == (False, 0)
    assert card.parallel_setting(None) == (False, 0)
    row = {"name": "d", "method": "draft_model", "draft": str(draft), "k": 2, "temperature": 0.0}
    assert card.speculative_config("m", row, {})["parallel_drafting"] is True  # from the draft's config
    assert "parallel_drafting" not in card.speculative_config("m", row | {"parallel_drafting": False}, {})


def test_tampered_release_fails_verification(run_dir, overrides, tmp_path, capsys):
    assert publish(overrides) == 0
    rel = release_dir(tmp_path)
    assert publish(overrides, f"publish.verify={rel}") == 0
    weights = rel / "model.safetensors"
    os.chmod(weights, 0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert any("model.safetensors: checksum mismatch" in p for p in verify_release(rel))
    assert publish(overrides, f"publish.verify={rel}") == 1
    assert "FAILED" in capsys.readouterr().out
    (rel / "extra.bin").write_bytes(b"x")
    (rel / "config.json").unlink()
    problems = verify_release(rel)
    assert any("extra.bin" in p and "added" in p for p in problems)
    assert any("config.json: missing" in p for p in problems)


def test_second_publish_is_version_2_and_moves_latest(run_dir, overrides, tmp_path):
    assert publish(overrides) == 0
    assert publish(overrides) == 0
    assert release_dir(tmp_path, "1").is_dir() and release_dir(tmp_path, "2").is_dir()
    name_dir = release_dir(tmp_path).parent
    assert read_latest(name_dir) == "2" and os.readlink(name_dir / "latest") == "2"
    assert (
        verify_release(release_dir(tmp_path, "1")) == [] and verify_release(release_dir(tmp_path, "2")) == []
    )


def test_tag_version_and_existing_tag_refused(run_dir, overrides, tmp_path, capsys):
    assert publish(overrides, "publish.version=rc1") == 0
    assert release_dir(tmp_path, "rc1").is_dir()
    assert publish(overrides, "publish.version=rc1") == 2
    assert "already exists" in capsys.readouterr().err
    assert publish(overrides) == 0  # tags do not take integer numbers
    assert release_dir(tmp_path, "1").is_dir() and read_latest(release_dir(tmp_path).parent) == "1"
    assert publish(overrides, "publish.version=../x") == 2


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "report.json not found"),
        ("incomplete", "is incomplete"),
        ("interrupted", "did not finish ("),
        ("no_gain", "no acceptance gain"),
        ("greedy", "greedy_match failed"),
        ("no_base", "no results for the base draft"),
        ("slower", "not faster than the target alone at any of the 2 measured settings: best speedup 0.90x"),
        ("untimed", "eval timed the draft at no setting"),
    ],
)
def test_gate_refuses_with_exit_2_and_writes_nothing(run_dir, overrides, tmp_path, capsys, case, message):
    if case == "missing":
        (run_dir / "eval" / "report.json").unlink()
    elif case == "incomplete":
        write_report(run_dir, complete=False)
    elif case == "interrupted":  # a later eval was killed before rewriting the earlier, complete report
        write_report(run_dir, complete=True, eval_finished=False)
    elif case == "no_gain":
        write_report(run_dir, base_acc=0.6, ours_acc=0.6)
    elif case == "greedy":
        write_report(run_dir, greedy=0.75)
    elif case == "slower":  # more acceptance than the base, but slower than no speculation at every k
        write_report(run_dir, speedup=0.5)
    elif case == "untimed":
        write_report(run_dir, speedup=None)
    else:
        write_report(run_dir, with_base=False)
    before = sorted(p.name for p in run_dir.iterdir())
    assert publish(overrides) == 2
    err = capsys.readouterr().err
    assert message in err and "publish.force=true" in err
    assert not (tmp_path / "releases").exists()
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no provenance/log written either


def test_slow_draft_is_published_only_when_forced_and_the_card_says_why(run_dir, overrides, tmp_path):
    write_report(run_dir, speedup=0.5)  # the reviewer's repro: 0.42x / 0.33x released with exit 0
    assert publish(overrides) == 2
    assert publish(overrides, "publish.force=true", "publish.force_reason=timed on a busy CPU") == 0
    readme = (release_dir(tmp_path) / "README.md").read_text()
    assert "not faster than the target alone" in readme and "timed on a busy CPU" in readme
    prov = json.loads((release_dir(tmp_path) / "provenance.json").read_text())
    assert prov["forced"] is True and prov["gate"]["best_speedup"] == pytest.approx(0.9)


def test_faster_draft_below_min_acceptance_publishes_with_a_warning(run_dir, overrides, tmp_path, caplog):
    """1.17x faster with the first drafted token accepted 0.34 < eval.min_acceptance 0.5. Eval says do not
    deploy, but the draft pays: released without force, the low acceptance a warning on the card and CLI."""
    write_report(run_dir, base_acc=0.1, ours_acc=0.34, speedup=0.77, min_acceptance=0.5)
    assert publish(overrides) == 0
    readme = (release_dir(tmp_path) / "README.md").read_text()
    warning = (
        "first drafted token accepted 0.34 at the fastest setting (k=4, temperature 0.00) is below "
        "eval.min_acceptance 0.50, so eval does not recommend deploying it; it is published because it is 1.17x faster"
    )
    assert f"> Warning: {warning}" in readme and "Published with `publish.force=true`" not in readme
    assert warning in caplog.text
    prov = json.loads((release_dir(tmp_path) / "provenance.json").read_text())
    assert prov["forced"] is False and prov["gate"]["passed"] is True
    assert any(warning in w for w in prov["gate"]["warnings"])


def test_gate_speed_condition_ignores_untimed_settings():
    from distill.publish import gate

    rows = [
        _row("d", None, 2, 0.5, speedup=0.8),
        _row("d", None, 4, 0.5, speedup=3.0) | {"error": "engine died"},  # not a measurement
        _row("d", None, 1, 0.5) | {"speedup": float("nan")},
    ]
    assert "any of the 1 measured settings: best speedup 0.80x (k=2, temperature 0.00)" in (
        gate._speed_problem(rows) or ""
    )
    assert gate._speed_problem([*rows, _row("d", None, 3, 0.5, speedup=1.01)]) is None
    report = {"settings": {"min_acceptance": 0.6}}
    assert gate._acceptance_warning(rows, report) == []  # slower: refused, not warned about
    assert gate._acceptance_warning([_row("d", None, 2, 0.7, speedup=1.3)], report) == []


def _write_results(run_dir: Path, results: list[dict], rec: dict, settings: dict | None = None) -> None:
    no_spec = {"name": "no_spec", "method": None, "k": 0, "output_tokens": 512, "tokens_per_s": 50.0}
    temps = sorted({float(r["temperature"]) for r in results})
    report = {
        "engine": "hf",
        "prompts": {"source": "p.jsonl", "count": 4},
        "results": [no_spec | {"temperature": t, "speedup": 1.0} for t in temps] + results,
        "recommendation": rec | {"deploy": True, "reason": "fastest measured setting"},
        "settings": settings or {"min_acceptance": 0.5, "rejection_sample_method": "standard"},
    }
    (run_dir / "eval" / "report.json").write_text(json.dumps(report))


def _served_spec(tmp_path: Path) -> dict:
    readme = (release_dir(tmp_path) / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("vllm serve "))
    return json.loads(line.split("--speculative-config '", 1)[1].rstrip("'"))


def test_card_serves_the_published_drafts_own_k_not_another_drafts(run_dir, overrides, tmp_path):
    """The reviewer's repro: the run's draft is labelled `mine` (k=1) and eval recommends another draft at
    k=3. The card serves `mine`'s own fastest setting and says the recommendation is about another draft."""
    other = tmp_path / "other-model"
    rec = {"name": "other", "draft": str(other), "k": 3, "temperature": 0.0, "draft_sample_method": "greedy"}
    results = [
        _row("mine", run_dir / "draft", 1, 0.6, speedup=1.1) | {"draft_sample_method": "greedy"},
        _row("mine", run_dir / "draft", 2, 0.5, speedup=1.05) | {"draft_sample_method": "greedy"},
        _row("base", run_dir / "draft_init", 1, 0.1, speedup=0.9) | {"draft_sample_method": "greedy"},
        _row("other", other, 3, 0.9, speedup=1.4) | {"draft_sample_method": "greedy"},
    ]
    _write_results(run_dir, results, rec | {"speedup": 1.4, "speculative_config": {"model": str(other)}})
    assert publish(overrides) == 0
    spec = _served_spec(tmp_path)
    assert spec["num_speculative_tokens"] == 1 and spec["model"] == str(release_dir(tmp_path).resolve())
    readme = (release_dir(tmp_path) / "README.md").read_text()
    assert (
        "this draft's fastest measured setting (eval's recommendation is for another draft, `other`)"
        in readme
    )
    assert "Eval's recommendation is for another draft measured beside this one: other" in readme
    assert "Eval's recommendation: deploy" not in readme


def test_card_serves_the_measured_draft_sampling_and_rejection_sampling(run_dir, overrides, tmp_path):
    """Eval measured (and recommends) probabilistic drafting at T=1 with block verification: the snippet carries
    both (vLLM would otherwise draft greedily), not the first k=2 row (greedy drafting), and its temperature."""
    draft, init = run_dir / "draft", run_dir / "draft_init"
    hot = {"temperature": 1.0}
    results = [
        _row("distilled", draft, 2, 0.2, speedup=1.1) | hot | {"draft_sample_method": "greedy"},
        _row("distilled", draft, 2, 0.7, speedup=1.6) | hot | {"draft_sample_method": "probabilistic"},
        _row("base", init, 2, 0.1, speedup=1.0) | hot | {"draft_sample_method": "greedy"},
        _row("base", init, 2, 0.3, speedup=1.2) | hot | {"draft_sample_method": "probabilistic"},
    ]
    measured = {
        "method": "draft_model",
        "num_speculative_tokens": 2,
        "model": str(draft),
        "draft_sample_method": "probabilistic",
    }
    rec = {"name": "distilled", "draft": str(draft), "k": 2, "draft_sample_method": "probabilistic"}
    rec |= hot | {"parallel_drafting": False, "speedup": 1.6, "speculative_config": measured}
    _write_results(run_dir, results, rec, {"min_acceptance": 0.5, "rejection_sample_method": "block"})
    assert publish(overrides) == 0
    assert _served_spec(tmp_path) == measured | {
        "model": str(release_dir(tmp_path).resolve()),
        "rejection_sample_method": "block",
    }
    readme = (release_dir(tmp_path) / "README.md").read_text()
    assert "measured at **temperature 1.00** with `draft_sample_method` probabilistic and k = 2" in readme


def test_complete_true_report_passes_and_missing_key_counts_as_complete(run_dir, overrides, tmp_path):
    write_report(run_dir, complete=True)
    assert publish(overrides) == 0


def test_force_publishes_with_the_reason_in_the_card(run_dir, overrides, tmp_path):
    write_report(run_dir, base_acc=0.6, ours_acc=0.5)
    assert publish(overrides, "publish.force=true") == 2  # a reason is required
    assert (
        publish(overrides, "publish.force=true", "publish.force_reason=checked by hand on GPU traffic") == 0
    )
    rel = release_dir(tmp_path)
    readme = (rel / "README.md").read_text()
    assert "publish.force=true" in readme and "checked by hand on GPU traffic" in readme
    assert "no acceptance gain" in readme
    prov = json.loads((rel / "provenance.json").read_text())
    assert prov["forced"] is True and prov["force_reason"] == "checked by hand on GPU traffic"
    assert verify_release(rel) == []


def test_force_without_any_eval_says_so(run_dir, overrides, tmp_path):
    (run_dir / "eval" / "report.json").unlink()
    assert publish(overrides, "publish.force=true", "publish.force_reason=eval runs elsewhere") == 0
    readme = (release_dir(tmp_path) / "README.md").read_text()
    assert "report.json not found" in readme and "eval runs elsewhere" in readme
    assert verify_release(release_dir(tmp_path)) == []


def test_missing_draft_is_an_input_error(run_dir, overrides, capsys):
    shutil.rmtree(run_dir / "draft")
    assert publish(overrides) == 2
    assert "distill train" in capsys.readouterr().err


def test_failed_build_leaves_no_release_and_keeps_latest(run_dir, overrides, tmp_path, monkeypatch):
    assert publish(overrides) == 0

    def broken(*args, **kwargs):
        raise RuntimeError("disk vanished")

    monkeypatch.setattr(card, "render", broken)
    assert publish(overrides) == 1
    name_dir = release_dir(tmp_path).parent
    assert sorted(p.name for p in name_dir.iterdir() if not p.name.startswith(".")) == [
        "1",
        "LATEST",
        "latest",
    ]
    assert read_latest(name_dir) == "1"
    assert not [p for p in name_dir.iterdir() if p.name.endswith(".tmp")]


def test_push_to_hub_offline_is_a_clear_error(run_dir, overrides, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_never_shown")
    assert publish(overrides, "publish.push_to_hub=true", "publish.hub_repo=me/tiny-draft") == 2
    err = capsys.readouterr().err
    assert "offline" in err and "push_to_hub=false" in err and "hf_secret_never_shown" not in err
    assert not (tmp_path / "releases").exists()
    assert publish(overrides, "publish.push_to_hub=true") == 2  # hub_repo required


def test_token_is_never_written(run_dir, overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_never_written")
    assert publish(overrides) == 0
    for root in (tmp_path / "releases", run_dir):
        for p in root.rglob("*"):
            if p.is_file():
                assert b"hf_secret_never_written" not in p.read_bytes(), p


def test_license_from_target_metadata_alias_or_override(tmp_path, run_dir, overrides):
    unknown = card.target_info(str(tmp_path), tmp_path, "auto")
    assert unknown.license is None and "unknown" in card._license_line(unknown)
    smol = card.target_info("smollm2-135m-instruct", None, "auto")
    assert (smol.license, smol.hub_id) == ("apache-2.0", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smol.serve_as == "HuggingFaceTB/SmolLM2-135M-Instruct"
    tiny = card.target_info("tiny-llama", None, "auto")  # no hub id: vLLM gets the alias's cache folder
    assert tiny.license == "apache-2.0" and tiny.serve_as.endswith("tiny-llama-v1")
    (tmp_path / "README.md").write_text("---\nlicense: llama3.2\nbase_model: x/y\n---\n# card\n")
    assert card.target_info(str(tmp_path), tmp_path, "auto").license == "llama3.2"
    assert card.target_info(str(tmp_path), tmp_path, "mit").license == "mit"
    assert publish(overrides, "publish.license=mit") == 0
    assert 'license: "mit"' in (release_dir(tmp_path) / "README.md").read_text()


def test_unknown_license_is_stated_in_the_card(run_dir, overrides, tmp_path):
    assert publish(overrides) == 0  # the session's tiny target is a bare local folder: no license metadata
    readme = (release_dir(tmp_path) / "README.md").read_text()
    assert 'license: "other"' in readme and "License: **unknown**" in readme


def test_gain_is_compared_at_matching_settings_only(tmp_path):
    from distill.publish import gate

    base = [
        _row("base", None, 2, 0.5) | {"draft_sample_method": "greedy"},
        _row("base", None, 2, 0.1) | {"temperature": 1.0, "draft_sample_method": "probabilistic"},
    ]
    ours = [
        _row("distilled", None, 2, 0.3) | {"draft_sample_method": "greedy"},
        _row("distilled", None, 4, 0.9) | {"draft_sample_method": "greedy"},
    ]
    assert gate.acceptance_gain(ours, base) == (0.3, 0.5, 1)  # k=4 and T=1 have no counterpart
    assert gate.acceptance_gain(ours, [])[2] == 0


def test_gain_without_a_common_k_compares_the_first_drafted_token():
    """A parallel draft swept at k=2,3 beside its base at k=1: no common k, so the first drafted token's
    acceptance decides (k-independent), and a draft that does not beat its base is still refused."""
    from distill.publish import gate

    base = [_row("base", None, 1, 0.05)]
    ours = [
        _row("distilled", None, 2, 0.2) | {"per_position_acceptance": [0.33, 0.07]},
        _row("distilled", None, 3, 0.14) | {"per_position_acceptance": [0.31, 0.07, 0.04]},
    ]
    assert gate.acceptance_gain(ours, base)[2] == 0
    assert gate.first_position_gain(ours, base) == pytest.approx((0.32, 0.05, 1))
    assert gate._gain_problem(ours, base) is None
    worse = [_row("base", None, 1, 0.5)]
    assert "first drafted token accepted 0.3200 vs base 0.5000" in gate._gain_problem(ours, worse)
    hot = [_row("base", None, 1, 0.05) | {"temperature": 1.0}]
    assert "not measured at any common (temperature, drafting) setting" in gate._gain_problem(ours, hot)


def test_sums_format_round_trip():
    sums = {"a/b.json": "0" * 64, "model.safetensors": "f" * 64}
    text = format_sums(sums)
    assert text == f"{'0' * 64}  a/b.json\n{'f' * 64}  model.safetensors\n"
    assert parse_sums(text) == sums
    assert parse_sums(f"{'1' * 64} *bin.dat\n") == {"bin.dat": "1" * 64}
    with pytest.raises(ValueError):
        parse_sums("nonsense\n")


def _card_line(report: dict) -> str:
    return card._recommendation(report)


def test_card_says_why_not_to_deploy():
    """Each cause in its own words; "not faster" only when the speedup says so."""
    rec = {"name": "distilled", "k": 4, "temperature": 0.0, "deploy": False, "reason": "gated"}
    low = {"complete": True, "settings": {"min_acceptance": 0.5}}
    line = _card_line(low | {"recommendation": rec | {"speedup": 1.3, "acceptance_rate": 0.3}})
    assert "acceptance 0.30 is below eval.min_acceptance 0.50" in line and "not faster" not in line
    line = _card_line(low | {"recommendation": rec | {"speedup": 0.8, "acceptance_rate": 0.9}})
    assert "speculation is not faster here (speedup 0.80x)" in line and "acceptance" not in line.split("—")[0]
    both = rec | {"speedup": 0.9, "acceptance_rate": 0.2, "min_acceptance": 0.6}
    line = _card_line({"complete": True, "recommendation": both})
    assert "acceptance 0.20 is below eval.min_acceptance 0.60; speculation is not faster" in line
    fast = rec | {"speedup": 1.5, "acceptance_rate": 0.8, "deploy": True, "causes": ["incomplete"]}
    line = _card_line({"complete": False, "recommendation": fast})
    assert "do **not** deploy (the eval is incomplete" in line and "not faster" not in line
    greedy = rec | {"speedup": 1.5, "acceptance_rate": 0.8, "causes": ["greedy_mismatch"]}
    assert "changed the target's greedy output" in _card_line({"complete": True, "recommendation": greedy})
    ok = rec | {"speedup": 1.5, "acceptance_rate": 0.8, "deploy": True}
    assert "Eval's recommendation: deploy —" in _card_line({"complete": True, "recommendation": ok})
    # A current report's bar is on the first drafted token (an older one's, above, on acceptance_rate).
    first = rec | {"speedup": 1.3, "acceptance_rate": 0.1, "first_drafted_acceptance": 0.25}
    line = _card_line(low | {"recommendation": first})
    assert "first drafted token accepted 0.25 is below eval.min_acceptance 0.50" in line
    above = first | {"first_drafted_acceptance": 0.6, "causes": ["greedy_mismatch"]}
    assert "below" not in _card_line(low | {"recommendation": above})


def test_card_shows_the_hardware(run_dir, overrides, tmp_path):
    report = write_report(run_dir)
    report["hardware"] = {"device": "cpu", "cpu": "Example CPU", "summary": "CPU: Example CPU, 2 cores"}
    (run_dir / "eval" / "report.json").write_text(json.dumps(report))
    assert publish(overrides) == 0
    assert "hardware: **CPU: Example CPU, 2 cores**" in (release_dir(tmp_path) / "README.md").read_text()


class FakeHfApi:
    """Records calls; `upload_folder` fails while `failures` > 0 (a network error, with the token in it)."""

    failures = 0
    uploads: ClassVar[list[str]] = []
    tags: ClassVar[list[str]] = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo, **kwargs):
        return repo

    def upload_folder(self, *, folder_path, repo_id, **kwargs):
        if FakeHfApi.failures > 0:
            FakeHfApi.failures -= 1
            raise ConnectionError(f"connection reset (Authorization: Bearer {self.token})")
        FakeHfApi.uploads.append(folder_path)

    def create_tag(self, repo, *, tag, **kwargs):
        FakeHfApi.tags.append(tag)


@pytest.fixture()
def fake_hub(monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_in_upload_error")
    monkeypatch.setattr(FakeHfApi, "uploads", [])
    monkeypatch.setattr(FakeHfApi, "tags", [])
    monkeypatch.setattr(FakeHfApi, "failures", 1)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_failed_upload_is_retried_for_the_same_release_without_a_new_version(
    run_dir, overrides, tmp_path, fake_hub, capsys
):
    hub_args = ("publish.push_to_hub=true", "publish.hub_repo=me/tiny-draft")
    assert publish(overrides, *hub_args) == 1  # the upload failed after the local release was written
    err = capsys.readouterr().err
    assert "retry only this upload" in err and "hf_secret_in_upload_error" not in err
    rel1, name_dir = release_dir(tmp_path, "1"), release_dir(tmp_path).parent
    assert verify_release(rel1) == [] and read_latest(name_dir) == "1" and fake_hub.uploads == []
    assert not (run_dir / "stages" / "publish.json").exists()
    card_before = (rel1 / "README.md").read_bytes()

    assert publish(overrides, *hub_args) == 0  # the rerun retries the upload of release 1 only
    assert not release_dir(tmp_path, "2").exists() and read_latest(name_dir) == "1"
    assert fake_hub.uploads == [str(rel1)] and fake_hub.tags == ["v1"]
    assert (rel1 / "README.md").read_bytes() == card_before and verify_release(rel1) == []
    summary = json.loads((run_dir / "stages" / "publish.json").read_text())["summary"]
    assert summary["version"] == "1" and summary["hub_url"] == "https://huggingface.co/me/tiny-draft"
    assert not list((run_dir / "stages").glob("*pending*"))

    assert publish(overrides, *hub_args) == 0  # once pushed, publishing again makes a new version
    assert read_latest(name_dir) == "2" and fake_hub.uploads[-1] == str(release_dir(tmp_path, "2"))


def test_pending_upload_of_a_changed_draft_makes_a_new_version(
    run_dir, overrides, tmp_path, fake_hub, tiny_tokenizer
):
    from distill.models.tiny import save_tiny_model

    hub_args = ("publish.push_to_hub=true", "publish.hub_repo=me/tiny-draft")
    assert publish(overrides, *hub_args) == 1
    save_tiny_model(run_dir / "draft", seed=9, tokenizer=tiny_tokenizer, num_layers=1)  # retrained since
    assert publish(overrides, *hub_args) == 0
    assert fake_hub.uploads == [str(release_dir(tmp_path, "2"))]
    assert read_latest(release_dir(tmp_path).parent) == "2"
