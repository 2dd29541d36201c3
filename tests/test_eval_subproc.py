"""`run_worker` with real child processes (tiny python scripts, no vLLM): success, a non-zero exit, a kill by
signal, a hang past the timeout (the whole process group is stopped), and a result that is not JSON."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from distill.errors import RuntimeFailure
from distill.utils.subproc import run_worker

# The child gets argv [-c, MODE, JOB_FILE, RESULT_FILE], like `python -m distill.vllm_worker JOB RESULT`.
CHILD = r"""
import json, os, signal, subprocess, sys, time
mode, job_file, result_file = sys.argv[1:4]
job = json.load(open(job_file))
for i in range(60):
    print(f"log line {i}", flush=True)
print("loading engine for", job["what"], flush=True)
if mode == "ok":
    json.dump({"results": [job["what"]], "complete": True}, open(result_file, "w"))
elif mode == "crash":
    print("RuntimeError: out of KV cache blocks", flush=True)
    sys.exit(3)
elif mode == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "garbage":
    open(result_file, "w").write("not json")
elif mode == "hang":
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(job["pid_file"], "w").write(str(grandchild.pid))
    print("engine core started", flush=True)
    time.sleep(600)
"""


def _run(tmp_path: Path, mode: str, timeout_s: float = 60.0) -> dict:
    job = {"what": "tiny", "pid_file": str(tmp_path / "grandchild.pid")}
    return run_worker(
        job,
        log_path=tmp_path / "worker.log",
        timeout_s=timeout_s,
        what="test worker",
        command=[sys.executable, "-c", CHILD, mode],
    )


def _gone(pid: int) -> bool:
    """Dead or a zombie (a container's init may never reap the orphaned grandchild)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_success_returns_the_result(tmp_path):
    assert _run(tmp_path, "ok") == {"results": ["tiny"], "complete": True}
    assert "loading engine for tiny" in (tmp_path / "worker.log").read_text()


def test_non_zero_exit_reports_the_exit_code_and_the_log_tail(tmp_path):
    with pytest.raises(RuntimeFailure) as err:
        _run(tmp_path, "crash")
    msg = str(err.value)
    assert "test worker failed (exit 3)" in msg and str(tmp_path / "worker.log") in msg
    assert msg.rstrip().endswith("RuntimeError: out of KV cache blocks")
    assert "log line 59" in msg and "log line 5\n" not in msg  # the tail, not the whole log


def test_killed_by_a_signal_is_named(tmp_path):
    with pytest.raises(RuntimeFailure, match=r"(?s)killed by SIGKILL — out of memory\?.*loading engine"):
        _run(tmp_path, "signal")


def test_a_result_that_is_not_json_is_a_runtime_failure(tmp_path):
    with pytest.raises(RuntimeFailure, match="result is not a JSON object"):
        _run(tmp_path, "garbage")


def test_hang_past_the_timeout_stops_the_process_group_with_the_log_tail(tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeFailure) as err:
        _run(tmp_path, "hang", timeout_s=1.5)
    assert time.monotonic() - start < 15
    msg = str(err.value)
    assert "test worker did not finish within 2 s and was stopped" in msg
    assert msg.rstrip().endswith("engine core started")
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild), "an engine process outlived the worker"
