"""Sizing a store before its run: the layers' shapes from one row through the hooked
forward, the store's bytes from them, and the check that the disk has room."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from torch import nn
from torch.utils.data import Dataset

from featcache.errors import FeatcacheError
from featcache.extraction.dry_run import DryRun, dry_run
from featcache.store.paths import partial_path
from featcache.store.size import (
    LayerSize,
    bytes_on_disk,
    dataset_bytes,
    layer_chunk_rows,
    require_space,
    store_bytes,
)

if TYPE_CHECKING:
    from featcache.extraction.api import RunOptions, _Plan

SIZING_ROWS = 8  # rows tried, one at a time, until one reads (the others may be skipped)
# Attribute text besides the provenance and the class names: the store key, library
# versions, layout, timings (about 1.5 KiB in the demo stores).
OTHER_ATTRS_BYTES = 1536
# How to run anyway when the check refuses, from the command line and from Python.
GO_AHEAD = "pass --ignore-free-space (check_space=False from Python)"


@dataclasses.dataclass(frozen=True)
class StoreEstimate:
    """What one store will take: ``bytes`` on disk once finished (uncompressed), and
    for each layer its shape per row (per token) and the bytes of its values."""

    path: Path
    rows: int
    tokens: int | None  # the tokens of per-token layers (None without any)
    layers: tuple[LayerSize, ...]
    layer_bytes: dict[str, int]
    bytes: int
    compression: str | None

    def needed(self, overwrite: bool) -> int:
        """Bytes the run still has to find free: the finished store, less what its
        partial store already holds when the run resumes it (a torchrun rank's store is
        its shard), plus room for the compressed copy (written beside it, at most as
        large) when the store is compressed."""
        written = 0 if overwrite else bytes_on_disk(partial_path(self.path))
        copy = self.bytes if self.compression is not None else 0
        return max(self.bytes - written, 0) + copy


def estimate_store(
    model: nn.Module, dataset: Dataset, path: Path, plan: _Plan, run: RunOptions
) -> StoreEstimate:
    """The size of the store a run of ``plan`` writes at ``path``; one row of the source
    runs through the hooked forward for the layers' shapes, and nothing is written."""
    seen = sized_rows(model, dataset, plan, run)
    rows = len(plan.rows)
    tokens = plan.token_capacity if any(s.per_token for s in seen.layers.values()) else None
    columns = getattr(dataset, "row_columns", None) or {}
    attrs = json.dumps(dict(plan.provenance), default=str) + json.dumps(plan.class_names)
    layers = tuple(seen.layers.values())
    total = store_bytes(
        rows,
        layers,
        ids_width=max((len(str(i).encode()) for i in plan.ids), default=1),
        has_labels=plan.has_labels,
        tokens=tokens,
        token_ids=seen.token_ids,
        chunk_rows=run.store.chunk_rows,
        checksum=run.store.checksum,
        row_column_bytes=sum(np.asarray(column).dtype.itemsize for column in columns.values()),
        attrs_bytes=len(attrs.encode()) + OTHER_ATTRS_BYTES,
    )
    per_layer = {}
    for layer in layers:
        length = max(tokens or 0, 1) if layer.per_token else rows
        chunk = layer_chunk_rows(layer, length, run.store.chunk_rows)
        per_layer[layer.key] = dataset_bytes(length, chunk, layer.item_bytes, checksum=False)
    return StoreEstimate(path, rows, tokens, layers, per_layer, total, run.store.compression)


def sized_rows(model: nn.Module, dataset: Dataset, plan: _Plan, run: RunOptions) -> DryRun:
    """A dry run of the first of the run's rows that reads: each layer's stored shape.

    Raises:
        FeatcacheError: when none of the first rows gives values (all skipped).
    """
    # The memory layout changes no shape: the default one spares converting the weights.
    plain = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, channels_last=False))
    first = plan.rows.start
    for row in range(first, min(plan.rows.stop, first + SIZING_ROWS)):
        seen = dry_run(model, dataset, plain, run, range(row, row + 1), 1, workers=False)
        if seen.layers:
            return seen
    raise FeatcacheError(
        f"none of the first {SIZING_ROWS} rows of the dataset could be read, so the size of "
        "the store is unknown; check the data (or pass check_space=False / "
        "--ignore-free-space to run without the check)"
    )


def check_free_space(estimates: Sequence[StoreEstimate], overwrite: bool) -> None:
    """Refuse a run whose stores need more bytes than their filesystem has free, in one
    line naming both (the stores of one run share the output folder).

    Raises:
        FeatcacheError: not enough free space.
    """
    if estimates:
        needed = sum(estimate.needed(overwrite) for estimate in estimates)
        require_space(needed, [estimate.path for estimate in estimates], GO_AHEAD)
