"""Launch-shape table entries bounded by the row count, shared by the CUDA and Triton backends' tables and the
tuning files that replace their entries (STRICTNORM_CUDA_TUNING, STRICTNORM_TRITON_TUNING). No entry changes a bit."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Bounded = tuple[tuple[int | None, T], ...]  # (max rows or None, choice) pairs, ascending, the last one unbounded


def for_rows(entries: Bounded[T], rows: int | None) -> T:
    """The first choice whose bound is at or above `rows`; rows None takes the unbounded one."""
    return next(c for bound, c in entries if bound is None or (rows is not None and rows <= bound))


def load_tuning_file(env: str, tables: dict[str, dict[int, object]], make: Callable[..., T]) -> None:
    """Replaces table entries from the JSON file named by the environment variable `env` (nothing without it):
    {"fwd": {"4096": {knobs}, "128": [[128, {knobs}], [null, {knobs}]]}, "bwd": {...}}, each entry stored as the
    bounded tuple of make(**knobs)."""
    path = os.environ.get(env)
    if not path:
        return
    with open(path) as f:
        data = json.load(f)
    for key, table in tables.items():
        for p, entries in data.get(key, {}).items():
            if isinstance(entries, dict):
                entries = [[None, entries]]
            if not entries or entries[-1][0] is not None:
                raise ValueError(f"{path}: the last {key} entry for P = {p} must be unbounded (null)")
            table[int(p)] = tuple((bound, make(**knobs)) for bound, knobs in entries)


def drop_shadowed(general_before: dict[int, object], general: dict[int, object], special_before: dict[int, object],
                  special: dict[int, object]) -> None:
    """After a tuning file loaded: where it replaced `general`'s entry for P but left the built-in entry of a more
    specific table for P (`special`, e.g. an inference call's), that built-in entry goes, so the tuned one serves."""
    for p, entry in general.items():
        if entry is not general_before.get(p) and p in special_before and special.get(p) is special_before[p]:
            del special[p]
