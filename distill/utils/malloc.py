"""Keep freed heap memory inside the process on Linux/glibc (`train.retain_freed_memory`).

A training step allocates and frees vocabulary-sized tensors many times (a block of the draft's logits is
`train.logits_block_rows` x 49,152 floats, 0.2 GB, and the softmax, its gradient and the loss each make one;
before the blocks (`distill.train.head_loss`) a micro-batch's P x 49,152 took 1-2 GB each). glibc serves blocks
that large with `mmap` and gives them back to the kernel on `free`, so every step page-faults gigabytes of
fresh, kernel-zeroed pages: on the 2-core CPU machine the kernel took 26% (autoregressive draft) and 32% (parallel
draft) of a SmolLM2 training process's CPU time, 8% and 9% with this setting, whose steps ran 1.33x and 1.35x
faster (BENCHMARKS.md, section 7). `mallopt(M_MMAP_MAX, 0)` makes glibc serve every block from the heap and
`mallopt(M_TRIM_THRESHOLD, -1)` keeps freed heap memory for the next allocation: the same pages are reused
step after step. Retained memory fragments (a freed block serves only requests that fit it), so training hands
it back every few steps (`trim_freed_memory`, train.callbacks.TrimFreedMemory), at once when the process passes
its memory budget (RETAINED_MEMORY_SHARE) or the machine runs short of available memory (MEMORY_RESERVE_SHARE),
and stops retaining when these force hand-backs close together (a long run's fragmented heap: from then on
retaining costs what it was meant to save). The process
would also keep its peak resident memory after training: `freed_memory_retained` therefore restores glibc's
defaults when training ends and hands the freed memory back (`malloc_trim`), so a `distill run` that goes on
to start vLLM for the eval finds the memory free again (vLLM on CPU refuses to start when the free memory is
below its KV cache size).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("distill")

# glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt(M_TRIM_THRESHOLD, -1) disables trimming completely (mallopt(3)): glibc stores the int as a size_t.
# The largest positive int, 2**31 - 1, is not enough: glibc trims a free heap top of 2 GiB or more, and a
# parallel draft's step frees more than that (its step ran 1.5x slower with it; BENCHMARKS.md, section 7).
NEVER_TRIM = -1
# How often training hands retained memory back (train.callbacks.TrimFreedMemory): fragmentation grows the
# retained memory by gigabytes within tens of steps, and each trim costs the next step its page faults.
TRIM_EVERY_STEPS = 20
# Between those trims the retained memory may not pass this share of the memory the process may use (the
# machine's, or its cgroup's limit when lower): past it training trims at once. Fragmentation spreads a step's
# blocks over an ever larger heap, so what 20 steps touch grows with the run's length: a 900-step parallel
# draft run went from 11 GB resident at step 237 to 24 GB, the whole machine, at step 357 and was killed.
# 0.5 of the 23.5 GiB machine forced the shipped demo's training to hand memory back every 7-20 steps from step 74
# and to stop retaining at step 225 (4.6 s/step against 3.4-3.6 retained; BENCHMARKS.md section 7). The share
# only has to leave room for the process's own step peak beyond its heap: other processes are covered by
# MEMORY_RESERVE_SHARE.
RETAINED_MEMORY_SHARE = 0.7
# Retained memory is a cache and gives way to the machine's other demand: whatever the share, a step that ends
# with less than this share of the memory limit still available (MemAvailable, or the cgroup's headroom) trims at
# once, so a process started beside training finds its memory.
MEMORY_RESERVE_SHARE = 0.2
# glibc's defaults (malloc/malloc.c: DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD).
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # gnu_get_libc_version exists only in glibc (musl and others have no mallopt knobs of this meaning).
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def retain_freed_memory(libc: ctypes.CDLL | None = None) -> bool:
    """Ask glibc to keep freed memory in the process (module docstring). True when both settings took."""
    libc = libc if libc is not None else _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    if not ok:  # never leave half of it in force
        release_freed_memory(libc)
        log.debug("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD; freed memory goes back to the kernel")
    return ok


def release_freed_memory(libc: ctypes.CDLL | None = None) -> bool:
    """Undo `retain_freed_memory` (glibc's default mmap and trim settings) and return every free heap page to
    the kernel now (`malloc_trim(0)`). True when glibc took it."""
    libc = libc if libc is not None else _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
    )
    trim_freed_memory(libc)
    return ok


def trim_freed_memory(libc: ctypes.CDLL | None = None) -> bool:
    """Return every free heap page to the kernel now (`malloc_trim(0)`), leaving the settings as they are. Kept
    memory fragments: a freed block is reused only by a request that fits it, and the aligned requests of the
    next step's tensors are often a little larger, so without a periodic trim the retained memory grows step by
    step (a parallel draft's training went from 13 to 18 GB resident in 120 steps). True when glibc ran it."""
    libc = libc if libc is not None else _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc/self/statm), None where it cannot be read."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def memory_limit_bytes(
    meminfo: Path = Path("/proc/meminfo"), cgroup_max: Path = Path("/sys/fs/cgroup/memory.max")
) -> int | None:
    """The memory this process may use: the machine's total, or its cgroup v2 limit when lower (a container's
    memory limit is what the kernel kills at). None where neither can be read."""
    limits = [n for n in (_meminfo_bytes(meminfo, "MemTotal"), _cgroup_limit(cgroup_max)) if n is not None]
    return min(limits) if limits else None


def _meminfo_bytes(meminfo: Path, field: str) -> int | None:
    """One /proc/meminfo field (given in kB) in bytes."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _cgroup_limit(cgroup_max: Path) -> int | None:
    """The cgroup v2 memory limit in bytes; None when unlimited ("max") or unreadable."""
    try:
        text = cgroup_max.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def available_bytes(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup_max: Path = Path("/sys/fs/cgroup/memory.max"),
    cgroup_current: Path = Path("/sys/fs/cgroup/memory.current"),
    cgroup_stat: Path = Path("/sys/fs/cgroup/memory.stat"),
) -> int | None:
    """Memory still available to this process: the machine's MemAvailable, or its cgroup v2 headroom when lower
    (limit minus usage, the inactive page cache counted as free as the kernel reclaims it first). None where
    neither can be read."""
    found = [n for n in (_meminfo_bytes(meminfo, "MemAvailable"),) if n is not None]
    limit = _cgroup_limit(cgroup_max)
    if limit is not None:
        try:
            used = int(cgroup_current.read_text().strip())
            for line in cgroup_stat.read_text().splitlines() if cgroup_stat.is_file() else []:
                if line.startswith("inactive_file "):
                    used -= int(line.split()[1])
            found.append(max(0, limit - used))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def _share_of_limit(share: float) -> int | None:
    limit = memory_limit_bytes()
    return None if limit is None else int(limit * share)


def memory_reserve_bytes(share: float = MEMORY_RESERVE_SHARE) -> int | None:
    """Available bytes below which training trims retained memory at once (MEMORY_RESERVE_SHARE)."""
    return _share_of_limit(share)


def retained_memory_budget(share: float = RETAINED_MEMORY_SHARE) -> int | None:
    """Resident bytes past which training trims retained memory at once (RETAINED_MEMORY_SHARE)."""
    return _share_of_limit(share)


@contextlib.contextmanager
def freed_memory_retained(enabled: bool = True, libc: ctypes.CDLL | None = None) -> Iterator[bool]:
    """Keep freed memory in the process inside the block (when `enabled` and glibc takes it); on leaving it,
    even by an exception, give it back. Yields whether the setting is in force."""
    on = enabled and retain_freed_memory(libc)
    try:
        yield on
    finally:
        if on:
            release_freed_memory(libc)
