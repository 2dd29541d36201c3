"""`train.retain_freed_memory`: glibc keeps freed memory in the process (distill.utils.malloc)."""

from __future__ import annotations

import os
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

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("trim", pad))  # type: ignore[arg-type]
        return 1


def test_asks_glibc_to_serve_from_the_heap_and_never_trim():
    libc = FakeLibc()
    assert malloc.retain_freed_memory(libc) is True  # type: ignore[arg-type]
    assert libc.calls == [(malloc.M_MMAP_MAX, 0), (malloc.M_TRIM_THRESHOLD, malloc.NEVER_TRIM)]
    assert (malloc.M_TRIM_THRESHOLD, malloc.M_MMAP_MAX) == (-1, -4)  # glibc's malloc.h numbers


def test_a_refused_setting_is_reported_not_raised_and_undone():
    libc = FakeLibc(answer=0)
    assert malloc.retain_freed_memory(libc) is False  # type: ignore[arg-type]
    assert libc.calls[-1] == ("trim", 0) and (malloc.M_MMAP_MAX, malloc.DEFAULT_MMAP_MAX) in libc.calls


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_this_linux_has_glibc_and_the_setting_takes():
    assert malloc._glibc() is not None
    with malloc.freed_memory_retained(True) as on:  # never left on: later tests start vLLM in this process
        assert on is True


def test_leaving_the_block_restores_the_defaults_and_trims_even_on_error():
    libc = FakeLibc()
    with pytest.raises(RuntimeError), malloc.freed_memory_retained(True, libc) as on:  # type: ignore[arg-type]
        assert on is True
        raise RuntimeError("training failed")
    assert libc.calls[2:] == [
        (malloc.M_MMAP_MAX, malloc.DEFAULT_MMAP_MAX),
        (malloc.M_TRIM_THRESHOLD, malloc.DEFAULT_TRIM_THRESHOLD),
        ("trim", 0),
    ]
    off = FakeLibc()
    with malloc.freed_memory_retained(False, off) as on:  # type: ignore[arg-type]
        assert on is False
    assert off.calls == []


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_memory_stays_inside_the_block_and_is_handed_back_after_it():
    """The real allocator: a freed 512 MiB block stays resident inside the block (the next step reuses it)
    and is returned to the kernel when the block ends (so vLLM, started next by `distill run`, has it)."""
    import torch

    base = _rss_mib()
    with malloc.freed_memory_retained(True) as on:
        assert on is True
        block = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB, touched
        del block
        retained = _rss_mib()
    after = _rss_mib()
    assert retained - base > 400, (base, retained)
    assert retained - after > 400, (retained, after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_a_free_heap_top_larger_than_2_gib_is_kept_too():
    """A parallel draft's step frees more than 2 GiB at once: the trim threshold must not be a positive int
    (glibc trims a free top of 2 GiB or more under the largest one, 2**31 - 1)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 2 * 2**30 + 256 * 2**20  # 2.25 GiB
    with malloc.freed_memory_retained(True) as on:
        assert on is True
        base = _rss_mib()
        block = libc.malloc(size)
        assert block, "malloc of 2.25 GiB failed"
        ctypes.memset(block, 1, size)
        libc.free(block)
        retained = _rss_mib()
    after = _rss_mib()
    assert retained - base > 2000, (base, retained)
    assert retained - after > 2000, (retained, after)


def _drive(cb, trainer, steps):
    for step in steps:
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, None, 0)


def test_retained_memory_goes_back_once_every_n_optimizer_steps():
    """TrimFreedMemory: a trim at every n-th optimizer step, once even when gradient accumulation ends several
    batches at the same global step, none at step 0."""
    from types import SimpleNamespace

    from distill.train.callbacks import TrimFreedMemory

    trimmed_at: list[int] = []
    trainer = SimpleNamespace(global_step=0)
    cb = TrimFreedMemory(2, trim=lambda: trimmed_at.append(trainer.global_step))
    _drive(cb, trainer, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5])
    assert trimmed_at == [2, 4]


def test_a_step_that_ends_over_the_memory_budget_trims_at_once():
    """Between the periodic trims, a step that ends with more resident than the budget trims right away (once
    per optimizer step); under the budget only the periodic trims run. The budget is shared by a node's ranks."""
    from types import SimpleNamespace

    from distill.train.callbacks import TrimFreedMemory

    gib = 1024**3
    resident = {1: 3, 2: 5, 3: 13, 4: 5, 5: 3, 6: 9, 7: 11, 8: 14, 9: 7, 10: 9, 11: 12}  # GiB after each step
    trimmed_at: list[int] = []
    released: list[int] = []
    trainer = SimpleNamespace(global_step=0, num_devices=2)
    cb = TrimFreedMemory(
        8,
        budget_bytes=20 * gib,
        trim=lambda: trimmed_at.append(trainer.global_step),
        resident=lambda: resident[trainer.global_step] * gib,
        release=lambda: released.append(trainer.global_step),
    )
    cb.setup(trainer, None, "fit")  # 2 ranks on the node: 10 GiB each
    cb.setup(trainer, None, "fit")  # a second setup does not halve it again
    _drive(cb, trainer, [1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    # 3 and 7 over budget (4 steps apart: retaining still pays), 8 periodic, 11 over budget 3 steps after it
    assert trimmed_at == [3, 7, 8, 11] and cb.over_budget == 3 and not released


def test_retaining_stops_when_the_budget_forces_trims_close_together():
    """Two budget trims within every_n_steps // 4 steps of the last hand-back: every step would pay the page
    faults, so glibc's defaults come back (once); the periodic hand-back goes on, the budget check does not."""
    from types import SimpleNamespace

    from distill.train.callbacks import TrimFreedMemory

    gib = 1024**3
    trimmed_at: list[int] = []
    released: list[int] = []
    trainer = SimpleNamespace(global_step=0, num_devices=1)
    cb = TrimFreedMemory(
        20,
        budget_bytes=10 * gib,
        trim=lambda: trimmed_at.append(trainer.global_step),
        resident=lambda: (12 if trainer.global_step in (30, 33, 50) else 4) * gib,
        release=lambda: released.append(trainer.global_step),
    )
    _drive(cb, trainer, range(1, 61))
    assert trimmed_at == [20, 30, 40, 60] and released == [33] and cb.released_at == 33


def test_memory_limit_is_the_lower_of_machine_and_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1 kB\n")
    cgroup = tmp_path / "memory.max"
    cgroup.write_text("max\n")
    assert malloc.memory_limit_bytes(meminfo, cgroup) == 24000000 * 1024
    cgroup.write_text("8589934592\n")  # a container limited to 8 GiB
    assert malloc.memory_limit_bytes(meminfo, cgroup) == 8 * 1024**3
    assert malloc.memory_limit_bytes(tmp_path / "none", tmp_path / "none") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="linux only")
def test_resident_bytes_sees_a_touched_block():
    import torch

    before = malloc.resident_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
    during = malloc.resident_bytes()
    del block
    assert before is not None and during is not None and during - before > 200 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_a_trim_inside_the_block_hands_the_memory_back_and_keeps_the_setting():
    import torch

    with malloc.freed_memory_retained(True) as on:
        assert on is True
        block = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB, touched
        del block
        retained = _rss_mib()
        assert malloc.trim_freed_memory() is True
        trimmed = _rss_mib()
        block = torch.ones(128 * 2**20, dtype=torch.float32)
        del block
        kept_again = _rss_mib()
    assert retained - trimmed > 400, (retained, trimmed)
    assert kept_again - trimmed > 400, (trimmed, kept_again)  # still retaining after the trim


def test_a_machine_short_of_memory_trims_at_once_under_the_budget():
    """Retained memory gives way to other processes: a step that ends with less than reserve_bytes available
    trims at once even with resident memory under the budget; without a reserve only the budget counts."""
    from types import SimpleNamespace

    from distill.train.callbacks import TrimFreedMemory

    gib = 1024**3
    available = {1: 9, 2: 3, 3: 9, 4: 9, 5: 9, 6: 2, 7: 9, 8: 9, 9: 9, 10: 9}  # GiB after each step
    trainer = SimpleNamespace(global_step=0, num_devices=1)
    for reserve, expected in ((4 * gib, [2, 6, 10]), (None, [10])):
        trimmed_at: list[int] = []
        cb = TrimFreedMemory(
            10,
            budget_bytes=20 * gib,
            trim=lambda: trimmed_at.append(trainer.global_step),  # noqa: B023 - called inside the loop body
            resident=lambda: 5 * gib,
            release=lambda: None,
            reserve_bytes=reserve,
            available=lambda: available[trainer.global_step] * gib,
        )
        _drive(cb, trainer, range(1, 11))
        assert trimmed_at == expected, reserve


def test_available_memory_is_the_lower_of_machine_and_cgroup_headroom(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   10000000 kB\n")
    limit, current, stat = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat"
    limit.write_text("max\n")
    assert malloc.available_bytes(meminfo, limit, current, stat) == 10000000 * 1024
    gib = 1024**3
    limit.write_text(
        f"{8 * gib}\n"
    )  # a container limited to 8 GiB, using 7 of which 2 are inactive page cache
    current.write_text(f"{7 * gib}\n")
    stat.write_text(f"anon {5 * gib}\ninactive_file {2 * gib}\nactive_file 0\n")
    assert malloc.available_bytes(meminfo, limit, current, stat) == 3 * gib
    current.write_text(f"{9 * gib}\n")  # over the limit by the page cache: no headroom, not negative
    stat.write_text("inactive_file 0\n")
    assert malloc.available_bytes(meminfo, limit, current, stat) == 0
    none = tmp_path / "none"
    assert malloc.available_bytes(none, none, none, none) is None
