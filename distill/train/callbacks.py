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

log = logging.getLogger("distill.train")


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
        tmp = self.path.with_name(f".{self.path.name}.{trainer.global_step}.tmp")
        trainer.save_checkpoint(str(tmp), weights_only=False)
        if trainer.is_global_zero:
            _fsync(tmp)
            os.replace(tmp, self.path)
            log.debug("checkpoint of step %d -> %s", trainer.global_step, self.path)
        trainer.strategy.barrier("distill.checkpoint")


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
