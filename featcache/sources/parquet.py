"""The parquet source: rows of one or more Parquet files (see docs/guides/sources.md).

Only the footers, labels and ids are read up front; ``ds[i]`` reads the image column of
its row group and keeps it, per process, so a loader's batches cost one read per group.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image

from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.sources.base import SourceDataset, SourceRequest, Transform
from featcache.sources.remote import object_version
from featcache.sources.tabular import (
    EncodedImageSource,
    SplitFiles,
    check_columns,
    class_indices,
    require_columns,
    split_paths,
    text_rows,
)
from featcache.util.extras import require
from featcache.util.fingerprints import file_sha256, lines_sha256
from featcache.util.urls import is_url


class ParquetSource(EncodedImageSource):
    """Images (and labels) of the rows of Parquet files; file handles and the cached row
    group are per process and never pickled."""

    def __init__(
        self,
        files: SplitFiles,
        file_starts: np.ndarray,
        group_starts: list[np.ndarray],
        column: str,
        kind: str,
        root: str | None,
        ids: list[str],
        labels: np.ndarray | None,
        class_names: list[str] | None,
        transform: Transform | None,
        decode_size: int | None,
    ) -> None:
        super().__init__(ids, labels, class_names, transform, decode_size, files.remote)
        self.files = files
        self.file_starts = file_starts  # [F + 1]: row of the first row of each file
        self.group_starts = group_starts  # per file, [G + 1]: first row of each group
        self.column, self.kind, self.root = column, kind, root
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._handles: dict[int, Any] = {}
        self._group: tuple[int, int, Any] | None = None  # (file, group, arrow array)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}, "_group": None}

    def _values(self, file: int, group: int) -> Any:
        if self._pid != os.getpid():
            self._reset()
        if self._group is not None and self._group[:2] == (file, group):
            return self._group[2]
        _, pq = _arrow()
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = pq.ParquetFile(self.files.open(file))
        table = handle.read_row_group(group, columns=[self.column])
        values = table.column(0).combine_chunks()
        self._group = (file, group, values)
        return values

    def _cell(self, i: int) -> tuple[Any, str]:
        file = int(np.searchsorted(self.file_starts, i, side="right")) - 1
        row = i - int(self.file_starts[file])
        starts = self.group_starts[file]
        group = int(np.searchsorted(starts, row, side="right")) - 1
        where = f"{self.files.names[file]} row {row}"
        try:
            values = self._values(file, group)
        except Exception as exc:
            raise FeatcacheError(
                f"cannot read {where} (row group {group}): {first_line(exc)}"
            ) from exc
        j = row - int(starts[group])
        if self.kind == "struct":
            return values.field("bytes")[j].as_py() or values.field("path")[j].as_py(), where
        return values[j].as_py(), where

    def _load(self, i: int) -> tuple[Image.Image, int]:
        value, where = self._cell(i)
        return self.decode(value, f"{self.ids[i]} ({where})", self.root), self.label(i)

    def fingerprint(self, content: bool = False) -> str:
        """sha256 over the row count, the image column and each file's name, size and
        schema (and bytes with ``content``); for URLs, each file's URL, size and ETag now."""
        _, pq = _arrow()
        lines = [f"parquet\t{len(self)} rows\t{self.column}"]
        infos = self.remote.stat(self.files.paths) if self.remote else []
        for f, (path, name) in enumerate(zip(self.files.paths, self.files.names, strict=True)):
            schema = pq.read_schema(self.files.open(f)).remove_metadata().to_string()
            if self.remote is None:
                line = f"{name}\t{os.path.getsize(path)}\t{schema}"
                digest = file_sha256(path) if content else ""
            else:
                line = f"{path}\t{object_version(infos[f])}\t{schema}"
                digest = self.remote.sha256(path, int(infos[f]["size"])) if content else ""
            lines.append(f"{line}\t{digest}" if content else line)
        return lines_sha256(lines)


def _arrow() -> tuple[ModuleType, ModuleType]:
    """``pyarrow`` and ``pyarrow.parquet``, a submodule that ``import pyarrow`` leaves out."""
    pa = require("pyarrow", "data.source parquet")
    return pa, importlib.import_module("pyarrow.parquet")


def parquet_source(request: SourceRequest) -> SourceDataset:
    """The rows of the Parquet files the split names.

    Raises:
        ConfigError: no such file, a file that is not Parquet, a missing column, files
            whose columns differ, bad labels or ids.
    """
    data, split, value, transform = request.args
    pa, pq = _arrow()
    check_columns(data)
    files = split_paths(data, split, value, "Parquet files")
    names = files.names
    metas = []
    for f, name in enumerate(names):
        try:
            metas.append(pq.ParquetFile(files.open(f)))
        except (pa.ArrowException, OSError) as exc:
            raise ConfigError(
                f"{name} cannot be read as a Parquet file ({first_line(exc)})"
            ) from None
    schema = metas[0].schema_arrow
    columns = list(schema.names)
    what = names[0]
    for meta, name in zip(metas[1:], names[1:], strict=True):
        if list(meta.schema_arrow.names) != columns:
            raise ConfigError(
                f"the Parquet files of split {split!r} differ: {names[0]} has columns "
                f"{', '.join(columns)} but {name} has {', '.join(meta.schema_arrow.names)}"
            )

    label_column = data.label_column or ("label" if "label" in columns else None)
    require_columns(data, label_column, columns, what)
    wanted = [c for c in (label_column, data.id_column, data.text_column) if c]
    tables = [meta.read(columns=wanted) for meta in metas] if wanted else []

    counts = [meta.metadata.num_rows for meta in metas]
    if not sum(counts):
        raise ConfigError(f"the Parquet files of split {split!r} have no rows")
    ids = _ids(tables, data.id_column, names, counts)
    labels, class_names = None, None
    if label_column:
        cells = [v for t in tables for v in t.column(label_column).to_pylist()]
        where = f"data.label_column {label_column!r}"
        if any(v is None for v in cells):
            raise ConfigError(
                f"{where}: row {cells.index(None)} of split {split!r} has no label; label "
                "every row or none"
            )
        labels, class_names = class_indices(cells, f"label column {label_column!r}")
        if class_names is None:
            class_names = _hf_class_names(schema, label_column)
        if len(labels) and labels.min() < 0:
            raise ConfigError(f"{where}: label {labels.min()} must be >= 0")

    if data.text_column:
        texts = [v or "" for t in tables for v in t.column(data.text_column).to_pylist()]
        where = f"{', '.join(names)} ({files.identity()[:16]})"
        return text_rows(texts, labels, ids, class_names, request.tokenizer, data.max_length, where)

    column, kind = _image_column(pa, schema, data.image_column, what)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    groups = []
    for meta in metas:
        rows = [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]
        groups.append(np.concatenate([[0], np.cumsum(rows)]).astype(np.int64))
    root = None
    if data.root:
        root = data.root if is_url(data.root) else str(Path(data.root).expanduser())
    return ParquetSource(
        files,
        starts,
        groups,
        column,
        kind,
        root,
        ids,
        labels,
        class_names,
        transform,
        request.decode_size,
    )


def _ids(
    tables: list[Any], id_column: str | None, names: list[str], counts: list[int]
) -> list[str]:
    if id_column is None:
        return [f"{name}:{row}" for name, n in zip(names, counts, strict=True) for row in range(n)]
    ids = [v for t in tables for v in t.column(id_column).to_pylist()]
    if any(v is None for v in ids):
        raise ConfigError(f"data.id_column {id_column!r}: row {ids.index(None)} has no id")
    ids = [str(v) for v in ids]
    if len(set(ids)) < len(ids):
        seen: set[str] = set()
        dup = next(v for v in ids if v in seen or seen.add(v))  # type: ignore[func-returns-value]
        raise ConfigError(
            f"data.id_column {id_column!r}: id {dup!r} is on two rows; ids must be unique"
        )
    return ids


def _image_column(pa: Any, schema: Any, column: str | None, what: str) -> tuple[str, str]:
    """The image column and how it holds images: "bytes", "struct" or "path"."""

    def kind(field: Any) -> str | None:
        t = field.type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return "bytes"
        if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
            return "struct"
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return "path"
        return None

    if column is not None:
        found = kind(schema.field(column))
        if found is None:
            raise ConfigError(
                f"data.image_column {column!r} of {what} holds {schema.field(column).type}; "
                "it must hold image bytes, a struct with a bytes field, or paths"
            )
        return column, found
    for field in schema:
        if kind(field) in ("bytes", "struct"):
            return field.name, str(kind(field))
    raise ConfigError(
        f"no column of {what} holds image bytes; set data.image_column (a column of bytes or "
        f"of paths); its columns: {', '.join(f'{f.name} ({f.type})' for f in schema)}"
    )


def _hf_class_names(schema: Any, column: str) -> list[str] | None:
    """Class names of a ClassLabel column, from the metadata Hugging Face writes."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][column]
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) else None
    if feature.get("_type") == "ClassLabel" and isinstance(names, list):
        return [str(n) for n in names]
    return None
