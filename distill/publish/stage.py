"""`distill publish`: a versioned, verifiable release of the distilled draft with a measured model card.

Load (draft folder, eval report, gate) → refuse or go → build the release in a temporary folder → verify its
checksums → rename it into `<publish.dir>/<publish.name>/<version>` → verify again → move `latest` → upload
(optional) → record completion. A reader never sees a half-written release or a `latest` pointing at one.

An upload that fails leaves the local release complete and `run_dir/stages/publish.push_pending.json` naming
it; the rerun (`distill publish` or `distill run`) retries only the upload of that same release while the draft
and the eval report are unchanged, instead of publishing a duplicate version.
"""

from __future__ import annotations

import datetime as _dt
import logging
import shutil
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from distill import rundir
from distill.config import Config, to_dict
from distill.errors import EXIT_OK, EXIT_RUNTIME, InputError, RuntimeFailure
from distill.publish import card, gate, hub
from distill.publish.release import (
    next_version,
    release_lock,
    set_latest,
    verify_release,
    write_sums,
)
from distill.utils.fs import (
    atomic_dir,
    atomic_write_json,
    atomic_write_text,
    folder_checksums,
    read_json,
    remove_stale_temporaries,
    sha256_file,
)

log = logging.getLogger("distill.publish")

# Files of the run's draft folder that the release writes itself.
_OWN_FILES = {"README.md", "provenance.json", "SHA256SUMS"}


def run(cfg: Config) -> int:
    """Publish `run_dir/draft` as the next release (see module docstring). Returns the exit code."""
    pcfg = cfg.publish
    if pcfg.verify:
        return verify_only(Path(pcfg.verify))
    run_dir = cfg.run_dir
    draft_dir = _require_draft(run_dir)
    result = _gate(run_dir, pcfg.force)
    token = hub.preflight(pcfg) if pcfg.push_to_hub else ""
    name_dir = Path(pcfg.dir) / pcfg.name
    pending = pending_release(cfg, name_dir, draft_dir)
    if pending is None:
        _refuse_existing_tag(name_dir, pcfg.version)
    run_config = _run_config(run_dir, cfg)  # before start_stage rewrites config.yaml
    rundir.start_stage(cfg, "publish")
    if pending is not None:
        version, final = pending
        log.info(
            "release %s is already written and verified; its upload is pending: retrying only that", final
        )
    else:
        version, final = _release(cfg, name_dir, draft_dir, result, run_config)
        log.info("published %s (version %s); latest -> %s", final, version, version)
    summary: dict[str, Any] = {
        "version": version,
        "path": str(final),
        "forced": bool(pcfg.force and not result.passed),
    }
    if pcfg.push_to_hub:
        summary["hub_url"] = hub.push(final, pcfg, version, token)  # raises: the pending record stays
    elif pending is not None:
        log.warning("publish.push_to_hub=false now: release %s stays local (its upload is dropped)", final)
    pending_path(run_dir).unlink(missing_ok=True)
    rundir.mark_complete(cfg, "publish", summary)
    print(f"published {final}")
    return EXIT_OK


def _release(
    cfg: Config, name_dir: Path, draft_dir: Path, result: gate.GateResult, run_config: dict[str, Any]
) -> tuple[str, Path]:
    """Build, verify and move in the next release; point `latest` at it. Returns (version, folder)."""
    pcfg = cfg.publish
    with release_lock(name_dir):
        remove_stale_temporaries(name_dir)
        version = next_version(name_dir) if pcfg.version == "auto" else pcfg.version
        _refuse_existing_tag(name_dir, version)  # a parallel publish may have taken it meanwhile
        final = name_dir / version
        model_ref = pcfg.hub_repo or str(final.resolve())
        with atomic_dir(final) as tmp:
            _build(tmp, cfg, draft_dir, result, run_config, version, model_ref)
            _check_built(tmp, draft_dir)
        problems = verify_release(final)
        if problems:
            raise RuntimeFailure(f"release {final} failed verification after the move: {'; '.join(problems)}")
        set_latest(name_dir, version)
        if pcfg.push_to_hub:  # until the upload succeeds, a rerun retries it instead of a new version
            atomic_write_json(
                pending_path(cfg.run_dir),
                {"version": version, "path": str(final.resolve()), "hub_repo": pcfg.hub_repo},
            )
    return version, final


# ---------------------------------------------------------------------------------------------------------
# A release whose upload is pending


def pending_path(run_dir: Path) -> Path:
    return rundir.completion_path(run_dir, "publish").with_name("publish.push_pending.json")


def pending_release(cfg: Config, name_dir: Path, draft_dir: Path) -> tuple[str, Path] | None:
    """(version, folder) of this run's release whose upload failed, when it is still the release this run
    would publish now: same place, intact, same draft bytes, same eval report, same model reference.
    Otherwise None (a stale record is dropped, with a warning)."""
    path = pending_path(cfg.run_dir)
    if not path.is_file():
        return None
    try:
        rec = read_json(path)
        version = str(rec["version"])
    except (OSError, ValueError, KeyError, TypeError):
        path.unlink(missing_ok=True)
        return None
    final = name_dir / version
    why = _pending_mismatch(cfg, final, draft_dir, rec)
    if why:
        log.warning("an earlier upload of %s never finished, but %s: publishing a new release", final, why)
        path.unlink(missing_ok=True)
        return None
    return version, final


def _pending_mismatch(cfg: Config, final: Path, draft_dir: Path, rec: dict[str, Any]) -> str | None:
    pcfg = cfg.publish
    if pcfg.version not in ("auto", rec["version"]):
        return f"publish.version asks for {pcfg.version}"
    if not final.is_dir() or Path(str(rec.get("path"))) != final.resolve():
        return f"it is not at {final} any more"
    if verify_release(final):
        return "it no longer verifies against its SHA256SUMS"
    try:
        prov = read_json(final / "provenance.json")
        source, release = prov["source"], prov["release"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its provenance.json is unreadable"
    report = cfg.run_dir / gate.REPORT
    current_report = sha256_file(report) if report.is_file() else None
    if source.get("draft_files") != folder_checksums(draft_dir):
        return f"{draft_dir} changed since"
    if source.get("eval_report_sha256") != current_report:
        return f"{report} changed since"
    if release.get("model_ref") != (pcfg.hub_repo or str(final.resolve())):
        return "the model reference in its card (publish.hub_repo) differs"
    return None


def verify_only(path: Path) -> int:
    """`publish.verify=PATH`: check a release against its SHA256SUMS; exit 0 intact, 1 tampered."""
    if not path.is_dir():
        raise InputError(
            f"publish.verify: {path} is not a folder; give a release folder such as releases/NAME/1."
        )
    problems = verify_release(path)
    if problems:
        print(f"{path}: FAILED verification\n" + "\n".join(f"  - {p}" for p in problems))
        return EXIT_RUNTIME
    print(f"{path}: OK (all files match SHA256SUMS)")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------
# Validation (nothing written before these pass)


def _require_draft(run_dir: Path) -> Path:
    draft_dir = run_dir / "draft"
    if not (draft_dir / "config.json").is_file() or not list(draft_dir.glob("*.safetensors")):
        raise InputError(
            f"run.dir: {draft_dir} holds no distilled draft (HF folder with safetensors). Run `distill train` "
            "(or `distill run`) with the same run.dir first."
        )
    return draft_dir


def _gate(run_dir: Path, force: bool) -> gate.GateResult:
    result = gate.check(run_dir)
    for w in result.warnings:
        log.warning("publish: %s", w)
    if result.passed:
        return result
    problems = "\n".join(f"  - {p}" for p in result.problems)
    if not force:
        raise InputError(
            f"refusing to publish {run_dir / 'draft'}: the eval gate failed:\n{problems}\n"
            "Fix the run (`distill eval` / `distill run`), or override with publish.force=true "
            "publish.force_reason='why' (the reason is written into the model card)."
        )
    log.warning("publish.force=true: publishing despite the eval gate:\n%s", problems)
    return result


def _refuse_existing_tag(name_dir: Path, version: str) -> None:
    if version != "auto" and (name_dir / version).exists():
        raise InputError(
            f"publish.version: release {name_dir / version} already exists and releases are never overwritten. "
            "Choose another tag, or publish.version=auto for the next integer."
        )


def _run_config(run_dir: Path, cfg: Config) -> dict[str, Any]:
    """The config that produced the draft: train's completion record, else run_dir/config.yaml, else `cfg`."""
    record = run_dir / "stages" / "train.json"
    try:
        stored = read_json(record).get("config") if record.is_file() else None
        if isinstance(stored, dict) and stored:
            return stored
        if (run_dir / "config.yaml").is_file():
            loaded = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False)
            if isinstance(loaded, dict):
                return {str(k): v for k, v in loaded.items()}
    except (OSError, ValueError, AttributeError):
        log.warning("could not read the run's stored config; describing training from the current config")
    return to_dict(cfg)


# ---------------------------------------------------------------------------------------------------------
# Building the release


def _copy_draft(draft_dir: Path, dest: Path) -> None:
    for src in sorted(draft_dir.rglob("*")):
        rel = src.relative_to(draft_dir)
        if not src.is_file() or src.name.startswith(".") or rel.as_posix() in _OWN_FILES:
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest / rel)


def _target_dir(ref: str) -> Path | None:
    path = Path(ref).expanduser()
    return path if path.is_dir() else None  # aliases/hub ids: their license is looked up, nothing is loaded


def _build(
    tmp: Path,
    cfg: Config,
    draft_dir: Path,
    result: gate.GateResult,
    run_config: dict[str, Any],
    version: str,
    model_ref: str,
) -> None:
    pcfg = cfg.publish
    _copy_draft(draft_dir, tmp)
    target = card.target_info(cfg.target.model, _target_dir(cfg.target.model), pcfg.license)
    if target.license is None:
        log.warning("the target's license is unknown; the card says so (set publish.license to record it)")
    forced = pcfg.force and not result.passed
    inputs = card.CardInputs(
        name=pcfg.name,
        version=version,
        model_ref=model_ref,
        target=target,
        report=result.report or {},
        tags=list(pcfg.tags),
        training=card.training_facts(cfg.run_dir, run_config),
        forced=forced,
        force_reason=pcfg.force_reason,
        gate_problems=result.problems,
        warnings=result.warnings,
        draft_rows=result.distilled,
    )
    atomic_write_text(tmp / "README.md", card.render(inputs))
    atomic_write_json(
        tmp / "provenance.json", _provenance(cfg, draft_dir, result, target, version, model_ref, forced)
    )
    write_sums(tmp)


def _provenance(
    cfg: Config,
    draft_dir: Path,
    result: gate.GateResult,
    target: card.TargetInfo,
    version: str,
    model_ref: str,
    forced: bool,
) -> dict[str, Any]:
    run_dir = cfg.run_dir
    report_path = run_dir / gate.REPORT
    records = {}
    for stage in rundir.STAGES:
        p = rundir.completion_path(run_dir, stage)
        if p.is_file():
            rec = read_json(p)
            records[stage] = {"config_hash": rec.get("config_hash"), "finished": rec.get("finished")}
    return {
        "release": {
            "name": cfg.publish.name,
            "version": version,
            "model_ref": model_ref,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        },
        "source": {
            "run_dir": str(run_dir.resolve()),
            "draft": str(draft_dir.resolve()),
            "draft_files": folder_checksums(draft_dir),
            "eval_report": str(report_path.resolve()) if report_path.is_file() else None,
            "eval_report_sha256": sha256_file(report_path) if report_path.is_file() else None,
            "stage_records": records,
        },
        "target": {
            "model": target.ref,
            "hub_id": target.hub_id,
            "license": target.license,
            "license_source": target.license_source,
        },
        "gate": gate.summary(result),
        "forced": forced,
        "force_reason": cfg.publish.force_reason if forced else None,
        "config": to_dict(cfg),
        "distill": rundir.provenance("publish"),
    }


def _check_built(tmp: Path, draft_dir: Path) -> None:
    """Before the release becomes visible: its SHA256SUMS hold, and the weights are the run's draft bytes."""
    problems = verify_release(tmp)
    source = folder_checksums(draft_dir)
    built = folder_checksums(tmp)
    problems += [
        f"{rel}: differs from {draft_dir / rel}"
        for rel, digest in source.items()
        if rel not in _OWN_FILES and built.get(rel) != digest
    ]
    if problems:
        raise RuntimeFailure(f"the release being built failed verification: {'; '.join(problems)}")
