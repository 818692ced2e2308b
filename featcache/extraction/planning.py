"""``plan``: what an extraction will take before it runs (see docs/guides/plan.md)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from featcache.config.spec import Spec, load_config
from featcache.errors import ConfigError
from featcache.extraction.dry_run import dry_run
from featcache.extraction.estimate import StoreEstimate, estimate_store, with_compressed_size
from featcache.extraction.from_config import (
    build_backbone_for,
    build_source_for,
    check_same_classes,
    complete_already,
    run_options,
    split_arguments,
)
from featcache.extraction.plan import ExtractionPlan, make_plan
from featcache.store.metadata import UNREADABLE_METADATA
from featcache.store.paths import partial_path
from featcache.store.resume import kept_until
from featcache.store.shards import read_shards
from featcache.util.files import free_bytes
from featcache.util.units import format_bytes

TIMED_BATCHES = 3  # batches timed per batch size, after one that warms up
FASTER = 1.05  # another batch size is suggested only when this much faster


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """One split: its store's estimate, and whether the run leaves a complete store of
    the same config as it is (then it writes nothing)."""

    split: str
    estimate: StoreEstimate
    complete: bool
    needed: int  # bytes the run still needs free for this store (0 when complete)
    done: int = 0  # rows a stopped run (its partial store, or shards) holds already

    @property
    def rows_to_write(self) -> int:
        """The rows the run computes: none for a complete store, else those not done."""
        return 0 if self.complete else max(self.estimate.rows - self.done, 0)


@dataclasses.dataclass(frozen=True)
class BatchTiming:
    """Rows per second of the hooked forward (data loading included) at one batch size,
    from ``batches`` batches after a first that warms up; ``peak_memory`` on CUDA."""

    batch_size: int
    rows_per_second: float | None  # None: the batch size did not fit in memory
    batches: int
    peak_memory: int | None = None


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a config's run will take, measured before it runs."""

    splits: list[SplitPlan]
    free: int  # free bytes on the output filesystem
    filesystem: Path  # the folder the free bytes were measured at
    device: str
    batch_size: int  # the config's loader.batch_size
    timings: list[BatchTiming]  # by batch size, the config's among them
    suggested_batch_size: int

    @property
    def bytes(self) -> int:
        """Bytes of every split's finished store."""
        return sum(split.estimate.bytes for split in self.splits)

    @property
    def compressed(self) -> int | None:
        """Predicted bytes of every split's store once compressed; None when the stores
        are not compressed (or no prediction was made)."""
        sizes = [split.estimate.compressed for split in self.splits]
        return None if None in sizes else sum(size or 0 for size in sizes)

    @property
    def needed(self) -> int:
        """Bytes the run still needs free: the stores it writes, less what their partial
        stores hold already, plus room for compressed copies."""
        return sum(split.needed for split in self.splits)

    @property
    def fits(self) -> bool:
        return self.needed <= self.free

    @property
    def rows_per_second(self) -> float | None:
        """The measured rate at the config's batch size."""
        return next(
            (t.rows_per_second for t in self.timings if t.batch_size == self.batch_size), None
        )

    @property
    def rows_to_write(self) -> int:
        """The rows the run computes: complete stores, and the rows a stopped run holds
        durably (which it keeps), aside."""
        return sum(split.rows_to_write for split in self.splits)

    @property
    def seconds(self) -> float | None:
        """Estimated seconds of the run: the rows still to write at the measured rate."""
        rate = self.rows_per_second
        return None if not rate else self.rows_to_write / rate

    def format(self) -> str:
        """The plan as ``featcache plan`` prints it."""
        lines = self._split_lines()
        layers = self.splits[0].estimate.layers
        table = [["layer", "stored as", "dtype", *(s.split for s in self.splits)]]
        for layer in layers:
            sizes = [format_bytes(s.estimate.layer_bytes[layer.key]) for s in self.splits]
            table.append([layer.key, _shape(layer.shape, layer.per_token), layer.dtype, *sizes])
        lines += _aligned(table, right=set(range(3, 3 + len(self.splits))))
        verdict = "fits" if self.fits else "DOES NOT FIT"
        compressed = self.compressed
        once = ""
        if compressed is not None:
            codec = self.splits[0].estimate.compression
            once = f" (about {format_bytes(compressed)} once compressed with {codec})"
        lines.append(
            f"disk        {format_bytes(self.bytes)} in all{once}, {format_bytes(self.needed)} "
            f"still to write; {format_bytes(self.free)} free on {self.filesystem}: {verdict}"
        )
        rate, seconds = self.rows_per_second, self.seconds
        if rate is not None and seconds is not None:
            timed = next(t for t in self.timings if t.batch_size == self.batch_size)
            how = (
                f"{rate:,.0f} rows/s at batch size {self.batch_size} on {self.device}, "
                f"{timed.batches} batch{'es' if timed.batches > 1 else ''} timed"
            )
            rows = self.rows_to_write
            todo = f"about {_duration(seconds)} for {rows:,} rows" if rows else "no rows to write"
            lines.append(f"time        {todo} ({how})")
        measured = ", ".join(f"{t.batch_size}: {_rate(t)}" for t in self.timings)
        lines.append(f"batch size  {self.suggested_batch_size} suggested ({measured})")
        return "\n".join(lines)

    def _split_lines(self) -> list[str]:
        """The table of splits: rows, tokens (with per-token layers), the store's bytes,
        its predicted compressed bytes (for compressed stores) and its path."""
        tokens = any(split.estimate.tokens is not None for split in self.splits)
        compressed = any(split.estimate.compressed is not None for split in self.splits)
        header = ["split", "rows", *(["tokens"] if tokens else []), "store"]
        header += ["compressed"] if compressed else []
        table = [[*header, "path"]]
        for split in self.splits:
            e = split.estimate
            row = [split.split, f"{e.rows:,}"]
            if tokens:
                row.append("-" if e.tokens is None else f"{e.tokens:,}")
            row.append(format_bytes(e.bytes))
            if compressed:
                row.append("-" if e.compressed is None else format_bytes(e.compressed))
            note = " (complete: nothing to write)" if split.complete else ""
            if split.done and not split.complete:
                note = f" ({split.done:,} rows done, {split.rows_to_write:,} to write)"
            table.append([*row, f"{e.path}{note}"])
        return _aligned(table, right=set(range(1, len(header))))


def plan(
    config: str | os.PathLike | Mapping[str, Any] | Spec,
    overrides: Iterable[str] = (),
    *,
    batches: int = TIMED_BATCHES,
) -> RunPlan:
    """What running ``config`` will take, without running the whole model.

    For each split: its rows (and tokens, for per-token layers) and the bytes of its
    store and of each layer, from one row through the hooked forward
    ([`featcache.extraction.estimate`][featcache.extraction.api.estimate]); for a
    compressed store (``store.compression``), also its predicted compressed bytes: a
    sample of its rows is run and compressed in memory with the store's filter. Then the
    free space on the output filesystem, and the rows per second of the run's own loop (data
    loading and the hooked forward, nothing written) over ``batches`` batches of the
    first split after one that warms up, at the config's batch size, half of it and
    twice it; the time estimate is the rows still to write at the config's rate, and the
    suggested batch size the fastest of those (the config's unless another is 5% faster;
    one that runs out of CUDA memory is left out, and on CUDA each one's peak memory is
    reported).
    """
    spec = config if isinstance(config, Spec) else load_config(config, overrides)
    if spec.models:
        raise ConfigError(
            "plan takes a config of one model; plan each model of models: alone "
            "(featcache plan does, or plan(one) for one in spec.per_model().values())"
        )
    backbone = build_backbone_for(spec)
    sources = {split: build_source_for(spec, split, backbone) for split in spec.data.splits}
    check_same_classes({split: source.class_names for split, source in sources.items()})
    splits: list[SplitPlan] = []
    plans: list[ExtractionPlan] = []
    for split, source in sources.items():
        path = spec.store_path(split)
        arguments = split_arguments(spec, split, source, backbone, None, fingerprint=False)
        split_plan = make_plan(backbone.model, source, spec.layers, run_options(spec), **arguments)
        plans.append(split_plan)
        estimate = with_compressed_size(split_plan, estimate_store(split_plan, path))
        complete = complete_already(spec, split)
        needed = 0 if complete else estimate.needed(spec.output.overwrite)
        done = 0 if spec.output.overwrite else rows_done(split_plan, path)
        splits.append(SplitPlan(split, estimate, complete, needed, done))
    free, folder = free_bytes(Path(spec.output.dir))
    first_plan = plans[0]
    timings = time_batch_sizes(first_plan, _candidates(spec, len(first_plan.rows)), batches)
    return RunPlan(
        splits=splits,
        free=free,
        filesystem=folder,
        device=str(first_plan.layout.device),
        batch_size=spec.loader.batch_size,
        timings=timings,
        suggested_batch_size=suggest_batch_size(timings, spec.loader.batch_size),
    )


def time_batch_sizes(
    plan: ExtractionPlan, batch_sizes: Iterable[int], batches: int = TIMED_BATCHES
) -> list[BatchTiming]:
    """Rows per second of the run's loop at each batch size, over ``batches`` batches
    after one that warms up (fewer where the rows run out)."""
    timings = []
    for size in batch_sizes:
        rows = range(plan.rows.start, min(plan.rows.stop, plan.rows.start + size * (batches + 1)))
        started = time.perf_counter()
        try:
            seen = dry_run(plan, rows, size)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            timings.append(BatchTiming(size, None, 0))
            continue
        if len(seen.finished) > 1:  # the first batch warms up
            seconds, done = seen.finished[-1] - seen.finished[0], sum(seen.rows[1:])
        else:
            seconds, done = time.perf_counter() - started, sum(seen.rows)
        rate = done / seconds if seconds > 0 else None
        timings.append(BatchTiming(size, rate, max(len(seen.finished) - 1, 1), seen.peak_memory))
    return timings


def suggest_batch_size(timings: list[BatchTiming], configured: int) -> int:
    """The fastest measured batch size, or ``configured`` unless another is at least
    5% faster (the spread of a few batches' timing)."""
    rates = {t.batch_size: t.rows_per_second for t in timings if t.rows_per_second}
    if not rates:
        return configured
    best = max(rates, key=lambda size: rates[size])
    base = rates.get(configured)
    if base is not None and rates[best] < FASTER * base:
        return configured
    return best


def _candidates(spec: Spec, rows: int) -> list[int]:
    """The config's batch size, half of it and twice it, within the rows of the split."""
    size = spec.loader.batch_size
    return sorted({max(size // 2, 1), size, *([2 * size] if 2 * size <= rows else [])})


def _aligned(rows: list[list[str]], right: set[int]) -> list[str]:
    """``rows`` as lines of columns two spaces apart, the ``right`` ones right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _shape(shape: tuple[int, ...], per_token: bool) -> str:
    dims = ", ".join(str(n) for n in shape)
    return f"[tokens, {dims}]" if per_token else f"[{dims}]"


def _rate(timing: BatchTiming) -> str:
    if timing.rows_per_second is None:
        return "out of memory"
    rate = f"{timing.rows_per_second:,.0f} rows/s"
    return rate if timing.peak_memory is None else f"{rate}, {format_bytes(timing.peak_memory)}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def rows_done(plan: ExtractionPlan, path: Path) -> int:
    """The rows of the store at ``path`` that a rerun of ``plan`` keeps rather than
    computes: those its partial store or shards hold, back to the batch grid."""
    step = plan.bucket_window or plan.options.loader.batch_size
    shards = read_shards(path, step, plan.shard_starts)
    if shards:
        return sum(len(shard.held) for shard in shards)
    partial = partial_path(path)
    if not partial.is_file():
        return 0
    try:
        return kept_until(partial, plan.rows.start, step, plan.shard_starts) - plan.rows.start
    except UNREADABLE_METADATA:  # the run itself names the damage
        return 0
