"""Atomic file and folder writes, hashing. Every artefact distill writes goes through here.

A reader never sees a half-written file: we write to a temporary sibling, fsync, then `os.replace`.
A full disk (ENOSPC) becomes a `RuntimeFailure` and the temporary is removed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distill.errors import RuntimeFailure


def _disk_full(path: Path, exc: OSError) -> RuntimeFailure:
    return RuntimeFailure(
        f"could not write {path}: {exc.strerror or exc}. Free space on that disk (or point run.dir / "
        "DISTILL_CACHE elsewhere) and rerun; completed work is kept and the run resumes."
    )


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask sets it while reading)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600); the finished file gets the mode a plain open() would give,
        # so that a server or CI job running as another user can read releases and reports.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(path, exc) from exc
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `final`; on success it becomes `final` in one rename.

    On any error the temporary folder is deleted, so `final` is never half written. With `replace=True`
    an existing `final` is swapped out (old copy removed after the new one is in place).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700, widened as for atomic_write_bytes
        yield tmp
        _widen_private_files(tmp)
        _fsync_tree(tmp)
        if final.exists():
            if not replace:
                raise FileExistsError(f"{final} already exists")
            trash = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(final, exc) from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _widen_private_files(root: Path) -> None:
    """Give every file the permissions a plain open() would: some writers (transformers' save_pretrained
    writes model.safetensors through a private temporary file) leave 0600 files, which a server or CI job
    running as another user cannot read."""
    wanted = 0o666 & ~_umask()
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode
                if stat.S_ISREG(mode) and (mode | wanted) != mode:
                    os.chmod(path, stat.S_IMODE(mode) | wanted)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(dirpath))


def remove_stale_temporaries(folder: str | os.PathLike[str]) -> int:
    """Delete leftovers of interrupted atomic writes (`.name.*.tmp`) in `folder`. Returns how many."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    removed = 0
    for p in folder.iterdir():
        if p.name.startswith(".") and (p.name.endswith(".tmp") or ".old-" in p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
            removed += 1
    return removed


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def folder_checksums(folder: str | os.PathLike[str]) -> dict[str, str]:
    """sha256 of every regular file under `folder`, keyed by relative POSIX path, sorted."""
    folder = Path(folder)
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            out[p.relative_to(folder).as_posix()] = sha256_file(p)
    return out
