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


def test_private_files_written_into_an_atomic_folder_are_widened(tmp_path, umask_022):
    """transformers' save_pretrained leaves model.safetensors at 0600; the finished folder's files get 0644
    (executable bits kept), so another user can load the draft."""
    with atomic_dir(tmp_path / "draft") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
        os.chmod(tmp / "model.safetensors", 0o600)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "run.sh").write_bytes(b"#!/bin/sh\n")
        os.chmod(tmp / "sub" / "run.sh", 0o700)
    assert _mode(tmp_path / "draft" / "model.safetensors") == 0o644
    assert _mode(tmp_path / "draft" / "sub" / "run.sh") == 0o744  # 0700 | 0644: still executable


def test_a_saved_draft_folder_is_readable_by_others(tmp_path, umask_022, tiny_llama, tiny_tokenizer):
    from distill.models.draft import save_hf_folder

    out = save_hf_folder(tiny_llama, tiny_tokenizer, tmp_path / "draft")
    assert {p.name: _mode(p) for p in out.iterdir()}["model.safetensors"] == 0o644
    assert all(_mode(p) & 0o044 == 0o044 for p in out.iterdir())
