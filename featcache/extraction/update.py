"""Updating a complete store: copy what it already holds, compute only the rest.

The new store is written at the ``.partial`` path and moved into place when complete, so
the old one stays readable until then. A row is reused when its id is in the old store
and its bytes are unchanged (change stamp, or ``content_hash`` column); its unchanged
layers (same tap record) are copied byte for byte. New or changed samples get every
layer; new or redefined layers are computed for every row. What the rows are computed
with must not have changed (:func:`update_refusal`). See docs/guides/update.md.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from featcache.capture.selectors import tap_record
from featcache.errors import ConfigError, FeatcacheWarning
from featcache.extraction.compare import first_over, relative_differences, tolerance_of
from featcache.extraction.estimate import check_free_space, estimate_store
from featcache.extraction.grid import GridBatches
from featcache.extraction.plan import ROW_UNITS, ExtractionPlan
from featcache.extraction.run import loaded_batches, recompute, run_rows
from featcache.extraction.writer_thread import CapturedBatch, WriterThread
from featcache.sources.stamps import changed_rows
from featcache.store import FeatureStore, remove_partial
from featcache.store.codec import QUANTIZED, encode
from featcache.store.history import history_of, run_record
from featcache.store.paths import OVERWRITE
from featcache.store.provenance import config_differences, short_value, value_at
from featcache.store.resume import UPDATE_MARK

# Per-row hashes of the samples' bytes, when the source records them (its row_columns).
HASH_COLUMN = "content_hash"
# Store key entries an update may change: what the rows are (the dataset), which layers,
# and how the store is batched and laid out, none of which changes a stored value beyond
# batch rounding. Any other difference needs a fresh run.
UPDATABLE_KEYS = frozenset(
    {
        "config_fingerprint",  # compared key by key: see UPDATABLE_CONFIG
        "dataset_fingerprint",
        "source_rows",
        "rows",
        "taps",
        "batch_size",
        "chunk_rows",
        "compression",
        "featcache_format",  # an older store is read and rewritten in this format
        "world_size",  # a store combined from torchrun shards becomes a plain one
    }
)
# Config keys (dotted, as config_differences names them) an update may change.
UPDATABLE_CONFIG = ("data.", "layers", "loader.batch_size", "store.compression", "store.chunk_rows")
COPY_ROWS = 256  # rows copied from the old store per write, between computed batches
CHECKED_ROWS = 8  # reused rows recomputed before an update, to prove they still hold


@dataclasses.dataclass(frozen=True)
class UpdateWork:
    """What an update copies and what it computes: ``old_rows[j]`` is the old store's row
    reused for the ``j``-th row of ``plan.rows`` (-1: computed with every layer);
    ``new_layers`` are computed for every row, ``kept_layers`` copied for reused rows."""

    old_rows: np.ndarray  # [len(plan.rows)] int64
    new_layers: list[str]
    kept_layers: list[str]
    # The old store's rows are the plan's, on the same batch grid (no sample added or
    # removed, the same batch size): then computed rows run in their grid batches.
    same_grid: bool = False

    @property
    def rows_computed(self) -> int:
        return int((self.old_rows < 0).sum())

    @property
    def rows_reused(self) -> int:
        return int((self.old_rows >= 0).sum())

    def batches_run(self, grid: GridBatches) -> Iterable[list[int]]:
        """The batches (positions into ``plan.rows``) that go through the model: all of
        ``grid`` when a layer is new; on the old store's grid, each grid batch holding a
        computed row, whole (batch composition changes a result's last bits, so computed
        rows get a fresh run's bytes); else the computed rows in batches of their own."""
        if self.new_layers:
            return grid
        if self.same_grid:
            return [batch for batch in grid if (self.old_rows[batch] < 0).any()]
        computed = np.flatnonzero(self.old_rows < 0)
        size = grid.batch_size
        return [computed[at : at + size].tolist() for at in range(0, len(computed), size)]


def update_refusal(
    stored_key: Mapping[str, Any],
    key: Mapping[str, Any],
    stored_config: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
) -> str:
    """What differs between a store's key (and config) and this run's that an update
    cannot take: ``"its weights differ (...)"``; "" when nothing does."""
    for name in sorted(set(stored_key) | set(key)):
        if name not in UPDATABLE_KEYS and stored_key.get(name) != key.get(name):
            return (
                f"its {name.replace('_', ' ')} differs from this run's "
                f"({short_value(stored_key.get(name))} vs {short_value(key.get(name))})"
            )
    if stored_config is None or config is None:
        return ""
    fixed = [
        name
        for name in config_differences(stored_config, config)
        if not name.startswith(UPDATABLE_CONFIG) or name == "data.max_length"
    ]
    if not fixed:
        return ""
    was, now = (short_value(value_at(c, fixed[0])) for c in (stored_config, config))
    return f"its config differs from this run's at {', '.join(fixed[:3])} ({was} vs {now})"


def plan_work(old: FeatureStore, plan: ExtractionPlan, hashes: np.ndarray | None) -> UpdateWork:
    """Match the rows and layers of ``plan`` to those of the ``old`` store. A row is
    reused only if its ``hashes`` entry (``[source rows]``, the ``content_hash`` column)
    equals the old store's, else, without hashes, if its change stamp is unchanged."""
    old_ids = old.ids
    row_of = {sample_id: row for row, sample_id in enumerate(old_ids)}
    old_rows = np.array([row_of.get(str(plan.ids[p]), -1) for p in plan.rows], dtype=np.int64)
    reused = np.flatnonzero(old_rows >= 0)
    if hashes is not None:
        held = old.file.get(HASH_COLUMN)
        if held is None:
            old_rows[:] = -1
        else:
            stored = np.asarray(held[: len(old_ids)])
            current = np.asarray(hashes)[plan.rows.start + reused]
            old_rows[reused[stored[old_rows[reused]] != current]] = -1
    elif plan.stamps is not None and old.stamps is not None:
        stamps = old.stamps[old_rows[reused]], plan.stamps[plan.rows.start + reused]
        old_rows[reused[changed_rows(*stamps)]] = -1
    stored_taps = {record["key"]: record for record in old.attrs.get("taps") or []}
    kept = [
        tap.key
        for tap in plan.taps
        if tap.key in old.layers and stored_taps.get(tap.key) == tap_record(tap)
    ]
    new = [tap.key for tap in plan.taps if tap.key not in kept]
    grid_keys = ("source_rows", "rows", "batch_size")
    stored_key, key = old.attrs.get("resume_key") or {}, plan.key().to_json()
    same_grid = old_ids == [str(plan.ids[p]) for p in plan.rows] and all(
        stored_key.get(name) == key.get(name) for name in grid_keys
    )
    return UpdateWork(old_rows, new, kept, same_grid)


def update_store(plan: ExtractionPlan, path: Path, *, check_space: bool = True) -> FeatureStore:
    """Bring the complete store at ``path`` up to ``plan``: copy what it holds, compute
    the rest. Returns the new store (its last ``history`` record says what was reused).

    Raises:
        ConfigError: the store was made with another model, weights, preprocessing or
            store settings (one line naming the difference), or holds per-token rows.
    """
    with FeatureStore(path) as old:
        _check_updatable(old, path, plan)
        columns = dict(getattr(plan.dataset, "row_columns", None) or {})
        if plan.hashes_content and HASH_COLUMN not in columns:
            raise ConfigError(
                f"cannot update {path}: data.content_hash is on but this source records no "
                "hash per sample (image folders and manifests do), so a changed sample "
                f"would go unseen; turn data.content_hash off, or pass {OVERWRITE}"
            )
        hashes = columns.get(HASH_COLUMN)
        if hashes is None and plan.stamps is not None and old.stamps is None:
            warnings.warn(
                f"{path} records no change stamps (it was written before featcache kept "
                "them), so this update cannot see a sample replaced under the same name; "
                f"set data.content_hash: true, or pass {OVERWRITE} to extract it afresh",
                FeatcacheWarning,
                stacklevel=3,
            )
        work = plan_work(old, plan, hashes)
        check_reused(old, path, plan, work)
        remove_partial(path)  # a stopped update (or other run) starts over
        if check_space:  # the old store stays until the new one replaces it
            check_free_space([estimate_store(plan, path)], True)
        run_taps = list(plan.taps)
        if work.new_layers and not work.rows_computed:  # the forward stops at the new layers
            run_taps = [tap for tap in plan.taps if tap.key in work.new_layers]
        batches = work.batches_run(plan.grid())
        if work.new_layers:
            positions = np.arange(plan.rows.start, plan.rows.stop)
        else:
            positions = plan.rows.start + np.array([o for b in batches for o in b], dtype=np.int64)
        mark = {UPDATE_MARK: old.attrs.get("created") or str(path)}
        start = time.perf_counter()
        with loaded_batches(plan, batches, workers_for=len(positions)) as loaded:
            with WriterThread(plan.writer(path, mark), path) as thread:
                merged = MergedRows(thread, old, plan, work, positions)
                done_before = len(plan.rows) - len(positions)
                timing = run_rows(plan, loaded, merged, taps=run_taps, done_before=done_before)
                merged.finish()
            writer = thread.writer
            assert writer is not None  # the thread raised otherwise
            timing["seconds_waiting_for_disk"] = thread.waited
            timing["seconds"] = time.perf_counter() - start
            timing["images_per_second"] = len(positions) / max(timing["seconds"], 1e-9)
            key = plan.key().to_json()
            layers = (len(work.new_layers), len(work.kept_layers))
            record = run_record("update", (work.rows_computed, work.rows_reused), layers, key)
            history = [*history_of(old.attrs, len(old), len(old.layers)), record]
            attrs = {**timing, "row_unit": ROW_UNITS[plan.unit], "resume_key": key}
            old.close()  # before the new store takes its name
            writer.close(complete=True, attrs={**attrs, "history": history}, row_columns=columns)
    return FeatureStore.just_sealed(path)


def _check_updatable(old: FeatureStore, path: Path, plan: ExtractionPlan) -> None:
    """Refuse an update whose rows would not be computed as the old store's were."""
    fix = f"pass {OVERWRITE} to extract it afresh"
    if old.offsets is not None or plan.row_tokens is not None or plan.bucket_window:
        raise ConfigError(
            f"cannot update {path}: it holds per-token rows or length-bucketed batches, "
            f"which an update does not rewrite; {fix}"
        )
    if plan.options.store.dtype in QUANTIZED:
        raise ConfigError(
            f"cannot update {path}: it holds int8 codes, which an update does not copy with "
            f"their scales; {fix}"
        )
    stored_config = old.config
    why = update_refusal(
        old.attrs.get("resume_key") or {},
        plan.key().to_json(),
        stored_config,
        plan.provenance.get("config"),
    )
    stored_preprocessing = old.attrs.get("preprocessing")
    preprocessing = plan.provenance.get("preprocessing")
    if not why and preprocessing is not None and stored_preprocessing != preprocessing:
        why = "its preprocessing differs from this run's"
    if why:
        raise ConfigError(
            f"cannot update {path}: {why}; an update computes new rows with the model, "
            f"weights, preprocessing and store settings the store was made with, so {fix}"
        )


def check_reused(old: FeatureStore, path: Path, plan: ExtractionPlan, work: UpdateWork) -> None:
    """Refuse the update when the first :data:`CHECKED_ROWS` reused rows' kept layers,
    recomputed, differ from the store beyond the resume check's tolerance.

    Raises:
        ConfigError: naming the row, its id, the layer and the difference.
    """
    reused = np.flatnonzero(work.old_rows >= 0)[:CHECKED_ROWS]
    if not len(reused) or not work.kept_layers:
        return
    kept = dataclasses.replace(plan, taps=[t for t in plan.taps if t.key in work.kept_layers])
    (captured,) = recompute(kept, [reused.tolist()])
    dtype = plan.options.store.dtype
    tolerance, rounding = tolerance_of(dtype, plan.layout.amp)
    rows = work.old_rows[captured.index - plan.rows.start]
    for key in captured.features:
        relative = relative_differences(captured.values(key, dtype), old.read(key, rows))
        at = first_over(relative, tolerance)
        if at is not None:
            difference = float(relative[at])
            sample = plan.ids[int(captured.index[at])]
            raise ConfigError(
                f"cannot update {path}: row {sample!r}, layer {key!r}, recomputed now differs "
                f"from the store by {difference:.1%} of its largest value, beyond {rounding} "
                "rounding, although the model, weights and settings match; the data, its "
                "transform or the model changed in a way the store's fingerprints cannot "
                f"see; pass {OVERWRITE} to extract it afresh"
            )


class MergedRows:
    """The run loop's sink for an update: the old store's rows put among the computed
    ones, in source order, whole rows handed to the writer thread. In a computed batch
    the reused rows' kept layers are copied over what was computed, so they stay byte
    for byte the old store's. ``positions``: the source positions that go through the
    model, in order."""

    def __init__(
        self,
        sink: WriterThread,
        old: FeatureStore,
        plan: ExtractionPlan,
        work: UpdateWork,
        positions: np.ndarray,
    ):
        self.sink, self.old, self.plan, self.work = sink, old, plan, work
        self.dtype = plan.options.store.dtype
        self.path = sink.path
        self.waited = 0.0  # seconds the forward waited on the writer thread
        run = set(positions.tolist())
        # Source positions copied whole, in order, and how many of them are written.
        self.copied = np.array([p for p in plan.rows if p not in run], dtype=np.int64)
        self.next = 0
        self.attrs: dict[str, dict[str, Any]] = {}
        self.labels = _source_labels(plan.dataset)

    @property
    def skipped(self) -> int:
        return self.sink.skipped

    def put(self, batch: CapturedBatch, feature_attrs: Any) -> None:
        if batch.ready is not None:
            batch.ready.synchronize()
        features = {key: value.clone() for key, value in batch.features.items()}
        if batch.release is not None:
            batch.release()  # the host buffers go back: the values are copied
        self._layer_attrs(feature_attrs)
        seen = [*batch.index.tolist(), *(int(r["index"]) for r in batch.skipped)]
        upto = max(seen) if seen else -1
        before = int(batch.index.min()) if len(batch.index) else upto + 1
        self._copy_until(before)  # whole blocks ahead of the batch
        stop = int(np.searchsorted(self.copied, upto, side="right"))
        between = self.copied[self.next : stop]  # rows interleaved with the batch's
        self.next = stop
        rows = np.concatenate([batch.index, between])
        order = np.argsort(rows, kind="stable")
        labels = np.concatenate([batch.labels, self._labels(between)])[order]
        parts = [self._filled(batch.index, features)] if len(batch.index) else []
        if len(between):
            parts.append(self._copies(between))
        picked = torch.from_numpy(order)
        values = {key: torch.cat([p[key] for p in parts])[picked] for key in (parts or [{}])[0]}
        self._put(rows[order], labels, values, batch.skipped)

    def finish(self) -> None:
        """Write the copied rows after the last computed batch."""
        self._copy_until(self.plan.rows.stop)

    def _layer_attrs(self, computed: Mapping[str, Mapping[str, Any]] | None) -> None:
        """Each layer's dataset attributes: as the forward found them, or as the old
        store recorded them for a layer copied without being computed."""
        if self.attrs:
            return
        for tap in self.plan.taps:
            found = (computed or {}).get(tap.key)
            if found is None:
                found = {
                    name: value
                    for name, value in self.old.layer_attrs(tap.key).items()
                    if name not in ("dtype", "layout")
                }
            self.attrs[tap.key] = dict(found)

    def _copy_until(self, position: int) -> None:
        stop = int(np.searchsorted(self.copied, position, side="left"))
        while self.next < stop:
            block = self.copied[self.next : min(self.next + COPY_ROWS, stop)]
            self.next += len(block)
            self._layer_attrs(None)
            self._put(block, self._labels(block), self._copies(block), [])

    def _old_rows(self, positions: np.ndarray) -> np.ndarray:
        return self.work.old_rows[positions - self.plan.rows.start]

    def _labels(self, positions: np.ndarray) -> np.ndarray:
        """The labels of copied rows: the source's own where it lists them (a manifest
        may relabel a sample), else the old store's."""
        if self.labels is not None:
            return self.labels[positions]
        labels = self.old.labels
        if labels is None:
            return np.full(len(positions), -1, dtype=np.int64)
        return labels[self._old_rows(positions)]

    def _copies(self, positions: np.ndarray) -> dict[str, torch.Tensor]:
        """Every layer of the rows at source ``positions``, read from the old store."""
        rows = self._old_rows(positions)
        return {tap.key: self._read(tap.key, rows) for tap in self.plan.taps}

    def _read(self, layer: str, rows: np.ndarray) -> torch.Tensor:
        return encode(self.old.read(layer, rows), self.dtype)  # the stored bits, as computed ones

    def _filled(
        self, positions: np.ndarray, computed: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A computed batch's values of every layer, the kept layers of its reused rows
        copied from the old store."""
        rows = self._old_rows(positions)
        reused = np.flatnonzero(rows >= 0)
        values = {}
        for tap in self.plan.taps:
            value = computed.get(tap.key)
            if tap.key in self.work.kept_layers and len(reused):
                old = self._read(tap.key, rows[reused])
                if value is None:
                    value = old.new_zeros((len(positions), *old.shape[1:]))
                value[torch.from_numpy(reused)] = old
            assert value is not None  # every row of a batch without it is reused
            values[tap.key] = value
        return values

    def _put(
        self,
        rows: np.ndarray,
        labels: np.ndarray,
        values: dict[str, torch.Tensor],
        skipped: Sequence[Mapping[str, Any]],
    ) -> None:
        ids = [self.plan.ids[int(p)] for p in rows]
        batch = CapturedBatch(rows, ids, labels, values, None, [dict(r) for r in skipped])
        self.sink.put(batch, self.attrs)
        self.waited = self.sink.waited


def _source_labels(dataset: Dataset) -> np.ndarray | None:
    """A featcache source's labels (int64 ``[rows]``, -1 where none) when it lists them
    without decoding a sample; None otherwise."""
    from featcache.sources.base import SourceDataset

    if not isinstance(dataset, SourceDataset):
        return None
    labels = getattr(dataset, "labels", None)
    if labels is None or len(labels) != len(dataset):
        return None
    return np.array([-1 if label is None else int(label) for label in labels], dtype=np.int64)
