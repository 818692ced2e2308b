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

# The entry of a partial store's key that marks it as an update's
# (:mod:`featcache.extraction.update`): a plain rerun refuses it, ``--update`` redoes it.
UPDATE_MARK = "update"


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
    source is read again from ``position`` (a multiple of the batch size); ``tokens``
    are the tokens of those rows (per-token stores), ``durable`` each dataset's durable
    entries (whole chunks, never written again: the entries recomputed below them are
    dropped)."""

    row: int
    position: int
    skipped: list[dict[str, Any]]  # skip records of source positions before ``position``
    durable: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    # The kept rows' source positions ([row] int64) and change stamps ([row] bytes; None
    # where the partial store records none), to tell which of them changed since.
    index: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    stamps: np.ndarray | None = None


def grid_start(position: int, first: int, step: int, boundaries: Sequence[int] = ()) -> int:
    """The batch start at or before ``position`` on the batch grid of a run from ``first``.

    Batches (or windows of batches) of ``step`` rows start at ``first`` and restart at
    every position in ``boundaries`` (the first rows of a sharded source's shards), so
    the grid is the same whichever block of whole shards a run starts at.
    """
    segment = max([first, *(b for b in boundaries if first <= b <= position)])
    return segment + (position - segment) // step * step


def restart_position(
    index: np.ndarray, first: int, step: int, boundaries: Sequence[int] = ()
) -> int:
    """Where a run whose durable rows have the source positions ``index`` restarts: the
    batch start at or before the position after its last durable row, on the grid of a
    run from ``first`` (``first`` when no row is durable). The rows before it are kept.

    Restarting on the batch grid of the first run keeps every batch holding the same
    samples as in an uninterrupted run: batch composition can change a result's last bits.
    """
    next_position = int(index[-1]) + 1 if len(index) else first
    return grid_start(next_position, first, step, boundaries)


def kept_until(
    partial: str | os.PathLike, first: int, step: int, boundaries: Sequence[int] = ()
) -> int:
    """The :func:`restart_position` of the partial store file ``partial`` (a run over
    rows from ``first``): the rows before it are kept when it is resumed or sealed."""
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
    """Check a partial store left by an earlier run; None when there is none.

    The run restarts on its batch grid (see :func:`restart_position`; ``batch_size`` is
    the grid's step). Every durable chunk is checked first. With ``seal``, the partial
    store may have been made for rows that go on past those of ``resume_key`` (a shard
    that another run stopped, whose kept rows are exactly this run's).

    Raises :class:`ConfigError` naming the first difference when the partial store was
    made with other settings, data or model (given this run's ``config``, as
    :func:`~featcache.config.spec.to_dict` gives it, the config keys that differ), and when it
    cannot be read or a durable chunk is damaged.
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
