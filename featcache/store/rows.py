"""Reading rows: plain chunks through a memory map, others through HDF5, each chunk checked
against its checksum the first time a handle on its file reads it.

Any set of mapped rows is one ``numpy.take`` of their byte offsets, wherever HDF5 placed
each chunk. A chunk that fails raises :class:`~featcache.errors.CorruptStoreError` before
any of its values are returned; a combined store is read from its shards.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from featcache.errors import CorruptStoreError, FeatcacheError, first_line
from featcache.store import codec
from featcache.store.layout import checksum, checksums_name, chunk_addresses

if TYPE_CHECKING:
    import torch

FIX = "re-extract it (featcache extract <config> --overwrite) or restore it from a copy"
_BAD = (OSError, RuntimeError, KeyError, ValueError)  # what h5py raises on damaged bytes


class Chunks:
    """What is known of a dataset while its file is open: its chunks' checksums, which
    passed, and for a mapped one the map and where each chunk begins (``addresses``).
    Nothing of HDF5: the file closes with its handles."""

    def __init__(self, dataset: h5py.Dataset):
        self.length = len(dataset)
        self.chunk_rows = dataset.chunks[0] if dataset.chunks else max(self.length, 1)
        chunks = -(-self.length // self.chunk_rows)
        self.checked = np.zeros(chunks, dtype=bool)
        sums = dataset.file.get(checksums_name(dataset.name))
        plain = sums is not None and not dataset.is_virtual and len(sums) >= chunks
        self.sums = sums[()] if plain else None  # else nothing to check against
        self.row_bytes = dataset.dtype.itemsize * int(np.prod(dataset.shape[1:], dtype=np.int64))
        self.stored = codec.attr(dataset, "dtype", "")  # a layer's store dtype ("bfloat16", ...)
        self.map: mmap.mmap | None = None
        self.addresses: np.ndarray | None = None
        self.bytes: np.ndarray | None = None
        self.rows: np.ndarray | None = None
        self.base = self.step = 1
        with contextlib.suppress(*_BAD, TypeError):  # a damaged index: HDF5 says what
            self._map(dataset)

    def _map(self, dataset: h5py.Dataset) -> None:
        native = dataset.dtype.isnative or dataset.dtype.itemsize == 1
        if dataset.file.driver != "sec2" or dataset.dtype.kind not in "biufS" or not native:
            return
        addresses = chunk_addresses(dataset)
        if addresses is None or not self.row_bytes:
            return
        handle = h5py.h5i.get_file_id(dataset.id).get_vfd_handle()
        whole = mmap.mmap(handle, 0, access=mmap.ACCESS_READ)
        if addresses.max() + self.chunk_rows * self.row_bytes > len(whole):  # a file cut short
            return
        self.map, self.addresses = whole, addresses
        self.bytes = np.frombuffer(whole, dtype=np.uint8)
        # Rows of ``row_bytes`` from byte ``base`` on, every ``step`` bytes: whole rows
        # (a plain array, the fast numpy.take) when every chunk lies on that grid.
        self.base = int(addresses[0]) % self.row_bytes
        aligned = not ((addresses - self.base) % self.row_bytes).any()
        self.step = self.row_bytes if aligned else 1
        count = (len(self.bytes) - self.base - self.row_bytes) // self.step + 1
        self.rows = np.lib.stride_tricks.as_strided(
            self.bytes[self.base :], (count, self.row_bytes), (self.step, 1), writeable=False
        )

    def offset(self, row: int) -> int:
        """The byte offset of row ``row`` in the file (a mapped dataset)."""
        assert self.addresses is not None
        return int(self.addresses[row // self.chunk_rows]) + row % self.chunk_rows * self.row_bytes

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Copy the mapped ``rows`` into ``out``, one numpy gather."""
        assert self.addresses is not None and self.rows is not None
        chunk, row = np.divmod(rows, self.chunk_rows)
        index = (self.addresses[chunk] + row * self.row_bytes - self.base) // self.step
        raw = out.reshape(len(rows), -1).view(np.uint8)
        if self.rows.flags.c_contiguous:
            np.take(self.rows, index, axis=0, out=raw)
        else:  # numpy.take would copy the whole strided view first
            raw[...] = self.rows[index]


class Rows:
    """Row reads of ``dataset`` (``chunks``: what is known of it), its rows named in errors
    as those of ``store`` from row ``first`` on (a shard's, in a combined store)."""

    def __init__(
        self, dataset: h5py.Dataset, chunks: Chunks, store: str | None = None, first: int = 0
    ):
        self.dataset, self.chunks = dataset, chunks
        self._store, self.first = store, first
        self.name = dataset.name.lstrip("/")
        self.length, self.chunk_rows, self.sums = chunks.length, chunks.chunk_rows, chunks.sums
        self.stored = chunks.stored
        self.direct = chunks.rows is not None  # read without HDF5 (and without the GIL)

    @property
    def store(self) -> str:
        """The file of the store the rows are named in (in errors)."""
        return self._store or self.dataset.file.filename

    def read(self, start: int, stop: int, out: np.ndarray) -> None:
        """Copy rows ``[start, stop)`` into ``out`` (C-contiguous, the dataset's dtype)."""
        if stop <= start:
            return
        if self.direct:
            self.take(np.arange(start, stop), out)
            return
        self.check(range(start // self.chunk_rows, -(-stop // self.chunk_rows)))
        try:
            self.dataset.read_direct(out, np.s_[start:stop])
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

    def take(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Copy the rows numbered ``rows`` (sorted, unique) into ``out``."""
        self.check(np.unique(rows // self.chunk_rows))
        if self.chunks.rows is None:
            read_runs(self, runs(rows), out)
        elif len(rows):
            self.chunks.gather(rows, out)

    def advise(self, start: int, stop: int) -> None:
        """Ask the kernel to read rows ``[start, stop)`` in the background (mapped only)."""
        self._advise_chunks(start, stop, "MADV_WILLNEED")

    def release(self, start: int, stop: int) -> None:
        """Let the process's mapped pages of rows ``[start, stop)`` go (mapped only); the
        kernel keeps them cached anyway."""
        self._advise_chunks(start, stop, "MADV_DONTNEED")

    def _advise_chunks(self, start: int, stop: int, advice: str) -> None:
        if self.chunks.map is None or not hasattr(mmap, advice):
            return
        size = self.chunk_rows * self.chunks.row_bytes
        for chunk in range(start // self.chunk_rows, -(-stop // self.chunk_rows)):
            begin = self.chunks.offset(chunk * self.chunk_rows)
            with contextlib.suppress(OSError, ValueError):  # advice only
                page = begin - begin % mmap.PAGESIZE
                self.chunks.map.madvise(getattr(mmap, advice), page, begin - page + size)

    def check(self, chunks: Iterable[int]) -> None:
        """Check the chunks numbered ``chunks`` not checked yet; raise for one that fails."""
        if self.sums is None:
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
        as plain HDF5 finds it."""
        start = chunk * self.chunk_rows
        try:
            if self.chunks.bytes is not None and not by_hdf5:
                at = self.chunks.offset(start)
                found = checksum(
                    self.chunks.bytes[at : at + self.chunk_rows * self.chunks.row_bytes]
                )
            elif self.sums is not None:
                origin = (start, *(0,) * (self.dataset.ndim - 1))
                found = checksum(self.dataset.id.read_direct_chunk(origin)[1])
            else:  # HDF5 checks it (Fletcher-32) as it reads it
                self.dataset[start : start + self.chunk_rows]
                return ""
        except _BAD as exc:
            return f"cannot be read by HDF5 ({first_line(exc)})"
        return "" if self.sums is None or found == int(self.sums[chunk]) else "fails its checksum"

    def error(self, chunk: int, problem: str) -> CorruptStoreError:
        """The one-line error for chunk ``chunk``: store, dataset, rows, fix."""
        start = chunk * self.chunk_rows
        stop = min(start + self.chunk_rows, self.length)
        what = chunk_text(self.dataset, start, stop, problem, self.first)
        return CorruptStoreError(f"store {self.store} is corrupted: {what}; {FIX}")


class PartRows:
    """Row reads of a combined store's dataset from its shards' (a :class:`Rows` each)."""

    def __init__(self, parts: list[Rows]):
        self.parts, self.firsts = parts, [part.first for part in parts]
        self.length = sum(part.length for part in parts)
        self.dataset, self.chunk_rows = parts[0].dataset, parts[0].chunk_rows
        self.stored = parts[0].stored
        self.direct = all(part.direct for part in parts)

    def _spans(self, start: int, stop: int) -> Iterator[tuple[Rows, int, int]]:
        for part in self.parts[max(bisect.bisect_right(self.firsts, start) - 1, 0) :]:
            first, last = max(start, part.first), min(stop, part.first + part.length)
            if part.first >= stop:
                return
            if first < last:
                yield part, first - part.first, last - part.first

    def read(self, start: int, stop: int, out: np.ndarray) -> None:
        for part, a, b in self._spans(start, stop):
            part.read(a, b, out[a + part.first - start : b + part.first - start])

    def take(self, rows: np.ndarray, out: np.ndarray) -> None:
        for part, a, b in self._spans(int(rows[0]), int(rows[-1]) + 1) if len(rows) else ():
            i, j = np.searchsorted(rows, [a + part.first, b + part.first])
            part.take(rows[i:j] - part.first, out[i:j])

    def advise(self, start: int, stop: int) -> None:
        for part, a, b in self._spans(start, stop):
            part.advise(a, b)

    def release(self, start: int, stop: int) -> None:
        for part, a, b in self._spans(start, stop):
            part.release(a, b)


# What is learnt of the datasets of one open file, by name, so that chunks are checked once.
Known = MutableMapping[str, "Chunks | PartRows"]


def rows_of(dataset: h5py.Dataset, known: Known | None = None) -> Rows | PartRows:
    """The reads of ``dataset`` (a combined store's from its shards); what is learnt of it
    is kept in ``known``, when given."""
    found = None if known is None else known.get(dataset.name)
    if found is None:
        found = (_shard_rows(dataset) if dataset.is_virtual else None) or Chunks(dataset)
        if known is not None:
            found = known.setdefault(dataset.name, found)
    return found if isinstance(found, PartRows) else Rows(dataset, found)


def let_go(known: Known) -> None:
    """Forget what ``known`` holds, closing the shard files a combined store's reads opened."""
    for found in list(known.values()):
        for part in found.parts if isinstance(found, PartRows) else ():
            with contextlib.suppress(*_BAD):
                part.dataset.file.close()
    known.clear()


def _shard_rows(dataset: h5py.Dataset) -> PartRows | None:
    """The reads of a combined store's dataset (None: not one)."""
    shards = codec.attr(dataset.file, "shards")
    if not isinstance(shards, list) or not shards:
        return None
    folder = Path(dataset.file.filename).parent
    parts, first = [], 0
    for shard in shards:
        found = h5py.File(folder / shard, "r")[dataset.name]  # closed by let_go, or when dropped
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


def read_runs(reader: Rows | PartRows, spans: Iterable[tuple[int, int]], out: np.ndarray) -> None:
    """Copy the row ranges ``[start, stop)`` of ``reader``'s dataset into ``out`` (its
    numpy dtype: ``uint16`` for bfloat16), one after the other."""
    at = 0
    for start, stop in spans:
        reader.read(start, stop, out[at : at + stop - start])
        at += max(stop - start, 0)


def read_head(dataset: h5py.Dataset, rows: int, known: Known | None = None) -> np.ndarray:
    """The first ``rows`` rows of a dataset (labels, index, ids, offsets, skip records)."""
    out = np.empty((rows, *dataset.shape[1:]), dtype=dataset.dtype)
    rows_of(dataset, known).read(0, rows, out)
    return out


def read_text_head(dataset: h5py.Dataset, rows: int, known: Known | None = None) -> list[str]:
    """:func:`read_head` of a dataset of fixed-length UTF-8 text, as ``str``."""
    return [raw.decode("utf-8") for raw in read_head(dataset, rows, known)]


def row_numbers(rows: slice | Sequence[int] | np.ndarray, num_rows: int) -> np.ndarray:
    """``rows`` (a slice, or numbers of which negative ones count from the end) as int64
    row numbers in ``[0, num_rows)``. Raises :class:`IndexError` for a row out of range,
    :class:`TypeError` for one that is not a whole number (``1.5``, ``True``, ``"3"``)."""
    if isinstance(rows, slice):
        return np.arange(*rows.indices(num_rows), dtype=np.int64)
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


def read_rows(reader: Rows | PartRows, rows: slice | np.ndarray) -> torch.Tensor:
    """Rows of a features dataset as a tensor ``[n, *shape]`` of its store dtype (bfloat16
    as ``torch.bfloat16``). ``rows``: a slice, or int64 row numbers in range, any order,
    with repeats (each read once, in increasing order)."""
    rows = row_numbers(rows, reader.length) if isinstance(rows, slice) else rows
    unique, inverse = np.unique(rows, return_inverse=True)
    array = np.empty((len(unique), *reader.dataset.shape[1:]), dtype=reader.dataset.dtype)
    if len(unique) and unique[-1] - unique[0] + 1 == len(unique):
        reader.read(int(unique[0]), int(unique[-1]) + 1, array)
    elif len(unique):
        reader.take(unique, array)
    if not np.array_equal(unique, rows):
        array = array[inverse.reshape(-1)]
    return codec.from_array(array, reader.stored)


def read_token_rows(
    reader: Rows | PartRows, offsets: np.ndarray, rows: np.ndarray
) -> tuple[torch.Tensor, np.ndarray]:
    """The tokens of ``rows`` (int64 row numbers, any order) of a per-token dataset whose
    row ``i`` is ``offsets[i]:offsets[i + 1]``: ``(values [sum T, ...], offsets [n + 1])``,
    in the order asked; one read per run of consecutive rows."""
    unique, inverse = np.unique(rows, return_inverse=True)
    counts = offsets[unique + 1] - offsets[unique]
    dataset = reader.dataset
    packed = np.empty((int(counts.sum()), *dataset.shape[1:]), dtype=dataset.dtype)
    spans = [(int(offsets[a]), int(offsets[b])) for a, b in runs(unique)]
    read_runs(reader, spans, packed)
    starts = np.concatenate([[0], np.cumsum(counts)])
    if not np.array_equal(unique, rows):  # put back in the order asked
        order = inverse.reshape(-1)
        pieces = [packed[starts[j] : starts[j + 1]] for j in order]
        packed = np.concatenate(pieces) if pieces else packed[:0]
        starts = np.concatenate([[0], np.cumsum(counts[order])])
    return codec.from_array(packed, reader.stored), starts.astype(np.int64)


def named(key: str) -> str:
    """A dataset of a store in words: ``layer <name>`` for a feature layer."""
    return f"layer {key[len('features/') :]}" if key.startswith("features/") else f"dataset {key}"


def chunk_text(dataset: h5py.Dataset, start: int, stop: int, problem: str, first: int = 0) -> str:
    """``layer a rows 8-11 fail their checksum``: rows ``[start, stop)`` of ``dataset`` and
    what is wrong with their chunk, ``problem`` (said of one row: "fails its checksum")."""
    if stop - start > 1:
        problem = problem.replace("fails its", "fail their")
    return f"{named(dataset.name.lstrip('/'))} {span_text(dataset, start, stop, first)} {problem}"


def span_text(dataset: h5py.Dataset, start: int, stop: int, first: int = 0) -> str:
    """``rows a-b`` in words; ``tokens a-b (rows i-j)`` for a per-token dataset, whose rows
    are left unnamed in a shard (``first``: the dataset's first row in its store)."""
    a, b = first + start, first + stop - 1
    if codec.attr(dataset, "layout") != "tokens" and dataset.name != "/token_ids":
        return f"row {a}" if a == b else f"rows {a}-{b}"
    tokens = f"token {a}" if a == b else f"tokens {a}-{b}"
    try:
        offsets = read_head(dataset.file["offsets"], len(dataset.file["offsets"]))
    except (OSError, KeyError, FeatcacheError):  # the offsets themselves are unreadable
        return tokens
    if first:
        return tokens
    row, last = np.searchsorted(offsets, [start, stop - 1], side="right") - 1
    return f"{tokens} (row {row})" if row == last else f"{tokens} (rows {row}-{last})"
