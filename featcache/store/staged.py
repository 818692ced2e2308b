"""One dataset's staging buffer (rows gathered into whole chunks, written as stored), and
reading back the durable entries of a dataset a stopped run was writing."""

from __future__ import annotations

import h5py
import numpy as np

from featcache.store.durable import durable_entries, marked_chunk
from featcache.store.fletcher import CHECKSUM_BYTES, checksum_bytes, checksum_only
from featcache.store.integrity import chunk_error


class Staged:
    """One dataset plus a one-chunk staging buffer; a checksummed dataset is written a
    whole chunk at a time, a resume that starts inside a chunk included.

    ``start`` is the first row (or token, for a ``per_token`` dataset) to write. A dataset
    indexed by row may hold ``lead`` entries before row 0 (``/offsets``: its leading 0).

    A checksummed dataset stages its rows in front of four spare bytes: each chunk gets its
    Fletcher-32 checksum there (:mod:`~featcache.store.fletcher`, bit-exact with HDF5's
    filter and a few times faster) and is written whole, as it is stored, with one
    ``write_direct_chunk``, its entries not yet staged zeroed (as in a new store). Such a
    dataset is never read back through HDF5's filter while it is written: a resume that
    starts inside a chunk stages the chunk's entries before ``start`` again from its stored
    bytes (see :func:`stored_entries`, which checks them against the entries the stopped
    run's last progress mark made durable, :func:`~featcache.store.durable.durable_entries`).

    :meth:`write_staged` writes the rows of a chunk still filling (for a progress mark)
    and keeps them staged: the chunk is written again, whole, once it fills.
    """

    def __init__(
        self,
        dataset: h5py.Dataset,
        start: int,
        *,
        lead: int = 0,
        per_token: bool = False,
    ):
        self.dataset = dataset
        self.lead = lead
        self.per_token = per_token
        self.item_shape = tuple(dataset.shape[1:])
        self.chunk_rows = dataset.chunks[0] if dataset.chunks else len(dataset)
        self.direct = checksum_only(dataset)
        shape = (self.chunk_rows, *self.item_shape)
        self.chunk_bytes = int(np.prod(shape, dtype=np.int64)) * dataset.dtype.itemsize
        self.entry_bytes = self.chunk_bytes // self.chunk_rows
        spare = CHECKSUM_BYTES if self.direct else 0
        self.stored = np.empty(self.chunk_bytes + spare, dtype=np.uint8)
        self.buffer = self.stored[: self.chunk_bytes].view(dataset.dtype).reshape(shape)
        self.filled = 0  # entries in the buffer
        self.flushed = start + lead  # entries written to the file and out of the buffer
        self.written = self.flushed  # entries written to the file, staged ones included
        if self.direct and self.flushed % self.chunk_rows:
            self._stage_again()

    def _stage_again(self) -> None:
        """Stage the entries of the chunk that ``flushed`` falls inside, from the chunk's
        stored bytes (of which the entries the last progress mark made durable are
        checked; all of those before ``flushed`` when that mark cannot be read)."""
        first = self.flushed - self.flushed % self.chunk_rows
        count = self.flushed - first
        durable = durable_entries(self.dataset)
        durable = self.flushed if durable is None else durable
        self.buffer[:count] = stored_entries(self.dataset, first, self.flushed, durable)
        self.flushed, self.filled = first, count

    def push(self, rows: np.ndarray) -> None:
        start = 0
        while start < len(rows):
            room = self.chunk_rows - (self.flushed + self.filled) % self.chunk_rows
            take = min(room, len(rows) - start)
            self.buffer[self.filled : self.filled + take] = rows[start : start + take]
            self.filled += take
            start += take
            if (self.flushed + self.filled) % self.chunk_rows == 0:
                self.flush()

    def flush(self) -> None:
        """Write the staged entries; those of a checksummed chunk that is not full yet stay
        staged, so that the chunk is written whole again as it fills."""
        if not self.filled:
            return
        if self.direct and self.filled < self.chunk_rows:
            self.write_staged()
            return
        if self.direct:
            self._write_chunk()
        else:
            self.dataset[self.flushed : self.flushed + self.filled] = self.buffer[: self.filled]
        self.flushed += self.filled
        self.filled = 0
        self.written = self.flushed

    def write_staged(self) -> None:
        """Write the entries staged so far to the file, keeping them in the buffer.

        A checksummed dataset writes the chunk whole (see :meth:`_write_chunk`); others
        write the staged entries through HDF5.
        """
        end = self.flushed + self.filled
        if end == self.written:
            return
        if self.direct:
            self._write_chunk()
        else:
            self.dataset[self.flushed : end] = self.buffer[: self.filled]
        self.written = end

    def _write_chunk(self) -> None:
        """Write the buffer as the whole chunk at ``flushed`` (a chunk's first entry),
        entries not staged zeroed, checksum appended."""
        assert self.flushed % self.chunk_rows == 0, "staged entries start a chunk"
        self.stored[self.filled * self.entry_bytes : self.chunk_bytes] = 0  # bytes, not values
        checksum = checksum_bytes(self.stored[: self.chunk_bytes])
        self.stored[self.chunk_bytes :] = np.frombuffer(checksum, dtype=np.uint8)
        write_chunk(self.dataset, self.flushed, self.stored)


def write_chunk(dataset: h5py.Dataset, row: int, stored: np.ndarray) -> None:
    """Write the chunk that starts at ``row`` of ``dataset`` as stored (filters applied)."""
    dataset.id.write_direct_chunk((row, *(0 for _ in dataset.shape[1:])), stored)


def read_durable(
    dataset: h5py.Dataset, start: int, stop: int, durable: int | None = None
) -> np.ndarray:
    """Entries ``[start, stop)`` of a dataset that a stopped run was writing, of which the
    first ``durable`` entries (default ``stop``, at least ``stop``) were durable.

    The chunk that the durable mark falls inside is read from its stored bytes (see
    :func:`stored_entries`); chunks before it through HDF5, which checks them.
    """
    durable = stop if durable is None else durable
    chunk_rows = dataset.chunks[0] if dataset.chunks else 0
    if not chunk_rows or durable % chunk_rows == 0 or not checksum_only(dataset):
        return dataset[start:stop]
    first = durable - durable % chunk_rows  # the chunk holding the mark
    if stop <= first:
        return dataset[start:stop]
    head = dataset[start:first] if start < first else dataset[0:0]
    tail = stored_entries(dataset, first, stop, durable)[max(start - first, 0) :]
    return np.concatenate([head, tail])


def stored_entries(dataset: h5py.Dataset, first: int, stop: int, durable: int) -> np.ndarray:
    """Entries ``[first, stop)`` of the checksummed chunk that starts at entry ``first``,
    read from its stored bytes, where the dataset's first ``durable`` entries were durable.

    The chunk passes its checksum, or it holds the durable mark and a run died while
    rewriting it, and it is as the mark wrote it (:mod:`~featcache.store.durable`). A
    chunk that is neither is refused as corrupted
    (:class:`~featcache.errors.CorruptStoreError`).
    """
    entries = marked_chunk(dataset, first, durable)
    if entries is None:
        reason = "fails its checksum, and its durable entries do not match it either"
        raise chunk_error(dataset, first, reason)
    return entries[: stop - first]
