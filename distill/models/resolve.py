"""Turn a model reference (local folder, built-in alias, hub id) into a local HF folder."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from distill.errors import InputError
from distill.models.builtin import ALIASES, ensure_alias

log = logging.getLogger("distill.models")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
WEIGHTS_INDEX = "model.safetensors.index.json"
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _looks_like_path(ref: str) -> bool:
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or ref.endswith(("/", ".safetensors"))


def resolve_model(ref: str, *, key: str, revision: str | None = None, allow_download: bool = True) -> Path:
    """Local HF folder for `ref`. `key` is the config key the reference came from (for error messages).

    Raises `InputError` (exit 2) for missing folders, unknown aliases, and hub ids on an offline machine.
    """
    if not ref:
        raise InputError(
            f"{key}: empty model reference; give a folder, a hub id or one of {sorted(ALIASES)}."
        )
    if ref in ALIASES:
        return ensure_alias(ref)
    path = Path(ref).expanduser()
    if path.exists():
        if is_hf_folder(path):
            return path
        raise InputError(f"{key}: {path} is not a Hugging Face model folder (no config.json in it).")
    if _looks_like_path(ref) or not _HUB_ID.match(ref):
        raise InputError(
            f"{key}: '{ref}' is neither an existing folder nor a built-in alias ({', '.join(sorted(ALIASES))}) "
            "nor a hub id (org/name). Fix the path or use an alias."
        )
    return _from_hub(ref, key=key, revision=revision, allow_download=allow_download)


def _offline_error(ref: str, key: str) -> InputError:
    return InputError(
        f"{key}: '{ref}' is a hub id, but this machine is offline (or the hub is unreachable). Download it on "
        f"an online machine (`huggingface-cli download {ref} --local-dir DIR`), copy DIR here and set {key}=DIR, "
        f"or use a built-in alias ({', '.join(sorted(ALIASES))})."
    )


def _from_hub(ref: str, *, key: str, revision: str | None, allow_download: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on huggingface_hub
        raise InputError(f"{key}: hub ids need huggingface_hub; install distill[hub].") from exc
    try:  # already in the local HF cache?
        return Path(
            snapshot_download(ref, revision=revision, local_files_only=True, allow_patterns=_HUB_PATTERNS)
        )
    except Exception:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline or not allow_download:
        raise _offline_error(ref, key)
    try:
        log.info("downloading %s from the hub (token from HF_TOKEN if set)", ref)
        return Path(snapshot_download(ref, revision=revision, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:
        if type(exc).__name__ in ("RepositoryNotFoundError", "RevisionNotFoundError", "GatedRepoError"):
            raise InputError(f"{key}: hub repository '{ref}' not found or not accessible ({exc}).") from exc
        raise _offline_error(ref, key) from exc


def weights_problem(folder: Path) -> str | None:
    """Why `folder`'s weights cannot load (None when they look complete): no weight file, or a safetensors
    file whose header is unreadable or promises more bytes than the file holds (a copy cut short). Reads the
    headers only, so it is cheap enough to run before any work starts."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            # Pickled weights can run code when loaded: distill loads safetensors only.
            return (
                "holds pickled weights (*.bin) only; distill loads safetensors. Convert them once: "
                "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)`"
            )
        return "holds no weights (*.safetensors)"
    missing = _missing_shards(folder, {f.name for f in files})
    if missing:
        return missing
    for f in files:
        try:
            with safe_open(str(f), "pt"):
                pass
        except Exception as exc:  # SafetensorError, OSError: both mean the file cannot be loaded
            return f"has a truncated or corrupt weight file {f.name} ({exc})"
    return None


def _missing_shards(folder: Path, present: set[str]) -> str | None:
    """Why a sharded checkpoint is incomplete: shards its index names that are not there, or an unreadable index."""
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return None
    try:
        named = {str(v) for v in json.loads(index.read_text())["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"has an unreadable {WEIGHTS_INDEX} ({exc})"
    missing = sorted(named - present)
    return f"lacks the weight shards {missing} that {WEIGHTS_INDEX} names" if missing else None


def require_weights(folder: Path, *, key: str) -> None:
    """`InputError` naming `key` when the model folder's weights are missing or damaged."""
    problem = weights_problem(folder)
    if problem:
        raise InputError(
            f"{key}: the model folder {folder} {problem}. Copy the model again (config.json, *.safetensors, "
            f"tokenizer files) or point {key} at a complete folder."
        )
