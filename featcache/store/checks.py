"""Whole-store checks: every chunk against its checksum (``verify --quick``, a resume), and
an incomplete store's progress mark against what its datasets hold."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import h5py

from featcache.store import codec
from featcache.store.layout import PROGRESS, chunk_addresses, read_progress
from featcache.store.paths import open_readonly, readable_path
from featcache.store.rows import PartRows, chunk_text, read_head, rows_of

if TYPE_CHECKING:
    from featcache.store.reader import FeatureStore

T = TypeVar("T")


@dataclass(frozen=True)
class BadChunk:
    """One chunk that fails: rows (or tokens) ``[start, stop)`` of the dataset ``key``."""

    key: str  # path of the dataset in the store: "features/layer2", "labels", "ids", ...
    start: int
    stop: int  # exclusive
    message: str  # "fails its checksum", "cannot be read by HDF5 (...)"

    def describe(self, file: h5py.File) -> str:
        """``layer layer2 rows 8-11 fail their checksum``."""
        return chunk_text(file[self.key], self.start, self.stop, self.message)


def scan_chunks(store: str | os.PathLike | FeatureStore) -> list[BadChunk]:
    """The chunks of ``store`` failing their checksum (format 2: HDF5's Fletcher-32 filter); a
    combined store's shard by shard, an incomplete one's durable chunks only."""
    return _of_file(store, scan_file)


def scan_file(file: h5py.File, after: Mapping[str, int] | None = None) -> list[BadChunk]:
    """:func:`scan_chunks` of an open store file; with ``after``, only the chunks of each
    dataset named there from that entry on. Each chunk is found as plain HDF5 finds it."""
    durable = {} if file.attrs.get("complete") else read_progress(file)[1]
    bad: list[BadChunk] = []
    for dataset in row_datasets(file):
        key = dataset.name.lstrip("/")
        reader = rows_of(dataset)
        first = 0 if after is None else after.get(key, len(dataset))
        limit = durable.get(key, len(dataset))
        for part in reader.parts if isinstance(reader, PartRows) else [reader]:
            size, stop = part.chunk_rows, min(part.length, limit - part.first)
            for start in range(max(first - part.first, 0) // size * size, stop, size):
                problem = part.chunk_problem(start // size, by_hdf5=True)
                if problem:
                    end = part.first + min(start + size, part.length)
                    bad.append(BadChunk(key, part.first + start, end, problem))
    return bad


def row_datasets(file: h5py.File) -> list[h5py.Dataset]:
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
    return _of_file(store, _has_checksums)


def _of_file(store: str | os.PathLike | FeatureStore, check: Callable[[h5py.File], T]) -> T:
    """``check`` of the open file of ``store`` (a path opened for it, or a FeatureStore)."""
    if isinstance(store, (str, os.PathLike)):
        with open_readonly(readable_path(store)) as file:
            return check(file)
    return check(store.file)


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


def durable_problem(file: h5py.File) -> str:
    """Why an incomplete store's progress mark cannot be right ("" when it can be): it
    counts rows not held in whole durable chunks, or a dataset's chunks have moved."""
    if "datasets" not in file[PROGRESS].attrs:
        return "it is an incomplete store of store format 2, which cannot be resumed"
    rows, durable = read_progress(file)
    if not 0 <= rows <= len(file["index"]):
        return f"its progress mark counts {rows} rows, but it holds {len(file['index'])}"
    for name, count in durable.items():
        dataset = file[name]
        if chunk_addresses(dataset) is None:
            return f"the chunk index of {name} changed since the store was created"
        if name == "token_ids" or codec.attr(dataset, "layout") == "tokens":
            needed = int(read_head(file["offsets"], rows + 1)[-1])
        else:
            needed = rows + (name == "offsets")
        whole = (
            count == len(dataset) or 0 <= count < len(dataset) and count % dataset.chunks[0] == 0
        )
        if not whole or count < needed:
            return f"its progress mark counts {rows} rows, but {name} holds {count} entries"
    return ""
