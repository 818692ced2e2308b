"""Row ranges of a dataset read into memory: through featcache's own chunk reads where it
can (each checksummed chunk checked once), through HDF5 otherwise, a bad chunk named."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import h5py
import numpy as np

from featcache.store.integrity import read_or_explain
from featcache.store.raw_chunks import raw_chunks

# A run of rows at least this big is read straight into its destination (read_direct);
# a smaller one through h5py's fast slice reader, whose calls cost several times less.
DIRECT_READ_BYTES = 256 << 10


def read_runs(
    dataset: h5py.Dataset, runs: Iterable[tuple[int, int]], out: np.ndarray, at: int = 0
) -> None:
    """Copy the row ranges ``[start, stop)`` of ``dataset`` into ``out``, one after the
    other from row ``at``. ``out`` has the dataset's numpy dtype (``uint16`` for bfloat16:
    :func:`~featcache.store.codec.as_array` of a bfloat16 tensor). A chunk that fails its
    checksum raises :class:`~featcache.errors.CorruptStoreError` naming its rows."""
    row_bytes = max(out.dtype.itemsize * int(np.prod(out.shape[1:], dtype=np.int64)), 1)
    direct_rows = max(DIRECT_READ_BYTES // row_bytes, 1)
    raw = raw_chunks(dataset)
    for start, stop in runs:
        rows = stop - start
        try:
            if raw is not None:
                raw.read(dataset, start, stop, out[at : at + rows])
            elif rows >= direct_rows:
                dataset.read_direct(out, np.s_[start:stop], np.s_[at : at + rows])
            else:
                out[at : at + rows] = dataset[start:stop]
        except OSError:  # read once more through HDF5, or have the bad chunk named
            into = out[at : at + rows]
            read_or_explain(
                dataset,
                range(start, stop),
                functools.partial(_copy_rows, dataset, start, stop, into),
            )
        at += rows


def _copy_rows(dataset: h5py.Dataset, start: int, stop: int, into: np.ndarray) -> None:
    into[...] = dataset[start:stop]


def read_head(dataset: h5py.Dataset, rows: int) -> np.ndarray:
    """The first ``rows`` rows of a 1-d dataset (labels, index, ids, skip records), read
    as the features are: chunks found through HDF5's listing of the chunk index, not its
    lookup by position, which a damaged key in the index's B-tree (the part the listing
    does not report) sends astray, so that HDF5 reads such a chunk as never written."""
    out = np.empty((rows,), dtype=dataset.dtype)
    read_runs(dataset, [(0, rows)] if rows else [], out)
    return out


def read_text_head(dataset: h5py.Dataset, rows: int) -> list[str]:
    """:func:`read_head` of a dataset of fixed-length UTF-8 text (ids, skip records), as
    ``str``."""
    return [raw.decode("utf-8") for raw in read_head(dataset, rows)]
