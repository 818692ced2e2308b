"""Change stamps: what a source can cheaply tell about the bytes behind each row.

A stamp is tab-separated ASCII ``name=value`` fields (a local file's ``size`` and
``mtime_ns``, an object's ``size`` and ``version``, its ETag; a WebDataset member's
``size`` and its shard's fields prefixed ``shard_``), taken when a run starts. An empty
stamp says nothing and is never reported as changed (see docs/concepts/provenance.md).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Sequence

import numpy as np


def file_stamp(path: str | os.PathLike) -> str:
    """The stamp of a local file: its size and modification time in nanoseconds; "" for
    a file that cannot be read."""
    try:
        stat = os.stat(path)
    except OSError:
        return ""
    return f"size={stat.st_size}\tmtime_ns={stat.st_mtime_ns}"


def object_stamp(version: str | None) -> str:
    """The stamp of an object from its listed version (as ``object_version`` gives it);
    "" for None."""
    if not version:
        return ""
    size, _, tag = version.partition("\t")
    return f"size={size}\tversion={tag}" if tag else f"size={size}"


def stamp_array(stamps: Iterable[str]) -> np.ndarray:
    """``[rows]`` fixed-length ASCII bytes (numpy ``S``) of ``stamps``, as stored."""
    return np.array([s.encode("ascii", "backslashreplace") for s in stamps], dtype=np.bytes_)


def changed_rows(stored: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Positions where both stamps are known and differ: ``stored`` and ``current`` are
    ``[rows]`` stamps of the same rows (bytes); returns int64 positions into them."""
    stored, current = np.asarray(stored, dtype=np.bytes_), np.asarray(current, dtype=np.bytes_)
    known = (stored != b"") & (current != b"")
    return np.flatnonzero(known & (stored != current)).astype(np.int64)


def describe_change(stored: bytes | str, current: bytes | str) -> str:
    """What differs between two stamps of one row: ``"size 138140 -> 168743"``, or
    ``"modified <time> -> <time> UTC"`` where only the time moved."""
    old, new = _fields(stored), _fields(current)
    names = [*new, *(name for name in old if name not in new)]
    differing = [name for name in names if old.get(name) != new.get(name)]
    if not differing:
        return "stamp unchanged"
    name = "size" if "size" in differing else differing[0]  # a size says most
    return f"{_label(name)} {_shown(name, old.get(name))} -> {_shown(name, new.get(name))}"


def change_report(
    rows: Sequence[int], ids: Sequence[str], stored: np.ndarray, current: np.ndarray, shown: int = 3
) -> str:
    """The first ``shown`` changed ``rows`` named (``"row 9, ants/A.jpg: changed on disk
    since extraction (size 138140 -> 168743)"``) and how many more."""
    named = [
        f"row {row}, {sample_id}: changed {_where(new)}since extraction "
        f"({describe_change(old, new)})"
        for row, sample_id, old, new in list(zip(rows, ids, stored, current, strict=True))[:shown]
    ]
    more = len(rows) - len(named)
    return "; ".join(named) + (f"; and {more} more row(s)" if more > 0 else "")


def _where(stamp: bytes | str) -> str:
    return "on disk " if "mtime_ns" in _fields(stamp) else ""


def _fields(stamp: bytes | str) -> dict[str, str]:
    text = stamp.decode("ascii", "replace") if isinstance(stamp, bytes) else stamp
    return dict(field.partition("=")[::2] for field in text.split("\t") if field)


def _label(name: str) -> str:
    return {"mtime_ns": "modified", "shard_mtime_ns": "shard modified"}.get(
        name, name.replace("_", " ")
    )


def _shown(name: str, value: str | None) -> str:
    if value is None:
        return "none"
    if name.endswith("mtime_ns") and value.isdigit():
        moment = datetime.datetime.fromtimestamp(int(value) / 1e9, datetime.timezone.utc)
        return moment.strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    return value
