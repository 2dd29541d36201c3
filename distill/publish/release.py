"""Release folders on disk: version numbers, SHA256SUMS, verification and the `latest` pointer.

Layout: `<publish.dir>/<name>/<version>/` (one folder per release, never modified after it is moved in),
`<publish.dir>/<name>/LATEST` (a one-line file naming the newest release, replaced atomically) and
`<publish.dir>/<name>/latest` (a symlink to the same folder, replaced atomically with `os.replace`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from distill.utils.fs import atomic_write_text, folder_checksums, sha256_file

SUMS = "SHA256SUMS"
LATEST_FILE = "LATEST"
LATEST_LINK = "latest"


def next_version(name_dir: Path) -> str:
    """The next integer version under `name_dir`: 1 + the largest integer folder name (tags are ignored)."""
    numbers = (
        [int(p.name) for p in name_dir.iterdir() if p.is_dir() and p.name.isdigit()]
        if name_dir.is_dir()
        else []
    )
    return str(max(numbers, default=0) + 1)


@contextlib.contextmanager
def release_lock(name_dir: Path) -> Iterator[None]:
    """Serialise publishes of one release name (two scheduled jobs must not take the same version)."""
    name_dir.mkdir(parents=True, exist_ok=True)
    with open(name_dir / ".publish.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def format_sums(checksums: dict[str, str]) -> str:
    """`sha256sum`-compatible lines (`<hex>  <path>`), so `sha256sum -c SHA256SUMS` works in the folder."""
    return "".join(f"{digest}  {path}\n" for path, digest in sorted(checksums.items()))


def parse_sums(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        digest, sep, path = line.partition("  ")
        if not sep:  # sha256sum's binary-mode marker: `<hex> *<path>`
            digest, sep, path = line.partition(" *")
        if not sep or len(digest) != 64:
            raise ValueError(f"malformed line: {line!r}")
        out[path] = digest
    return out


def write_sums(folder: Path) -> dict[str, str]:
    sums = {k: v for k, v in folder_checksums(folder).items() if k != SUMS}
    atomic_write_text(folder / SUMS, format_sums(sums))
    return sums


def verify_release(path: str | os.PathLike[str]) -> list[str]:
    """Check a release folder against its SHA256SUMS. Returns the problems found (empty = intact).

    Detects changed, missing and added files (a file slipped into a release is tampering too).
    """
    folder = Path(path)
    sums_path = folder / SUMS
    if not sums_path.is_file():
        return [f"{sums_path} is missing"]
    try:
        expected = parse_sums(sums_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [f"{sums_path} is unreadable: {exc}"]
    problems = []
    for rel, digest in expected.items():
        p = folder / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
        elif sha256_file(p) != digest:
            problems.append(f"{rel}: checksum mismatch (modified)")
    present = {k for k in folder_checksums(folder) if k != SUMS}
    problems.extend(f"{rel}: not listed in {SUMS} (added)" for rel in sorted(present - set(expected)))
    return problems


def read_latest(name_dir: Path) -> str | None:
    p = name_dir / LATEST_FILE
    if not p.is_file():
        return None
    return p.read_text(encoding="utf-8").strip() or None


def set_latest(name_dir: Path, version: str) -> None:
    """Point `LATEST` and the `latest` symlink at `version`; each is replaced in one atomic rename."""
    atomic_write_text(name_dir / LATEST_FILE, version + "\n")
    tmp = name_dir / f".{LATEST_LINK}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.symlink(version, tmp, target_is_directory=True)
        os.replace(tmp, name_dir / LATEST_LINK)
    except OSError:
        # Filesystems without symlinks (some network/Windows mounts): the LATEST file is the pointer.
        with contextlib.suppress(OSError):
            tmp.unlink()
