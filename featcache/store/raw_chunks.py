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
with ``os.preadv``; anything else (compressed layers), and a chunk not stored as its plain
bytes, is read by HDF5 as usual. A store combined from torchrun shards, whose layers are
virtual datasets over whole datasets of the shard files, is read the same way from each
shard (:class:`SourcedChunks`).
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from featcache.errors import CorruptStoreError
from featcache.store.chunks import row_bytes
from featcache.store.durable import chunk_as_marked, durable_entries
from featcache.store.fletcher import (
    CHECKSUM_BYTES,
    LISTED_TWICE,
    NOT_PLAIN,
    checksum_only,
    fletcher32,
    plain_chunk_addresses,
    stored_chunk_bytes,
)
from featcache.store.integrity import (
    LISTED_TWICE_REASON,
    BadChunk,
    checked_twice,
    corrupt_store_error,
    whole_sources,
)

UNLOCATED = -2  # address of a chunk not looked up yet
BY_HDF5 = NOT_PLAIN  # a chunk HDF5 reads itself (not stored as its plain bytes)
_CAN_ADVISE = hasattr(os, "posix_fadvise")  # not on macOS or Windows


class RawChunks:
    """Row reads of one dataset straight from the file; with a checksum, each chunk is
    checked on its first read while the file is open.

    With ``located``, every chunk is located at once; ``own_file`` (the path of
    ``dataset``'s file, implying ``located``) makes it read through a descriptor of its
    own, closed when it is forgotten. Both serve the sources of a combined dataset
    (:class:`SourcedChunks`), read through the combined dataset and, for a source in
    another file, without an HDF5 handle on that file kept open."""

    def __init__(
        self,
        dataset: h5py.Dataset,
        own_file: str | os.PathLike | None = None,
        located: bool = False,
    ):
        self.checksum = checksum_only(dataset)
        self.chunk_rows = int(dataset.chunks[0])
        self.rows = len(dataset)
        self.row_bytes = row_bytes(dataset)
        self.chunk_bytes = self.chunk_rows * self.row_bytes
        self.stored_bytes = stored_chunk_bytes(dataset, self.checksum)
        chunks = -(-len(dataset) // self.chunk_rows)
        self.addresses = np.full(chunks, UNLOCATED, dtype=np.int64)
        self.checked = np.zeros(chunks, dtype=bool)
        self.file_name = dataset.file.filename
        if located or own_file is not None:
            self._locate_all(dataset)
        if own_file is None:
            # The file's descriptor: it stays the same while the file is open, and an entry
            # is only found for the file it was made for (see raw_chunks).
            self.fd = int(h5py.h5i.get_file_id(dataset.id).get_vfd_handle())
        else:
            self.fd = os.open(own_file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            weakref.finalize(self, os.close, self.fd)

    def read(
        self, dataset: h5py.Dataset, start: int, stop: int, out: np.ndarray, offset: int = 0
    ) -> None:
        """Copy rows ``[start, stop)`` of the dataset this was made for into ``out``:
        ``stop - start`` rows of its dtype and row shape, C-contiguous. ``dataset`` is
        that dataset, or, with ``offset``, the virtual dataset it fills from row
        ``offset`` on: what HDF5 reads the rows of a chunk not stored plain from, and
        whose rows a chunk that fails is named by."""
        if not dataset.id.valid:  # its file was closed: let h5py say so
            dataset.read_direct(out, np.s_[offset + start : offset + stop])
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
                raise self._error(dataset, offset, chunk, LISTED_TWICE_REASON)
            if address == BY_HDF5 or not target.flags.c_contiguous:
                dataset.read_direct(target, np.s_[offset + first : offset + last])
            elif self.checksum and not self.checked[chunk]:
                self.checked[chunk] = self._checked_read(
                    dataset, offset, chunk, address, first, last, target
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
        offset: int,
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
            durable = durable_entries(dataset)  # None for a virtual dataset
            if durable is not None and last <= durable:
                raw = data.reshape(-1).view(np.uint8)
                if chunk_as_marked(raw, expected, start, durable, self.chunk_rows):
                    passed = False
                    return
            raise OSError(
                f"Fletcher-32 of the chunk at byte {address} of {self.file_name} is "
                f"{found:#010x}, stored {expected:#010x}"
            )

        try:
            checked_twice(read_and_check)
        except OSError as exc:
            raise self._error(dataset, offset, chunk, str(exc)) from exc
        if not whole:
            rows = data.view(dataset.dtype).reshape(self.chunk_rows, *dataset.shape[1:])
            target[...] = rows[first - start : last - start]
        return passed

    def _error(
        self, dataset: h5py.Dataset, offset: int, chunk: int, message: str
    ) -> CorruptStoreError:
        """The error for chunk ``chunk``, named by its rows of ``dataset`` (see
        :meth:`read`)."""
        start = chunk * self.chunk_rows
        stop = min(start + self.chunk_rows, self.rows)
        key = dataset.name.lstrip("/")
        return corrupt_store_error(dataset, BadChunk(key, offset + start, offset + stop, message))


@dataclass(frozen=True)
class _Part:
    """One source of a combined dataset: the reads of its chunks, which fill the
    combined dataset's rows ``[first, stop)``."""

    first: int
    stop: int
    chunks: RawChunks


class SourcedChunks:
    """Row reads of a virtual dataset made of whole datasets, each filling one block of its
    rows (a layer of a store combined from torchrun shards), straight from each source's
    chunks with a :class:`RawChunks` of its own. A chunk that fails is named by the
    combined dataset's rows; one not stored plain is read by HDF5 through the combined
    dataset.

    Read through HDF5's virtual dataset instead, every read of a chunk would check it
    whole again, as plain h5py does (a shuffled DataLoader epoch ran about 20 times
    slower), and each chunk would be found by HDF5's lookup by position rather than its
    listing of the chunk index, which featcache's reads of a single file follow."""

    def __init__(self, parts: list[_Part]):
        self.parts = parts
        self._firsts = [part.first for part in parts]

    @classmethod
    def open(cls, dataset: h5py.Dataset) -> SourcedChunks | None:
        """The reads of virtual ``dataset``'s sources, each opened beside the file that
        names it, as HDF5 finds them; None when they cannot all be read straight from
        their files (another mapping, a compressed source, a shard missing), and HDF5
        reads it as usual, and says what is wrong."""
        try:
            sources = whole_sources(dataset)
            if sources is None:
                return None
            parts = []
            for source in sources:
                if source.file_name == ".":
                    found = dataset.file[source.name]
                    if not reads_raw(found):
                        return None
                    chunks = RawChunks(found, located=True)
                    parts.append(_Part(source.first, source.stop, chunks))
                    continue
                path = Path(dataset.file.filename).parent / source.file_name
                with h5py.File(path, "r", rdcc_nbytes=0) as file:
                    found = file[source.name]
                    if not reads_raw(found):
                        return None
                    parts.append(_Part(source.first, source.stop, RawChunks(found, path)))
        except (OSError, KeyError):
            return None
        return cls(parts)

    def read(self, dataset: h5py.Dataset, start: int, stop: int, out: np.ndarray) -> None:
        """Copy rows ``[start, stop)`` of the combined ``dataset`` into ``out``, as
        :meth:`RawChunks.read` does."""
        for part, first, last in self._spans(start, stop):
            target = out[first - start : last - start]
            part.chunks.read(dataset, first - part.first, last - part.first, target, part.first)

    def advise(self, dataset: h5py.Dataset, start: int, stop: int) -> None:
        """:meth:`RawChunks.advise` for the chunks of each source that hold rows
        ``[start, stop)`` of the combined ``dataset`` (every one was located when it was
        opened)."""
        for part, first, last in self._spans(start, stop):
            part.chunks.advise(dataset, first - part.first, last - part.first)

    def _spans(self, start: int, stop: int) -> list[tuple[_Part, int, int]]:
        """The sources holding rows ``[start, stop)``, each with its share of them."""
        spans = []
        at = max(bisect.bisect_right(self._firsts, start) - 1, 0)
        for part in self.parts[at:]:
            if part.first >= stop:
                break
            first, last = max(start, part.first), min(stop, part.stop)
            if first < last:
                spans.append((part, first, last))
        return spans


MAX_TRACKED = 64  # datasets whose chunk addresses are remembered, most recent first

# Keyed by HDF5's serial number of the open file (never reused within a process; the
# same for every handle on a file while any is open) and the dataset's path, so a store
# read through a new h5py object each time (FeatureStore) checks each chunk once.
_OPEN: OrderedDict[tuple[tuple[int, int], str], RawChunks | SourcedChunks | None] = OrderedDict()
_OPEN_LOCK = threading.Lock()  # a shuffle buffer is read on two threads


def raw_chunks(dataset: h5py.Dataset) -> RawChunks | SourcedChunks | None:
    """The :class:`RawChunks` (:class:`SourcedChunks` for a combined store's virtual
    dataset) of this dataset in its open file, made on its first read (and forgotten after
    :data:`MAX_TRACKED` others, or once its file is closed); None when HDF5 reads it as
    usual."""
    key = (tuple(dataset.id.fileno), dataset.name)
    with _OPEN_LOCK:
        if key in _OPEN:
            _OPEN.move_to_end(key)
            return _OPEN[key]
        chunks: RawChunks | SourcedChunks | None = None
        if reads_raw(dataset):
            chunks = RawChunks(dataset)
        elif dataset.is_virtual:
            chunks = SourcedChunks.open(dataset)
        _forget_closed_files()
        _OPEN[key] = chunks
        if len(_OPEN) > MAX_TRACKED:
            _OPEN.popitem(last=False)
        return chunks


def _forget_closed_files() -> None:
    """Drop the entries of files no longer open: their serial numbers are never seen
    again, and a combined store's entry holds descriptors of its shard files."""
    open_files = {
        tuple(file_id.fileno)
        for file_id in h5py.h5f.get_obj_ids(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
    }
    for key in [key for key in _OPEN if key[0] not in open_files]:
        del _OPEN[key]


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
