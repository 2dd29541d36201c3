"""The merge lock of the data stage: one job merges at a time; a lock left by a killed job does not block.

`data/merge.lock` is created exclusively (O_EXCL, which local disks and NFS honour alike) and holds who merges:
host, boot id, pid namespace, pid and the pid's start time. It is removed when the merge ends. After a kill -9 it
stays behind; the next job then judges its holder:

- same host, same boot and pid namespace: alive while that pid runs and is the same process (a pid reused by a
  later process has another start time). A dead holder's lock is stale and taken over.
- another host (or container): cannot be checked from here, so it is trusted; `data.merge=true` takes it over.
- an empty or unreadable lock older than `UNREADABLE_STALE_S` (left by an older version, or by a kill between
  create and write) is stale; a younger one may still be being written and counts as held.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("distill.data")

UNREADABLE_STALE_S = 30.0


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start: int | None = None  # /proc/<pid>/stat starttime (clock ticks after boot)
    boot: str | None = None  # /proc/sys/kernel/random/boot_id
    pidns: str | None = None  # /proc/self/ns/pid link
    since: str = ""

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}" + (f" since {self.since}" if self.since else "")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _pidns() -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of `pid` from /proc, or None when it has no entry."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 (state) onwards
    return fields[0], int(fields[19])  # field 22: starttime


def me() -> Holder:
    stat = _proc_stat(os.getpid())
    return Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        start=stat[1] if stat else None,
        boot=_read("/proc/sys/kernel/random/boot_id"),
        pidns=_pidns(),
        since=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def holder_alive(h: Holder) -> bool | None:
    """True / False for a holder this machine can check; None for one on another host or in another container."""
    here = me()
    if h.host != here.host or (h.pidns and here.pidns and h.pidns != here.pidns):
        return None
    if h.boot and here.boot and h.boot != here.boot:
        return False  # the machine rebooted since
    try:
        os.kill(h.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    if not Path("/proc/self/stat").is_file():
        return True  # no /proc: the pid exists, that is all we can tell
    stat = _proc_stat(h.pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return h.start is None or stat[1] == h.start


def read_holder(path: Path) -> Holder | None:
    """The lock's holder; None when the file is empty or unreadable. Raises FileNotFoundError when absent."""
    text = path.read_text()
    try:
        obj = json.loads(text)
        return Holder(**{k: obj[k] for k in Holder.__dataclass_fields__ if k in obj})
    except (ValueError, TypeError, KeyError):
        return None


def _create(path: Path, holder: Holder) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(holder), f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _stale(path: Path, holder: Holder | None, *, force: bool) -> bool:
    if holder is None:
        try:
            return force or time.time() - path.stat().st_mtime > UNREADABLE_STALE_S
        except FileNotFoundError:
            return True
    alive = holder_alive(holder)
    return alive is False or (alive is None and force)


def _take_over(path: Path, holder: Holder | None) -> None:
    """Remove a stale lock, unless another job replaced it meanwhile (then it is put back)."""
    tomb = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.stale")
    try:
        os.rename(path, tomb)
    except FileNotFoundError:
        return
    try:
        if read_holder(tomb) != holder:
            with contextlib.suppress(FileExistsError):
                os.link(tomb, path)  # not the lock we judged: give it back
        else:
            log.warning("data: removing a stale merge lock %s (%s)", path, _who(holder))
    finally:
        with contextlib.suppress(OSError):
            tomb.unlink()


def _who(holder: Holder | None) -> str:
    return holder.describe() + ", no longer running" if holder else "empty or unreadable"


def try_acquire(path: Path, *, force: bool = False) -> tuple[bool, Holder | None]:
    """(True, None) when this process now holds the lock; else (False, holder) of the job that keeps it
    (holder None: an unreadable lock too young to call stale). `force` also takes locks whose holder cannot be
    checked (another host), never one held by a live process here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = me()
    holder: Holder | None = None
    for _ in range(5):
        if _create(path, mine):
            return True, None
        try:
            holder = read_holder(path)
        except FileNotFoundError:
            continue  # released meanwhile: try again
        if not _stale(path, holder, force=force):
            return False, holder
        _take_over(path, holder)
    return False, holder


def release(path: Path) -> None:
    """Remove the lock if it is still this process's (`force` elsewhere may have taken it over)."""
    with contextlib.suppress(OSError):
        h = read_holder(path)
        if h is not None and h.pid == os.getpid() and h.host == socket.gethostname():
            path.unlink()


@contextlib.contextmanager
def held(path: Path, *, force: bool = False) -> Iterator[tuple[bool, Holder | None]]:
    """`with held(path) as (got, holder):` the lock for the block when `got`, released after it."""
    got, holder = try_acquire(path, force=force)
    try:
        yield got, holder
    finally:
        if got:
            release(path)
