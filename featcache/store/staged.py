"""One dataset's staging buffer: rows gathered into whole chunks, written as stored."""

from __future__ import annotations

import h5py
import numpy as np

from featcache.store.fletcher import CHECKSUM_BYTES, checksum_bytes, checksum_only


class Staged:
    """One dataset plus a one-chunk staging buffer; writes whole chunks (the first write
    after a resume may complete a chunk that was partly written).

    ``start`` is the first row (or token, for a ``per_token`` dataset) to write. A dataset
    indexed by row may hold ``lead`` entries before row 0 (``/offsets``: its leading 0).

    A checksummed dataset stages its rows in front of four spare bytes: a whole chunk gets
    its Fletcher-32 checksum there (:mod:`~featcache.store.fletcher`, bit-exact with
    HDF5's filter and a few times faster) and is written as it is stored, with one
    ``write_direct_chunk``. Partial chunks go through HDF5's filter.

    :meth:`write_staged` writes the rows of a chunk still filling (for a progress mark)
    and keeps them staged: the chunk is written again, whole, once it fills.
    """

    def __init__(
        self, dataset: h5py.Dataset, start: int, *, lead: int = 0, per_token: bool = False
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
        if not self.filled:
            return
        if self.direct and self.filled == self.chunk_rows:  # a whole chunk, aligned
            self._write_chunk()
        else:
            self.dataset[self.flushed : self.flushed + self.filled] = self.buffer[: self.filled]
        self.flushed += self.filled
        self.filled = 0
        self.written = self.flushed

    def write_staged(self) -> None:
        """Write the entries staged so far to the file, keeping them in the buffer.

        A chunk that starts at the buffer's first entry is written whole and as stored,
        its entries not yet staged zeroed (as in a new store), so no filter reads it back;
        other staged entries go through HDF5's filter.
        """
        end = self.flushed + self.filled
        if end == self.written:
            return
        if self.direct and self.flushed % self.chunk_rows == 0:
            self.stored[self.filled * self.entry_bytes : self.chunk_bytes] = 0  # bytes, not values
            self._write_chunk()
        else:
            self.dataset[self.flushed : end] = self.buffer[: self.filled]
        self.written = end

    def _write_chunk(self) -> None:
        """Write the buffer as the whole chunk at ``flushed``, checksum appended."""
        checksum = checksum_bytes(self.stored[: self.chunk_bytes])
        self.stored[self.chunk_bytes :] = np.frombuffer(checksum, dtype=np.uint8)
        write_chunk(self.dataset, self.flushed, self.stored)


def write_chunk(dataset: h5py.Dataset, row: int, stored: np.ndarray) -> None:
    """Write the chunk that starts at ``row`` of ``dataset`` as stored (filters applied)."""
    dataset.id.write_direct_chunk((row, *(0 for _ in dataset.shape[1:])), stored)
