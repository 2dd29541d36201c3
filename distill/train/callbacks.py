"""Atomic checkpoints (`last.ckpt` is always a complete file) and SIGTERM / Ctrl-C -> save -> exit 130.

Lightning catches KeyboardInterrupt inside `fit` and calls `sys.exit(1)` (lightning 2.6,
`trainer/call.py`), so a plain Ctrl-C would neither save nor exit 130: while Lightning runs, SIGINT is handled
like SIGTERM (a flag acted on at the next step boundary). A second Ctrl-C stops at once; the last checkpoint
written stays valid.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from lightning.pytorch.callbacks import Callback

from distill.errors import Interrupted
from distill.utils.fs import sha256_file

log = logging.getLogger("distill.train")
GIB = 1024**3


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopFlag:
    """Set by the SIGTERM / SIGINT handler during `fit`; acted on at the next step boundary, where the model,
    optimizer and data position are consistent (a signal mid-step would otherwise save a half-applied step).

    A second SIGINT raises KeyboardInterrupt at once (`forced`): the user does not want to wait for the step.
    """

    def __init__(self) -> None:
        self.requested = False
        self.forced = False
        self.signal_name = "a stop signal"  # on another rank: ranks agree at the step boundary

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            self.forced = True
            raise KeyboardInterrupt
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            log.warning(
                "received %s: saving a checkpoint at the end of this step, then stopping%s",
                self.signal_name,
                " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "",
            )
        self.requested = True


@contextlib.contextmanager
def handle_signals(
    handler: Callable[[int, FrameType | None], Any], signals: tuple[signal.Signals, ...] = STOP_SIGNALS
) -> Iterator[None]:
    """Install `handler` for `signals` (main thread only: Python allows no other), restore the old ones after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, old in previous.items():
            if old is not None:  # None: a handler not installed from Python, which cannot be restored
                signal.signal(s, old)


class AtomicCheckpoint(Callback):
    """Save every `every` steps, at `max_steps` and on a stop request, to a temporary file renamed over `path`."""

    def __init__(self, path: Path, *, every: int, max_steps: int, stop: StopFlag):
        self.path = Path(path)
        self.every = every
        self.max_steps = max_steps
        self.stop = stop

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning installs its own SIGTERM handler when fit starts; under DDP it broadcasts from inside the
        # handler, which deadlocks when the signal lands mid-collective. Ours only sets a flag; the ranks agree
        # on it at the next step boundary. SIGINT likewise (spawned ranks get here without `_fit`'s handlers).
        # Lightning restores the previous handlers at teardown.
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self.stop.handler)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        local_stop = self.stop.requested or bool(getattr(trainer, "received_sigterm", False))
        # Every rank must agree: saving is collective.
        stop = trainer.strategy.reduce_boolean_decision(local_stop, all=False)
        if stop or step % self.every == 0 or step >= self.max_steps:
            self.save(trainer)
        if stop:
            self.stop.requested = True
            raise Interrupted(
                f"received {self.stop.signal_name}; checkpoint of step {step} saved to {self.path}, rerun the "
                "same command to resume."
            )

    def save(self, trainer: Any) -> None:
        step = trainer.global_step
        # The CSV logger writes its rows every 100 steps: flushed with each checkpoint, a kill -9 loses no row
        # of the steps the resumed run will not replay.
        for logger in trainer.loggers:
            logger.save()
        tmp = self.path.with_name(f".{self.path.name}.{step}.tmp")
        trainer.save_checkpoint(str(tmp), weights_only=False)
        if trainer.is_global_zero:
            _fsync(tmp)
            digest = sha256_file(tmp)
            os.replace(tmp, self.path)
            write_checksum(self.path, step, digest)
            log.debug("checkpoint of step %d -> %s (sha256 %s)", step, self.path, digest[:12])
        trainer.strategy.barrier("distill.checkpoint")


# Bit rot that still unpickles (flipped bytes inside a tensor) loads "fine" and resumes into NaN weights, so each
# checkpoint gets its sha256 in a sidecar, verified before resuming. The sidecar is written after the rename: a
# crash between the two leaves the record of the previous save, recognised by its step and then not applied.
CHECKSUM_SUFFIX = ".sha256.json"


def checksum_path(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name + CHECKSUM_SUFFIX)


def write_checksum(ckpt: Path, step: int, digest: str | None = None) -> None:
    """Record `ckpt`'s sha256 (computed when not given) and the step it holds beside it."""
    from distill.utils.fs import atomic_write_json

    record = {"file": ckpt.name, "global_step": int(step), "sha256": digest or sha256_file(ckpt)}
    atomic_write_json(checksum_path(ckpt), record)


def checksum_problem(ckpt: Path, step: Any) -> str | None:
    """What is wrong with `ckpt` (which loaded and says it holds `step`) by its sidecar, None when it matches or
    cannot be checked: no sidecar (a checkpoint from before checksums, a copy), or the sidecar of another save."""
    from distill.utils.fs import read_json

    side = checksum_path(ckpt)
    if not side.is_file():
        return None
    try:
        record = read_json(side)
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s); %s is not verified", side, exc, ckpt)
        return None
    if not isinstance(record, dict) or record.get("global_step") != step:
        log.warning("%s records another save than %s (step %s); it is not verified", side, ckpt.name, step)
        return None
    if sha256_file(ckpt) != record.get("sha256"):
        return f"is damaged (its sha256 differs from the one recorded in {side.name} when it was saved)"
    return None


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class TrimFreedMemory(Callback):
    """While `train.retain_freed_memory` keeps freed memory in the process, hand it back every `every_n_steps`
    optimizer steps (`distill.utils.malloc.trim_freed_memory`): the retained memory fragments and would grow
    without bound; trimming costs the next step its page faults, once per `every_n_steps` steps.

    A step that ends with more than `budget_bytes` resident (`malloc.RETAINED_MEMORY_SHARE`), or with less than
    `reserve_bytes` still available to the machine (`malloc.MEMORY_RESERVE_SHARE`: other processes need it),
    trims at once, so the retained memory never runs the machine out of memory. Fragmentation spreads each
    step's blocks over a larger heap as a run goes on, and the budget then forces trims ever more often; once two come within
    `every_n_steps // 4` steps of each other, every step pays the page faults that retaining was meant to save,
    so the callback stops retaining (`release`: glibc's defaults) for the rest of the run and only goes on
    handing back every `every_n_steps` steps. The parallel draft's training reached that point 100-120 steps
    after its process started (BENCHMARKS.md, section 7)."""

    def __init__(
        self,
        every_n_steps: int,
        budget_bytes: int | None = None,
        trim: Callable[[], object] | None = None,
        resident: Callable[[], int | None] | None = None,
        release: Callable[[], object] | None = None,
        reserve_bytes: int | None = None,
        available: Callable[[], int | None] | None = None,
    ) -> None:
        from distill.utils.malloc import (
            available_bytes,
            release_freed_memory,
            resident_bytes,
            trim_freed_memory,
        )

        self.every_n_steps = every_n_steps
        self.budget_bytes = budget_bytes
        self.rank_budget_bytes = budget_bytes
        self.trim = trim or trim_freed_memory
        self.resident = resident or resident_bytes
        self.release = release or release_freed_memory
        self.reserve_bytes = reserve_bytes
        self.available = available or available_bytes
        self.last_trimmed = -1
        self.over_budget = 0  # trims the budget forced, for the log line when training ends
        self.released_at: int | None = None  # the step retaining stopped at

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # The processes of one node share its memory: each rank gets its share of the budget.
        if self.budget_bytes is not None:
            self.rank_budget_bytes = self.budget_bytes // max(1, int(getattr(trainer, "num_devices", 1) or 1))

    def _over_budget(self) -> bool:
        if self.rank_budget_bytes is not None:
            rss = self.resident()
            if rss is not None and rss > self.rank_budget_bytes:
                return True
        if self.reserve_bytes is not None:
            free = self.available()
            if free is not None and free < self.reserve_bytes:
                return True
        return False

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # once per optimizer step: with gradient accumulation several batches end at the same global step
        if not step or step == self.last_trimmed:
            return
        # The periodic hand-back goes on after retaining stopped: the heap the retaining phase fragmented stays,
        # and the small blocks glibc still serves from it touch its free pages again and keep them (a run that
        # stopped trimming there sat at 12-13 GB resident; a process that never retained peaked at 7.3 GB).
        if step % self.every_n_steps == 0:
            self.last_trimmed = step
            self.trim()
        elif self.released_at is None and self._over_budget():
            self.over_budget += 1
            if step - self.last_trimmed <= max(1, self.every_n_steps // 4):
                self.released_at = step
                self.release()
                log.info(
                    "step %d: retained memory passed its budget (%.1f GiB resident, %.1f GiB kept available) %d "
                    "steps after the last hand-back; keeping freed memory no longer pays, so glibc's defaults are "
                    "back for the rest of training",
                    step, (self.rank_budget_bytes or 0) / GIB, (self.reserve_bytes or 0) / GIB,
                    step - self.last_trimmed,
                )  # fmt: skip
                return
            log.debug(
                "step %d: resident memory over the budget or the machine short of memory: trimming now", step
            )
            self.last_trimmed = step
            self.trim()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.over_budget:
            log.info(
                "retained memory reached its budget (%.1f GiB) %d times; each time it was handed back early",
                (self.rank_budget_bytes or 0) / GIB,
                self.over_budget,
            )


class LogProgress(Callback):
    """Training progress as log lines (used instead of the rich bar when stdout is not a terminal: cron, SLURM,
    `make demo > log`): step, loss, seconds per step and ETA at most every `every_s` seconds, and the
    validation figures after each validation."""

    def __init__(self, every_s: float = 30.0, clock: Callable[[], float] | None = None) -> None:
        import time

        self.every_s = every_s
        self.clock = clock or time.monotonic
        self.start: float | None = None
        self.start_step = 0
        self.last = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = self.last = self.clock()
        self.start_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = self.clock()
        step, total = trainer.global_step, trainer.max_steps
        if not trainer.is_global_zero or (now - self.last < self.every_s and step < total):
            return
        self.last = now
        done = max(step - self.start_step, 1)
        per_step = (now - self.start if self.start is not None else 0.0) / done
        loss = trainer.callback_metrics.get("loss")
        parts = [f"train: step {step}/{total} ({100 * step / max(total, 1):.0f}%)"]
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        parts += [f"{per_step:.2f} s/step", f"eta {per_step * max(total - step, 0) / 60:.1f} min"]
        log.info(", ".join(parts))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        figures = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        # A stand-alone `trainer.validate` (the final or a resumed step's) starts from step 0: the module knows.
        fitting = trainer.state.fn == "fit"
        step = (
            trainer.global_step if fitting else getattr(pl_module, "eval_step", None) or trainer.global_step
        )
        if figures:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(figures.items()))
            log.info(f"validation at step {step}: {shown}")
