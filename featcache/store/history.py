"""A store's history: one record per run that wrote it, kept in its ``history`` attribute.

A fresh extraction starts the list with one record; each update
(:mod:`featcache.extraction.update`) copies the list of the store it replaces and adds
its own. A record says when the run finished (UTC, ISO 8601), what it computed and what
it copied from the store before it, and the fingerprints it ran under::

    {"time": "2026-11-27T02:10:00+00:00", "kind": "update",
     "rows_computed": 25, "rows_reused": 195, "rows_resumed": 0,
     "layers_computed": 0, "layers_reused": 2,
     "config_fingerprint": "...", "dataset_fingerprint": "..."}

``rows_computed`` are the rows that ran through the model for every layer (new samples,
or samples whose bytes changed); ``layers_computed`` the layers computed for every row
(new ones, or ones whose definition changed); the rest was copied. ``rows_resumed`` are
the rows a stopped run had written, which this run resumed after and kept (0 for a run
that started afresh); records written before it was kept lack it, and read as 0.

A shard of a run of several processes records the ``launch`` it was written by; the store
combined over shards has one record per launch, summed over its shards
(:func:`featcache.store.merge.launch_records`).
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
    kept, the store key's ``config_fingerprint`` and ``dataset_fingerprint`` (from
    ``fingerprints``), finished at ``time`` (default: now); ``launch``, when given, names
    the launch of several processes that the run was part of."""
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
