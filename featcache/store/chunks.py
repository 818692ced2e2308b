"""How many rows one HDF5 chunk of a store holds (about 1 MiB along N), and the chunk cache
to read a layer with."""

from __future__ import annotations

from collections.abc import Sequence

import h5py
import numpy as np

from featcache.store import codec

TARGET_CHUNK_BYTES = 1 << 20  # about 1 MiB per chunk: big sequential reads, small waste
MAX_META_CHUNK_ROWS = 4096  # rows per chunk of the 1-d datasets (index, ids, labels)
CACHE_FLOOR_BYTES = 4 << 20  # smallest chunk cache given to a filtered layer
CACHE_CHUNKS = 4  # whole chunks a filtered layer's cache holds, at least


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


def chunk_cache_for(chunk_bytes: int, filtered: bool, nbytes: int | None) -> tuple[int, int]:
    """``(nslots, nbytes)`` of the HDF5 chunk cache for one layer read row by row:
    ``nbytes`` when given, else by the rule below (``filtered``: read whole by HDF5)."""
    if nbytes is None:
        # HDF5 reads the selected rows of an unfiltered chunk straight from the file
        # unless the chunk fits in the cache; then it loads the whole chunk for one row.
        # On [50000, 512] float16 in 1 MiB chunks, random rows read 10x and sorted random
        # batches 2x slower with a 4 MiB cache than with none (scripts/bench_read.py).
        # A filtered chunk is always read whole, so there the cache only saves rereads.
        nbytes = max(CACHE_FLOOR_BYTES, CACHE_CHUNKS * chunk_bytes) if filtered else 0
    if nbytes == 0:
        return 0, 0
    # HDF5 suggests a prime number of hash slots, about 100 times the chunks that fit.
    return _next_prime(100 * max(nbytes // max(chunk_bytes, 1), 1)), nbytes


def _next_prime(n: int) -> int:
    while n < 2 or any(n % d == 0 for d in range(2, int(n**0.5) + 1)):
        n += 1
    return n
