"""Reading rows: plain chunks through a memory map, others through HDF5, each chunk checked
against its checksum the first time it is read while its file is open.

Plain chunks (every dataset of an uncompressed format-3 store) are read through a memory
map of the file: a row costs a copy out of the page cache, a random batch one
``numpy.take``, a chunk's check a hash of its mapped bytes. A compressed layer, and a
format-2 store, are read by HDF5 (which checks format-2 chunks itself, Fletcher-32, on
every read). A chunk that fails raises :class:`~featcache.errors.CorruptStoreError`
naming the layer and rows before any of its values are returned. A store combined from
torchrun shards is read from each shard so, its rows named as the combined store's.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from featcache.errors import CorruptStoreError, FeatcacheError, first_line
from featcache.store import codec
from featcache.store.layout import (
    LISTED_TWICE,
    checksum,
    checksums_name,
    chunk_addresses,
    chunk_listing,
    segments,
)
from featcache.store.paths import open_readonly

FIX = "re-extract it (featcache extract <config> --overwrite) or restore it from a copy"


class Chunks:
    """What is known of a dataset while its file is open: its chunks' checksums, which
    passed, where its rows are mapped. Nothing of HDF5: the file closes with its handles."""

    def __init__(self, dataset: h5py.Dataset):
        self.length = len(dataset)
        self.chunk_rows = dataset.chunks[0] if dataset.chunks else max(self.length, 1)
        chunks = -(-self.length // self.chunk_rows)
        self.checked = np.zeros(chunks, dtype=bool)
        sums = dataset.file.get(checksums_name(dataset.name))
        self.sums = None if sums is None or dataset.is_virtual else sums[()]
        if self.sums is not None and len(self.sums) < chunks:
            self.sums = None  # not a format-3 checksum list: nothing to check against
        # Runs of chunks lying back to back, each (first row, array over the mapping, the
        # padding of its last chunk included). A chunk the index lists twice cannot be
        # trusted (which copy HDF5 reads depends on the lookup), nor any of an index that
        # cannot be read.
        self.index_error, listed = "", None
        try:
            self.addresses, self.mapped, self.map = _mapped(dataset)
            if self.addresses is None and dataset.chunks:
                listed = chunk_listing(dataset)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            self.addresses, self.mapped, self.map = None, [], None
            self.index_error = f"its chunk index cannot be read: {first_line(exc)}"
        self.firsts = [first for first, _ in self.mapped]
        self.twice = (
            set() if listed is None else set(np.flatnonzero(listed == LISTED_TWICE).tolist())
        )


class Rows:
    """Row reads of ``dataset`` (``chunks``: what is known of it), its rows named in errors
    as those of ``store`` from row ``first`` on (a combined store, for a shard's)."""

    def __init__(
        self, dataset: h5py.Dataset, chunks: Chunks, store: str | None = None, first: int = 0
    ):
        self.dataset, self.chunks = dataset, chunks
        self.store, self.first = store or dataset.file.filename, first
        self.name = dataset.name.lstrip("/")
        self.length, self.chunk_rows, self.sums = chunks.length, chunks.chunk_rows, chunks.sums
        self.mapped = chunks.mapped
        self.direct = bool(self.mapped)  # read without HDF5 (and without the GIL)

    def read(self, start: int, stop: int, out: np.ndarray) -> None:
        """Copy rows ``[start, stop)`` into ``out`` (C-contiguous, the dataset's dtype)."""
        if stop <= start:
            return
        self.check(range(start // self.chunk_rows, -(-stop // self.chunk_rows)))
        if not self.mapped:
            self._hdf5(lambda: self.dataset.read_direct(out, np.s_[start:stop]), start, stop)
            return
        at = bisect.bisect_right(self.chunks.firsts, start) - 1
        for first, rows in self.mapped[at:]:
            a, b = max(start, first), min(stop, first + len(rows))
            if a >= stop:
                break
            np.copyto(out[a - start : b - start], rows[a - first : b - first])

    def take(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Copy the rows numbered ``rows`` (sorted, unique) into ``out``."""
        if not len(rows):
            return
        self.check(np.unique(rows // self.chunk_rows))
        if not self.mapped:
            at = 0
            for start, stop in runs(rows):
                self.read(start, stop, out[at : at + stop - start])
                at += stop - start
            return
        cuts = np.searchsorted(rows, self.chunks.firsts[1:]).tolist()
        for (first, values), a, b in zip(self.mapped, [0, *cuts], [*cuts, len(rows)], strict=True):
            if b > a:
                np.take(values, rows[a:b] - first, axis=0, out=out[a:b])

    def advise(self, start: int, stop: int) -> None:
        """Ask the kernel to read rows ``[start, stop)`` in the background (mapped only)."""
        whole = self.chunks.map
        if whole is None or not hasattr(mmap, "MADV_WILLNEED"):
            return
        base = _base(whole)
        for first, rows in self.mapped:
            a, b = max(start, first), min(stop, first + len(rows))
            if a < b:
                begin = rows[a - first :].ctypes.data - base
                page = begin - begin % mmap.PAGESIZE
                with contextlib.suppress(OSError, ValueError):  # advice only
                    whole.madvise(
                        mmap.MADV_WILLNEED, page, begin - page + (b - a) * rows.strides[0]
                    )

    def check(self, chunks: Iterable[int]) -> None:
        """Check the chunks numbered ``chunks`` not checked yet; raise for one that fails."""
        if self.sums is None and not self.chunks.twice and not self.chunks.index_error:
            return
        checked = self.chunks.checked
        for chunk in chunks:
            if not checked[chunk]:
                problem = self.chunk_problem(int(chunk))
                if problem:
                    raise self.error(int(chunk), problem)
                checked[chunk] = True

    def chunk_problem(self, chunk: int, by_hdf5: bool = False) -> str:
        """Why chunk ``chunk`` cannot be read as stored ("" when it can); ``by_hdf5``: found
        by HDF5's lookup by position, as plain HDF5 reads it (a damaged index key can send
        that elsewhere than featcache's reads)."""
        start = chunk * self.chunk_rows
        if chunk in self.chunks.twice:
            return "is in a chunk the chunk index lists twice (a damaged index)"
        if self.chunks.index_error:
            return f"cannot be read ({self.chunks.index_error})"
        try:
            if self.mapped and not by_hdf5:
                first, rows = self.mapped[bisect.bisect_right(self.chunks.firsts, start) - 1]
                found = checksum(rows[start - first : start - first + self.chunk_rows])
            elif self.sums is not None:
                origin = (start, *(0,) * (self.dataset.ndim - 1))
                found = checksum(self.dataset.id.read_direct_chunk(origin)[1])
            else:  # HDF5 checks it (Fletcher-32) as it reads it
                self.dataset[start : start + self.chunk_rows]
                return ""
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            return f"cannot be read by HDF5 ({first_line(exc)})"
        return "" if self.sums is None or found == int(self.sums[chunk]) else "fails its checksum"

    def error(self, chunk: int, problem: str) -> CorruptStoreError:
        """The one-line error for chunk ``chunk``: store, dataset, rows, fix."""
        start = chunk * self.chunk_rows
        stop = min(start + self.chunk_rows, self.length)
        what = chunk_text(self.dataset, start, stop, problem, self.first)
        return CorruptStoreError(f"store {self.store} is corrupted: {what}; {FIX}")

    def _hdf5(self, read, start: int, stop: int) -> None:
        """Run ``read``, an HDF5 read of rows ``[start, stop)``; name the chunk it fails on."""
        try:
            read()
        except OSError as exc:
            for chunk in range(start // self.chunk_rows, -(-stop // self.chunk_rows)):
                problem = self.chunk_problem(chunk)
                if problem:
                    raise self.error(chunk, problem) from exc
            where = span_text(self.dataset, start, stop, self.first)
            raise FeatcacheError(
                f"reading {named(self.name)} {where} of store {self.store} failed "
                f"({first_line(exc)}); check it with featcache verify --quick {self.store}"
            ) from exc


class PartRows:
    """Row reads of a combined store's dataset from its shards' (a :class:`Rows` each)."""

    def __init__(self, parts: list[Rows]):
        self.parts = parts
        self.firsts = [part.first for part in parts]
        self.length = sum(part.length for part in parts)
        self.dataset = parts[0].dataset
        self.chunk_rows = parts[0].chunk_rows
        self.direct = all(part.direct for part in parts)

    def _spans(self, start: int, stop: int) -> Iterable[tuple[Rows, int, int]]:
        at = max(bisect.bisect_right(self.firsts, start) - 1, 0)
        for part in self.parts[at:]:
            first, last = max(start, part.first), min(stop, part.first + part.length)
            if part.first >= stop:
                return
            if first < last:
                yield part, first, last

    def read(self, start: int, stop: int, out: np.ndarray) -> None:
        for part, first, last in self._spans(start, stop):
            part.read(first - part.first, last - part.first, out[first - start : last - start])

    def take(self, rows: np.ndarray, out: np.ndarray) -> None:
        for part, first, last in self._spans(int(rows[0]), int(rows[-1]) + 1) if len(rows) else ():
            a, b = np.searchsorted(rows, [first, last])
            part.take(rows[a:b] - part.first, out[a:b])

    def advise(self, start: int, stop: int) -> None:
        for part, first, last in self._spans(start, stop):
            part.advise(first - part.first, last - part.first)


def _mapped(
    dataset: h5py.Dataset,
) -> tuple[np.ndarray | None, list[tuple[int, np.ndarray]], mmap.mmap | None]:
    """Where the dataset's chunks lie, its rows over a read-only map of its file (one array
    per run of chunks back to back, with its first row), and the map; ``(None, [], None)``
    for a dataset not stored as plain chunks of whole rows."""
    native = dataset.dtype.isnative or dataset.dtype.itemsize == 1
    if dataset.file.driver != "sec2" or dataset.dtype.kind not in "biufS" or not native:
        return None, [], None
    addresses = chunk_addresses(dataset)
    if addresses is None:
        return None, [], None
    rows = dataset.chunks[0]
    items = rows * int(np.prod(dataset.shape[1:], dtype=np.int64))
    try:
        fd = h5py.h5i.get_file_id(dataset.id).get_vfd_handle()
        whole = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError, TypeError):
        return None, [], None
    found = []
    for chunk, count, address in segments(addresses, items * dataset.dtype.itemsize):
        if address + count * items * dataset.dtype.itemsize > len(whole):  # a file cut short
            return None, [], None  # HDF5 says what is missing
        values = np.frombuffer(whole, dtype=dataset.dtype, count=count * items, offset=address)
        found.append((chunk * rows, values.reshape(count * rows, *dataset.shape[1:])))
    return addresses, found, whole


def _base(whole: mmap.mmap) -> int:
    """The address of a mapping's first byte."""
    return np.frombuffer(whole, dtype=np.uint8, count=1).ctypes.data


MAX_TRACKED = 64  # datasets known, most recent first
# Keyed by HDF5's serial number of the open file (never reused in a process, the same for
# every handle on it) and the dataset's path: a chunk is checked once while its file is
# open, however many h5py objects read it.
_OPEN: OrderedDict[tuple[tuple[int, int], str], Chunks | PartRows] = OrderedDict()
_LOCK = threading.Lock()  # a shuffle buffer is read on two threads


def rows_of(dataset: h5py.Dataset) -> Rows | PartRows:
    """The reads of ``dataset`` (a combined store's from its shards), what is known of it
    kept while its file is open."""
    key = (tuple(dataset.id.fileno), dataset.name)
    with _LOCK:
        known = _OPEN.get(key)
        if known is not None:
            _OPEN.move_to_end(key)
        else:
            known = (_shard_rows(dataset) if dataset.is_virtual else None) or Chunks(dataset)
            files = h5py.h5f.get_obj_ids(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
            open_files = {tuple(file.fileno) for file in files}
            for stale in [k for k in _OPEN if k[0] not in open_files]:
                del _OPEN[stale]
            _OPEN[key] = known
            if len(_OPEN) > MAX_TRACKED:
                _OPEN.popitem(last=False)
    return known if isinstance(known, PartRows) else Rows(dataset, known)


@contextlib.contextmanager
def opened(path: str | os.PathLike, **options: Any) -> Iterator[h5py.File]:
    """A store file open read-only for the block, forgotten (:func:`forget`) after."""
    with open_readonly(path, **options) as file:
        try:
            yield file
        finally:
            forget(file)


def forget(file: h5py.File, wait: bool = True) -> None:
    """Drop what is known of ``file``'s datasets (a combined store's let go of its shards).

    With ``wait=False`` (from the garbage collector, which may run inside :func:`rows_of`
    on any thread) nothing is done while another read holds the lock: :func:`rows_of`
    drops what it knows of closed files itself.
    """
    try:
        serial = tuple(file.id.fileno)
    except (OSError, RuntimeError, KeyError, ValueError):  # a damaged root: nothing read
        return
    if not _LOCK.acquire(blocking=wait):
        return
    try:
        for key in [key for key in _OPEN if key[0] == serial]:
            del _OPEN[key]
    finally:
        _LOCK.release()


def _shard_rows(dataset: h5py.Dataset) -> PartRows | None:
    """The reads of a combined store's dataset (None: not one)."""
    shards = codec.attr(dataset.file, "shards")
    if not isinstance(shards, list) or not shards:
        return None
    folder = Path(dataset.file.filename).parent
    parts, first = [], 0
    for shard in shards:
        found = h5py.File(folder / shard, "r")[dataset.name]  # open while its reads are known
        parts.append(Rows(found, Chunks(found), dataset.file.filename, first))
        first += len(found)
    if first != len(dataset):
        raise CorruptStoreError(
            f"store {dataset.file.filename} is damaged: its shards hold {first} rows of "
            f"{dataset.name.lstrip('/')}, it {len(dataset)}; {FIX}"
        )
    return PartRows(parts)


def runs(rows: np.ndarray) -> Iterable[tuple[int, int]]:
    """``[start, stop)`` of each run of consecutive numbers in sorted unique ``rows``."""
    if not len(rows):
        return ()
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.r_[0, breaks]].tolist()
    stops = (rows[np.r_[breaks - 1, len(rows) - 1]] + 1).tolist()
    return zip(starts, stops, strict=True)


def read_runs(
    dataset: h5py.Dataset, spans: Iterable[tuple[int, int]], out: np.ndarray, at: int = 0
) -> None:
    """Copy the row ranges ``[start, stop)`` of ``dataset`` into ``out`` (its numpy dtype:
    ``uint16`` for bfloat16), one after the other from row ``at``."""
    reader = rows_of(dataset)
    for start, stop in spans:
        reader.read(start, stop, out[at : at + stop - start])
        at += max(stop - start, 0)


def read_head(dataset: h5py.Dataset, rows: int) -> np.ndarray:
    """The first ``rows`` rows of a dataset (labels, index, ids, offsets, skip records)."""
    out = np.empty((rows, *dataset.shape[1:]), dtype=dataset.dtype)
    rows_of(dataset).read(0, rows, out)
    return out


def read_text_head(dataset: h5py.Dataset, rows: int) -> list[str]:
    """:func:`read_head` of a dataset of fixed-length UTF-8 text, as ``str``."""
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
    """Rows of a features dataset as a tensor ``[n, *shape]`` of its store dtype (bfloat16
    as ``torch.bfloat16``). ``rows``: a slice, or int64 row numbers in range in any order,
    with repeats (each read once, in increasing order, then put in the order asked)."""
    if isinstance(rows, slice) and rows.step in (None, 1):
        start, stop, _ = rows.indices(len(dataset))
        array = np.empty((max(stop - start, 0), *dataset.shape[1:]), dtype=dataset.dtype)
        rows_of(dataset).read(start, stop, array)
        return codec.decode(array, codec.attr(dataset, "dtype", ""))
    if isinstance(rows, slice):
        rows = np.arange(*rows.indices(len(dataset)), dtype=np.int64)
    unique, inverse = np.unique(rows, return_inverse=True)
    array = np.empty((len(unique), *dataset.shape[1:]), dtype=dataset.dtype)
    if len(unique) and unique[-1] - unique[0] + 1 == len(unique):
        rows_of(dataset).read(int(unique[0]), int(unique[-1]) + 1, array)
    else:
        rows_of(dataset).take(unique, array)
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
    read_runs(dataset, [(int(offsets[a]), int(offsets[b])) for a, b in runs(unique)], packed)
    starts = np.concatenate([[0], np.cumsum(counts)])
    if not np.array_equal(unique, rows):  # put back in the order asked
        order = inverse.reshape(-1)
        pieces = [packed[starts[j] : starts[j + 1]] for j in order]
        packed = np.concatenate(pieces) if pieces else packed[:0]
        starts = np.concatenate([[0], np.cumsum(counts[order])])
    return codec.decode(packed, codec.attr(dataset, "dtype", "")), starts.astype(np.int64)


def named(key: str) -> str:
    """A dataset of a store in words: ``layer <name>`` for a feature layer."""
    return f"layer {key[len('features/') :]}" if key.startswith("features/") else f"dataset {key}"


def chunk_text(dataset: h5py.Dataset, start: int, stop: int, problem: str, first: int = 0) -> str:
    """``layer a rows 8-11 fail their checksum``: rows ``[start, stop)`` of ``dataset`` and
    what is wrong with their chunk, ``problem`` (said of one row: "fails its checksum")."""
    if stop - start > 1:
        problem = problem.replace("fails its", "fail their").replace("is in a", "are in a")
    return f"{named(dataset.name.lstrip('/'))} {span_text(dataset, start, stop, first)} {problem}"


def span_text(dataset: h5py.Dataset, start: int, stop: int, first: int = 0) -> str:
    """``rows a-b`` in words; ``tokens a-b (rows i-j)`` for a per-token dataset. ``first``:
    the dataset's first row in its store (a shard's: its tokens' rows left unnamed)."""
    a, b = first + start, first + stop - 1
    if codec.attr(dataset, "layout") != "tokens" and dataset.name != "/token_ids":
        return f"row {a}" if a == b else f"rows {a}-{b}"
    tokens = f"token {a}" if a == b else f"tokens {a}-{b}"
    try:
        offsets = read_head(dataset.file["offsets"], len(dataset.file["offsets"]))
    except (OSError, KeyError, FeatcacheError):  # the offsets themselves are unreadable
        offsets = None
    if first or offsets is None:
        return tokens
    row = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
    return f"{tokens} (row {row})" if row == last else f"{tokens} (rows {row}-{last})"
