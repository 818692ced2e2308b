"""Writing a store: whole chunks into space allocated at creation, progress marked on chunk
boundaries, completion."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import h5py
import numpy as np

from featcache.errors import CorruptStoreError, FeatcacheError
from featcache.store import codec, layout
from featcache.store.checks import scan_file
from featcache.store.merge import copy_store
from featcache.store.metadata import seal
from featcache.store.paths import OVERWRITE, open_readonly, partial_path, skipped_log_path
from featcache.store.provenance import FORMAT_VERSION
from featcache.store.resume import ResumePoint
from featcache.store.skipped import rewrite_log, write_skipped
from featcache.util.files import building_beside, replace_durably

MARK_SECONDS = 0.5  # how often durable progress is recorded while writing
_datasync = getattr(os, "fdatasync", os.fsync)  # fdatasync: Linux; fsync elsewhere


@dataclasses.dataclass(frozen=True)
class StorePlan:
    """What a store holds and how it is written: everything :class:`StoreWriter` needs."""

    path: Path
    rows: int  # source rows the store is sized for (fewer are stored when some are skipped)
    ids_width: int = 1  # bytes of the longest id
    dtype: str = "float16"  # of the layers
    # a store.compression value ("gzip", "zstd:5", ...): a compressed copy made at completion
    compression: str | None = None
    chunk_rows: int | None = None  # rows (tokens) per chunk; None: layout.chunk_rows_for
    checksum: bool = True  # an XXH3 checksum per chunk
    has_labels: bool = True
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the provenance
    token_capacity: int | None = None  # the tokens per-token layers are sized for
    # [source rows] each row's change stamp (numpy S), stored as /stamps; None: no stamps
    stamps: np.ndarray | None = dataclasses.field(default=None, compare=False)
    mark_seconds: float = MARK_SECONDS  # how often progress is marked

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))


class StoreWriter:
    """Writes the store ``plan`` describes, crash-safely, to ``<path>.partial``; renamed to
    ``path`` when complete.

    The file is created whole on the first batch, when the layers' shapes are known; each
    dataset then writes whole chunks at their places. At most every ``mark_seconds`` the
    file is synced and ``/progress`` records the whole chunks written, so a crash loses at
    most the chunk each dataset was filling.
    """

    def __init__(self, plan: StorePlan, resume: ResumePoint | None = None):
        self.plan = plan
        self.path = plan.path
        self.partial = partial_path(self.path)
        self.resume = resume
        self.rows_appended = resume.row if resume else 0
        self.tokens_appended = resume.tokens if resume else 0
        self.skipped: list[dict[str, Any]] = list(resume.skipped) if resume else []
        self.fd: int | None = None
        self._columns: dict[str, _Column] = {}
        self._progress_at = 0
        # Token end offsets of the rows appended from row ``_ends_base`` on (per-token
        # stores), to tell which rows the durable tokens cover; trimmed at every mark.
        self._ends = np.empty(0, dtype=np.int64)
        self._ends_base = self.rows_appended
        self._marked: list[int] = []
        self._last_mark = time.monotonic()
        # Marks sync the file on a thread of their own: appends go on meanwhile.
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="featcache-sync")
        self._syncing: Future[None] | None = None
        self._log: TextIO | None = None
        log = skipped_log_path(self.path)
        if resume is not None:
            rewrite_log(log, self.skipped)  # later records are redone
            self._open()
        elif log.exists():
            log.unlink()

    def _create(
        self,
        features: Mapping[str, np.ndarray],
        feature_attrs: Mapping,
        ragged: frozenset[str],
        token_ids: bool,
    ) -> None:
        """Create the whole file under a temporary name, sync it, rename it to ``.partial``."""
        plan = self.plan
        if ragged and plan.token_capacity is None:
            raise FeatcacheError(
                f"layer {sorted(ragged)[0]!r} gives per-token rows, but {self.path} was not "
                "sized for tokens; give the dataset a token_lengths attribute"
            )
        with building_beside(self.partial, ".creating") as creating:
            options = {"libver": layout.LIBVER, "meta_block_size": layout.META_BLOCK_BYTES}
            with h5py.File(creating, "w", **options) as f:
                codec.write_attrs(f, plan.attrs)
                codec.write_attrs(f, {"featcache_format": FORMAT_VERSION, "capacity": plan.rows})
                f.attrs["complete"] = False
                add = layout.allocate_checked if plan.checksum else layout.allocate
                shapes: dict[str, tuple[tuple, Any]] = {"index": ((plan.rows,), np.int64)}
                shapes["ids"] = ((plan.rows,), h5py.string_dtype("utf-8", max(plan.ids_width, 1)))
                if plan.has_labels:
                    shapes["labels"] = ((plan.rows,), np.int64)
                if plan.stamps is not None:
                    width = plan.stamps.dtype.itemsize + layout.STAMP_ROOM
                    shapes[layout.STAMPS] = ((plan.rows,), np.dtype(f"S{width}"))
                tokens = max(plan.token_capacity or 0, 1)
                if ragged:
                    shapes["offsets"] = ((plan.rows + 1,), np.int64)
                    if token_ids:
                        shapes["token_ids"] = ((tokens,), np.int64)
                meta_rows = plan.chunk_rows or layout.chunk_rows_for((), 8, plan.rows)
                for name, (shape, dtype) in shapes.items():
                    add(f, name, shape, dtype, meta_rows)
                f.create_group("features", track_order=True)
                stored = codec.numpy_dtype(plan.dtype)
                scaled: list[str] = []
                for key, array in features.items():
                    shape = (tokens if key in ragged else plan.rows, *array.shape[1:])
                    rows = plan.chunk_rows or layout.chunk_rows_for(
                        shape[1:], stored.itemsize, shape[0]
                    )
                    dataset = add(f, f"features/{key}", shape, stored, rows)
                    per_token = {"layout": "tokens"} if key in ragged else {}
                    attrs = dict(feature_attrs.get(key, {}), dtype=plan.dtype, **per_token)
                    codec.write_attrs(dataset, attrs)
                    if plan.dtype in codec.QUANTIZED:  # a float32 scale per row (token)
                        scales = add(f, codec.scales_name(key), shape[:1], np.float32, rows)
                        codec.write_attrs(scales, per_token)
                        scaled.append(codec.scales_name(key))
                if plan.checksum:
                    codec.set_attr(f["checksums"], "algorithm", layout.CHECKSUM)
                names = [*shapes, *(f"features/{key}" for key in features), *scaled]
                progress = layout.allocate(f, layout.PROGRESS, (1 + len(names),), "<i8")
                progress[...] = 0
                codec.set_attr(progress, "datasets", json.dumps(names))
            replace_durably(creating, self.partial)
        self._open()

    def _open(self) -> None:
        """Open the ``.partial`` file for raw writes and find where each dataset lies."""
        durable = self.resume.durable if self.resume else {}
        with open_readonly(self.partial) as f:
            names = layout.dataset_names(f)
            self._progress_at = int(f[layout.PROGRESS].id.get_offset())
            columns = {}
            for name in names:
                dataset = f[name]
                addresses = layout.chunk_addresses(dataset)
                if addresses is None:
                    raise CorruptStoreError(
                        f"store {self.partial} is corrupted: the chunk index of {name} changed "
                        f"since the store was created; pass {OVERWRITE} to start over"
                    )
                sums = f.get(layout.checksums_name(name))
                per_token = name == "token_ids" or codec.attr(dataset, "layout") == "tokens"
                start = self.tokens_appended if per_token else self.rows_appended
                columns[name] = _Column(
                    dataset,
                    addresses,
                    None if sums is None else int(sums.id.get_offset()),
                    start,
                    durable.get(name, 0),
                    int(name == "offsets"),
                    per_token,
                )
        self.fd = os.open(self.partial, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        for column in columns.values():
            column.fd = self.fd
        self._columns = columns
        if "offsets" in columns:  # where the first row to come starts
            columns["offsets"].push(np.array([self.tokens_appended], dtype=np.int64))

    def append(
        self,
        index: np.ndarray,
        ids: Sequence[str],
        labels: np.ndarray | None,
        features: Mapping[str, np.ndarray],
        feature_attrs: Mapping[str, Mapping[str, Any]] | None = None,
        skipped: Sequence[Mapping[str, Any]] = (),
        lengths: np.ndarray | None = None,
        token_ids: np.ndarray | None = None,
        ragged: frozenset[str] = frozenset(),
        scales: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Append ``len(index)`` rows and the skip records of source positions among them.

        ``index``: ``[rows]`` source positions; ``labels``: ``[rows]`` ints (or None);
        ``features[key]``: ``[rows, *shape]`` in the HDF5 dtype of the store dtype (see
        ``codec.as_array``). The layers in ``ragged`` are per-token: ``[sum(lengths),
        *shape]``, with their int64 ``token_ids`` ``[sum(lengths)]`` when given. An int8
        store's ``scales[key]`` are float32, one per row (token) of ``features[key]``.
        """
        for record in skipped:
            self._log_skip(dict(record))
        index = np.asarray(index, dtype=np.int64)
        rows = len(index)
        if rows == 0:
            return
        if self.fd is None:
            self._create(features, feature_attrs or {}, ragged, token_ids is not None)
        if self.rows_appended + rows > self.plan.rows:
            raise FeatcacheError(f"more rows than the {self.plan.rows} the store was sized for")
        self._check_layout(features, ragged)
        columns = self._columns
        if "offsets" in columns:
            if lengths is None:
                raise FeatcacheError(f"{self.path} holds per-token rows; append their lengths")
            ends = self.tokens_appended + np.cumsum(lengths, dtype=np.int64)
            if ends[-1] > (self.plan.token_capacity or 0):
                raise FeatcacheError(
                    f"more tokens than the {self.plan.token_capacity} the store was sized for; "
                    "the dataset's token_lengths do not match its items"
                )
            columns["offsets"].push(ends)
            if "token_ids" in columns and token_ids is not None:
                columns["token_ids"].push(np.asarray(token_ids, dtype=np.int64))
            self._ends = np.concatenate([self._ends, ends])
            self.tokens_appended = int(ends[-1])
        for key, array in features.items():
            columns[f"features/{key}"].push(array)
        if self.plan.dtype in codec.QUANTIZED:
            if scales is None or set(scales) != set(features):
                raise FeatcacheError(f"{self.path} holds int8 codes; append their scales")
            for key, scale in scales.items():
                columns[codec.scales_name(key)].push(scale)
        columns["index"].push(index)
        columns["ids"].push(np.char.encode(np.asarray(ids, dtype=str), "utf-8"))
        if "labels" in columns:
            columns["labels"].push(np.asarray(labels, dtype=np.int64))
        if layout.STAMPS in columns:  # b"" (unknown) where this run has no stamps
            stamps = self.plan.stamps
            columns[layout.STAMPS].push(np.zeros(rows, "S1") if stamps is None else stamps[index])
        self.rows_appended += rows
        if time.monotonic() - self._last_mark >= self.plan.mark_seconds:
            self.mark()

    def _log_skip(self, record: dict[str, Any]) -> None:
        if self._log is None:
            self._log = open(skipped_log_path(self.path), "a", encoding="utf-8")  # noqa: SIM115
        self._log.write(json.dumps(record) + "\n")
        self.skipped.append(record)

    def _check_layout(self, features: Mapping[str, np.ndarray], ragged: frozenset[str]) -> None:
        """Refuse a batch whose layers differ from the store's (per-token or not, shape)."""
        for key, array in features.items():
            column = self._columns[f"features/{key}"]
            if column.per_token != (key in ragged):
                raise FeatcacheError(
                    f"layer {key!r} gives per-token rows for padded batches and one row of "
                    "all its tokens for batches that needed no padding; give the dataset's "
                    "items an attention_mask (every batch then stores per-token rows) or "
                    "reduce the tokens (mean, max, cls, last)"
                )
            if column.entry_shape != array.shape[1:]:
                got = "per-token rows" if key in ragged else "one row per sample"
                raise FeatcacheError(
                    f"layer {key!r} changed shape between batches (now {got} of shape "
                    f"{list(array.shape[1:])}, stored {list(column.entry_shape)}); reduce it "
                    "to a fixed shape (mean, cls, last, avg, ...)"
                )

    @property
    def durable_rows(self) -> int:
        """Rows whose entries lie in whole chunks written to every dataset."""
        columns = self._columns.values()
        if not columns:
            return self.rows_appended
        rows = min(c.durable - c.lead for c in columns if not c.per_token)
        tokens = [c.durable for c in columns if c.per_token]
        if tokens:
            covered = int(np.searchsorted(self._ends, min(tokens), side="right"))
            rows = min(rows, self._ends_base + covered)
        return max(0, min(rows, self.rows_appended))  # offsets lead: -1 before a whole chunk

    def mark(self, wait: bool = False) -> None:
        """Record in ``/progress`` the whole chunks written so far once the file is synced, on
        the sync thread; ``wait``: until it is recorded."""
        self._last_mark = time.monotonic()
        if self._log is not None:  # the skip records before any mark that counts them
            self._log.flush()
            os.fsync(self._log.fileno())
        if self.fd is None:
            return
        if wait or self._syncing is not None and self._syncing.done():
            self._wait()
        rows = self.durable_rows
        record = [rows, *(c.durable for c in self._columns.values())]
        if record != self._marked and self._syncing is None:
            self._marked = record
            marked = np.array(record, dtype="<i8")
            self._syncing = self._syncer.submit(self._sync, self.fd, marked)
            drop = max(0, rows - self._ends_base)
            self._ends, self._ends_base = self._ends[drop:], self._ends_base + drop
        if wait:
            self._wait()

    def _wait(self) -> None:
        """Wait for the mark being recorded, if any: its error is the writer's."""
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            syncing.result()

    def _sync(self, fd: int, record: np.ndarray) -> None:
        # The chunks are on the disk before the mark that counts them is written. The
        # file's size and layout never change, so syncing its data (fdatasync) is enough.
        _datasync(fd)
        _write_all(fd, record, self._progress_at)

    def close(
        self,
        complete: bool = False,
        attrs: Mapping[str, Any] | None = None,
        row_columns: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Close. With ``complete=True``, finish the store and move it into place; otherwise
        mark the whole chunks written (best effort), so that a rerun resumes from them.
        ``row_columns`` (``[source rows]`` each) are stored, for the rows written, as 1-d
        datasets of those names."""
        try:
            if complete:
                self._finish(attrs or {}, row_columns or {})
            else:
                with contextlib.suppress(Exception):  # e.g. the disk that just filled up
                    self.mark(wait=True)
        finally:
            with contextlib.suppress(Exception):  # a failed run's mark: nothing to add
                self._wait()
            self._syncer.shutdown()
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def _finish(self, attrs: Mapping[str, Any], row_columns: Mapping[str, np.ndarray]) -> None:
        if self.fd is None:
            raise FeatcacheError(
                f"no rows to write to {self.path}: every sample was skipped "
                f"({len(self.skipped)} skipped; see the messages above)"
            )
        for column in self._columns.values():
            column.write_tail()
        _datasync(self.fd)  # every row is on the disk before the store says it is complete
        self.mark(wait=True)
        os.close(self.fd)
        self.fd = None
        rows = self.rows_appended
        if self.resume is not None:
            self._check_written()
        with h5py.File(self.partial, "r+", libver=layout.LIBVER, locking=False) as f:
            for name, column in self._columns.items():
                size = self.tokens_appended if column.per_token else rows + column.lead
                if len(f[name]) != size:  # samples were skipped, or fewer tokens than sized for
                    f[name].resize(size, axis=0)
                    if self.plan.checksum and size % column.rows:
                        # HDF5 zeroes the entries of the last chunk past the new size, such
                        # as durable rows a sealed shard leaves out.
                        layout.refresh_checksum(f, name, size // column.rows)
            chunk_rows = self._columns["index"].rows
            for name in [*row_columns, "skipped"]:
                for stale in (name, f"checksums/{name}"):  # from a stopped completion
                    if stale in f:
                        del f[stale]
            index = f["index"][:rows]
            for name, per_source_row in row_columns.items():
                values = np.asarray(per_source_row)[index]
                layout.write_checked(f, name, values, chunk_rows, self.plan.checksum)
            if self.skipped:
                records = sorted(self.skipped, key=lambda r: r["index"])
                write_skipped(f, records, chunk_rows, self.plan.checksum)
            codec.write_attrs(f, attrs)
            codec.write_attrs(f, {"num_rows": rows, "rows_written": rows})
            f.attrs["skipped"] = len(self.skipped)
            f.flush()  # every row is on disk before the flag says so
            f.attrs["complete"] = True
            seal(f)  # last: the digest covers every attribute written above
        if self.plan.compression is not None:
            copy_store(self.partial, self.path, self.plan.compression)
            self.partial.unlink()
        else:
            replace_durably(self.partial, self.path)
        skipped_log_path(self.path).unlink(missing_ok=True)

    def _check_written(self) -> None:
        """Check every chunk this run wrote, found as plain HDF5 finds it: a resumed store's
        damaged chunk index would make HDF5 read it otherwise than it was written."""
        assert self.resume is not None
        with open_readonly(self.partial) as f:
            bad = scan_file(f, after=self.resume.durable)
            if bad:
                raise CorruptStoreError(
                    f"store {self.partial} is corrupted: {bad[0].describe(f)}; pass "
                    f"{OVERWRITE} to start over"
                )

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(complete=False)


class _Column:
    """One dataset being written: entries gathered into whole chunks, each written at its
    place in the file (``addresses``) with its checksum. ``start`` is the entry the first
    pushed value is; values below ``durable`` (already written) are dropped."""

    def __init__(
        self,
        dataset: h5py.Dataset,
        addresses: np.ndarray,
        sums_at: int | None,
        start: int,
        durable: int,
        lead: int,
        per_token: bool,
    ):
        self.name, self.addresses, self.sums_at = dataset.name, addresses, sums_at
        self.lead, self.per_token, self.length = lead, per_token, len(dataset)
        self.fd = -1
        self.entry_shape = tuple(dataset.shape[1:])
        self.rows = dataset.chunks[0]
        self.dtype = dataset.dtype
        self.entry_bytes = self.dtype.itemsize * int(np.prod(self.entry_shape, dtype=np.int64))
        self.chunk = np.zeros((self.rows, *self.entry_shape), dtype=self.dtype)
        self.next = start  # the entry the next pushed value is
        self.written = max(durable, 0)  # entries in whole chunks written
        self.filled = 0  # entries gathered in ``chunk`` after ``written``

    @property
    def durable(self) -> int:
        """Entries in whole chunks written: a chunk boundary, or the dataset's length."""
        whole = self.written // self.rows * self.rows
        return self.written if self.written == self.length else whole

    def push(self, values: np.ndarray) -> None:
        """Take the next ``len(values)`` entries."""
        values = np.ascontiguousarray(values, dtype=self.dtype)
        drop = min(max(self.written - self.next, 0), len(values))
        self.next += len(values)
        values = values[drop:]
        if self.filled:  # complete the chunk being filled
            take = min(self.rows - self.filled, len(values))
            self.chunk[self.filled : self.filled + take] = values[:take]
            self.filled += take
            values = values[take:]
            if self.filled == self.rows:
                self._write(self.chunk)
        if not self.filled:
            whole = len(values) // self.rows * self.rows
            if whole:
                self._write(values[:whole])  # straight from the batch
            self.filled = len(values) - whole
            self.chunk[: self.filled] = values[whole:]
        if self.filled and self.written + self.filled == self.length:
            self.write_tail()  # the dataset's last chunk is complete

    def write_tail(self) -> None:
        """Write the chunk being filled, its entries not gathered yet as zero bytes."""
        if self.filled:
            self.chunk.reshape(-1).view(np.uint8)[self.filled * self.entry_bytes :] = 0
            self._write(self.chunk, entries=self.filled)

    def _write(self, values: np.ndarray, entries: int | None = None) -> None:
        """Write ``values`` (whole chunks) at entry ``written``, and their checksums."""
        raw = values.reshape(-1).view(np.uint8)
        size = self.rows * self.entry_bytes
        first = self.written // self.rows
        for at in range(0, len(raw), size):
            _write_all(self.fd, raw[at : at + size], int(self.addresses[first + at // size]))
        if self.sums_at is not None:
            sums = [layout.checksum(raw[i : i + size]) for i in range(0, len(raw), size)]
            _write_all(self.fd, np.array(sums, dtype="<u8"), self.sums_at + 8 * first)
        added = len(values) if entries is None else entries
        self.written = min(self.written + added, self.length)
        self.filled = 0


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    """Write all of ``data``'s bytes at ``offset`` (``pwrite`` may write fewer at once)."""
    view = data.reshape(-1).view(np.uint8).data
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done
