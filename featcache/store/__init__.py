"""The HDF5 store: one file per split, readable by any HDF5 tool.

Layout::

    /features/<key>  [N, *shape]  float16 | float32 | bfloat16 (stored as uint16 bits)
    /labels          [N] int64    (absent when the source has no labels)
    /index           [N] int64    position of the row in the source dataset
    /ids             [N] utf-8    stable sample ids

File attributes hold the format version, the ``complete`` flag, the durable row count
(``rows_written``) and the provenance (resolved config, fingerprints, weights identity,
library versions, class names, creation time) as JSON strings. No pickles anywhere.

:class:`StoreWriter` appends batches through per-dataset staging buffers and writes
HDF5 in whole chunks; :class:`FeatureStore` reads a store back.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from tqdm.auto import tqdm

from featcache.errors import ConfigError, FeatcacheError
from featcache.store.codec import DTYPES, JSON_ATTRS, encode

FORMAT_VERSION = 1
TARGET_CHUNK_BYTES = 1 << 20  # about 1 MiB per chunk: big sequential reads, small waste
MAX_META_CHUNK_ROWS = 4096
MARK_SECONDS = 0.5  # how often durable progress is recorded while writing
PARTIAL_SUFFIX = ".partial"
SKIPPED_SUFFIX = ".skipped.jsonl"
READ_CACHE_BYTES = 16 << 20  # HDF5 chunk cache per open dataset: holds several whole chunks
_NUMPY_DTYPES = {name: np_dtype for name, (_, np_dtype) in DTYPES.items()}
TORCH_DTYPES = {name: t_dtype for name, (t_dtype, _) in DTYPES.items()}
_JSON_ATTRS = JSON_ATTRS
to_store_dtype = encode


def chunk_rows_for(row_shape: Sequence[int], dtype: str, num_rows: int) -> int:
    """Rows per chunk so that one chunk holds about :data:`TARGET_CHUNK_BYTES`."""
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
    return int(max(1, min(num_rows, TARGET_CHUNK_BYTES // max(row_bytes, 1))))


def check_output_path(path: Path, overwrite: bool) -> None:
    """Refuse to clobber a complete store, and fail early when the folder cannot take one."""
    if path.exists() and not overwrite:
        raise ConfigError(f"store already exists: {path}; pass --overwrite to replace it")
    if path.exists() and path.is_dir():
        raise ConfigError(f"output path {path} is a folder; give a file path ending in .h5")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create output folder {folder}: {exc.strerror}") from exc
    try:  # a real write: permission bits alone say nothing for root or read-only mounts
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            f"output folder {folder} is not writable ({exc.strerror}); choose another output dir"
        ) from exc


def partial_path(path: str | os.PathLike) -> Path:
    """Where the store at ``path`` lives while it is being written."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL_SUFFIX)


def skipped_log_path(path: str | os.PathLike) -> Path:
    """The append-only log of skipped samples kept beside a partial store."""
    path = Path(path)
    return path.with_name(path.name + SKIPPED_SUFFIX)


def remove_store(path: str | os.PathLike) -> None:
    """Delete a store and any partial state of it (``--overwrite``)."""
    for candidate in (Path(path), partial_path(path), skipped_log_path(path)):
        if candidate.exists():
            candidate.unlink()


def stored_resume_key(path: str | os.PathLike) -> dict[str, Any] | None:
    """The settings a store (complete or partial) was made with; None if unreadable."""
    try:
        with h5py.File(path, "r") as f:
            return json.loads(f.attrs["resume_key"])
    except (OSError, KeyError, ValueError):
        return None


@dataclass
class ResumePoint:
    """Where an interrupted extraction continues: rows ``[0, row)`` are kept and the
    source is read again from ``position`` (a multiple of the batch size)."""

    row: int
    position: int
    skipped: list[dict[str, Any]]  # skip records of source positions before ``position``


def plan_resume(
    path: str | os.PathLike, resume_key: Mapping[str, Any], batch_size: int, first: int = 0
) -> ResumePoint | None:
    """Check a partial store left by an earlier run; None when there is none.

    Raises :class:`ConfigError` naming the first difference when the partial store was
    made with other settings, data or model, and when it cannot be read.
    """
    partial = partial_path(path)
    if not partial.exists():
        return None
    try:
        with h5py.File(partial, "r") as f:
            stored_key = json.loads(f.attrs["resume_key"])
            durable = int(f["progress"][0])
            index = f["index"][:durable]
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(
            f"cannot resume from {partial}: it is not readable ({_first_line(exc)}); "
            "pass --overwrite to start over"
        ) from exc
    for key in sorted(set(stored_key) | set(resume_key)):
        if stored_key.get(key) != resume_key.get(key):
            raise ConfigError(
                f"cannot resume {partial}: its {key.replace('_', ' ')} differs from this "
                f"run's ({_short(stored_key.get(key))} vs {_short(resume_key.get(key))}); "
                "pass --overwrite to start over"
            )
    next_position = int(index[-1]) + 1 if durable else first
    # Restart on the batch grid of the first run (batches start at ``first``), so that every
    # batch holds the same samples as in an uninterrupted run: batch composition can
    # change the last bits of a result.
    position = first + (next_position - first) // batch_size * batch_size
    row = int(np.searchsorted(index, position))
    log = skipped_log_path(path)
    skipped = []
    if log.exists():
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line torn by a crash
                record = json.loads(line)
                if isinstance(record, dict) and record.get("index", position) < position:
                    skipped.append(record)
    return ResumePoint(row, position, skipped)


class StoreWriter:
    """Writes one store, crash-safely, to ``<path>.partial``; renamed to ``path`` when complete.

    The file is created on the first batch, when feature shapes are known, with every
    dataset allocated to its full size up front: afterwards the run only writes raw data
    into space that already exists and never changes HDF5 metadata, so a crash at any
    instant cannot corrupt the file's structure. Each dataset stages rows in a one-chunk
    buffer and writes whole chunks. At most every ``mark_seconds`` the writer flushes and
    fsyncs the file and then records in ``/progress`` how many rows are durable in every
    dataset; a rerun resumes from there (:func:`plan_resume`). Skipped samples go to an
    append-only log beside the file until the store completes.

    ``close(complete=True)`` writes the tail, the skip records and the final attributes,
    compresses if asked (a copy into a new file), and renames the store into place.
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
        has_labels: bool = True,
        attrs: Mapping[str, Any] | None = None,
        resume: ResumePoint | None = None,
        mark_seconds: float = MARK_SECONDS,
    ):
        self.path = Path(path)
        self.partial = partial_path(self.path)
        self.capacity = capacity
        self.ids_width = max(1, ids_width)
        self.dtype = dtype
        self.compression = compression
        self.chunk_rows = chunk_rows
        self.has_labels = has_labels
        self.attrs = dict(attrs or {})
        self.mark_seconds = mark_seconds
        self.start_row = resume.row if resume else 0
        self.rows_appended = self.start_row
        self.skipped: list[dict[str, Any]] = list(resume.skipped) if resume else []
        self.file: h5py.File | None = None
        self._staging: dict[str, _Staged] = {}
        self._marked = self.start_row
        self._last_mark = time.monotonic()
        log = skipped_log_path(self.path)
        if resume is not None:
            # Keep only the records before the resume point; later ones are redone.
            _write_atomically(log, "".join(json.dumps(r) + "\n" for r in self.skipped))
            self._open_partial()
        elif log.exists():
            log.unlink()
        self._log = None

    # -- creation and resume -------------------------------------------------------------

    def _create(self, features: Mapping[str, np.ndarray], feature_attrs: Mapping) -> None:
        """Create the whole file under a temporary name, then rename it to ``.partial``."""
        creating = self.partial.with_name(self.partial.name + ".creating")
        f = h5py.File(creating, "w", rdcc_nbytes=0)  # whole-chunk writes skip the cache
        try:
            f.attrs["featcache_format"] = FORMAT_VERSION
            f.attrs["complete"] = False
            f.attrs["capacity"] = self.capacity
            write_attrs(f, self.attrs)
            _allocate(f, "progress", (1,), np.int64, None)
            meta_rows = self.chunk_rows or min(self.capacity, MAX_META_CHUNK_ROWS)
            for name, dtype in self._meta_dtypes().items():
                _allocate(f, name, (self.capacity,), dtype, meta_rows)
            group = f.create_group("features", track_order=True)
            for key, array in features.items():
                shape = array.shape[1:]
                chunk = self.chunk_rows or chunk_rows_for(shape, self.dtype, self.capacity)
                dataset = _allocate(
                    group, key, (self.capacity, *shape), _NUMPY_DTYPES[self.dtype], chunk
                )
                for attr, value in dict(feature_attrs.get(key, {}), dtype=self.dtype).items():
                    dataset.attrs[attr] = value
            f.flush()
            os.fsync(f.id.get_vfd_handle())
        except BaseException:
            f.close()
            creating.unlink(missing_ok=True)
            raise
        os.replace(creating, self.partial)  # the open handle follows the rename
        self.file = f
        self._stage()

    def _meta_dtypes(self) -> dict[str, Any]:
        dtypes = {"index": np.int64, "ids": h5py.string_dtype("utf-8", self.ids_width)}
        if self.has_labels:
            dtypes["labels"] = np.int64
        return dtypes

    def _open_partial(self) -> None:
        self.file = h5py.File(self.partial, "r+", rdcc_nbytes=0)
        self._stage()

    def _stage(self) -> None:
        assert self.file is not None
        names = [*self._meta_dtypes(), *(f"features/{k}" for k in self.file["features"])]
        self._staging = {name: _Staged(self.file[name], self.start_row) for name in names}

    # -- appending ---------------------------------------------------------------------------

    def append(
        self,
        index: np.ndarray,
        ids: Sequence[str],
        labels: np.ndarray | None,
        features: Mapping[str, np.ndarray],
        feature_attrs: Mapping[str, Mapping[str, Any]] | None = None,
        skipped: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Append ``len(index)`` rows (``features[key]``: ``[rows, *shape]``) and the skip
        records of source positions among them."""
        for record in skipped:
            self._log_skip(dict(record))
        rows = len(index)
        if rows == 0:
            return
        if self.file is None:
            self._create(features, feature_attrs or {})
        if self.rows_appended + rows > self.capacity:
            raise FeatcacheError(f"more rows than the {self.capacity} the store was sized for")
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

    @property
    def durable_rows(self) -> int:
        """Rows written to every dataset (staged rows not included)."""
        if not self._staging:
            return self.start_row
        return min(staged.flushed for staged in self._staging.values())

    def mark(self) -> None:
        """Make every flushed row durable, then record the count in ``/progress``."""
        self._last_mark = time.monotonic()
        if self._log is not None:
            self._log.flush()
            os.fsync(self._log.fileno())
        durable = self.durable_rows
        if self.file is None or durable == self._marked:
            return
        self.file.flush()
        os.fsync(self.file.id.get_vfd_handle())  # the data is on disk before the mark is
        self.file["progress"][0] = durable
        self.file.flush()
        self._marked = durable

    # -- closing ---------------------------------------------------------------------------

    def close(self, complete: bool = False, attrs: Mapping[str, Any] | None = None) -> None:
        """Close. With ``complete=True``, finish the store and move it into place; otherwise
        keep what was appended (best effort) so that a rerun resumes."""
        try:
            if complete:
                self._finish(attrs or {})
            else:
                for staged in self._staging.values():
                    with contextlib.suppress(Exception):  # e.g. the disk that just filled up
                        staged.flush()
                with contextlib.suppress(Exception):
                    self.mark()  # counts only the datasets that did flush
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.file is not None and self.file.id.valid:
                self.file.close()

    def _finish(self, attrs: Mapping[str, Any]) -> None:
        if self.file is None:
            raise FeatcacheError(
                f"no rows to write to {self.path}: every sample was skipped "
                f"({len(self.skipped)} skipped; see the messages above)"
            )
        for staged in self._staging.values():
            staged.flush()
        self.mark()
        f = self.file
        rows = self.rows_appended
        if rows < self.capacity:  # samples were skipped
            for name in self._staging:
                f[name].resize(rows, axis=0)
        if self.skipped:
            write_skipped(f, sorted(self.skipped, key=lambda r: r["index"]))
        write_attrs(f, attrs)
        f.attrs["num_rows"] = rows
        f.attrs["rows_written"] = rows
        f.attrs["skipped"] = len(self.skipped)
        f.flush()  # every row is on disk before the flag says so
        f.attrs["complete"] = True
        f.close()
        if self.compression is not None:
            copy_store(self.partial, self.path, self.compression)
            self.partial.unlink()
        else:
            os.replace(self.partial, self.path)
        skipped_log_path(self.path).unlink(missing_ok=True)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(complete=False)


def _allocate(
    group: h5py.Group, name: str, shape: tuple, dtype: Any, chunk_rows: int | None
) -> h5py.Dataset:
    """A dataset whose storage is allocated now (no fill), so writes never add metadata."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    options: dict[str, Any] = {}
    if chunk_rows is not None:
        options["chunks"] = (min(chunk_rows, shape[0]), *shape[1:])
        options["maxshape"] = (None, *shape[1:])  # shrinks at the end if samples were skipped
    return group.create_dataset(
        name, shape=shape, dtype=dtype, dcpl=dcpl, fill_time="never", **options
    )


def write_attrs(f: h5py.File, attrs: Mapping[str, Any]) -> None:
    """Set file attributes; structured ones (config, weights, ...) as JSON strings."""
    for key, value in attrs.items():
        f.attrs[key] = json.dumps(value) if key in _JSON_ATTRS else value


def write_skipped(f: h5py.File, records: Sequence[Mapping[str, Any]]) -> None:
    """The ``/skipped`` group: source position, id and reason of every sample left out."""
    group = f.create_group("skipped")
    text = h5py.string_dtype("utf-8")
    group.create_dataset("index", data=np.array([r["index"] for r in records], dtype=np.int64))
    group.create_dataset("ids", data=[str(r["id"]) for r in records], dtype=text)
    group.create_dataset("reasons", data=[str(r["reason"]) for r in records], dtype=text)


def copy_store(
    source: str | os.PathLike,
    target: str | os.PathLike,
    compression: str | None = None,
    progress: bool = False,
    attrs: Mapping[str, Any] | None = None,
    drop: Sequence[str] = (),
) -> None:
    """Copy a store into one self-contained file, chunk by chunk, then move it into place.

    Virtual datasets (a sharded store) become real ones, chunked like featcache chunks
    its own; ``compression`` applies to every chunked dataset; ``attrs`` are set last and
    the file attributes named in ``drop`` are left out.
    """
    target = Path(target)
    tmp = target.with_name(target.name + ".copying")
    with h5py.File(source, "r") as src, h5py.File(tmp, "w") as dst:
        for key, value in src.attrs.items():
            if key not in drop:
                dst.attrs[key] = value
        objects = list(_walk(src))
        total = sum(o.size * o.dtype.itemsize for _, o in objects if isinstance(o, h5py.Dataset))
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=target.name, disable=not progress
        ) as bar:
            for name, obj in objects:
                if isinstance(obj, h5py.Group):
                    dst.create_group(name, track_order=name == "features")
                else:
                    _copy_dataset(obj, dst, name, compression, bar)
        write_attrs(dst, attrs or {})
    os.replace(tmp, target)


def _walk(group: h5py.Group, prefix: str = ""):
    """(name, object) for everything under ``group``, in creation order where tracked."""
    for key in group:
        obj = group[key]
        yield prefix + key, obj
        if isinstance(obj, h5py.Group):
            yield from _walk(obj, prefix + key + "/")


def _copy_dataset(
    obj: h5py.Dataset, dst: h5py.File, name: str, compression: str | None, bar: tqdm
) -> None:
    if obj.shape == () or len(obj) == 0:
        out = dst.create_dataset(name, data=obj[()], dtype=obj.dtype)
    else:
        row_bytes = max(int(np.prod(obj.shape[1:], dtype=np.int64)) * obj.dtype.itemsize, 1)
        chunks = obj.chunks
        if chunks is None:  # virtual: chunk like featcache does
            rows = TARGET_CHUNK_BYTES // row_bytes
            if obj.ndim == 1:
                rows = min(rows, MAX_META_CHUNK_ROWS)
            chunks = (int(min(max(rows, 1), len(obj))), *obj.shape[1:])
        out = dst.create_dataset(
            name, shape=obj.shape, dtype=obj.dtype, chunks=chunks, compression=compression
        )
        step = max(chunks[0], 8 * TARGET_CHUNK_BYTES // row_bytes)  # a few chunks per read
        for start in range(0, len(obj), step):
            block = obj[start : start + step]
            out[start : start + len(block)] = block
            bar.update(block.nbytes)
    for key, value in obj.attrs.items():
        out.attrs[key] = value


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:16] + "..." + text[-8:]


class _Staged:
    """One dataset plus a one-chunk staging buffer; writes whole chunks (the first write
    after a resume may complete a chunk that was partly written)."""

    def __init__(self, dataset: h5py.Dataset, start_row: int):
        self.dataset = dataset
        self.chunk_rows = dataset.chunks[0] if dataset.chunks else len(dataset)
        self.buffer = np.empty((self.chunk_rows, *dataset.shape[1:]), dtype=dataset.dtype)
        self.filled = 0  # rows in the buffer
        self.flushed = start_row  # rows written to the file

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
        if self.filled:
            self.dataset[self.flushed : self.flushed + self.filled] = self.buffer[: self.filled]
            self.flushed += self.filled
            self.filled = 0


class FeatureStore:
    """Read access to a store written by featcache.

    Metadata (layers, shapes, labels, ids, provenance) is read when needed; the file is
    opened lazily and reopened in a new process, so instances can be sent to workers.
    A store that is still being written (or whose run was interrupted) lives at
    ``<path>.partial``; opening it raises :class:`FeatcacheError` unless
    ``allow_incomplete=True``, and then only its durable rows are visible.
    """

    def __init__(self, path: str | os.PathLike, *, allow_incomplete: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            partial = partial_path(self.path)
            if not partial.is_file():
                raise ConfigError(f"store not found: {self.path}")
            if not allow_incomplete:
                rows = _durable_rows(partial)
                raise FeatcacheError(
                    f"store {self.path} is incomplete ({rows} rows written, in {partial.name}); "
                    "rerun the extraction to resume it, or pass allow_incomplete=True to read it"
                )
            self.path = partial
        self._file: h5py.File | None = None
        self._pid: int | None = None
        try:
            attrs = self.file.attrs
            if "featcache_format" not in attrs:
                raise ConfigError(f"{self.path} is an HDF5 file but not a featcache store")
        except OSError as exc:
            raise ConfigError(f"{self.path} is not a readable HDF5 store: {exc}") from exc

    @property
    def file(self) -> h5py.File:
        """The open ``h5py.File`` for this process (read-only)."""
        if self._file is None or self._pid != os.getpid() or not self._file.id.valid:
            self._file = open_for_reading(self.path)
            self._pid = os.getpid()
        return self._file

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid() and self._file.id.valid:
            self._file.close()
        self._file = None

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_file": None, "_pid": None}

    def __len__(self) -> int:
        """Rows that can be read: all of them, or the durable ones of an incomplete store."""
        return int(self.file.attrs["num_rows"]) if self.complete else self.rows_written

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        return f"FeatureStore({str(self.path)!r}, rows={len(self)}, layers={self.layers}, {state})"

    @property
    def complete(self) -> bool:
        return bool(self.file.attrs["complete"])

    @property
    def rows_written(self) -> int:
        """Rows durably written (all of them once the store is complete)."""
        if self.complete:
            return int(self.file.attrs["rows_written"])
        return int(self.file["progress"][0])

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """Samples left out under ``on_error: skip``: ``{"index", "id", "reason"}`` each."""
        if "skipped" not in self.file:
            return []
        group = self.file["skipped"]
        return [
            {"index": int(i), "id": sample_id, "reason": reason}
            for i, sample_id, reason in zip(
                group["index"][:],
                group["ids"].asstr()[:],
                group["reasons"].asstr()[:],
                strict=True,
            )
        ]

    @property
    def layers(self) -> list[str]:
        """Stored layer keys, in the order they were captured."""
        return list(self.file["features"])

    def shape(self, layer: str) -> tuple[int, ...]:
        """Shape of one row of ``layer`` (without the leading N)."""
        return tuple(self._features(layer).shape[1:])

    def dtype(self, layer: str) -> torch.dtype:
        """The torch dtype rows of ``layer`` come back as."""
        return TORCH_DTYPES[self._features(layer).attrs["dtype"]]

    def layer_attrs(self, layer: str) -> dict[str, Any]:
        return dict(self._features(layer).attrs)

    def _features(self, layer: str) -> h5py.Dataset:
        group = self.file["features"]
        if layer not in group:
            raise ConfigError(
                f"layer {layer!r} is not in store {self.path}; it holds: {', '.join(self.layers)}"
            )
        return group[layer]

    @property
    def has_labels(self) -> bool:
        return "labels" in self.file

    @property
    def labels(self) -> np.ndarray | None:
        """``[N]`` int64 labels, or None when the source had none."""
        return self.file["labels"][: len(self)] if self.has_labels else None

    @property
    def index(self) -> np.ndarray:
        """``[N]`` int64 position of each row in the source dataset."""
        return self.file["index"][: len(self)]

    @property
    def ids(self) -> list[str]:
        return list(self.file["ids"].asstr()[: len(self)])

    @property
    def attrs(self) -> dict[str, Any]:
        """File attributes, JSON values decoded."""
        out: dict[str, Any] = {}
        for key, value in self.file.attrs.items():
            if key in _JSON_ATTRS and isinstance(value, str):
                value = json.loads(value)
            elif isinstance(value, np.generic):
                value = value.item()
            out[key] = value
        return out

    @property
    def config(self) -> dict[str, Any] | None:
        """The resolved config the store was made with (None when made from Python)."""
        return self.attrs.get("config")

    @property
    def class_names(self) -> list[str] | None:
        return self.attrs.get("class_names")

    def read(
        self, layer: str, rows: slice | Sequence[int] | np.ndarray = slice(None)
    ) -> torch.Tensor:
        """Rows of ``layer`` as a tensor ``[n, *shape]`` in the stored dtype.

        ``rows`` is a slice or any sequence of row numbers (any order, repeats allowed);
        the file is read in increasing order and the result put back in the order asked.
        """
        if isinstance(rows, slice):
            rows = slice(*rows.indices(len(self)))
        return read_rows(self._features(layer), rows)


def _durable_rows(partial: Path) -> int:
    try:
        with h5py.File(partial, "r") as f:
            return int(f["progress"][0])
    except (OSError, KeyError):
        return 0


def open_for_reading(path: str | os.PathLike) -> h5py.File:
    """Open a store read-only with a chunk cache that holds whole chunks."""
    return h5py.File(path, "r", rdcc_nbytes=READ_CACHE_BYTES)


def read_rows(dataset: h5py.Dataset, rows: slice | Sequence[int] | np.ndarray) -> torch.Tensor:
    """Read rows from a features dataset into a tensor, undoing the bfloat16 encoding."""
    if isinstance(rows, slice):
        array = dataset[rows]
    else:
        wanted = np.asarray(rows, dtype=np.int64)
        unique, inverse = np.unique(wanted, return_inverse=True)
        array = dataset[unique] if len(unique) else dataset[0:0]
        array = array[inverse]
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if dataset.attrs.get("dtype") == "bfloat16":
        tensor = tensor.view(torch.int16).view(torch.bfloat16)
    return tensor
