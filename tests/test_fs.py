"""Atomic writes: the finished file or folder has the mode the umask gives, not mkstemp's private one."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest

from distill.utils.fs import atomic_dir, atomic_write_bytes


@pytest.fixture()
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_files_and_folders_are_readable_by_others_under_umask_022(tmp_path, umask_022):
    atomic_write_bytes(tmp_path / "report.json", b"{}")
    with atomic_dir(tmp_path / "release") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
    assert _mode(tmp_path / "report.json") == 0o644
    assert _mode(tmp_path / "release") == 0o755
    assert _mode(tmp_path / "release" / "model.safetensors") == 0o644


def test_a_private_umask_is_respected(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write_bytes(tmp_path / "secret.json", b"{}")
        with atomic_dir(tmp_path / "private"):
            pass
    finally:
        os.umask(old)
    assert _mode(tmp_path / "secret.json") == 0o600
    assert _mode(tmp_path / "private") == 0o700
