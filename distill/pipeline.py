"""`distill run`: data → train → eval → publish, for people and for schedulers.

Each stage records completion with the hash of the config sections that produced it (`distill.rundir`). A rerun
skips stages complete with the same config, lets an interrupted stage resume itself (each stage resumes from
its own saved state), and reruns a stage whose config changed together with every stage after it. Exit codes
follow CONTRACT.md (0 / 1 / 2 / 130) so cron, systemd, SLURM and Kubernetes can act on them.

Under a multi-process launcher (`srun` with several tasks, torchrun, Lightning's `ddp` re-execution), rank 0
runs every stage; the other ranks wait for the data stage, join training (Lightning's SLURM/DDP support wires
them up), and stop there.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from distill import rundir
from distill.config import Config
from distill.errors import EXIT_OK, DistillError, Interrupted, RuntimeFailure
from distill.utils.fs import atomic_write_json, read_json

log = logging.getLogger("distill.run")

StageFn = Callable[[Config], "int | None"]

# Pipeline stage name -> CLI dispatch name.
CLI_NAMES = {"data": "data", "train": "train", "eval": "eval", "publish": "publish"}
WAIT_POLL_S = 5.0


def resolve_stage(name: str) -> StageFn:
    """The stage function, via the CLI's dispatch table (raises DistillError when not built yet)."""
    from distill.cli import resolve_stage as cli_resolve

    return cli_resolve(CLI_NAMES[name])


def load_stages() -> dict[str, StageFn]:
    """All four stage functions, or one error naming every stage that is not built yet."""
    funcs, missing = {}, []
    for name in rundir.STAGES:
        try:
            funcs[name] = resolve_stage(name)
        except DistillError as exc:
            missing.append(f"{name} ({exc})")
    if missing:
        raise RuntimeFailure(
            "`distill run` needs all four stages, but these are not available in this installation: "
            + "; ".join(missing)
            + ". Run the available stages one by one meanwhile (`distill data`, ...)."
        )
    return funcs


def _recorded_hash(cfg: Config, stage: str) -> str | None:
    p = rundir.completion_path(cfg.run_dir, stage)
    try:
        rec = read_json(p) if p.is_file() else None
    except (OSError, ValueError):
        return None
    return rec.get("config_hash") if isinstance(rec, dict) else None


def plan(cfg: Config) -> list[tuple[str, str]]:
    """(stage, action) per stage: `skip` (complete with the same config), `start` (never completed: a fresh
    start or a resume), `changed` (its config changed since it completed) or `redo` (an earlier stage runs, so
    its inputs are rebuilt). Once one stage runs, every later one runs too."""
    out, running = [], False
    for stage in rundir.STAGES:
        recorded = _recorded_hash(cfg, stage)
        if not running and rundir.is_complete(cfg, stage):
            out.append((stage, "skip"))
            continue
        running = True
        if recorded is None:
            out.append((stage, "start"))
        elif recorded != rundir.stage_hash(cfg, stage):
            out.append((stage, "changed"))
        else:
            out.append((stage, "redo"))
    return out


def _describe(cfg: Config, stage: str, action: str) -> str:
    return {
        "skip": f"{stage}: complete with the same config (hash {rundir.stage_hash(cfg, stage)}), skipping",
        "start": f"{stage}: running (resumes from its saved state if it was interrupted)",
        "changed": f"{stage}: config changed since it completed (hash now {rundir.stage_hash(cfg, stage)}), "
        "running it again",
        "redo": f"{stage}: an earlier stage is being redone, so running it again on the new inputs",
    }[action]


def _attach_log(cfg: Config) -> bool:
    # The log file lives in the run folder; a fresh run's folder is created by the first stage (after its own
    # validation, so bad input writes nothing), which attaches the same file.
    if cfg.run_dir.is_dir():
        rundir.attach_log_file(cfg.run_dir)
        return True
    return False


def _status(cfg: Config, **fields: Any) -> None:
    # Only rank 0 reports: the other ranks read this file to learn that rank 0 stopped.
    if launcher_rank() == 0 and cfg.run_dir.is_dir():
        atomic_write_json(
            rundir.completion_path(cfg.run_dir, "run"),
            {
                "time": time.time(),
                "pid": os.getpid(),
                "iso_time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **fields,
            },
        )


def run(cfg: Config) -> int:
    """Run the pipeline; returns the first non-zero stage exit code, or 0."""
    funcs = load_stages()
    rank = launcher_rank()
    if rank != 0:
        return _run_follower(cfg, funcs, rank)
    in_file = _attach_log(cfg)
    steps = plan(cfg)
    for stage, action in steps:
        log.info(_describe(cfg, stage, action))
    if all(action == "skip" for _, action in steps):
        log.info("nothing to do: every stage is complete with this config (run folder %s)", cfg.run_dir)
        return EXIT_OK
    for stage, action in steps:
        if action == "skip":
            continue
        for later in rundir.STAGES[rundir.STAGES.index(stage) :]:
            rundir.clear_complete(cfg, later)  # a failed rerun must not leave stale "complete" records
        stage_cfg = _fresh_outputs(cfg, stage) if action in ("changed", "redo") else cfg
        code = _run_stage(stage_cfg, stage, funcs[stage])
        if not in_file and _attach_log(cfg):  # a fresh run: put the plan into the new log file too
            in_file = True
            log.info("distill run plan: %s", ", ".join(f"{s}={a}" for s, a in steps))
        if code != EXIT_OK:
            return code
    _status(cfg, status="done")
    log.info("pipeline complete: %s", cfg.run_dir)
    return EXIT_OK


def _fresh_outputs(cfg: Config, stage: str) -> Config:
    """The config a stage reruns with when its previous outputs came from another config (or from inputs that
    are being rebuilt): data overwrites its old records, train starts from step 0 instead of resuming an old
    checkpoint. Both keys are `run_only`, so the stage hash is unchanged."""
    if stage == "data":
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, overwrite=True))
    if stage == "train":
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="never"))
    return cfg


def _run_stage(cfg: Config, stage: str, fn: StageFn) -> int:
    start = time.monotonic()
    _status(cfg, status="running", stage=stage)
    try:
        result = fn(cfg)
    except (Interrupted, KeyboardInterrupt):
        _attach_log(cfg)
        log.warning("interrupted during %s; its state is saved — rerun the same command to resume", stage)
        _status(cfg, status="interrupted", stage=stage)
        raise
    except BaseException as exc:
        _attach_log(cfg)
        _status(cfg, status="failed", stage=stage, error=type(exc).__name__)
        raise
    _attach_log(cfg)
    code = EXIT_OK if result is None else int(result)
    if code != EXIT_OK:
        log.error("%s exited with code %d; stopping (later stages not run)", stage, code)
        _status(cfg, status="failed", stage=stage, exit_code=code)
        return code
    if launcher_rank() == 0 and not rundir.is_complete(cfg, stage):  # other ranks never record completion
        log.warning("%s returned success but recorded no completion; a rerun will run it again", stage)
    log.info("%s: done in %.1f s", stage, time.monotonic() - start)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------
# Multi-process launchers (SLURM srun with several tasks, torchrun)


def launcher_rank() -> int:
    """This process's rank under a multi-process launcher (0 for a plain process).

    SLURM's srun sets SLURM_PROCID per task; torchrun sets RANK; Lightning's `ddp` strategy re-executes the
    command line for its extra processes with LOCAL_RANK / NODE_RANK set (and no RANK).
    """
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) != 0:
            return int(value)
    return 0


def _run_follower(cfg: Config, funcs: dict[str, StageFn], rank: int) -> int:
    """Ranks > 0: wait until rank 0 has the data, then take part in training only."""
    started = time.time()
    log.info("rank %d: waiting for rank 0 to finish the data stage", rank)
    while not rundir.is_complete(cfg, "data"):
        status = _read_status(cfg)
        if status.get("status") in ("failed", "interrupted") and float(status.get("time", 0)) >= started:
            raise RuntimeFailure(
                f"rank {rank}: rank 0 stopped during {status.get('stage')} ({status['status']})."
            )
        time.sleep(WAIT_POLL_S)
    if rundir.is_complete(cfg, "train"):
        log.info("rank %d: train already complete, nothing to do on this rank", rank)
        return EXIT_OK
    return _run_stage(cfg, "train", funcs["train"])


def _read_status(cfg: Config) -> dict[str, Any]:
    p = rundir.completion_path(cfg.run_dir, "run")
    try:
        status = read_json(p) if p.is_file() else {}
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}
