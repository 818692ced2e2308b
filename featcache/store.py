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

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from featcache.errors import ConfigError, FeatcacheError

FORMAT_VERSION = 1
TARGET_CHUNK_BYTES = 1 << 20  # about 1 MiB per chunk: big sequential reads, small waste
MAX_META_CHUNK_ROWS = 4096
READ_CACHE_BYTES = 16 << 20  # HDF5 chunk cache per open dataset: holds several whole chunks
_NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}
_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
_JSON_ATTRS = ("config", "weights", "versions", "class_names", "source", "taps")


def to_store_dtype(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Cast a batch to the store's dtype, on its own device (bfloat16 as raw int16 bits)."""
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.int16)
    return x.to(_TORCH_DTYPES[dtype])


def chunk_rows_for(row_shape: Sequence[int], dtype: str, num_rows: int) -> int:
    """Rows per chunk so that one chunk holds about :data:`TARGET_CHUNK_BYTES`."""
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
    return int(max(1, min(num_rows, TARGET_CHUNK_BYTES // max(row_bytes, 1))))


def check_output_path(path: Path, overwrite: bool) -> None:
    """Refuse to clobber a store, and fail early when the folder cannot take one."""
    if path.exists() and not overwrite:
        raise ConfigError(f"store already exists: {path}; pass --overwrite to replace it")
    if path.exists() and path.is_dir():
        raise ConfigError(f"output path {path} is a folder; give a file path ending in .h5")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create output folder {folder}: {exc.strerror}") from exc
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"output folder {folder} is not writable; choose another output dir")


class StoreWriter:
    """Writes one store. Datasets for features are created on the first batch.

    ``append`` takes rows in order. Each dataset stages rows in a preallocated buffer of
    one chunk and writes whole chunks, so memory stays flat and HDF5 never rewrites a
    chunk. ``rows_written`` in the file attributes is the count of rows durably written
    to every dataset. ``close(complete=True)`` flushes the tail and marks the store
    complete; any other exit leaves ``complete=False``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        num_rows: int,
        *,
        dtype: str = "float16",
        compression: str | None = None,
        chunk_rows: int | None = None,
        has_labels: bool = True,
        attrs: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ):
        self.path = Path(path)
        check_output_path(self.path, overwrite)
        if num_rows < 1:
            raise ConfigError("the dataset is empty; there is nothing to extract")
        self.num_rows = num_rows
        self.dtype = dtype
        self.compression = compression
        self.chunk_rows = chunk_rows
        self.rows_appended = 0
        self._staging: dict[str, _Staged] = {}
        self.file = h5py.File(self.path, "w")
        try:
            self._init_file(has_labels, attrs or {})
        except BaseException:
            self.file.close()
            raise

    def _init_file(self, has_labels: bool, attrs: Mapping[str, Any]) -> None:
        f = self.file
        f.attrs["featcache_format"] = FORMAT_VERSION
        f.attrs["complete"] = False
        f.attrs["rows_written"] = 0
        f.attrs["num_rows"] = self.num_rows
        for key, value in attrs.items():
            f.attrs[key] = json.dumps(value) if key in _JSON_ATTRS else value
        meta_rows = self.chunk_rows or min(self.num_rows, MAX_META_CHUNK_ROWS)
        self._add("index", (), np.int64, meta_rows)
        self._add("ids", (), h5py.string_dtype("utf-8"), meta_rows)
        if has_labels:
            self._add("labels", (), np.int64, meta_rows)
        f.create_group("features", track_order=True)

    def _add(
        self,
        name: str,
        row_shape: tuple,
        dtype: Any,
        chunk_rows: int,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        chunk_rows = min(chunk_rows, self.num_rows)
        dataset = self.file.create_dataset(
            name,
            shape=(self.num_rows, *row_shape),
            dtype=dtype,
            chunks=(chunk_rows, *row_shape),
            compression=self.compression,
        )
        for key, value in (attrs or {}).items():
            dataset.attrs[key] = value
        self._staging[name] = _Staged(dataset, chunk_rows)

    def append(
        self,
        index: np.ndarray,
        ids: Sequence[str],
        labels: np.ndarray | None,
        features: Mapping[str, np.ndarray],
        feature_attrs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Append ``len(index)`` rows; ``features[key]`` has shape ``[rows, *shape]``."""
        rows = len(index)
        if self.rows_appended + rows > self.num_rows:
            raise FeatcacheError(f"more rows than the {self.num_rows} the store was sized for")
        for key, array in features.items():
            name = f"features/{key}"
            if name not in self._staging:
                chunk = self.chunk_rows or chunk_rows_for(
                    array.shape[1:], self.dtype, self.num_rows
                )
                extra = dict((feature_attrs or {}).get(key, {}), dtype=self.dtype)
                self._add(name, array.shape[1:], _NUMPY_DTYPES[self.dtype], chunk, extra)
            self._staging[name].push(array)
        self._staging["index"].push(np.asarray(index, dtype=np.int64))
        self._staging["ids"].push(np.asarray(ids, dtype=object))
        if "labels" in self._staging:
            self._staging["labels"].push(np.asarray(labels, dtype=np.int64))
        self.rows_appended += rows
        self._mark_progress()

    def _mark_progress(self) -> None:
        durable = min(staged.flushed for staged in self._staging.values())
        if durable != self.file.attrs["rows_written"]:
            self.file.attrs["rows_written"] = durable

    def close(self, complete: bool = False, attrs: Mapping[str, Any] | None = None) -> None:
        """Close the file. With ``complete=True``, flush all rows, set ``attrs`` (a run
        summary, say) and mark the store complete."""
        if not self.file.id.valid:
            return
        try:
            if complete:
                if self.rows_appended != self.num_rows:
                    raise FeatcacheError(
                        f"store {self.path} got {self.rows_appended} of {self.num_rows} rows"
                    )
                for staged in self._staging.values():
                    staged.flush()
                self._mark_progress()
                for key, value in (attrs or {}).items():
                    self.file.attrs[key] = value
                self.file.flush()  # every row on disk before the flag says so
                self.file.attrs["complete"] = True
        finally:
            self.file.close()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(complete=False)


class _Staged:
    """One dataset plus a one-chunk staging buffer; writes happen only in whole chunks."""

    def __init__(self, dataset: h5py.Dataset, chunk_rows: int):
        self.dataset = dataset
        self.chunk_rows = chunk_rows
        self.buffer = np.empty((chunk_rows, *dataset.shape[1:]), dtype=_buffer_dtype(dataset))
        self.filled = 0  # rows in the buffer
        self.flushed = 0  # rows written to the file

    def push(self, rows: np.ndarray) -> None:
        start = 0
        while start < len(rows):
            take = min(self.chunk_rows - self.filled, len(rows) - start)
            self.buffer[self.filled : self.filled + take] = rows[start : start + take]
            self.filled += take
            start += take
            if self.filled == self.chunk_rows:
                self.flush()

    def flush(self) -> None:
        if self.filled:
            self.dataset[self.flushed : self.flushed + self.filled] = self.buffer[: self.filled]
            self.flushed += self.filled
            self.filled = 0


def _buffer_dtype(dataset: h5py.Dataset) -> Any:
    return object if h5py.check_string_dtype(dataset.dtype) else dataset.dtype


class FeatureStore:
    """Read access to a store written by featcache.

    Metadata (layers, shapes, labels, ids, provenance) is read when needed; the file is
    opened lazily and reopened in a new process, so instances can be sent to workers.
    An incomplete store raises :class:`FeatcacheError` unless ``allow_incomplete=True``.
    """

    def __init__(self, path: str | os.PathLike, *, allow_incomplete: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"store not found: {self.path}")
        self._file: h5py.File | None = None
        self._pid: int | None = None
        try:
            attrs = self.file.attrs
            if "featcache_format" not in attrs:
                raise ConfigError(f"{self.path} is an HDF5 file but not a featcache store")
        except OSError as exc:
            raise ConfigError(f"{self.path} is not a readable HDF5 store: {exc}") from exc
        if not self.complete and not allow_incomplete:
            raise FeatcacheError(
                f"store {self.path} is incomplete ({self.rows_written} of {len(self)} rows "
                "written); rerun the extraction, or pass allow_incomplete=True to read it"
            )

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
        return int(self.file.attrs["num_rows"])

    def __repr__(self) -> str:
        state = "complete" if self.complete else f"incomplete, {self.rows_written} rows written"
        return f"FeatureStore({str(self.path)!r}, rows={len(self)}, layers={self.layers}, {state})"

    @property
    def complete(self) -> bool:
        return bool(self.file.attrs["complete"])

    @property
    def rows_written(self) -> int:
        return int(self.file.attrs["rows_written"])

    @property
    def layers(self) -> list[str]:
        """Stored layer keys, in the order they were captured."""
        return list(self.file["features"])

    def shape(self, layer: str) -> tuple[int, ...]:
        """Shape of one row of ``layer`` (without the leading N)."""
        return tuple(self._features(layer).shape[1:])

    def dtype(self, layer: str) -> torch.dtype:
        """The torch dtype rows of ``layer`` come back as."""
        return _TORCH_DTYPES[self._features(layer).attrs["dtype"]]

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
        return self.file["labels"][:] if self.has_labels else None

    @property
    def index(self) -> np.ndarray:
        """``[N]`` int64 position of each row in the source dataset."""
        return self.file["index"][:]

    @property
    def ids(self) -> list[str]:
        return [s.decode() if isinstance(s, bytes) else s for s in self.file["ids"][:]]

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
        return read_rows(self._features(layer), rows)


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
