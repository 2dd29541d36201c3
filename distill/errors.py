"""Errors that map to the CLI's exit codes (see CONTRACT.md).

`InputError` / `ConfigError` mean the user must fix something (exit 2, nothing written); `RuntimeFailure`
means the run itself failed (exit 1); `Interrupted` means SIGINT/SIGTERM arrived and state was saved (exit 130).
"""

from __future__ import annotations

from collections.abc import Sequence

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_INPUT = 2
EXIT_INTERRUPTED = 130


class DistillError(Exception):
    """Base class: carries the exit code the CLI returns."""

    exit_code = EXIT_RUNTIME


class InputError(DistillError):
    """Bad config value, bad file or bad model reference. The message names the key/file and the fix."""

    exit_code = EXIT_INPUT


class ConfigError(InputError):
    """One or more config problems, reported together."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = (
            "invalid config" if len(self.problems) == 1 else f"invalid config ({len(self.problems)} problems)"
        )
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in self.problems))


class RuntimeFailure(DistillError):
    """The stage failed while running (engine crash, disk full, NaN loss...)."""

    exit_code = EXIT_RUNTIME


class Interrupted(DistillError):
    """SIGINT or SIGTERM: the stage saved its state; rerunning resumes."""

    exit_code = EXIT_INTERRUPTED
