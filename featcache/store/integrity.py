"""Chunk checksums: whether a store has them, which chunks fail, and the error naming one."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import h5py
import numpy as np

from featcache.errors import CorruptStoreError, FeatcacheError, first_line
from featcache.store import codec
from featcache.store.chunks import chunk_rows_of
from featcache.store.durable import chunk_as_marked, durable_entries
from featcache.store.fletcher import (
    CHECKSUM_BYTES,
    LISTED_TWICE,
    NOT_PLAIN,
    checksum_bytes,
    checksum_only,
    plain_chunk_addresses,
)
from featcache.store.metadata import changed_chunk_index, chunked_datasets
from featcache.store.paths import readable_path

if TYPE_CHECKING:
    from featcache.store.reader import FeatureStore

FIX = "re-extract it (featcache extract <config> --overwrite) or restore it from a copy"
# A chunk that fails its check is read once more after this long: the writer of a store
# still being written rewrites the chunk of its last rows at every progress mark, and a
# read during that write sees part of each.
RETRY_SECONDS = 0.01
# Why a chunk listed twice by its dataset's chunk index (fletcher.LISTED_TWICE) is refused.
LISTED_TWICE_REASON = "in a chunk the chunk index lists twice (a damaged index)"

T = TypeVar("T")


@dataclass(frozen=True)
class BadChunk:
    """One chunk that fails to read: rows ``[start, stop)`` of the dataset ``key``."""

    key: str  # path of the dataset in the store: "features/layer2", "labels", "ids", ...
    start: int
    stop: int  # exclusive
    message: str  # h5py's error, first line


def scan_chunks(store: str | os.PathLike | FeatureStore) -> list[BadChunk]:
    """Read every chunk of every chunked dataset of ``store`` and list those that fail.

    Features, labels, index and ids are read one chunk at a time into one reused buffer
    per dataset, so memory stays at about one chunk. A virtual dataset (a store combined
    from shards) is read by the chunks of its sources, named by its own rows. An empty
    list: every chunk reads (and, with checksums, matches its checksum).
    """
    if isinstance(store, (str, os.PathLike)):
        with h5py.File(readable_path(store), "r", rdcc_nbytes=0) as file:
            return _scan(file)
    return _scan(store.file)


def has_checksums(store: str | os.PathLike | FeatureStore) -> bool:
    """Whether every feature dataset of ``store`` carries Fletcher-32 checksums (for a
    store combined from shards: whether every shard's dataset does)."""
    if isinstance(store, (str, os.PathLike)):
        with h5py.File(readable_path(store), "r") as file:
            return _has_checksums(file)
    return _has_checksums(store.file)


def dataset_has_checksum(dataset: h5py.Dataset) -> bool:
    """Whether ``dataset``'s chunks carry Fletcher-32 checksums; a virtual dataset has
    them when all of its source datasets do."""
    if not dataset.is_virtual:
        return bool(dataset.fletcher32)
    sources = dataset.virtual_sources()
    for source in sources:
        with _source(dataset, source.file_name, source.dset_name) as found:
            if not found.fletcher32:
                return False
    return bool(sources)


@contextlib.contextmanager
def _source(dataset: h5py.Dataset, file_name: str, name: str) -> Iterator[h5py.Dataset]:
    """Source ``name`` of virtual ``dataset``, in file ``file_name`` (``"."``: the same
    file; else, as HDF5 looks for it, beside the file that names it), open for the block."""
    if file_name == ".":
        yield dataset.file[name]
        return
    with h5py.File(Path(dataset.file.filename).parent / file_name, "r", rdcc_nbytes=0) as f:
        yield f[name]


def read_or_explain(dataset: h5py.Dataset, rows: range, read: Callable[[], T]) -> T:
    """``read()``, a read of ``rows`` of ``dataset``; if it fails, the chunks holding
    those rows are read one by one (each twice at most, as :func:`checked_twice` does),
    and the first that fails raises :class:`CorruptStoreError` naming its rows.

    When every such chunk reads on its own, the failure was passing (a chunk rewritten by
    the writer of a store still being written, read halfway), and ``read()`` runs once
    more; a second failure of it raises :class:`FeatcacheError`, one line naming the
    store, the rows and HDF5's reason. The read paths pay nothing until a read fails.
    """
    try:
        return read()
    except OSError as error:
        bad = _first_bad_chunk(dataset, rows)
        if bad is not None:
            raise corrupt_store_error(dataset, bad) from error
    try:
        return read()
    except OSError as error:
        what = _named(dataset.name.lstrip("/"))
        where = span_text(dataset, rows.start, rows[-1] + 1) if rows else "no rows"
        store = dataset.file.filename
        raise FeatcacheError(
            f"reading {what} {where} of store {store} failed twice ({first_line(error)}), "
            "though each chunk holding them reads on its own; check the store with "
            f"featcache verify --quick {store}"
        ) from error


def corrupt_store_error(dataset: h5py.Dataset, bad: BadChunk) -> CorruptStoreError:
    """The one-line error for the chunk ``bad`` of ``dataset``: store, dataset, rows, fix."""
    what = _named(bad.key)
    one = bad.stop - bad.start == 1
    rows = span_text(dataset, bad.start, bad.stop)
    if bad.message == LISTED_TWICE_REASON:
        fails = f"{'is' if one else 'are'} {LISTED_TWICE_REASON}"
    elif dataset_has_checksum(dataset):
        fails = "fails its checksum" if one else "fail their checksum"
    else:  # e.g. a compressed chunk that no longer decompresses
        fails = f"cannot be read ({bad.message})"
    return CorruptStoreError(
        f"store {dataset.file.filename} is corrupted: {what} {rows} {fails}; {FIX}"
    )


def chunk_error(dataset: h5py.Dataset, start: int, message: str) -> CorruptStoreError:
    """:func:`corrupt_store_error` for the chunk of ``dataset`` that starts at row (or
    entry) ``start``, with ``message`` saying why it fails."""
    assert dataset.chunks is not None
    stop = min(start + dataset.chunks[0], len(dataset))
    return corrupt_store_error(dataset, BadChunk(dataset.name.lstrip("/"), start, stop, message))


def _named(key: str) -> str:
    """A dataset of a store in words: ``layer <name>`` for a feature layer."""
    return f"layer {key[len('features/') :]}" if key.startswith("features/") else f"dataset {key}"


def span_text(dataset: h5py.Dataset, start: int, stop: int) -> str:
    """``rows a-b`` of ``dataset`` in words; ``tokens a-b (rows i-j)`` for a dataset of
    per-token rows (a per-token layer, or ``/token_ids``)."""
    if codec.attr(dataset, "layout") != "tokens" and dataset.name != "/token_ids":
        return f"row {start}" if stop - start == 1 else f"rows {start}-{stop - 1}"
    tokens = f"token {start}" if stop - start == 1 else f"tokens {start}-{stop - 1}"
    try:
        offsets = dataset.file["offsets"][()]
    except (OSError, KeyError):  # the offsets themselves are unreadable
        return tokens
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
    return f"{tokens} (row {first})" if first == last else f"{tokens} (rows {first}-{last})"


def _scan(file: h5py.File) -> list[BadChunk]:
    datasets: list[h5py.Dataset] = []
    file.visititems(
        lambda _, obj: (
            datasets.append(obj)
            if isinstance(obj, h5py.Dataset)
            and obj.shape
            and (obj.chunks is not None or obj.is_virtual)
            else None
        )
    )
    bad: list[BadChunk] = []
    for dataset in datasets:
        key = dataset.name.lstrip("/")
        sources = whole_sources(dataset) if dataset.is_virtual else None
        if sources is None:
            bad += _scan_dataset(dataset, key)
            continue
        # A store combined from shards: each shard's chunks are read as a plain store's
        # are, where a chunk that HDF5's lookup misses is found (a read through the
        # virtual dataset would give zeros), and named by this dataset's rows.
        for source in sources:
            with _source(dataset, source.file_name, source.name) as found:
                bad += _scan_dataset(found, key, source.first)
    return bad


def _scan_dataset(dataset: h5py.Dataset, key: str, first: int = 0) -> list[BadChunk]:
    """The chunks of ``dataset`` that fail, as rows of ``key`` from row ``first`` on.

    In an incomplete store only the chunks holding durable entries are read (a resume
    writes the others again), and the chunk its last mark falls inside passes when it is
    as marked (:mod:`~featcache.store.durable`)."""
    durable = durable_entries(dataset)
    spans = chunk_spans(dataset)
    if durable is not None:
        spans = [(start, stop) for start, stop in spans if start < durable]
    longest = max((stop - start for start, stop in spans), default=0)
    buffer = np.empty((longest, *dataset.shape[1:]), dtype=dataset.dtype)
    summed = not dataset.is_virtual and checksum_only(dataset)
    plain = plain_chunk_addresses(dataset) if summed else None
    bad: list[BadChunk] = []
    for start, stop in spans:
        if plain is not None and plain[start // dataset.chunks[0]] == LISTED_TWICE:
            bad.append(BadChunk(key, first + start, first + stop, LISTED_TWICE_REASON))
            continue
        if plain is not None and plain[start // dataset.chunks[0]] != NOT_PLAIN:
            check = functools.partial(_check_stored_chunk, dataset, start, durable)
        else:  # HDF5 reads it, through its filters
            rows, into = np.s_[start:stop], np.s_[: stop - start]
            check = functools.partial(dataset.read_direct, buffer, rows, into)
        try:
            checked_twice(check)
        except OSError as exc:
            bad.append(BadChunk(key, first + start, first + stop, first_line(exc)))
    return bad


@dataclass(frozen=True)
class WholeSource:
    """A source of a virtual dataset mapped whole to its rows ``[first, stop)``."""

    file_name: str
    name: str
    first: int
    stop: int
    chunk_rows: int


def whole_sources(dataset: h5py.Dataset) -> list[WholeSource] | None:
    """The sources of a virtual dataset, when each is a whole dataset mapped to one block
    of rows (a combined store's); else None."""
    sources = []
    for source in dataset.virtual_sources():
        (first, *_), (last, *_) = source.vspace.get_select_bounds()
        with _source(dataset, source.file_name, source.dset_name) as found:
            rows, step = len(found), chunk_rows_of(found)
        if rows != last + 1 - first:
            return None
        sources.append(
            WholeSource(source.file_name, source.dset_name, int(first), int(last) + 1, step)
        )
    return sources


def damaged_index(file: h5py.File) -> str:
    """Why the chunk index of a dataset of ``file`` cannot be trusted, as "the chunk index
    of <name> ..." ("" when every one can): it differs from the digest recorded for it
    (see :func:`~featcache.store.metadata.record_chunk_indexes`), or it lists a chunk
    twice, or a lookup by position misses a chunk it lists (HDF5 then writes that chunk
    as a second copy and reads zeros for it). Where HDF5 cannot list chunks (before
    1.12.3) only the digest is compared."""
    changed = changed_chunk_index(file)
    if changed:
        return changed
    for dataset in chunked_datasets(file):
        problem = _index_problem(dataset)
        if problem:
            return f"the chunk index of {dataset.name.lstrip('/')} {problem}"
    return ""


def _index_problem(dataset: h5py.Dataset) -> str:
    records: list[tuple[tuple[int, ...], int | None]] = []
    try:
        dataset.id.chunk_iter(lambda info: records.append((info.chunk_offset, info.byte_offset)))
    except (AttributeError, NotImplementedError):
        return ""
    seen: set[tuple[int, ...]] = set()
    for offset, address in records:
        if offset in seen:
            return f"lists the chunk at row {offset[0]} twice"
        seen.add(offset)
        try:
            found = dataset.id.get_chunk_info_by_coord(offset).byte_offset
        except (RuntimeError, KeyError):
            found = None
        if found != address:
            return f"misses the chunk at row {offset[0]} in a lookup by position"
    return ""


def checked_twice(check: Callable[[], object]) -> None:
    """Run ``check``, a read of one chunk that raises OSError when the chunk is bad; if it
    fails, run it once more after :data:`RETRY_SECONDS`, and let a second failure raise."""
    try:
        check()
    except OSError:
        time.sleep(RETRY_SECONDS)
        check()


def _check_stored_chunk(dataset: h5py.Dataset, start: int, durable: int | None = None) -> None:
    """Check the chunk at row ``start`` with featcache's Fletcher-32 (a few times faster
    than HDF5's filter); raises OSError when it does not match, unless the dataset's
    first ``durable`` entries were durable and the chunk is as marked."""
    try:
        _, stored = dataset.id.read_direct_chunk((start, *(0 for _ in dataset.shape[1:])))
    except (RuntimeError, KeyError) as exc:  # the listing has it; a lookup does not find it
        raise OSError(
            f"HDF5 finds no chunk by its position though the chunk index lists one (a damaged "
            f"index key: featcache reads it, plain HDF5 reads zeros; {first_line(exc)})"
        ) from exc
    view = memoryview(stored)  # slices of bytes would copy them
    data, expected = view[:-CHECKSUM_BYTES], view[-CHECKSUM_BYTES:]
    if checksum_bytes(data) == expected:
        return
    if durable is not None:
        raw, stored_sum = np.frombuffer(data, dtype=np.uint8), int.from_bytes(expected, "little")
        if chunk_as_marked(raw, stored_sum, start, durable, dataset.chunks[0]):
            return
    raise OSError("Fletcher-32 checksum mismatch (the chunk's bytes changed)")


def _has_checksums(file: h5py.File) -> bool:
    features = file.get("features")
    if not isinstance(features, h5py.Group) or not len(features):
        return False
    return all(dataset_has_checksum(features[key]) for key in features)


def chunk_spans(dataset: h5py.Dataset) -> list[tuple[int, int]]:
    """The row ranges ``[start, stop)`` of ``dataset``'s chunks along its first axis, in
    order. A virtual dataset has those of its sources, moved to its own rows, when each
    source is a whole dataset mapped to one block of rows (as in a store combined from
    shards); else blocks of :func:`~featcache.store.chunks.chunk_rows_of` rows."""
    rows = len(dataset)
    if dataset.is_virtual:
        try:
            return _virtual_spans(dataset)
        except (OSError, KeyError, ValueError):
            pass
    step = chunk_rows_of(dataset)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _virtual_spans(dataset: h5py.Dataset) -> list[tuple[int, int]]:
    sources = whole_sources(dataset)
    if sources is None:
        raise ValueError("a source is not mapped whole")
    spans: list[tuple[int, int]] = []
    for source in sources:
        edges = [*range(source.first, source.stop, source.chunk_rows), source.stop]
        spans.extend(zip(edges[:-1], edges[1:], strict=True))
    spans.sort()
    starts = [start for start, _ in spans]
    stops = [0, *(stop for _, stop in spans[:-1])]
    if starts != stops or not spans or spans[-1][1] != len(dataset):
        raise ValueError("the sources do not tile the virtual dataset")
    return spans


def _first_bad_chunk(dataset: h5py.Dataset, rows: range) -> BadChunk | None:
    """The first chunk holding one of ``rows`` (a positive step) that fails to read."""
    if not len(rows):
        return None
    for first, last in chunk_spans(dataset):
        if last <= rows[0] or first > rows[-1]:
            continue
        asked = rows.start + max(0, -(-(first - rows.start) // rows.step)) * rows.step
        if asked >= last:  # a step over the whole chunk
            continue
        try:
            checked_twice(functools.partial(dataset.__getitem__, np.s_[first:last]))
        except OSError as exc:
            return BadChunk(dataset.name.lstrip("/"), first, last, first_line(exc))
    return None
