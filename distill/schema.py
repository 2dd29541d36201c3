"""Helpers for declaring config fields: every key carries its documentation and its allowed range.

`opt(default, "help", ge=0)` is a dataclass field whose metadata the validator and `distill docs` read, so each
key is documented exactly once, here in the schema.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any


def opt(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    each_ge: float | None = None,
    each_gt: float | None = None,
    each_le: float | None = None,
    run_only: bool = False,
    hashed_when_set: bool = False,
) -> Any:
    """A documented config field. `each_*` bound every element of a list field.

    `run_only=True` marks keys that change how a stage runs but not what it produces (timeouts, overwrite
    flags, parallelism): they are left out of the config hash that decides whether a stage is complete.
    `hashed_when_set=True` marks keys added after run folders existed: at their default they are left out of
    that hash, so adding them did not make every earlier run (and its checkpoints) look foreign.
    """
    meta = {
        "help": help,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "each_ge": each_ge,
        "each_gt": each_gt,
        "each_le": each_le,
        "run_only": run_only or None,
        "hashed_when_set": hashed_when_set or None,
    }
    meta = {k: v for k, v in meta.items() if v is not None}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """A nested config section (a dataclass) with its documentation."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})
