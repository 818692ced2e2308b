"""Rows through the hooked forward with nothing written: each layer's stored shape and
each batch's time, to size and plan a run."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from featcache.extraction.grid import GridBatches
from featcache.extraction.plan import ExtractionPlan
from featcache.extraction.run import loaded_batches, run_rows
from featcache.extraction.writer_thread import CapturedBatch
from featcache.store import codec


@dataclasses.dataclass(frozen=True)
class LayerSize:
    """One stored layer: ``shape`` of a row (of a token, for a per-token layer) and the
    store dtype its values are kept in."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    per_token: bool = False

    @property
    def item_bytes(self) -> int:
        """Bytes of one row (one token) as stored, with its float32 scale if int8."""
        scale = 4 if self.dtype in codec.QUANTIZED else 0
        return math.prod(self.shape) * codec.numpy_dtype(self.dtype).itemsize + scale


@dataclasses.dataclass
class DryRun:
    """What a dry run saw, noted as the run loop's sink: each layer's row (token) shape,
    and each batch's end time."""

    dtype: str  # the store dtype, which the layers are kept in
    layers: dict[str, LayerSize] = dataclasses.field(default_factory=dict)
    finished: list[float] = dataclasses.field(default_factory=list)  # perf_counter seconds
    rows: list[int] = dataclasses.field(default_factory=list)  # rows of each batch
    token_ids: bool = False  # per-token layers come with their input token ids
    peak_memory: int | None = None  # CUDA: the most bytes allocated during the run
    path: Path = Path("dry run")
    waited: float = 0.0
    skipped: int = 0

    def put(self, batch: CapturedBatch, feature_attrs: Mapping[str, Any]) -> None:
        self.finished.append(time.perf_counter())
        self.rows.append(len(batch.index))
        self.token_ids |= batch.token_ids is not None
        for key, value in batch.features.items():
            per_token = key in batch.ragged
            shape = tuple(int(n) for n in value.shape[1:])
            self.layers.setdefault(key, LayerSize(key, shape, self.dtype, per_token))
        if batch.release is not None:
            if batch.ready is not None:
                batch.ready.synchronize()
            batch.release()


def dry_run(plan: ExtractionPlan, rows: range, batch_size: int, workers: bool = True) -> DryRun:
    """Run the source rows ``rows`` through the hooked forward in batches of
    ``batch_size``, keeping only shapes and timings; with ``workers``, loaded by as many
    worker processes as the full run would start. ``torch.compile`` is left off."""
    options = plan.options
    options = dataclasses.replace(
        options,
        loader=dataclasses.replace(options.loader, batch_size=batch_size),
        runtime=dataclasses.replace(options.runtime, progress=False, compile=False),
    )
    seen = DryRun(options.store.dtype)
    cuda = plan.layout.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(plan.layout.device)
    grid = GridBatches(rows, batch_size, plan.shard_starts)
    workers_for = len(plan.rows) if workers else None
    with loaded_batches(plan, grid, rows=rows, workers_for=workers_for, options=options) as batches:
        run_rows(plan, batches, seen, total=len(rows), options=options, warn=False)
    if cuda:
        seen.peak_memory = int(torch.cuda.max_memory_allocated(plan.layout.device))
    return seen
