"""The shards of a store written by several processes: the rows each holds, and the rest.

A shard is a store of its own over one block of source rows, named and keyed by the
block; the shards of a store hold disjoint blocks (docs/guides/torchrun.md).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.store import codec
from featcache.store.metadata import UNREADABLE_METADATA
from featcache.store.paths import (
    OVERWRITE,
    PARTIAL_SUFFIX,
    open_readonly,
    partial_path,
    shards_of,
    store_path_of,
)
from featcache.store.resume import kept_until


@dataclass(frozen=True)
class Shard:
    """One shard file: ``path`` is its store path (its ``.partial`` while incomplete),
    ``block`` the source rows it was made for, ``held`` those it holds (all of a complete
    one's block; of a partial one, those a resume keeps), ``key`` its store key."""

    path: Path
    block: range
    held: range
    complete: bool
    key: Mapping[str, Any]
    launch: str | None = None  # the launch of processes that wrote it, when recorded

    @property
    def file(self) -> Path:
        """The file on disk: the store, or its ``.partial``."""
        return self.path if self.complete else partial_path(self.path)


def read_shards(
    path: str | os.PathLike, step: int = 1, boundaries: Sequence[int] = ()
) -> list[Shard]:
    """The shards beside the store at ``path``, by first row; a partial shard's held rows
    end on its batch grid (:func:`~featcache.store.resume.grid_start`; ``step=1``: every
    durable row).

    Raises:
        FeatcacheError: a shard file cannot be read, or two shards hold the same rows.
    """
    shards = []
    for file in shards_of(path):
        complete = not file.name.endswith(PARTIAL_SUFFIX)
        try:
            with open_readonly(file) as f:
                key = codec.attr(f, "resume_key")
                launch = codec.attr(f, "launch")
                complete = complete and bool(f.attrs.get("complete"))
            block = range(*key["rows"])
            kept = block.stop if complete else kept_until(file, block.start, step, boundaries)
            held = range(block.start, kept)
        except FileNotFoundError:  # completed (or removed) by another process meanwhile
            if complete or not store_path_of(file).exists():
                continue
            return read_shards(path, step, boundaries)
        except (*UNREADABLE_METADATA, KeyError, TypeError) as exc:
            raise FeatcacheError(
                f"shard {file} cannot be read ({first_line(exc)}); delete it to compute its "
                f"rows again, or pass {OVERWRITE} to start the store over"
            ) from exc
        shards.append(Shard(store_path_of(file), block, held, complete, key, launch))
    shards.sort(key=lambda shard: shard.block.start)
    for before, after in itertools.pairwise(shards):
        if before.held.stop > after.held.start and after.held:
            raise FeatcacheError(
                f"shards {before.file.name} and {after.file.name} both hold row "
                f"{after.held.start}; delete one of them, or pass {OVERWRITE} to start over"
            )
    return shards


def missing_rows(shards: Sequence[Shard], num_rows: int) -> list[range]:
    """The blocks of ``range(num_rows)`` that none of ``shards`` holds, in order."""
    return uncovered(range(num_rows), [shard.held for shard in shards])


def uncovered(rows: range, held: Iterable[range]) -> list[range]:
    """The blocks of ``rows`` that none of the disjoint blocks ``held`` covers, in order."""
    parts, at = [], rows.start
    for span in sorted((span for span in held if span), key=lambda span: span.start):
        parts.append(range(at, min(span.start, rows.stop)))  # empty where ``at`` is past it
        at = max(at, span.stop)
    parts.append(range(at, rows.stop))
    return [part for part in parts if part]


def check_same_run(shards: Sequence[Shard], key: Mapping[str, Any]) -> None:
    """Refuse a shard made under another store key than ``key`` (rows aside).

    Raises:
        ConfigError: naming the shard and the first entry that differs.
    """
    for shard in shards:
        differ = [
            k
            for k in sorted(set(shard.key) | set(key))
            if k != "rows" and shard.key.get(k) != key.get(k)
        ]
        if differ:
            raise ConfigError(
                f"shard {shard.file} was made with another {differ[0]} than this run; "
                f"rerun with the settings it was made with, or pass {OVERWRITE} to start over"
            )


def describe_shards(path: str | os.PathLike) -> list[str]:
    """What ``featcache info`` prints of a store not combined yet: the rows each shard
    holds, and those no shard holds; [] when there are no shards."""
    shards = read_shards(path)
    if not shards:
        return []
    num_rows = int(shards[0].key.get("source_rows", max(s.block.stop for s in shards)))
    held = sum(len(shard.held) for shard in shards)
    lines = [f"{path}: not combined yet; {len(shards)} shards hold {held} of {num_rows} rows"]
    width = len(str(num_rows))
    for shard in shards:
        state = "complete" if shard.complete else f"partial (of rows up to {shard.block.stop})"
        rows = f"{shard.held.start:>{width}}-{shard.held.stop:<{width}}"
        lines.append(f"  rows {rows}  {shard.file.name}  {state}")
    remaining = missing_rows(shards, num_rows)
    spans = ", ".join(f"{r.start}-{r.stop}" for r in remaining[:8])
    more = f", ... ({len(remaining)} blocks)" if len(remaining) > 8 else ""
    left = sum(map(len, remaining))
    lines.append(f"  remaining: {left} rows" + (f" ({spans}{more})" if left else ""))
    return lines
