"""How many bytes a store takes on disk, and whether the filesystem under it has them."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from featcache.errors import FeatcacheError
from featcache.store import codec
from featcache.store.layout import META_BLOCK_BYTES, chunk_rows_for
from featcache.units import format_bytes

# HDF5's own bytes in a store, measured on stores written by StoreWriter: the superblock
# and root group, and per chunked dataset its object header (shape, type, featcache's
# attributes) and its chunk index (version-1 B-tree nodes of 64 entries).
FILE_METADATA_BYTES = 2400
DATASET_METADATA_BYTES = 800
BTREE_ENTRIES = 64
CHECKSUM_BYTES = 8  # one XXH3-64 per chunk, in /checksums/<dataset>


@dataclasses.dataclass(frozen=True)
class LayerSize:
    """One stored layer: ``shape`` of a row (of a token, for a per-token layer) and the
    store dtype its values are kept in."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    per_token: bool = False

    @property
    def item_bytes(self) -> int:
        """Bytes of one row (one token) as stored."""
        return int(np.prod(self.shape, dtype=np.int64)) * codec.numpy_dtype(self.dtype).itemsize


def store_bytes(
    rows: int,
    layers: Sequence[LayerSize],
    *,
    ids_width: int,
    has_labels: bool = True,
    tokens: int | None = None,
    token_ids: bool = False,
    chunk_rows: int | None = None,
    checksum: bool = True,
    row_column_bytes: int = 0,
    attrs_bytes: int = 0,
) -> int:
    """Bytes on disk of the finished, uncompressed store that
    :class:`~featcache.store.StoreWriter` writes for ``rows`` rows of ``layers``.

    What it counts, as the writer lays the store out:

    - every chunked dataset allocated in full when the file is created, in whole chunks
      (``ceil(length / chunk)`` chunks of ``chunk`` rows) and, when ``checksum``, its
      ``/checksums`` array of 8 bytes per chunk: a dense layer ``[rows, *shape]`` and a
      per-token layer ``[tokens, *shape]``, chunked as
      :func:`~featcache.store.layout.chunk_rows_for` says (or ``chunk_rows``); ``/index``
      and ``/labels`` (int64) and ``/ids`` (``ids_width`` bytes each) in the chunks of an
      8-byte row; for per-token layers ``/offsets`` (``rows + 1`` int64) and, with
      ``token_ids``, ``/token_ids`` (int64 per token); and ``/progress`` (8 bytes for the
      rows and one per dataset);
    - ``row_column_bytes`` per row of the columns a source records when the store
      completes (a text source's ``num_tokens`` and ``truncated``: 9 bytes);
    - HDF5's own metadata, estimated: a fixed part per file and per dataset, the chunk
      index (a B-tree node per 64 chunks), and ``attrs_bytes`` of attribute text, in the
      whole blocks of :data:`~featcache.store.layout.META_BLOCK_BYTES` HDF5 takes for it.

    Not counted: samples skipped during the run (the store is sized for every row and
    keeps its size), the ``/skipped`` records, and compression (a compressed store is a
    copy written after the run; this is the size of the store before that copy).
    Dense layers are exact up to the metadata estimate; per-token layers are as exact as
    the token count ``tokens`` is.
    """
    meta_chunk = chunk_rows or chunk_rows_for((), 8, rows)
    datasets: list[tuple[int, int, int, int]] = []  # length, chunk rows, row bytes, rank
    datasets.append((rows, meta_chunk, 8, 1))  # index
    datasets.append((rows, meta_chunk, max(1, ids_width), 1))  # ids
    if has_labels:
        datasets.append((rows, meta_chunk, 8, 1))
    token_rows = max(tokens or 0, 1)
    if any(layer.per_token for layer in layers):
        datasets.append((rows + 1, meta_chunk, 8, 1))  # offsets
        if token_ids:
            datasets.append((token_rows, meta_chunk, 8, 1))
    for layer in layers:
        length = token_rows if layer.per_token else rows
        chunk = layer_chunk_rows(layer, length, chunk_rows)
        datasets.append((length, chunk, layer.item_bytes, 1 + len(layer.shape)))
    data = 8 * (1 + len(datasets)) + rows * row_column_bytes  # /progress, the columns
    metadata = FILE_METADATA_BYTES + attrs_bytes
    for length, chunk, row_bytes, rank in datasets:
        chunks = math.ceil(length / min(chunk, length))
        data += dataset_bytes(length, chunk, row_bytes, checksum)
        metadata += DATASET_METADATA_BYTES + _btree_bytes(chunks, rank)
        if checksum:
            metadata += DATASET_METADATA_BYTES  # its /checksums array's header
    # HDF5 takes the space for metadata in whole blocks of META_BLOCK_BYTES.
    return data + META_BLOCK_BYTES * math.ceil(metadata / META_BLOCK_BYTES)


def layer_chunk_rows(layer: LayerSize, length: int, chunk_rows: int | None = None) -> int:
    """Rows (tokens) per chunk of ``layer``'s dataset of ``length`` rows (tokens)."""
    itemsize = codec.numpy_dtype(layer.dtype).itemsize
    return min(chunk_rows or chunk_rows_for(layer.shape, itemsize, length), length)


def dataset_bytes(length: int, chunk: int, row_bytes: int, checksum: bool = True) -> int:
    """Bytes of a chunked dataset of ``length`` rows of ``row_bytes``, allocated in whole
    chunks of ``chunk`` rows, and of its chunk checksums when ``checksum``."""
    chunk = min(chunk, length)
    chunks = math.ceil(length / chunk)
    return chunks * (chunk * row_bytes + (CHECKSUM_BYTES if checksum else 0))


def _btree_bytes(chunks: int, rank: int) -> int:
    """Bytes of the version-1 B-tree that indexes ``chunks`` chunks of a dataset of
    ``rank`` dimensions: nodes of 64 entries, each keyed by the chunk's size, filter mask
    and ``rank + 1`` offsets."""
    key = 8 + 8 * (rank + 1)
    node = 24 + (BTREE_ENTRIES + 1) * key + BTREE_ENTRIES * 8
    leaves = math.ceil(chunks / BTREE_ENTRIES)
    return node * (leaves + (leaves > 1))


def bytes_on_disk(path: str | os.PathLike) -> int:
    """Bytes the file at ``path`` occupies (its allocated blocks: a store's unwritten
    rows take none); 0 when there is no such file."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return 0
    blocks = getattr(stat, "st_blocks", None)
    return stat.st_size if blocks is None else min(stat.st_size, blocks * 512)


def free_bytes(path: str | os.PathLike) -> tuple[int, Path]:
    """Free bytes on the filesystem that will hold ``path`` (a folder that may not exist
    yet), and the existing folder they were measured at."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free, folder


def require_space(needed: int, where: Sequence[Path], option: str) -> None:
    """Refuse a run whose stores at ``where`` need ``needed`` more bytes than the
    filesystem under them has free. ``option`` names the way to go ahead anyway.

    Raises:
        FeatcacheError: one line giving what the run needs and what is free.
    """
    free, folder = free_bytes(where[0].parent)
    if needed <= free:
        return
    names = ", ".join(str(path) for path in where)
    raise FeatcacheError(
        f"not enough disk space for {names}: the run needs about {format_bytes(needed)} and "
        f"{format_bytes(free)} is free on {folder}; free some space, write elsewhere "
        f"(output.dir), or {option} to run anyway"
    )
