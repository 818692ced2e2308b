"""Resuming an interrupted store: the settings it was made with and where to restart."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featcache.errors import ConfigError, first_line
from featcache.store import codec
from featcache.store.checks import durable_problem, scan_file
from featcache.store.layout import STAMPS, read_progress
from featcache.store.metadata import UNREADABLE_METADATA
from featcache.store.paths import OVERWRITE, open_readonly, partial_path, skipped_log_path
from featcache.store.provenance import key_difference
from featcache.store.rows import read_head, rows_of
from featcache.store.skipped import read_log

UPDATE_MARK = "update"  # the key entry of an update's partial store: a plain rerun refuses it


def stored_resume_key(path: str | os.PathLike) -> dict[str, Any] | None:
    """The settings a store (complete or partial) was made with; None if unreadable."""
    try:
        with open_readonly(path) as f:
            return codec.attr(f, "resume_key")
    except UNREADABLE_METADATA:  # a torn file's headers fail their checksums
        return None


@dataclass
class ResumePoint:
    """Where an interrupted extraction continues: rows ``[0, row)`` are kept and the
    source is read again from ``position``; ``durable`` is each dataset's durable entries
    (whole chunks, never written again), ``tokens`` the kept rows' tokens."""

    row: int
    position: int
    skipped: list[dict[str, Any]]  # skip records of source positions before ``position``
    durable: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    # The kept rows' source positions ([row] int64) and change stamps ([row] bytes; None
    # where none are recorded), to tell which of them changed since.
    index: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    stamps: np.ndarray | None = None


def grid_start(position: int, first: int, step: int, boundaries: Sequence[int] = ()) -> int:
    """The batch start at or before ``position`` on the grid of ``step`` rows from
    ``first``, restarting at each of ``boundaries`` (a sharded source's first rows)."""
    segment = max([first, *(b for b in boundaries if first <= b <= position)])
    return segment + (position - segment) // step * step


def restart_position(
    index: np.ndarray, first: int, step: int, boundaries: Sequence[int] = ()
) -> int:
    """Where a run whose durable rows have the source positions ``index`` restarts: the
    grid batch start at or before the position after its last durable row. On the first
    run's grid, every batch holds the samples of an uninterrupted run, whose composition
    can change a result's last bits."""
    next_position = int(index[-1]) + 1 if len(index) else first
    return grid_start(next_position, first, step, boundaries)


def kept_until(
    partial: str | os.PathLike, first: int, step: int, boundaries: Sequence[int] = ()
) -> int:
    """The :func:`restart_position` of the partial store file ``partial`` (a run over
    rows from ``first``): the rows it keeps."""
    with open_readonly(partial) as f:
        durable_rows, _ = read_progress(f)
        return restart_position(read_head(f["index"], durable_rows), first, step, boundaries)


def plan_resume(
    path: str | os.PathLike,
    resume_key: Mapping[str, Any],
    batch_size: int,
    first: int = 0,
    boundaries: Sequence[int] = (),
    config: Mapping[str, Any] | None = None,
    *,
    seal: bool = False,
) -> ResumePoint | None:
    """Check a partial store left by an earlier run and where to restart (on the grid of
    ``batch_size``); None when there is none. With ``seal``, its rows may go on past
    those of ``resume_key`` (a stopped shard whose kept rows are exactly this run's).

    Raises:
        ConfigError: it was made with other settings (the config keys that differ from
            ``config``, when given), cannot be read, or a durable chunk is damaged.
    """
    partial = partial_path(path)
    if not partial.exists():
        return None

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"cannot resume from {partial}: {why}; pass {OVERWRITE} to start over")

    try:
        with open_readonly(partial) as f:
            stored_key = codec.attr(f, "resume_key")
            for key in sorted(set(stored_key) | set(resume_key)):
                if stored_key.get(key) != resume_key.get(key):
                    if seal and key == "rows" and _ends_later(stored_key[key], resume_key[key]):
                        continue
                    stored_config = codec.attr(f, "config")
                    raise refuse(key_difference(key, stored_key, resume_key, stored_config, config))
            problem = durable_problem(f)
            bad = [] if problem else scan_file(f)
            if problem or bad:
                raise refuse(problem or bad[0].describe(f))
            durable_rows, durable = read_progress(f)
            index = read_head(f["index"], durable_rows)
            position = restart_position(index, first, batch_size, boundaries)
            if seal and position != resume_key["rows"][1]:
                raise refuse(f"it keeps rows up to {position}, not {resume_key['rows'][1]}")
            row = int(np.searchsorted(index, position))
            tokens = np.zeros(1, dtype=np.int64)
            if "offsets" in f:
                rows_of(f["offsets"]).read(row, row + 1, tokens)
            stamps = read_head(f[STAMPS], row) if STAMPS in f else None
    except UNREADABLE_METADATA as exc:
        raise refuse(f"it is not readable ({first_line(exc)})") from exc
    skipped = read_log(skipped_log_path(path), before=position)
    return ResumePoint(row, position, skipped, durable, int(tokens[0]), index[:row], stamps)


def _ends_later(stored: Any, rows: Sequence[int]) -> bool:
    """Whether the stored rows ``[start, stop]`` start where ``rows`` do and end later."""
    return isinstance(stored, list) and stored[0] == rows[0] and stored[1] >= rows[1]
