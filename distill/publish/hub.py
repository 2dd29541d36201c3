"""Optional upload of a release to the Hugging Face Hub. The token comes from the environment only and is
never logged, written or put in an error message."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from distill.errors import InputError, RuntimeFailure
from distill.publish.config import PublishConfig

log = logging.getLogger("distill.publish")

_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def preflight(pcfg: PublishConfig) -> str:
    """Check, before anything is written, that an upload can be attempted. Returns the token."""
    if _offline():
        raise InputError(
            "publish.push_to_hub: this machine is offline (HF_HUB_OFFLINE is set), so the release cannot be "
            "uploaded. Run on a machine with hub access, or set publish.push_to_hub=false and upload the release "
            "folder later (`hf upload ORG/NAME RELEASE_DIR`)."
        )
    try:
        import huggingface_hub  # noqa: F401
    except ImportError as exc:
        raise InputError("publish.push_to_hub: needs huggingface_hub; `pip install 'distill[hub]'`.") from exc
    token = next((os.environ[v] for v in _TOKEN_VARS if os.environ.get(v)), "")
    if not token:
        raise InputError(
            "publish.push_to_hub: no token; export HF_TOKEN (a write token) in the job's environment."
        )
    return token


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "***") if token else text


def push(folder: Path, pcfg: PublishConfig, version: str, token: str) -> str:
    """Upload `folder` to `pcfg.hub_repo` and tag the commit with the version. Returns the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo = pcfg.hub_repo
    try:
        api.create_repo(repo, repo_type="model", private=pcfg.hub_private, exist_ok=True)
        api.upload_folder(
            folder_path=str(folder),
            repo_id=repo,
            repo_type="model",
            commit_message=f"distill release {pcfg.name} {version}",
        )
        api.create_tag(
            repo, tag=f"v{version}" if version.isdigit() else version, repo_type="model", exist_ok=True
        )
    except Exception as exc:  # connection errors, auth errors, hub errors: all leave the local release intact
        raise RuntimeFailure(
            f"publish.push_to_hub: upload of {folder} to {repo} failed ({type(exc).__name__}: "
            f"{_scrub(str(exc), token)}). The local release is complete and verified; rerun the same command "
            f"once the hub is reachable to retry only this upload (no new version), or upload it with "
            f"`hf upload {repo} {folder}`."
        ) from None  # `from None`: the chained exception could carry request headers
    log.info("uploaded %s to https://huggingface.co/%s", folder, repo)
    return f"https://huggingface.co/{repo}"
