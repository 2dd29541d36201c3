"""`train.retain_freed_memory`: glibc keeps freed memory in the process (distill.utils.malloc)."""

from __future__ import annotations

import sys

import pytest

from distill.utils import malloc


class FakeLibc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def test_asks_glibc_to_serve_from_the_heap_and_never_trim():
    libc = FakeLibc()
    assert malloc.retain_freed_memory(libc) is True  # type: ignore[arg-type]
    assert libc.calls == [(malloc.M_MMAP_MAX, 0), (malloc.M_TRIM_THRESHOLD, malloc.NEVER_TRIM)]
    assert (malloc.M_TRIM_THRESHOLD, malloc.M_MMAP_MAX) == (-1, -4)  # glibc's malloc.h numbers


def test_a_refused_setting_is_reported_not_raised():
    assert malloc.retain_freed_memory(FakeLibc(answer=0)) is False  # type: ignore[arg-type]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_this_linux_has_glibc_and_the_setting_takes():
    assert malloc._glibc() is not None
    assert malloc.retain_freed_memory() is True
