"""The format-3 layout: datasets allocated whole, their chunk sizes, chunk checksums, progress.

Datasets are unfiltered and allocated in full at creation, so a run writes whole chunks
straight into their places and never changes HDF5's metadata until the store completes
(docs/store-format.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np
import xxhash

from featcache.store import codec

CHECKSUM = "xxh3_64"  # the /checksums group's "algorithm" attribute
TARGET_CHUNK_BYTES = 1 << 20  # a chunk holds about 1 MiB ...
MAX_CHUNK_ROWS = 256  # ... of at most this many rows: it fills in seconds, even on a CPU
PROGRESS = "progress"
STAMPS = "stamps"  # [N] fixed-length ASCII: each row's change stamp (featcache.sources.stamps)
STAMP_ROOM = 8  # bytes a stamp may grow by in a resumed run (a file size's digits)

# HDF5 file formats: checksummed version-2 object headers in a version-2 superblock, which
# HDF5 does not mark as open for writing (a file whose writer was killed still opens); a
# file written whole uses HDF5 1.10's format, whose chunk indexes carry checksums too.
LIBVER = ("v108", "v110")
WHOLE_FILE_LIBVER = ("v110", "v110")
# HDF5's block size for the metadata it writes while allocating (chunk indexes): big, so
# that a dataset's chunks are allocated back to back.
META_BLOCK_BYTES = 64 << 10


def checksum(data: Any) -> int:
    """The XXH3-64 checksum of ``data``'s bytes (any contiguous buffer), as stored."""
    return xxhash.xxh3_64_intdigest(data)


def chunk_rows_for(entry_shape: Sequence[int], itemsize: int, length: int) -> int:
    """Entries per chunk of a dataset of ``length`` entries of ``entry_shape``: about
    :data:`TARGET_CHUNK_BYTES`, at most :data:`MAX_CHUNK_ROWS`, at least 1."""
    entry_bytes = max(int(np.prod(entry_shape, dtype=np.int64)) * itemsize, 1)
    return int(max(1, min(length, MAX_CHUNK_ROWS, TARGET_CHUNK_BYTES // entry_bytes)))


def checksums_name(name: str) -> str:
    """Where the chunk checksums of dataset ``name`` live."""
    return f"checksums/{name.lstrip('/')}"


def allocate(
    group: h5py.Group,
    name: str,
    shape: tuple,
    dtype: Any,
    chunk_rows: int | None = None,
    resizable: bool = True,
) -> h5py.Dataset:
    """A dataset whose storage is allocated now and never filled, chunked by ``chunk_rows``
    along its first axis (``resizable``: completion may shrink it), or contiguous without
    ``chunk_rows``. Writes into it never add metadata."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    options: dict[str, Any] = {}
    if chunk_rows is not None:
        options["chunks"] = (min(chunk_rows, shape[0]), *shape[1:])
        options["maxshape"] = (None if resizable else shape[0], *shape[1:])
    return group.create_dataset(
        name, shape=shape, dtype=dtype, dcpl=dcpl, fill_time="never", **options
    )


def allocate_checked(file: h5py.File, name: str, shape: tuple, dtype: Any, chunk_rows: int):
    """:func:`allocate` a chunked dataset and its ``/checksums`` entry, one per chunk."""
    dataset = allocate(file, name, shape, dtype, chunk_rows)
    chunks = -(-shape[0] // dataset.chunks[0])
    allocate(file, checksums_name(name), (max(chunks, 1),), "<u8")
    return dataset


def write_checked(
    file: h5py.File, name: str, data: np.ndarray, chunk_rows: int, checked: bool = True
) -> None:
    """Write a whole dataset ``name`` of ``data`` (at least one row) at once, with its chunk
    checksums when ``checked``."""
    add = allocate_checked if checked else allocate
    dataset = add(file, name, data.shape, data.dtype, chunk_rows)
    dataset[...] = data
    if checked:
        file[checksums_name(name)][...] = stored_checksums(dataset)


def stored_checksums(dataset: h5py.Dataset) -> np.ndarray:
    """The checksum of each chunk of ``dataset`` as HDF5 stored it (filters applied)."""
    dataset.id.flush()  # chunks still in HDF5's cache are written first
    rows, zeros = dataset.chunks[0], (0,) * (dataset.ndim - 1)
    stored = (
        dataset.id.read_direct_chunk((start, *zeros))[1] for start in range(0, len(dataset), rows)
    )
    return np.array([checksum(chunk) for chunk in stored] or [0], dtype="<u8")


def refresh_checksum(file: h5py.File, name: str, chunk: int) -> None:
    """Record the checksum of chunk ``chunk`` of dataset ``name`` as it is stored now."""
    dataset = file[name]
    start = (chunk * dataset.chunks[0], *(0,) * (dataset.ndim - 1))
    file[checksums_name(name)][chunk] = checksum(dataset.id.read_direct_chunk(start)[1])


def chunk_addresses(dataset: h5py.Dataset) -> np.ndarray | None:
    """Where each chunk of ``dataset`` begins in the file (``int64``, in row order), when
    every chunk is stored once as its plain bytes of whole rows (as :func:`allocate` lays
    it out); else None (not chunked, virtual, filtered, a chunk missing or listed twice)."""
    if dataset.chunks is None or dataset.is_virtual or not len(dataset):
        return None
    if dataset.chunks[1:] != dataset.shape[1:] or dataset.id.get_create_plist().get_nfilters():
        return None
    rows = dataset.chunks[0]
    size = rows * dataset.dtype.itemsize * int(np.prod(dataset.shape[1:], dtype=np.int64))
    listing = np.full(-(-len(dataset) // rows), -1, dtype=np.int64)

    def note(info: h5py.h5d.StoreInfo) -> None:
        chunk = info.chunk_offset[0] // rows
        plain = (
            info.byte_offset is not None and info.size == size and not any(info.chunk_offset[1:])
        )
        if chunk < len(listing):
            listing[chunk] = info.byte_offset if plain and listing[chunk] == -1 else -2

    dataset.id.chunk_iter(note)
    return None if (listing < 0).any() else listing


def dataset_names(file: h5py.File) -> list[str]:
    """The datasets whose progress ``/progress`` records, in its order."""
    return list(json.loads(codec.attr(file[PROGRESS], "datasets", "[]")))


def read_progress(file: h5py.File) -> tuple[int, dict[str, int]]:
    """``(durable rows, {dataset: durable entries})`` of a format-3 store."""
    values = file[PROGRESS][()]
    return int(values[0]), dict(zip(dataset_names(file), map(int, values[1:]), strict=False))
