"""Samples left out of a store: the log beside a partial store, the ``/skipped`` group.

A skip record is ``{"index": source position, "id": sample id, "reason": text}``. While a
store is written the records go to an append-only JSON-lines log beside it
(:func:`~featcache.store.paths.skipped_log_path`); a complete store holds them in
``/skipped/{index,ids,reasons}``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from featcache.store.paths import replace_durably


def write_skipped(f: h5py.File | h5py.Group, records: Sequence[Mapping[str, Any]]) -> None:
    """The ``/skipped`` group: source position, id and reason of every sample left out."""
    group = f.create_group("skipped")
    text = h5py.string_dtype("utf-8")
    group.create_dataset("index", data=np.array([r["index"] for r in records], dtype=np.int64))
    group.create_dataset("ids", data=[str(r["id"]) for r in records], dtype=text)
    group.create_dataset("reasons", data=[str(r["reason"]) for r in records], dtype=text)


def read_skipped(f: h5py.File | h5py.Group) -> list[dict[str, Any]]:
    """The records of the ``/skipped`` group, in stored order; [] when there is none."""
    if "skipped" not in f:
        return []
    group = f["skipped"]
    return [
        {"index": int(i), "id": sample_id, "reason": reason}
        for i, sample_id, reason in zip(
            group["index"][:],
            group["ids"].asstr()[:],
            group["reasons"].asstr()[:],
            strict=True,
        )
    ]


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
