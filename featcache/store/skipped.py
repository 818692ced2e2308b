"""Samples left out of a store: the JSON-lines log beside a partial store, the ``/skipped`` group.

A record is ``{"index": source position, "id": sample id, "reason": text}``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from featcache.store import codec
from featcache.store.layout import write_checked
from featcache.store.rows import read_head, read_text_head
from featcache.util.files import replace_durably


def write_skipped(
    f: h5py.File, records: Sequence[Mapping[str, Any]], chunk_rows: int, checked: bool = True
) -> None:
    """Write the ``/skipped`` group: each column chunked by ``chunk_rows`` (with checksums
    when ``checked``), texts fixed-length UTF-8, out of HDF5's unchecked global heap."""
    columns = {
        "index": np.array([r["index"] for r in records], dtype=np.int64),
        "ids": codec.fixed_texts([str(r["id"]) for r in records]),
        "reasons": codec.fixed_texts([str(r["reason"]) for r in records]),
    }
    for name, data in columns.items():
        write_checked(f, f"skipped/{name}", data, chunk_rows, checked)


def read_skipped(f: h5py.File) -> list[dict[str, Any]]:
    """The records of the ``/skipped`` group, in stored order ([] when none); a chunk that
    fails its checksum raises :class:`~featcache.errors.CorruptStoreError`."""
    if "skipped" not in f:
        return []
    group = f["skipped"]
    index, ids, reasons = (_column(group[name]) for name in ("index", "ids", "reasons"))
    return [
        {"index": int(i), "id": sample_id, "reason": reason}
        for i, sample_id, reason in zip(index, ids, reasons, strict=True)
    ]


def _column(dataset: h5py.Dataset) -> np.ndarray | list[str]:
    """A whole column, checked as the features are, text as ``str`` (older stores' text is
    variable-length, read by HDF5)."""
    if dataset.dtype.kind == "O":
        return list(dataset.asstr()[:])
    if dataset.dtype.kind in "iu":
        return read_head(dataset, len(dataset))
    return read_text_head(dataset, len(dataset))


def read_log(path: Path, before: int) -> list[dict[str, Any]]:
    """The records of the log at ``path`` for source positions before ``before``."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line torn by a crash
                record = json.loads(line)
                if isinstance(record, dict) and record.get("index", before) < before:
                    records.append(record)
    return records


def rewrite_log(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Replace the log at ``path`` with ``records``, atomically and durably."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    replace_durably(tmp, path)
