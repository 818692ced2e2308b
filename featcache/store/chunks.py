"""How many rows one HDF5 chunk of a store holds: about 1 MiB of data along N."""

from __future__ import annotations

from collections.abc import Sequence

import h5py
import numpy as np

from featcache.store import codec

TARGET_CHUNK_BYTES = 1 << 20  # about 1 MiB per chunk: big sequential reads, small waste
MAX_META_CHUNK_ROWS = 4096  # rows per chunk of the 1-d datasets (index, ids, labels)


def chunk_rows_for(row_shape: Sequence[int], dtype: str, num_rows: int) -> int:
    """Rows per chunk so that one chunk of ``[num_rows, *row_shape]`` values of store
    dtype ``dtype`` holds about :data:`TARGET_CHUNK_BYTES`."""
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * codec.numpy_dtype(dtype).itemsize
    return int(max(1, min(num_rows, TARGET_CHUNK_BYTES // max(row_bytes, 1))))


def row_bytes(dataset: h5py.Dataset) -> int:
    """Bytes of one row (``dataset[i]``) as stored, at least 1."""
    return max(int(np.prod(dataset.shape[1:], dtype=np.int64)) * dataset.dtype.itemsize, 1)


def chunk_rows_of(dataset: h5py.Dataset) -> int:
    """Rows per chunk of ``dataset``; for an unchunked one (a virtual dataset over shards),
    the rows of a :data:`TARGET_CHUNK_BYTES` chunk."""
    if dataset.chunks is not None:
        return int(dataset.chunks[0])
    return max(TARGET_CHUNK_BYTES // row_bytes(dataset), 1)
