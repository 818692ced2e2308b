"""Reading a store: :class:`FeatureStore`, the per-process file handle, row reads."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from featcache.errors import ConfigError, CorruptStoreError, IncompleteStoreError, first_line
from featcache.store import codec
from featcache.store.checks import durable_problem
from featcache.store.containment import foreign_data_problem
from featcache.store.layout import STAMPS
from featcache.store.metadata import UNREADABLE_METADATA, metadata_problem, newer_format
from featcache.store.paths import (
    open_readonly,
    partial_path,
    readable_path,
    shards_of,
    skipped_log_path,
    store_path_of,
)
from featcache.store.provenance import recorded_config
from featcache.store.rows import (
    FIX,
    Known,
    PartRows,
    Rows,
    let_go,
    read_head,
    read_rows,
    read_text_head,
    read_token_rows,
    row_numbers,
    rows_of,
)
from featcache.store.skipped import read_log, read_skipped

if TYPE_CHECKING:
    import torch

    from featcache.store.describe import StoreDescription

RowSelection = slice | Sequence[int] | np.ndarray


class StoreFile:
    """A store's HDF5 file, read-only, opened on first use in each process (pickling keeps
    only the path, so a DataLoader worker opens its own handle). What reads learn
    (:attr:`known`, :attr:`memo`) lives as long as the handle."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file: h5py.File | None = None
        self._pid: int | None = None
        self._datasets: dict[str, h5py.Dataset] = {}
        self._known: Known = {}
        self._memo: dict[str, Any] = {}

    def _open_here(self) -> h5py.File | None:
        """The handle, if this process opened it and it is still open."""
        file = self._file
        return file if file is not None and self._pid == os.getpid() and file.id.valid else None

    @property
    def is_open(self) -> bool:
        """Whether this process holds an open handle."""
        return self._open_here() is not None

    @property
    def file(self) -> h5py.File:
        """The open ``h5py.File`` of this process."""
        file = self._open_here()
        if file is None:
            file = self._file = open_readonly(readable_path(self.path))
            self._pid = os.getpid()
            self._datasets, self._known, self._memo = {}, {}, {}
        return file

    @property
    def known(self) -> Known:
        """What reads have learnt of this file's datasets (``rows.rows_of``'s ``known``)."""
        _ = self.file  # opened in this process first
        return self._known

    @property
    def memo(self) -> dict[str, Any]:
        """Values read from this file once: the rows of a complete store, layer layouts."""
        _ = self.file
        return self._memo

    def dataset(self, name: str, chunk_cache: tuple[int, int] | None = None) -> h5py.Dataset:
        """The dataset ``name``, opened once per handle; ``chunk_cache``: ``(nslots, nbytes)``
        of its own HDF5 chunk cache, which HDF5 applies only if nothing else in this
        process holds the dataset open."""
        found = self._datasets.get(name)
        if found is not None:
            return found
        if chunk_cache is None:
            found = self.file[name]
        else:
            dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
            dapl.set_chunk_cache(*chunk_cache, 0.75)
            # A high-level Dataset lets h5py cache its fast slice reader.
            found = h5py.Dataset(h5py.h5d.open(self.file.id, name.encode(), dapl), readonly=True)
        # A virtual dataset is not kept: HDF5 crashes (SIGSEGV) in its exit handler closing
        # the creation property list of one still open at a spawned worker's teardown.
        if not found.is_virtual:
            self._datasets[name] = found
        return found

    def rows(self, name: str, chunk_cache: tuple[int, int] | None = None) -> Rows | PartRows:
        """The reads of the dataset ``name``, what they learn kept on this handle (a combined
        store's virtual dataset is opened once, to find its shards)."""
        found = self.known.get(f"/{name}")
        if isinstance(found, PartRows):
            return found
        return rows_of(self.dataset(name, chunk_cache), self._known)

    def close(self) -> None:
        """Close this process's handle; one inherited from another process is left alone."""
        file = self._open_here()
        if file is not None:
            self._datasets.clear()
            let_go(self._known)
            file.close()
        self._file = None
        self._datasets, self._known, self._memo = {}, {}, {}

    def __getstate__(self) -> dict[str, Any]:
        return vars(StoreFile(self.path))  # pickled as a handle not opened yet


class FeatureStore:
    """Read access to a store written by featcache.

    Metadata (layers, shapes, labels, ids, provenance) is read when needed; the file is
    opened lazily and reopened in a new process, so instances can be sent to workers.
    A store that is still being written (or whose run was interrupted) lives at
    ``<path>.partial``; opening it (by either name), or such a file copied or renamed to
    another name, raises [`IncompleteStoreError`][featcache.errors.IncompleteStoreError]
    unless ``allow_incomplete=True``, and then only its durable rows are visible.
    """

    def __init__(self, path: str | os.PathLike, *, allow_incomplete: bool = False):
        self.path = store_path_of(path)  # a store's .partial file is the store, incomplete
        partial = partial_path(self.path)
        # A .partial named outright is read even beside a complete store of the same name
        # (an interrupted --overwrite keeps the old one); once renamed, it is that store.
        named_partial = Path(path).name == partial.name and partial.is_file()
        if named_partial or not self.path.is_file():
            if not partial.is_file():
                if self.path.is_dir():
                    raise ConfigError(
                        f"{self.path} is a folder, not a store; give the path of a store file "
                        "(.h5) in it"
                    )
                raise ConfigError(f"store not found: {self.path}{_shards_note(self.path)}")
            if not allow_incomplete:
                beside = f"; the {self.path.name} beside it is an earlier run's"
                where = f", in {partial.name}{beside if self.path.is_file() else ''}"
                raise _incomplete(self.path, _rows_in(partial), where, "to resume it")
            self.path = partial
        self._handle = StoreFile(self.path)
        self._dtypes: dict[str, str] = {}  # each layer's store dtype, once read
        try:
            file = self.file
        except OSError as exc:
            raise ConfigError(f"{self.path} is not a readable HDF5 store: {exc}") from exc
        try:
            is_store = "featcache_format" in file.attrs
            newer = newer_format(file) if is_store else ""
            complete = is_store and not newer and self.complete
        except UNREADABLE_METADATA as exc:
            problem = f"its metadata cannot be read ({first_line(exc)})"
        else:
            if not is_store:
                raise ConfigError(f"{self.path} is an HDF5 file but not a featcache store")
            if newer:
                self.close()
                raise ConfigError(f"cannot read store {self.path}: {newer}")
            # An incomplete store has no attribute digest yet, but its attributes must read
            # and its progress mark must agree with what its datasets hold.
            problem = metadata_problem(file, sealed=complete) or foreign_data_problem(file)
            if not complete and not problem:
                problem = durable_problem(file)
        if problem:
            self.close()
            raise CorruptStoreError(f"store {self.path} is damaged: {problem}; {FIX}")
        if not complete and not allow_incomplete:
            # An interrupted run's file, copied or renamed to a store's name.
            rows = self.rows_written
            self.close()
            where = ": the file of a run that never finished, copied or renamed since"
            raise _incomplete(self.path, rows, where, "that made it")

    @classmethod
    def just_sealed(cls, path: str | os.PathLike) -> FeatureStore:
        """The complete store this process has just written and sealed at ``path`` (while
        holding its writer lock), opened without checking its metadata against the
        digests recorded a moment ago: what [`featcache.extract`][featcache.extraction.api.extract]
        returns."""
        store = cls.__new__(cls)
        store.path = Path(path)
        store._handle = StoreFile(store.path)
        store._dtypes = {}
        _ = store.file  # opened now, as __init__ opens it: moving the file later changes nothing
        return store

    @property
    def file(self) -> h5py.File:
        """The open ``h5py.File`` for this process (read-only)."""
        return self._handle.file

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __len__(self) -> int:
        """Rows that can be read: all of them, or the durable ones of an incomplete store."""
        memo = self._handle.memo
        if "rows" not in memo:
            if not self.complete:
                return self.rows_written
            memo["rows"] = int(self.file.attrs["num_rows"])  # a complete store never changes
        return int(memo["rows"])

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
        """Samples left out under ``on_error: skip``: ``{"index", "id", "reason"}`` each,
        in source order. An incomplete store's are read from the log beside it, up to its
        last durable row (the resume redoes the rest)."""
        if self.complete:
            return read_skipped(self.file)
        index = self.index
        if not len(index):
            return []
        records = read_log(skipped_log_path(store_path_of(self.path)), before=int(index[-1]) + 1)
        return sorted(records, key=lambda record: record["index"])

    @property
    def layers(self) -> list[str]:
        """Stored layer keys, in the order they were captured."""
        return list(self.file["features"])

    def shape(self, layer: str) -> tuple[int, ...]:
        """Shape of one row of ``layer`` (without the leading N); of one token for a layer
        of per-token rows ([`is_per_token`][featcache.store.reader.FeatureStore.is_per_token])."""
        return tuple(self._features(layer).shape[1:])

    def is_per_token(self, layer: str) -> bool:
        """Whether ``layer`` holds per-token rows: row ``i`` is ``[T_i, *shape]``, tokens
        ``offsets[i]:offsets[i + 1]`` of its ``[total_tokens, *shape]`` dataset."""
        memo = self._handle.memo
        key = f"per_token/{layer}"
        if key not in memo:
            memo[key] = codec.attr(self._features(layer), "layout") == "tokens"
        return bool(memo[key])

    @property
    def offsets(self) -> np.ndarray | None:
        """``[N + 1]`` int64 token offsets of the rows (None: no per-token layers)."""
        return self._head("offsets", len(self) + 1)

    @property
    def token_ids(self) -> np.ndarray | None:
        """``[total_tokens]`` int64 input token ids of the per-token rows, when recorded."""
        offsets = self.offsets
        return None if offsets is None else self._head("token_ids", int(offsets[-1]))

    def read_tokens(
        self, layer: str, rows: RowSelection = slice(None)
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The tokens of ``rows`` of a per-token layer: ``(values, offsets)``.

        ``values`` is ``[sum T_i, *shape]`` in the stored dtype (int8 codes dequantized to
        float32), the rows' tokens one row after the other in the order asked; ``offsets``
        (``[n + 1]`` int64) says row ``j`` of the request is ``values[offsets[j]:offsets[j + 1]]``.
        """
        if not self.is_per_token(layer):
            raise ConfigError(f"layer {layer!r} holds one row per sample; read it with read()")
        picked = row_numbers(rows, len(self))
        # Only the offsets of the rows asked for are read: a row at a time stays cheap.
        first, last = (int(picked.min()), int(picked.max()) + 1) if len(picked) else (0, 0)
        window = np.empty(last + 1 - first, dtype=np.int64)
        self._handle.rows("offsets").read(first, last + 1, window)
        values, offsets = read_token_rows(self._reader(layer), window, picked - first)
        if self._quantized(layer):
            scales = read_token_rows(self._scales(layer), window, picked - first)[0]
            values = codec.dequantize(values, scales)
        return values, offsets

    def dtype(self, layer: str) -> torch.dtype:
        """The torch dtype rows of ``layer`` come back as (float32 for int8 codes)."""
        return codec.value_dtype(self._stored_dtype(layer))

    def _stored_dtype(self, layer: str) -> str:
        """The store dtype of ``layer``, read once."""
        if layer not in self._dtypes:  # opening a virtual dataset costs more than a row
            self._dtypes[layer] = codec.attr(self._features(layer), "dtype")
        return self._dtypes[layer]

    def _quantized(self, layer: str) -> bool:
        return self._stored_dtype(layer) in codec.QUANTIZED

    def _scales(self, layer: str) -> Rows | PartRows:
        return self._handle.rows(codec.scales_name(layer))

    def layer_attrs(self, layer: str) -> dict[str, Any]:
        """The attributes of ``layer``'s dataset: ``dtype``, ``module``, ``capture``, ..."""
        return codec.read_attrs(self._features(layer))

    def _features(self, layer: str) -> h5py.Dataset:
        """The dataset of ``layer``, opened anew (for its shape and attributes)."""
        group = self.file["features"]
        if layer not in group:
            raise ConfigError(
                f"layer {layer!r} is not in store {self.path}; it holds: {', '.join(self.layers)}"
            )
        return group[layer]

    def _reader(self, layer: str) -> Rows | PartRows:
        """The reads of ``layer``: opened anew when HDF5 reads it, so that a FeatureDataset
        opened meanwhile gets its own chunk cache; kept when mapped or read from shards."""
        name = f"features/{layer}"
        found = self._handle.known.get(f"/{name}")  # what an earlier read learnt
        if isinstance(found, PartRows) or found is not None and found.rows is not None:
            return self._handle.rows(name)
        return rows_of(self._features(layer), self._handle.known)

    @property
    def has_labels(self) -> bool:
        return "labels" in self.file

    @property
    def labels(self) -> np.ndarray | None:
        """``[N]`` int64 labels, or None when the source had none."""
        return self._head("labels", len(self))

    @property
    def index(self) -> np.ndarray:
        """``[N]`` int64 position of each row in the source dataset."""
        return read_head(self.file["index"], len(self), self._handle.known)

    @property
    def ids(self) -> list[str]:
        """``N`` stable sample ids (relative file paths for image folders)."""
        return read_text_head(self.file["ids"], len(self), self._handle.known)

    @property
    def stamps(self) -> np.ndarray | None:
        """``[N]`` each row's change stamp as it was read (fixed-length ASCII bytes, ``b""``
        where unknown; see `featcache.sources.stamps`), or None when the store
        recorded none (its source had none, or it was written before stamps existed)."""
        return self._head(STAMPS, len(self))

    def _head(self, name: str, rows: int) -> np.ndarray | None:
        """The first ``rows`` entries of the dataset ``name``; None when the store has none."""
        found = name in self.file
        return read_head(self.file[name], rows, self._handle.known) if found else None

    @property
    def attrs(self) -> dict[str, Any]:
        """File attributes, JSON values decoded."""
        return codec.read_attrs(self.file)

    @property
    def config(self) -> dict[str, Any] | None:
        """The resolved config the store was made with (None when made from Python), keys
        added to featcache since then set as the store was made
        (`featcache.store.provenance.recorded_config`)."""
        config = self.attrs.get("config")
        return None if config is None else recorded_config(config)

    @property
    def class_names(self) -> list[str] | None:
        return self.attrs.get("class_names")

    def read(self, layer: str, rows: RowSelection = slice(None)) -> torch.Tensor:
        """Rows of ``layer`` as a tensor ``[n, *shape]`` in the stored dtype (int8 codes
        dequantized to float32).

        ``rows`` is a slice or any sequence of row numbers (any order, repeats allowed,
        negative ones counted from the end); the file is read in increasing order and the
        result put back in the order asked. A chunk that fails its checksum raises
        [`CorruptStoreError`][featcache.errors.CorruptStoreError].
        """
        if self.is_per_token(layer):
            raise ConfigError(
                f"layer {layer!r} holds per-token rows of different lengths; read them with "
                "read_tokens(), FeatureDataset (one [T, D] row per item) or TokenDataset"
            )
        picked = row_numbers(rows, len(self))
        values = read_rows(self._reader(layer), picked)
        if self._quantized(layer):
            values = codec.dequantize(values, read_rows(self._scales(layer), picked))
        return values

    def describe(self) -> StoreDescription:
        """What ``featcache info`` shows: sizes, layers, rows, provenance, the time split."""
        from featcache.store.describe import describe

        return describe(self)


def _incomplete(store: Path, rows: int, where: str, rerun: str) -> IncompleteStoreError:
    """The refusal of ``store`` holding ``rows`` durable rows ``where``; ``rerun``: to what end."""
    return IncompleteStoreError(
        f"store {store} is incomplete ({rows} rows written{where}); rerun the extraction "
        f"{rerun}, or pass allow_incomplete=True to read those rows",
        str(store),
        rows,
    )


def _rows_in(file: Path) -> int:
    """All rows of a complete store file, a ``.partial``'s durable ones; 0 when unreadable."""
    try:
        with open_readonly(file) as f:
            return int(f.attrs["num_rows"] if f.attrs.get("complete") else f["progress"][0])
    except (OSError, KeyError):
        return 0


def _shards_note(path: Path) -> str:
    """What a missing store's folder holds of shards not combined yet ("" when none)."""
    shards = shards_of(path)
    if not shards:
        return ""
    rows = sum(map(_rows_in, shards))
    return (
        f"; {len(shards)} shards ({shards[0].name}, ...) hold {rows} rows durably and have "
        f"not been combined yet: `featcache info {path}` lists them, and rerunning the "
        "extraction, with any number of processes, computes the rest and combines them"
    )
