"""The data stage's merge lock: a dead holder's lock is taken over, a live or unverifiable one is respected."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distill.data import lock

REPO = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write(path: Path, holder: lock.Holder) -> None:
    path.write_text(json.dumps(dataclasses.asdict(holder)))


@pytest.fixture()
def path(tmp_path) -> Path:
    return tmp_path / "data" / "merge.lock"


def test_acquire_release_and_a_second_taker_is_refused(path):
    got, _ = lock.try_acquire(path)
    assert got and lock.read_holder(path) is not None
    again, holder = lock.try_acquire(path)
    assert not again and holder is not None and holder.pid == os.getpid()  # we are alive: respected
    lock.release(path)
    assert not path.exists()


def test_lock_of_a_dead_local_process_is_taken_over(path):
    path.parent.mkdir(parents=True)
    _write(path, dataclasses.replace(lock.me(), pid=_dead_pid()))
    got, _ = lock.try_acquire(path)
    holder = lock.read_holder(path)
    assert got and holder is not None and holder.pid == os.getpid()


def test_reused_pid_and_reboot_count_as_dead(path):
    path.parent.mkdir(parents=True)
    me = lock.me()
    if me.start is None or me.boot is None:
        pytest.skip("no /proc here")
    _write(path, dataclasses.replace(me, start=me.start - 1))  # our pid, but another process's start time
    assert lock.try_acquire(path)[0]
    lock.release(path)
    _write(path, dataclasses.replace(me, boot="another-boot"))
    assert lock.try_acquire(path)[0]


def test_live_local_holder_is_respected_even_with_force(path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        stat = lock._proc_stat(proc.pid)
        path.parent.mkdir(parents=True)
        _write(path, dataclasses.replace(lock.me(), pid=proc.pid, start=stat[1] if stat else None))
        for force in (False, True):
            got, holder = lock.try_acquire(path, force=force)
            assert not got and holder is not None and holder.pid == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert lock.try_acquire(path)[0]  # killed (and reaped): stale now


def test_holder_on_another_host_needs_force(path):
    path.parent.mkdir(parents=True)
    _write(path, dataclasses.replace(lock.me(), host=socket.gethostname() + "-elsewhere", pid=_dead_pid()))
    got, holder = lock.try_acquire(path)
    assert not got and holder is not None and "elsewhere" in holder.describe()
    assert lock.try_acquire(path, force=True)[0]


def test_unreadable_lock_is_stale_only_when_old(path):
    path.parent.mkdir(parents=True)
    path.write_text("")  # as an older version left it, or a kill between create and write
    assert lock.try_acquire(path) == (False, None)
    old = time.time() - lock.UNREADABLE_STALE_S - 5
    os.utime(path, (old, old))
    assert lock.try_acquire(path)[0]


def test_release_leaves_a_lock_taken_over_by_another(path):
    assert lock.try_acquire(path)[0]
    other = dataclasses.replace(lock.me(), host="elsewhere")
    _write(path, other)
    lock.release(path)
    assert lock.read_holder(path) == other
    assert not list(path.parent.glob(".merge.lock.*"))  # no take-over leftovers
