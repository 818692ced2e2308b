"""Writing a store: crash-safe appends in whole chunks, durable progress marks, completion."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import h5py
import numpy as np

from featcache.errors import CorruptStoreError, FeatcacheError
from featcache.provenance import FORMAT_VERSION
from featcache.store import codec
from featcache.store.chunks import MAX_META_CHUNK_ROWS, chunk_rows_for
from featcache.store.durable import durable_entries
from featcache.store.integrity import damaged_index
from featcache.store.merge import copy_store
from featcache.store.metadata import record_chunk_indexes, seal
from featcache.store.paths import OVERWRITE, partial_path, replace_durably, skipped_log_path
from featcache.store.resume import ResumePoint
from featcache.store.skipped import rewrite_log, write_skipped
from featcache.store.sparse import created_sparse
from featcache.store.staged import Staged, read_durable

MARK_SECONDS = 0.5  # how often durable progress is recorded while writing


class StoreWriter:
    """Writes one store, crash-safely, to ``<path>.partial``; renamed to ``path`` when complete.

    The file is created on the first batch, when feature shapes are known, with every
    dataset allocated to its full size up front (disk space is taken as rows are written):
    afterwards the run only writes raw data into space that already exists and never
    changes HDF5 metadata, so a crash at any instant cannot corrupt the file's structure.
    Each dataset stages rows in a one-chunk buffer and writes whole chunks. At most every
    ``mark_seconds`` the writer writes the rows of the chunks still filling too, flushes
    and fsyncs the file, and then records in ``/progress`` that every row appended so far
    is durable; a rerun resumes from there (:func:`~featcache.store.resume.plan_resume`).
    Skipped samples go to an append-only log beside the file until the store completes.

    ``close(complete=True)`` writes the tail, the skip records and the final attributes,
    compresses if asked (a copy into a new file), and renames the store into place.

    With ``checksum`` (the default) every chunked dataset (features, labels, index, ids)
    gets HDF5's Fletcher-32 filter: each chunk carries a checksum that HDF5 checks on
    every read (and featcache's readers once per open store). Whole chunks are written
    as stored, their checksum computed by :mod:`~featcache.store.fletcher`.
    A resumed store keeps the filters it was created with.

    Per-token rows: a layer appended as *ragged* (its values packed as ``[tokens, ...]``,
    one block of ``lengths[i]`` tokens per row) is stored as one ``[total_tokens, ...]``
    dataset (attribute ``layout="tokens"``), allocated for ``token_capacity`` tokens, with
    ``/offsets`` ``[N + 1]`` int64 (row ``i`` is tokens ``offsets[i]:offsets[i + 1]``) and,
    when given, ``/token_ids`` ``[total_tokens]`` int64. A row is durable once its tokens
    are, so a resume restarts at a row boundary in every dataset.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        capacity: int,
        *,
        ids_width: int,
        dtype: str = "float16",
        compression: str | None = None,
        chunk_rows: int | None = None,
        checksum: bool = True,
        has_labels: bool = True,
        attrs: Mapping[str, Any] | None = None,
        resume: ResumePoint | None = None,
        mark_seconds: float = MARK_SECONDS,
        token_capacity: int | None = None,
    ):
        self.path = Path(path)
        self.partial = partial_path(self.path)
        self.capacity = capacity
        self.ids_width = max(1, ids_width)
        self.dtype = dtype
        self.compression = compression
        self.chunk_rows = chunk_rows
        self.checksum = checksum
        self.has_labels = has_labels
        self.attrs = dict(attrs or {})
        self.mark_seconds = mark_seconds
        self.resumed = resume is not None
        self.start_row = resume.row if resume else 0
        self.rows_appended = self.start_row
        self.skipped: list[dict[str, Any]] = list(resume.skipped) if resume else []
        self.token_capacity = token_capacity
        self.tokens_appended = 0  # set from /offsets on resume
        self.file: h5py.File | None = None
        self._staging: dict[str, Staged] = {}
        self._token_staging: list[Staged] = []  # the staged datasets indexed by token
        # End offsets of the rows appended since row ``_ends_base`` whose durability is
        # not yet known (per-token stores only; trimmed at every mark).
        self._ends = np.empty(0, dtype=np.int64)
        self._ends_base = self.start_row
        self._marked = self.start_row
        self._last_mark = time.monotonic()
        log = skipped_log_path(self.path)
        if resume is not None:
            # Keep only the records before the resume point; later ones are redone.
            rewrite_log(log, self.skipped)
            self._open_partial()
        elif log.exists():
            log.unlink()
        self._log: TextIO | None = None

    # -- creation and resume -------------------------------------------------------------

    def _create(
        self,
        features: Mapping[str, np.ndarray],
        feature_attrs: Mapping,
        ragged: frozenset[str] = frozenset(),
        token_ids: bool = False,
    ) -> None:
        """Create the whole file under a temporary name, then rename it to ``.partial``."""
        if ragged and self.token_capacity is None:
            raise FeatcacheError(
                f"layer {sorted(ragged)[0]!r} gives per-token rows, but {self.path} was not "
                "sized for tokens; give the dataset a token_lengths attribute"
            )
        creating = self.partial.with_name(self.partial.name + ".creating")
        try:
            with created_sparse(creating) as building:  # zero fill left unwritten; synced
                self._build(building, features, feature_attrs, ragged, token_ids)
            f = h5py.File(creating, "r+", rdcc_nbytes=0)  # whole-chunk writes skip the cache
        except BaseException:
            creating.unlink(missing_ok=True)
            raise
        os.replace(creating, self.partial)  # the open handle follows the rename
        self.file = f
        self._stage()

    def _build(
        self,
        f: h5py.File,
        features: Mapping[str, np.ndarray],
        feature_attrs: Mapping,
        ragged: frozenset[str],
        token_ids: bool,
    ) -> None:
        """Lay out every dataset of a new store in ``f``, allocated to its full size."""
        f.attrs["featcache_format"] = FORMAT_VERSION
        f.attrs["complete"] = False
        f.attrs["capacity"] = self.capacity
        codec.write_attrs(f, self.attrs)
        _allocate(f, "progress", (1,), np.int64, None)
        meta_rows = self.chunk_rows or min(self.capacity, MAX_META_CHUNK_ROWS)
        for name, dtype in self._meta_dtypes().items():
            _allocate(f, name, (self.capacity,), dtype, meta_rows, self.checksum)
        tokens = max(self.token_capacity or 0, 1)
        if ragged:
            offsets = _allocate(
                f, "offsets", (self.capacity + 1,), np.int64, meta_rows, self.checksum
            )
            offsets[0] = 0
            if token_ids:
                _allocate(f, "token_ids", (tokens,), np.int64, meta_rows, self.checksum)
        group = f.create_group("features", track_order=True)
        for key, array in features.items():
            shape = array.shape[1:]
            length = tokens if key in ragged else self.capacity
            chunk = self.chunk_rows or chunk_rows_for(shape, self.dtype, length)
            dataset = _allocate(
                group, key, (length, *shape), codec.numpy_dtype(self.dtype), chunk, self.checksum
            )
            layout = {"layout": "tokens"} if key in ragged else {}
            codec.write_attrs(dataset, dict(feature_attrs.get(key, {}), dtype=self.dtype, **layout))
        record_chunk_indexes(f)  # never changed by the run: a resume compares its file to these

    def _meta_dtypes(self) -> dict[str, Any]:
        dtypes = {"index": np.int64, "ids": h5py.string_dtype("utf-8", self.ids_width)}
        if self.has_labels:
            dtypes["labels"] = np.int64
        return dtypes

    def _open_partial(self) -> None:
        self.file = h5py.File(self.partial, "r+", rdcc_nbytes=0)
        try:
            if "offsets" in self.file:
                self.tokens_appended = self._durable_offset(self.start_row)
            self._stage()
        except BaseException:  # e.g. damaged rows at the resume point: left as found
            self.file.close()
            self.file = None
            raise

    def _durable_offset(self, row: int) -> int:
        """``/offsets[row]`` of the partial file, for a row at most the durable ones."""
        assert self.file is not None
        offsets = self.file["offsets"]
        return int(read_durable(offsets, row, row + 1, durable_entries(offsets))[0])

    def _stage(self) -> None:
        f = self.file
        assert f is not None
        rows, tokens = self.start_row, self.tokens_appended
        staging = {name: Staged(f[name], rows) for name in self._meta_dtypes()}
        if "offsets" in f:
            staging["offsets"] = Staged(f["offsets"], rows, lead=1)
            if "token_ids" in f:
                staging["token_ids"] = Staged(f["token_ids"], tokens, per_token=True)
        for key, dataset in f["features"].items():
            if codec.attr(dataset, "layout") == "tokens":
                staging[f"features/{key}"] = Staged(dataset, tokens, per_token=True)
            else:
                staging[f"features/{key}"] = Staged(dataset, rows)
        self._staging = staging
        self._token_staging = [staged for staged in staging.values() if staged.per_token]

    # -- appending ---------------------------------------------------------------------------

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
    ) -> None:
        """Append ``len(index)`` rows and the skip records of source positions among them.

        ``index``: ``[rows]`` source positions; ``labels``: ``[rows]`` ints (None without
        labels); ``features[key]``: ``[rows, *shape]`` in the HDF5 dtype of the store dtype
        (``codec.to_numpy(codec.encode(x, dtype))``: ``uint16`` bits for bfloat16). The
        layers in ``ragged`` are per-token rows instead: ``[sum(lengths), *shape]``, row
        ``i`` owning ``lengths[i]`` consecutive tokens, whose ids ``token_ids`` (int64
        ``[sum(lengths)]``) are stored beside them when given.
        """
        for record in skipped:
            self._log_skip(dict(record))
        rows = len(index)
        if rows == 0:
            return
        if self.file is None:
            self._create(features, feature_attrs or {}, ragged, token_ids is not None)
        if self.rows_appended + rows > self.capacity:
            raise FeatcacheError(f"more rows than the {self.capacity} the store was sized for")
        self._check_layout(features, ragged)
        if self._token_staging:
            if lengths is None:
                raise FeatcacheError(f"{self.path} holds per-token rows; append their lengths")
            ends = self.tokens_appended + np.cumsum(lengths, dtype=np.int64)
            if self.token_capacity is not None and ends[-1] > self.token_capacity:
                raise FeatcacheError(
                    f"more tokens than the {self.token_capacity} the store was sized for; "
                    "the dataset's token_lengths do not match its items"
                )
            self._staging["offsets"].push(ends)
            if "token_ids" in self._staging and token_ids is not None:
                self._staging["token_ids"].push(np.asarray(token_ids, dtype=np.int64))
            self._ends = np.concatenate([self._ends, ends])
            self.tokens_appended = int(ends[-1])
        for key, array in features.items():
            self._staging[f"features/{key}"].push(array)
        self._staging["index"].push(np.asarray(index, dtype=np.int64))
        self._staging["ids"].push(np.char.encode(np.asarray(ids, dtype=str), "utf-8"))
        if self.has_labels:
            self._staging["labels"].push(np.asarray(labels, dtype=np.int64))
        self.rows_appended += rows
        if time.monotonic() - self._last_mark >= self.mark_seconds:
            self.mark()

    def _log_skip(self, record: dict[str, Any]) -> None:
        if self._log is None:
            self._log = open(skipped_log_path(self.path), "a", encoding="utf-8")  # noqa: SIM115
        self._log.write(json.dumps(record) + "\n")
        self.skipped.append(record)

    def _check_layout(self, features: Mapping[str, np.ndarray], ragged: frozenset[str]) -> None:
        """Refuse a batch whose layers differ from the store's (per-token or not, shape)."""
        for key, array in features.items():
            staged = self._staging[f"features/{key}"]
            if staged.per_token != (key in ragged):
                raise FeatcacheError(
                    f"layer {key!r} gives per-token rows for padded batches and one row of "
                    "all its tokens for batches that needed no padding; give the dataset's "
                    "items an attention_mask (every batch then stores per-token rows) or "
                    "reduce the tokens (mean, max, cls, last)"
                )
            if staged.item_shape != array.shape[1:]:
                got = "per-token rows" if key in ragged else "one row per sample"
                raise FeatcacheError(
                    f"layer {key!r} changed shape between batches (now {got} of shape "
                    f"{list(array.shape[1:])}, stored {list(staged.item_shape)}); reduce it "
                    "to a fixed shape (mean, cls, last, avg, ...)"
                )

    @property
    def durable_rows(self) -> int:
        """Rows written to every dataset (rows only staged not included)."""
        if not self._staging:
            return self.start_row
        rows = min(
            staged.written - staged.lead
            for staged in self._staging.values()
            if not staged.per_token
        )
        if self._token_staging:
            tokens = min(staged.written for staged in self._token_staging)
            covered = int(np.searchsorted(self._ends, tokens, side="right"))
            rows = min(rows, self._ends_base + covered)
        return rows

    def mark(self, *, write_staged: bool = True) -> None:
        """Make every appended row durable, then record the count in ``/progress``.

        With ``write_staged=False`` only rows already written count (after a failed write).
        """
        self._last_mark = time.monotonic()
        if self._log is not None:
            self._log.flush()
            os.fsync(self._log.fileno())
        if write_staged:  # else a store smaller than one chunk would mark nothing
            for staged in self._staging.values():
                staged.write_staged()
        durable = self.durable_rows
        if self.file is None or durable == self._marked:
            return
        self.file.flush()
        # The data is on disk before the mark is. The file was allocated whole at creation,
        # so flushing its data (fdatasync) is enough; its size and layout do not change.
        _datasync(self.file.id.get_vfd_handle())
        self.file["progress"][0] = durable
        self.file.flush()
        self._marked = durable
        if len(self._ends):  # rows before the durable one need no more tracking
            drop = max(0, durable - self._ends_base)
            self._ends, self._ends_base = self._ends[drop:], self._ends_base + drop

    # -- closing ---------------------------------------------------------------------------

    def close(
        self,
        complete: bool = False,
        attrs: Mapping[str, Any] | None = None,
        row_columns: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Close. With ``complete=True``, finish the store and move it into place; otherwise
        keep what was appended (best effort) so that a rerun resumes.

        ``row_columns`` are per-source-row arrays (``[source rows]``, indexed by source
        position, e.g. a text source's ``truncated`` flags): each is stored, for the rows
        written, as a 1-d dataset of that name when the store completes.
        """
        try:
            if complete:
                self._finish(attrs or {}, row_columns or {})
            else:
                for staged in self._staging.values():
                    with contextlib.suppress(Exception):  # e.g. the disk that just filled up
                        staged.flush()
                with contextlib.suppress(Exception):
                    self.mark(write_staged=False)  # counts only the datasets that did flush
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.file is not None and self.file.id.valid:
                self.file.close()

    def _finish(self, attrs: Mapping[str, Any], row_columns: Mapping[str, np.ndarray]) -> None:
        if self.file is None:
            raise FeatcacheError(
                f"no rows to write to {self.path}: every sample was skipped "
                f"({len(self.skipped)} skipped; see the messages above)"
            )
        for staged in self._staging.values():
            staged.flush()
        self.mark()
        if self.resumed:  # a file that sat on disk: its chunk index may have been damaged
            self._check_indexes()
        f = self.file
        rows = self.rows_appended
        for name, staged in self._staging.items():
            size = self.tokens_appended if staged.per_token else rows + staged.lead
            if len(f[name]) != size:  # samples were skipped, or fewer tokens than sized for
                f[name].resize(size, axis=0)
        for name in [*row_columns, "skipped"]:
            if name in f:  # written by a run that stopped while it moved the store into place
                del f[name]
        if row_columns:
            index = f["index"][:rows]
            for name, column in row_columns.items():
                f.create_dataset(name, data=np.asarray(column)[index])
        if self.skipped:
            write_skipped(f, sorted(self.skipped, key=lambda r: r["index"]))
        codec.write_attrs(f, attrs)
        f.attrs["num_rows"] = rows
        f.attrs["rows_written"] = rows
        f.attrs["skipped"] = len(self.skipped)
        f.flush()  # every row is on disk before the flag says so
        f.attrs["complete"] = True
        seal(f)  # last: the digest covers every attribute written above
        f.close()
        if self.compression is not None:
            copy_store(self.partial, self.path, self.compression)
            self.partial.unlink()
        else:
            replace_durably(self.partial, self.path)
        skipped_log_path(self.path).unlink(missing_ok=True)

    def _check_indexes(self) -> None:
        """Refuse to complete a resumed store whose chunk index has gone wrong: a damaged
        index can make HDF5 write a chunk as a second copy beside the one it lists, so
        that readers of the store would disagree on its rows."""
        assert self.file is not None
        problem = damaged_index(self.file)
        if problem:
            raise CorruptStoreError(
                f"store {self.partial} is corrupted: {problem}; pass {OVERWRITE} to start over"
            )

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(complete=False)


_datasync = getattr(os, "fdatasync", os.fsync)  # fdatasync: Linux; fsync elsewhere


def _allocate(
    group: h5py.Group,
    name: str,
    shape: tuple,
    dtype: Any,
    chunk_rows: int | None,
    checksum: bool = False,
) -> h5py.Dataset:
    """A dataset whose storage is allocated now, so writes never add metadata.

    Unfiltered storage is only reserved (no fill). With ``checksum`` (chunked datasets
    only) HDF5 fills every chunk at allocation, whatever the fill time: zeros with their
    Fletcher-32 checksum (also zeros), which a file built by
    :func:`~featcache.store.sparse.created_sparse` leaves unwritten. A chunk's
    checksummed size never changes, so later writes stay in place.
    """
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    options: dict[str, Any] = {}
    if chunk_rows is not None:
        options["chunks"] = (min(chunk_rows, shape[0]), *shape[1:])
        options["maxshape"] = (None, *shape[1:])  # shrinks at the end if samples were skipped
        options["fletcher32"] = checksum
    return group.create_dataset(
        name, shape=shape, dtype=dtype, dcpl=dcpl, fill_time="never", **options
    )
