"""Atomic checkpoints (`last.ckpt` is always a complete file) and SIGTERM -> save -> exit 130."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from lightning.pytorch.callbacks import Callback

from distill.errors import Interrupted

log = logging.getLogger("distill.train")


class StopFlag:
    """Set by the SIGTERM handler during `fit`; acted on at the next step boundary, where the model,
    optimizer and data position are consistent (a signal mid-step would otherwise save a half-applied step)."""

    def __init__(self) -> None:
        self.requested = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


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
        # on it at the next step boundary. (Lightning restores the previous handler at teardown.)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop.handler)

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
                f"received SIGTERM; checkpoint of step {step} saved to {self.path}, rerun the same "
                "command to resume."
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
