"""A store's history: one record per run that wrote it, kept in its ``history`` attribute.

An update copies the list of the store it replaces and adds its own record; a store
combined over shards has one record per launch (:func:`featcache.store.merge.launch_records`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any


def run_record(
    kind: str,
    rows: tuple[int, int],
    layers: tuple[int, int],
    fingerprints: Mapping[str, Any],
    time: str | None = None,
    resumed: int = 0,
    launch: str | None = None,
) -> dict[str, Any]:
    """One run's record: ``kind`` (``"extract"`` or ``"update"``), ``rows`` and ``layers``
    as ``(computed, reused)``, the ``resumed`` rows a stopped run had written and this one
    kept, the fingerprints of the store key, finished at ``time`` (default: now), and the
    ``launch`` of several processes the run was part of, when given."""
    record = {
        "time": time or datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "kind": kind,
        "rows_computed": rows[0],
        "rows_reused": rows[1],
        "rows_resumed": resumed,
        "layers_computed": layers[0],
        "layers_reused": layers[1],
        "config_fingerprint": fingerprints.get("config_fingerprint"),
        "dataset_fingerprint": fingerprints.get("dataset_fingerprint"),
    }
    return record if launch is None else {**record, "launch": launch}


def history_of(attrs: Mapping[str, Any], rows: int, layers: int) -> list[dict[str, Any]]:
    """The history a store with file attributes ``attrs`` records; for a store written
    before histories were kept, one record of the run that made it (``rows`` rows and
    ``layers`` layers computed, at its ``created`` time)."""
    recorded = attrs.get("history")
    if isinstance(recorded, list):
        return [dict(record) for record in recorded]
    key = attrs.get("resume_key") or {}
    return [run_record("extract", (rows, 0), (layers, 0), key, attrs.get("created"))]


def describe_run(record: Mapping[str, Any]) -> str:
    """One record as a line: ``update: computed 25 rows and 0 layers, reused 195 rows and
    2 layers``; a resumed run's ends ``, resumed 1024 rows a stopped run wrote``."""
    line = (
        f"{record.get('kind')}: computed {record.get('rows_computed')} rows and "
        f"{record.get('layers_computed')} layers, reused {record.get('rows_reused')} rows "
        f"and {record.get('layers_reused')} layers"
    )
    resumed = record.get("rows_resumed") or 0  # absent from older stores' records
    return line + (f", resumed {resumed} rows a stopped run wrote" if resumed else "")


def history_lines(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """What ``featcache info`` shows of a history: one line per run, oldest first."""
    return [f"{record.get('time')}  {describe_run(record)}" for record in history]
