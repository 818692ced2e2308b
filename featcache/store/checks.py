"""Whole-store checks: every chunk against its checksum (``verify --quick``, a resume), and
an incomplete store's progress mark against what its datasets hold."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h5py
import numpy as np

from featcache.store import codec
from featcache.store.layout import PROGRESS, chunk_addresses, read_progress
from featcache.store.paths import readable_path
from featcache.store.rows import PartRows, Rows, chunk_text, opened, rows_of

if TYPE_CHECKING:
    from featcache.store.reader import FeatureStore


@dataclass(frozen=True)
class BadChunk:
    """One chunk that fails: rows (or tokens) ``[start, stop)`` of the dataset ``key``."""

    key: str  # path of the dataset in the store: "features/layer2", "labels", "ids", ...
    start: int
    stop: int  # exclusive
    message: str  # "fails its checksum", "cannot be read (...)"

    def describe(self, file: h5py.File) -> str:
        """``layer layer2 rows 8-11 fail their checksum``."""
        return chunk_text(file[self.key], self.start, self.stop, self.message)


def scan_chunks(store: str | os.PathLike | FeatureStore) -> list[BadChunk]:
    """Check every chunk of every dataset of ``store`` and list those that fail: against
    its checksum, or, in a format-2 store, read through HDF5's Fletcher-32 filter. A
    store combined from shards is checked shard by shard, named by its own rows; an
    incomplete one in its durable chunks only (a resume writes the others again)."""
    if isinstance(store, (str, os.PathLike)):
        with opened(readable_path(store)) as file:
            return scan_file(file)
    return scan_file(store.file)


def scan_file(file: h5py.File, after: Mapping[str, int] | None = None) -> list[BadChunk]:
    """:func:`scan_chunks` of an open store file; with ``after``, only the chunks of each
    dataset named there from that entry on. Each chunk is found as plain HDF5 finds it."""
    durable = {} if file.attrs.get("complete") else durable_entries(file)
    bad: list[BadChunk] = []
    for dataset in _row_datasets(file):
        key = dataset.name.lstrip("/")
        reader = rows_of(dataset)
        first = 0 if after is None else after.get(key, len(dataset))
        limit = durable.get(key, len(dataset))
        for part in reader.parts if isinstance(reader, PartRows) else [reader]:
            bad += _scan(part, key, first, limit)
    return bad


def _scan(rows: Rows, key: str, first: int, limit: int) -> list[BadChunk]:
    bad = []
    stop = min(rows.length, limit - rows.first)
    for start in range(
        max(first - rows.first, 0) // rows.chunk_rows * rows.chunk_rows, stop, rows.chunk_rows
    ):
        problem = rows.chunk_problem(start // rows.chunk_rows, by_hdf5=True)
        if problem:
            stop = min(start + rows.chunk_rows, rows.length)
            bad.append(BadChunk(key, rows.first + start, rows.first + stop, problem))
    return bad


def _row_datasets(file: h5py.File) -> list[h5py.Dataset]:
    """Every dataset of rows or tokens in ``file`` (not the checksums, nor progress)."""
    found: list[h5py.Dataset] = []

    def visit(name: str, obj: object) -> None:
        rows = isinstance(obj, h5py.Dataset) and (obj.chunks is not None or obj.is_virtual)
        if rows and name != PROGRESS and not name.startswith("checksums/"):
            found.append(obj)

    file.visititems(visit)
    return found


def has_checksums(store: str | os.PathLike | FeatureStore) -> bool:
    """Whether every layer of ``store`` carries chunk checksums (XXH3 in format 3,
    Fletcher-32 in format 2; for a store combined from shards, in every shard)."""
    if isinstance(store, (str, os.PathLike)):
        with opened(readable_path(store)) as file:
            return _has_checksums(file)
    return _has_checksums(store.file)


def _has_checksums(file: h5py.File) -> bool:
    features = file.get("features")
    if not isinstance(features, h5py.Group) or not len(features):
        return False
    for key in features:
        reader = rows_of(features[key])
        for part in reader.parts if isinstance(reader, PartRows) else [reader]:
            if part.sums is None and not part.dataset.fletcher32:
                return False
    return True


def durable_entries(file: h5py.File) -> dict[str, int]:
    """Each dataset's durable entries in an incomplete store: the whole chunks its last
    mark counts (format 3), or the durable rows' entries (format 2, whose mark counts rows)."""
    if "datasets" in file[PROGRESS].attrs:
        return read_progress(file)[1]
    rows = int(file[PROGRESS][0])
    found = {}
    for dataset in _row_datasets(file):
        name = dataset.name.lstrip("/")
        if name == "offsets":
            found[name] = rows + 1
        elif name == "token_ids" or codec.attr(dataset, "layout") == "tokens":
            found[name] = int(_entries(file["offsets"], rows, rows + 1)[0])
        else:
            found[name] = rows
    return found


def durable_problem(file: h5py.File) -> str:
    """Why an incomplete store's progress mark cannot be right ("" when it can be): it
    counts more rows than its datasets hold durably, entries that are not whole chunks,
    or rows never written (the durable rows' source positions, ``/index``, increase; a
    row never written reads as position 0); or a dataset's chunks are no longer where the
    store was created with them, as its run writes them."""
    rows, held = int(file[PROGRESS][0]), len(file["index"])
    if not 0 <= rows <= held:
        return f"its progress mark counts {rows} rows, but it holds {held}"
    if "datasets" in file[PROGRESS].attrs:
        for name, count in read_progress(file)[1].items():
            dataset = file[name]
            if chunk_addresses(dataset) is None:  # where the run writes each chunk
                return f"the chunk index of {name} changed since the store was created"
            whole = count == len(dataset) or 0 <= count % dataset.chunks[0] == 0 <= count < len(
                dataset
            )
            if name == "token_ids" or codec.attr(dataset, "layout") == "tokens":
                needed = int(_entries(file["offsets"], rows, rows + 1)[0])
            else:
                needed = rows + (name == "offsets")
            if not whole or count < needed:
                return f"its progress mark counts {rows} rows, but {name} holds {count} entries"
    if rows < 2:
        return ""
    before, last = _entries(file["index"], rows - 2, rows)
    if last > before:
        return ""
    return (
        f"its progress mark counts {rows} rows, but row {rows - 1} was never written (source "
        f"position {last}, not after row {rows - 2}'s {before})"
    )


def _entries(dataset: h5py.Dataset, start: int, stop: int) -> np.ndarray:
    """Entries ``[start, stop)`` of ``dataset``, read and checked as any row is."""
    out = np.empty(stop - start, dtype=dataset.dtype)
    rows_of(dataset).read(start, stop, out)
    return out
