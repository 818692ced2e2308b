"""Rows of a dataset read into memory, by ranges or by row numbers in any order: through
featcache's own chunk reads where it can (each checksummed chunk checked once), through
HDF5 otherwise, a bad chunk named."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import h5py
import numpy as np
import torch

from featcache.store import codec
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
        if rows <= 0:  # a row of zero tokens
            continue
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


def row_numbers(rows: Sequence[int] | np.ndarray, num_rows: int) -> np.ndarray:
    """``rows`` as int64 row numbers in ``[0, num_rows)``; negative ones count from the end.

    Raises :class:`IndexError` for a row outside the ``num_rows`` rows, and
    :class:`TypeError` for one that is not a whole number (``1.5``, ``True``, ``"3"``).
    """
    given = np.asarray(rows)
    if given.size and given.dtype.kind not in "iu":
        raise TypeError(
            f"row numbers must be integers, got {given.reshape(-1)[0].item()!r} "
            f"({given.dtype}); index with int rows"
        )
    rows = given.astype(np.int64).reshape(-1)
    rows = np.where(rows < 0, rows + num_rows, rows)
    if len(rows) and (rows.min() < 0 or rows.max() >= num_rows):
        raise IndexError(f"row index out of range for a dataset of {num_rows} rows")
    return rows


def read_rows(dataset: h5py.Dataset, rows: slice | np.ndarray) -> torch.Tensor:
    """Rows of a features dataset as a tensor ``[n, *shape]`` of its store dtype.

    ``rows`` is a slice (with a positive step) or int64 row numbers in range, in any order
    and with repeats: those are read once each in increasing order, one slice per run of
    consecutive rows, and put back in the order asked. bfloat16 rows come back as
    ``torch.bfloat16`` (see :mod:`~featcache.store.codec`). A chunk that fails its
    checksum raises :class:`~featcache.errors.CorruptStoreError` naming its rows.
    """
    if isinstance(rows, slice):
        start, stop, step = rows.indices(len(dataset))
        if step == 1:
            array = np.empty((max(stop - start, 0), *dataset.shape[1:]), dtype=dataset.dtype)
            read_runs(dataset, [(start, stop)] if stop > start else [], array)
            return codec.decode(array, codec.attr(dataset, "dtype", ""))
        read = functools.partial(dataset.__getitem__, rows)
        array = np.ascontiguousarray(read_or_explain(dataset, range(start, stop, step), read))
    else:
        unique, inverse = np.unique(rows, return_inverse=True)
        array = np.empty((len(unique), *dataset.shape[1:]), dtype=dataset.dtype)
        read_runs(dataset, _runs(unique), array)
        if not np.array_equal(unique, rows):
            array = array[inverse.reshape(-1)]
    return codec.decode(array, codec.attr(dataset, "dtype", ""))


def read_token_rows(
    dataset: h5py.Dataset, offsets: np.ndarray, rows: np.ndarray
) -> tuple[torch.Tensor, np.ndarray]:
    """The tokens of ``rows`` (int64 row numbers, any order) of a per-token dataset whose
    row ``i`` is ``offsets[i]:offsets[i + 1]``: ``(values [sum T, ...], offsets [n + 1])``,
    the rows in the order asked. The file is read once per run of consecutive rows."""
    unique, inverse = np.unique(rows, return_inverse=True)
    counts = offsets[unique + 1] - offsets[unique]
    packed = np.empty((int(counts.sum()), *dataset.shape[1:]), dtype=dataset.dtype)
    spans = [(int(offsets[a]), int(offsets[b])) for a, b in _runs(unique)]
    read_runs(dataset, spans, packed)
    starts = np.concatenate([[0], np.cumsum(counts)])
    if not np.array_equal(unique, rows):  # put back in the order asked
        order = inverse.reshape(-1)
        pieces = [packed[starts[j] : starts[j + 1]] for j in order]
        packed = np.concatenate(pieces) if pieces else packed[:0]
        counts = counts[order]
        starts = np.concatenate([[0], np.cumsum(counts)])
    return codec.decode(packed, codec.attr(dataset, "dtype", "")), starts.astype(np.int64)


def _runs(rows: np.ndarray) -> Iterable[tuple[int, int]]:
    """``[start, stop)`` of each run of consecutive numbers in sorted unique ``rows``."""
    if not len(rows):
        return ()
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.r_[0, breaks]].tolist()
    stops = (rows[np.r_[breaks - 1, len(rows) - 1]] + 1).tolist()
    return zip(starts, stops, strict=True)
