"""Reading rows straight from a dataset's chunks in the file, checking each chunk once.

HDF5 checks a Fletcher-32 chunk on every read, and to check it reads the chunk whole: a
random row costs a whole chunk and its checksum, again and again. :class:`RawChunks`
checks each chunk of a dataset the first time it is read while its file is open (the
chunk's stored bytes read with ``preadv`` and summed by
:func:`~featcache.store.fletcher.fletcher32`), remembers where the chunk lies in the
file, and from then on reads the rows asked for straight from there. A file opened again
is checked again. A chunk that fails its checksum is read once more (a store still
being written may be rewriting it), then raises
:class:`~featcache.errors.CorruptStoreError` naming its rows, before any of its values
are returned. Chunks stored without any filter (``store.checksum: false``) are read the
same way, with nothing to check. :meth:`RawChunks.advise` tells the kernel which chunks
a read will need, so that a shuffle buffer's blocks come from the disk together.

Reads release the GIL, so two threads read (and check) on two cores where HDF5's reads
take turns. It applies to a chunked dataset with no filter but Fletcher-32 (featcache's
default) or none at all, in a file opened with HDF5's default (POSIX) driver on a system
with ``os.preadv``; anything else (compressed layers, virtual datasets), and a chunk not
stored as its plain bytes, is read by HDF5 as usual.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import h5py
import numpy as np

from featcache.store.chunks import row_bytes
from featcache.store.durable import as_marked, durable_entries
from featcache.store.fletcher import (
    CHECKSUM_BYTES,
    LISTED_TWICE,
    NOT_PLAIN,
    checksum_only,
    fletcher32,
    plain_chunk_addresses,
    stored_chunk_bytes,
)
from featcache.store.integrity import LISTED_TWICE_REASON, checked_twice, chunk_error

UNLOCATED = -2  # address of a chunk not looked up yet
BY_HDF5 = NOT_PLAIN  # a chunk HDF5 reads itself (not stored as its plain bytes)
_CAN_ADVISE = hasattr(os, "posix_fadvise")  # not on macOS or Windows


class RawChunks:
    """Row reads of one dataset straight from the file; with a checksum, each chunk is
    checked on its first read while the file is open."""

    def __init__(self, dataset: h5py.Dataset):
        self.checksum = checksum_only(dataset)
        self.chunk_rows = int(dataset.chunks[0])
        self.row_bytes = row_bytes(dataset)
        self.chunk_bytes = self.chunk_rows * self.row_bytes
        self.stored_bytes = stored_chunk_bytes(dataset, self.checksum)
        chunks = -(-len(dataset) // self.chunk_rows)
        self.addresses = np.full(chunks, UNLOCATED, dtype=np.int64)
        self.checked = np.zeros(chunks, dtype=bool)
        # The file's descriptor: it stays the same while the file is open, and an entry is
        # only found for the file it was made for (see raw_chunks).
        self.fd = int(h5py.h5i.get_file_id(dataset.id).get_vfd_handle())

    def read(self, dataset: h5py.Dataset, start: int, stop: int, out: np.ndarray) -> None:
        """Copy rows ``[start, stop)`` of ``dataset`` (the one this was made for) into
        ``out``: ``stop - start`` rows of its dtype and row shape, C-contiguous."""
        if not dataset.id.valid:  # its file was closed: let h5py say so
            dataset.read_direct(out, np.s_[start:stop])
            return
        chunks = range(start // self.chunk_rows, -(-stop // self.chunk_rows))
        if len(chunks) == 1:  # most reads of single rows: no array operation per read
            if self.addresses[chunks.start] == UNLOCATED:
                self._locate_all(dataset)
        elif (self.addresses[chunks.start : chunks.stop] == UNLOCATED).any():
            self._locate_all(dataset)
        for chunk in chunks:
            first = max(start, chunk * self.chunk_rows)
            last = min(stop, (chunk + 1) * self.chunk_rows)
            target = out[first - start : last - start]
            address = int(self.addresses[chunk])
            if address == LISTED_TWICE:
                raise chunk_error(dataset, chunk * self.chunk_rows, LISTED_TWICE_REASON)
            if address == BY_HDF5 or not target.flags.c_contiguous:
                dataset.read_direct(target, np.s_[first:last])
            elif self.checksum and not self.checked[chunk]:
                self.checked[chunk] = self._checked_read(
                    dataset, chunk, address, first, last, target
                )
            else:
                skip = (first - chunk * self.chunk_rows) * self.row_bytes
                _pread_into(self.fd, target, address + skip)

    def advise(self, dataset: h5py.Dataset, start: int, stop: int) -> None:
        """Ask the kernel to start reading the chunks that hold rows ``[start, stop)`` of
        ``dataset`` in the background. A buffer of a shuffled epoch asks for all its blocks
        at once, so a store read from the disk has them all in flight, not one or two; a
        chunk already in the page cache costs a lookup. Advice only: a system or file that
        refuses it is read as usual."""
        if not _CAN_ADVISE or not dataset.id.valid:
            return
        addresses = self.addresses[start // self.chunk_rows : -(-stop // self.chunk_rows)]
        if (addresses == UNLOCATED).any():  # an epoch reads every chunk: locate them all
            self._locate_all(dataset)
        for address in addresses[addresses >= 0].tolist():
            try:
                os.posix_fadvise(self.fd, address, self.stored_bytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    def _locate_all(self, dataset: h5py.Dataset) -> None:
        """Look up where every chunk lies, listing HDF5's chunk index once (a lookup by
        position costs a walk of the index per chunk, and would not see a chunk that the
        index lists twice)."""
        self.addresses[:] = plain_chunk_addresses(dataset, self.checksum)

    def _checked_read(
        self,
        dataset: h5py.Dataset,
        chunk: int,
        address: int,
        first: int,
        last: int,
        target: np.ndarray,
    ) -> bool:
        """Read chunk ``chunk`` whole from ``address`` with its checksum, check it, and
        copy its rows ``[first, last)`` into ``target``. Returns whether the whole chunk
        passed: in an incomplete store, the chunk its last mark falls inside may instead
        be as marked (:mod:`~featcache.store.durable`) when only durable rows are asked."""
        start = chunk * self.chunk_rows
        whole = last - first == self.chunk_rows  # the rows asked for fill the chunk
        data = target if whole else np.empty(self.chunk_bytes, dtype=np.uint8)
        checksum = np.empty(CHECKSUM_BYTES, dtype=np.uint8)
        passed = True

        def read_and_check() -> None:
            nonlocal passed
            _pread_into(self.fd, [data, checksum], address)
            expected = int.from_bytes(checksum.tobytes(), "little")
            found = fletcher32(data)
            if found == expected:
                return
            durable = durable_entries(dataset)
            if durable is not None and last <= durable:
                raw = data.reshape(-1).view(np.uint8)
                if as_marked(raw, expected, (durable - start) * self.row_bytes):
                    passed = False
                    return
            raise OSError(
                f"Fletcher-32 of the chunk at byte {address} of "
                f"{dataset.file.filename} is {found:#010x}, stored {expected:#010x}"
            )

        try:
            checked_twice(read_and_check)
        except OSError as exc:
            raise chunk_error(dataset, start, str(exc)) from exc
        if not whole:
            rows = data.view(dataset.dtype).reshape(self.chunk_rows, *dataset.shape[1:])
            target[...] = rows[first - start : last - start]
        return passed


MAX_TRACKED = 64  # datasets whose chunk addresses are remembered, most recent first

# Keyed by HDF5's serial number of the open file (never reused within a process; the
# same for every handle on a file while any is open) and the dataset's path, so a store
# read through a new h5py object each time (FeatureStore) checks each chunk once.
_OPEN: OrderedDict[tuple[tuple[int, int], str], RawChunks | None] = OrderedDict()
_OPEN_LOCK = threading.Lock()  # a shuffle buffer is read on two threads


def raw_chunks(dataset: h5py.Dataset) -> RawChunks | None:
    """The :class:`RawChunks` of this dataset in its open file, made on its first read
    (and forgotten after :data:`MAX_TRACKED` others); None when HDF5 reads it as usual."""
    key = (tuple(dataset.id.fileno), dataset.name)
    with _OPEN_LOCK:
        if key in _OPEN:
            _OPEN.move_to_end(key)
            return _OPEN[key]
        chunks = RawChunks(dataset) if reads_raw(dataset) else None
        _OPEN[key] = chunks
        if len(_OPEN) > MAX_TRACKED:
            _OPEN.popitem(last=False)
        return chunks


def reads_raw(dataset: h5py.Dataset) -> bool:
    """Whether :class:`RawChunks` reads ``dataset``'s rows straight from the file (and HDF5
    never reads its chunks whole for featcache, so it needs no chunk cache)."""
    if not hasattr(os, "preadv") or dataset.file.driver != "sec2":
        return False  # positioned reads into a buffer: POSIX systems only
    if dataset.chunks is None or dataset.is_virtual:
        return False
    if dataset.dtype.kind not in "biufS" or not dataset.dtype.isnative:
        return False  # variable-length or compound values, or bytes in another order
    filters = dataset.id.get_create_plist().get_nfilters()
    if filters and not checksum_only(dataset):
        return False  # compressed: HDF5 decodes it
    return tuple(dataset.chunks[1:]) == tuple(dataset.shape[1:])  # rows are contiguous


def _pread_into(fd: int, targets: np.ndarray | list[np.ndarray], offset: int) -> None:
    """Fill ``targets`` (C-contiguous arrays, one after the other) with the file's bytes
    from ``offset``."""
    views = [t.data.cast("B") for t in (targets if isinstance(targets, list) else [targets])]
    for view in views:
        done = 0
        while done < len(view):  # preadv may return fewer bytes than asked
            got = os.preadv(fd, [view[done:]], offset)
            if got == 0:
                raise OSError(f"unexpected end of file at byte {offset}")
            done += got
            offset += got
