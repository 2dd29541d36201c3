"""Progress bars that also work in logs: a rich bar on a terminal; elsewhere (cron, SLURM, `make demo > log`)
a plain log line at most every `every_s` seconds and one at the end, so scheduled jobs show where they are."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("distill.progress")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class LoggedProgress:
    """The subset of `rich.progress.Progress` the stages use (context manager, add_task, update)."""

    def __init__(self, every_s: float = 30.0, clock: Any = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.tasks: dict[int, dict[str, Any]] = {}

    def __enter__(self) -> LoggedProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        for task_id, t in self.tasks.items():
            if t["logged"] < t["completed"] or not t["completed"]:
                self._log(task_id)

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        task_id = len(self.tasks)
        now = self.clock()
        self.tasks[task_id] = {"description": description, "total": total, "completed": 0.0, "fields": fields,
                               "start": now, "last": now, "logged": -1.0}  # fmt: skip
        return task_id

    def update(self, task_id: int, advance: float = 0.0, **fields: Any) -> None:
        t = self.tasks[task_id]
        t["completed"] += advance
        t["fields"].update(fields)
        done = t["total"] is not None and t["completed"] >= t["total"]
        if done or self.clock() - t["last"] >= self.every_s:
            self._log(task_id)

    def _log(self, task_id: int) -> None:
        t = self.tasks[task_id]
        now = self.clock()
        elapsed = now - t["start"]
        parts = [f"{t['description']}: {t['completed']:.0f}"]
        if t["total"]:
            parts[0] += f"/{t['total']:.0f} ({100 * t['completed'] / t['total']:.0f}%)"
        parts += [str(v) for v in t["fields"].values() if v]
        parts.append(f"elapsed {_duration(elapsed)}")
        if t["total"] and 0 < t["completed"] < t["total"]:
            parts.append(f"eta {_duration(elapsed * (t['total'] - t['completed']) / t['completed'])}")
        log.info(", ".join(parts))
        t["last"], t["logged"] = now, t["completed"]


def progress(every_s: float = 30.0) -> Any:
    """A rich progress bar on a terminal, a LoggedProgress otherwise."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if not Console().is_terminal:
        return LoggedProgress(every_s)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        transient=False,
    )
