"""Resuming an interrupted store: the settings it was made with and where to restart."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from featcache.errors import ConfigError, first_line
from featcache.store import codec
from featcache.store.paths import OVERWRITE, partial_path, skipped_log_path
from featcache.store.skipped import read_log


def stored_resume_key(path: str | os.PathLike) -> dict[str, Any] | None:
    """The settings a store (complete or partial) was made with; None if unreadable."""
    try:
        with h5py.File(path, "r") as f:
            return codec.attr(f, "resume_key")
    except (OSError, KeyError, ValueError):
        return None


@dataclass
class ResumePoint:
    """Where an interrupted extraction continues: rows ``[0, row)`` are kept and the
    source is read again from ``position`` (a multiple of the batch size)."""

    row: int
    position: int
    skipped: list[dict[str, Any]]  # skip records of source positions before ``position``


def grid_start(position: int, first: int, step: int, boundaries: Sequence[int] = ()) -> int:
    """The batch start at or before ``position`` on the batch grid of a run from ``first``.

    Batches (or windows of batches) of ``step`` rows start at ``first`` and restart at
    every position in ``boundaries`` (the first rows of a sharded source's shards), so
    the grid is the same whichever block of whole shards a run starts at.
    """
    segment = max([first, *(b for b in boundaries if first <= b <= position)])
    return segment + (position - segment) // step * step


def plan_resume(
    path: str | os.PathLike,
    resume_key: Mapping[str, Any],
    batch_size: int,
    first: int = 0,
    boundaries: Sequence[int] = (),
) -> ResumePoint | None:
    """Check a partial store left by an earlier run; None when there is none.

    The run restarts on its batch grid (see :func:`grid_start`; ``batch_size`` is the
    grid's step).

    Raises :class:`ConfigError` naming the first difference when the partial store was
    made with other settings, data or model, and when it cannot be read.
    """
    partial = partial_path(path)
    if not partial.exists():
        return None
    try:
        with h5py.File(partial, "r") as f:
            stored_key = codec.attr(f, "resume_key")
            durable = int(f["progress"][0])
            index = f["index"][:durable]
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(
            f"cannot resume from {partial}: it is not readable ({first_line(exc)}); "
            f"pass {OVERWRITE} to start over"
        ) from exc
    for key in sorted(set(stored_key) | set(resume_key)):
        if stored_key.get(key) != resume_key.get(key):
            raise ConfigError(
                f"cannot resume {partial}: its {key.replace('_', ' ')} differs from this "
                f"run's ({_short(stored_key.get(key))} vs {_short(resume_key.get(key))}); "
                f"pass {OVERWRITE} to start over"
            )
    next_position = int(index[-1]) + 1 if durable else first
    # Restart on the batch grid of the first run (batches start at ``first``), so that every
    # batch holds the same samples as in an uninterrupted run: batch composition can
    # change the last bits of a result.
    position = grid_start(next_position, first, batch_size, boundaries)
    row = int(np.searchsorted(index, position))
    return ResumePoint(row, position, read_log(skipped_log_path(path), before=position))


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:16] + "..." + text[-8:]
