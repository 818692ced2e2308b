"""The one run: rows of a plan, loaded in batches, through the hooked forward, into a sink.

Runs differ only in their rows and their sink: a store, an update's merge, a comparison
with stored rows (`recompute`), or a dry run's timer. `make_loader` is the one place a
``DataLoader`` of source rows is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from featcache.config.spec import LoaderSpec
from featcache.extraction.batches import Batch, Collate, SourceRows, num_workers, pins, started
from featcache.extraction.loop import run_rows
from featcache.extraction.plan import ExtractionPlan, RunOptions
from featcache.extraction.writer_thread import CapturedBatch

# Batches of the source rows in a range, from a loader shared with other runs.
Feed = Callable[[range], contextlib.AbstractContextManager[Iterator[Batch]]]


def make_loader(
    rows: Dataset,
    batches: Iterable[list[int]],
    loader: LoaderSpec,
    device: torch.device,
    *,
    workers_for: int | None,
    collate: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """A loader of ``rows`` (a `SourceRows`, or a view of one) in ``batches`` (lists of
    positions into it), collated into one `Batch` each unless ``collate`` says otherwise;
    its worker processes are sized for ``workers_for`` rows (None: load in this process)."""
    workers = 0
    if workers_for is not None:
        workers = num_workers(loader.num_workers, workers_for, loader.batch_size)
    return DataLoader(
        rows,
        batch_sampler=batches,
        num_workers=workers,
        pin_memory=pins(loader.pin_memory, device),
        collate_fn=collate or Collate(getattr(rows, "pad_values", None)),
    )


@contextlib.contextmanager
def loaded_batches(
    plan: ExtractionPlan,
    batches: Iterable[list[int]],
    *,
    rows: range | None = None,
    workers_for: int | None = None,
    feed: Feed | None = None,
    options: RunOptions | None = None,
) -> Iterator[Iterator[Batch]]:
    """The batches of ``plan``'s source rows ``rows`` (default the plan's), ``batches``
    listing positions into ``rows``. ``workers_for``: the row count the worker processes
    are sized for (None: load in this process). A ``feed`` (a pass shared with other
    models) gives the batches instead; ``options`` replace the plan's. Enter it before
    opening the sink: forked workers then never hold the store's file."""
    rows = plan.rows if rows is None else rows
    if feed is not None:
        with feed(rows) as fed:
            yield fed
        return
    loader = (options or plan.options).loader
    source_rows = SourceRows(plan.dataset, rows, has_labels=plan.has_labels)
    made = make_loader(source_rows, batches, loader, plan.layout.device, workers_for=workers_for)
    with started(made) as loaded:
        yield loaded


@dataclasses.dataclass
class Collected:
    """A sink that keeps every batch, on the CPU: what a comparison recomputes."""

    batches: list[CapturedBatch] = dataclasses.field(default_factory=list)
    path: Path = Path("recomputed")
    waited: float = 0.0

    @property
    def skipped(self) -> int:
        return sum(len(batch.skipped) for batch in self.batches)

    def put(self, batch: CapturedBatch, feature_attrs: Mapping[str, Any]) -> None:
        batch.own()
        self.batches.append(batch)


def recompute(
    plan: ExtractionPlan,
    batches: Sequence[list[int]],
    *,
    on_nonfinite: Literal["fail", "skip", "keep"] | None = None,
) -> list[CapturedBatch]:
    """The captured values of ``batches`` (positions into ``plan.rows``), run as the run
    loop runs them, in this process and without a progress bar. Unreadable rows and those
    the non-finite policy (``on_nonfinite`` replaces the plan's) drops are left out,
    recorded as skipped."""
    options = plan.options
    options = dataclasses.replace(
        options,
        loader=dataclasses.replace(options.loader, on_error="skip"),
        store=dataclasses.replace(
            options.store, on_nonfinite=on_nonfinite or options.store.on_nonfinite
        ),
        runtime=dataclasses.replace(options.runtime, progress=False, compile=False),
    )
    collected = Collected()
    with loaded_batches(plan, batches) as loaded:
        run_rows(plan, loaded, collected, options=options, warn=False)
    return collected.batches
