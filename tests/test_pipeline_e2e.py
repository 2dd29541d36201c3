"""The real `distill run` on configs/tiny.yaml (reference eval engine): end to end, SIGKILL mid-train and resume
to the same result, and a rerun after completion that does nothing. Minutes on 2 CPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distill.publish.release import read_latest, verify_release

REPO = Path(__file__).resolve().parents[1]


def _cmd(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "distill", "run", "-c", "configs/tiny.yaml", *overrides]


def _env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DISTILL_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def _run(overrides: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cmd(overrides), cwd=REPO, env=_env(cache), capture_output=True, text=True, timeout=1200
    )


def _kill_during_train(overrides: list[str], cache: Path, run_dir: Path) -> None:
    """Start the pipeline and SIGKILL its whole process group once train has written a checkpoint."""
    proc = subprocess.Popen(
        _cmd(overrides),
        cwd=REPO,
        env=_env(cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "train" / "last.ckpt").is_file():
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the pipeline ended before train wrote a checkpoint"
        assert not (run_dir / "stages" / "train.json").exists(), "train finished before the kill"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _acceptance(run_dir: Path) -> list[tuple]:
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    return sorted(
        (r["name"], r["k"], r["temperature"], r.get("acceptance_rate"), r.get("num_accepted_tokens"))
        for r in report["results"]
        if r.get("method") == "draft_model"
    )


def _records(run_dir: Path) -> dict[str, str]:
    return {
        p.name: p.read_text() for p in sorted((run_dir / "stages").glob("*.json")) if p.name != "run.json"
    }


@pytest.mark.slow
def test_run_killed_mid_train_resumes_to_the_same_result_and_rerun_does_nothing(
    tiny_config_overrides, tmp_path, isolated_cache
):
    import torch

    common = [
        *tiny_config_overrides,
        "eval.engine=hf",
        f"publish.dir={tmp_path / 'releases'}",
        # Tiny random models decode faster alone than with speculation; this test is about resuming.
        "publish.force=true",
        "publish.force_reason=tiny random models are not faster with speculation",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    first = _run([*common, f"run.dir={a}", "publish.name=a"], isolated_cache)
    assert first.returncode == 0, first.stderr[-3000:]

    b_args = [*common, f"run.dir={b}", "publish.name=b"]
    _kill_during_train(b_args, isolated_cache, b)
    resumed = _run(b_args, isolated_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log_text = (b / "distill.log").read_text()
    assert "data: complete with the same config" in log_text and "resuming from" in log_text

    ta, tb = _tensors(a / "draft"), _tensors(b / "draft")
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    assert _acceptance(a) == _acceptance(b)
    release = tmp_path / "releases" / "b" / "1"
    assert verify_release(release) == [] and read_latest(release.parent) == "1"

    before = _records(b)
    report_mtime = (b / "eval" / "report.json").stat().st_mtime_ns
    again = _run(b_args, isolated_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do" in (b / "distill.log").read_text()
    assert _records(b) == before
    assert (b / "eval" / "report.json").stat().st_mtime_ns == report_mtime
    assert sorted(p.name for p in release.parent.iterdir() if not p.name.startswith(".")) == [
        "1",
        "LATEST",
        "latest",
    ]
