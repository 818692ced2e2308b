"""Several models over one pass of a dataset: each sample read and decoded once, then
given to every model's own preprocessing, forward and store. Each model runs on its own
thread as ``extract`` would, on the same batches, so each store equals its single run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from featcache.capture.runtime import resolve_device
from featcache.errors import ConfigError, FeatcacheError
from featcache.extraction.api import run_plan
from featcache.extraction.batches import (
    Batch,
    Collate,
    SourceRows,
    first_sample,
    source_length,
    split_sample,
    started,
)
from featcache.extraction.dataset_info import dataset_classes, dataset_ids
from featcache.extraction.estimate import StoreEstimate, check_free_space, estimate_store
from featcache.extraction.grid import GridBatches, shard_starts
from featcache.extraction.plan import PLAN_ARGUMENTS, ExtractionPlan, RunOptions, make_plan
from featcache.extraction.run import make_loader
from featcache.store import FeatureStore
from featcache.store.lock import writer_lock

Transform = Callable[[Any], Any]
_POLL = 0.2  # seconds between looks at whether a blocked hand-over should give up
_LOADER_KEYS = frozenset(f.name for f in dataclasses.fields(RunOptions().loader))


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """One model of a shared pass: what [`extract`][featcache.extraction.api.extract] takes
    for it.

    ``transform`` turns a decoded sample of the pass's dataset into this model's input
    (None: the sample as it is). ``options`` are its own keyword options of ``extract``
    (``provenance``, ``dtype``, ``prefix_tokens`` ...); the loader's are the pass's.
    """

    model: nn.Module
    layers: Any
    path: str | os.PathLike
    transform: Transform | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Decoded(Dataset):
    """``dataset`` with its last few items read in this process kept, so that the models'
    checks before a pass read the same first rows once; other attributes are its own."""

    KEPT = 8

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._kept: dict[int, Any] = {}
        self._lock = threading.Lock()  # the models' threads read before the pass

    def __len__(self) -> int:
        return source_length(self.dataset)

    def __getitem__(self, i: int) -> Any:
        with self._lock:
            if i in self._kept:
                return self._kept[i]
        item = self.dataset[i]  # decoded outside the lock: threads decode side by side
        with self._lock:
            while len(self._kept) >= self.KEPT:
                self._kept.pop(next(iter(self._kept)))
            self._kept[i] = item
        return item

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "_kept", "_lock"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset, self._kept, self._lock = state["dataset"], {}, threading.Lock()


class Transformed(Dataset):
    """The items of ``dataset`` with ``transform`` applied to their inputs: one model's
    view of the pass (what its checks before the pass read)."""

    _OWN: tuple[str, ...] = ("dataset", "transform")  # never looked up in the dataset

    def __init__(self, dataset: Decoded, transform: Transform | None):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        value, label = split_sample(self.dataset[i])
        return (value if self.transform is None else self.transform(value)), label

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._OWN:
            raise AttributeError(name)
        return getattr(self.dataset, name)


class FanOut(Transformed):
    """The items of ``dataset`` as ``((input of model 0, input of model 1, ...), label)``:
    each read once, then given to every transform."""

    _OWN = ("dataset", "transform", "transforms")

    def __init__(self, dataset: Decoded, transforms: Sequence[Transform | None]):
        super().__init__(dataset, None)
        self.transforms = list(transforms)

    def __getitem__(self, i: int) -> Any:
        value, label = split_sample(self.dataset[i])
        return tuple(value if t is None else t(value) for t in self.transforms), label


class FanOutCollate:
    """A batch of :class:`FanOut` items as one :class:`Batch` per model, each collated as
    a run of that model alone collates it."""

    def __init__(self, count: int, pad_values: Mapping[str, int] | None = None):
        self.count, self.collate = count, Collate(pad_values)

    def __call__(self, samples: list[tuple[Any, int, int, str]]) -> list[Batch]:
        return [
            self.collate(
                [
                    (None if v is None else v[m], label, row, error)
                    for v, label, row, error in samples
                ]
            )
            for m in range(self.count)
        ]


class _Stopped(FeatcacheError):
    """The pass stopped before this model's rows were all given."""


STOPPED = "stopped: another model of this run failed, or the run was interrupted"


_END = object()


class SharedPass:
    """One loader feeding the extractions of ``count`` models, each on its own thread.

    Once every model has asked for its rows (:meth:`feed`) or finished, the pass reads
    from the first row asked to the end, in a single run's batches, and gives each model
    the batches of its own rows. A model that fails stops the pass and the others (their
    stores left partial, for a rerun to resume).
    """

    def __init__(self, dataset: FanOut, count: int, run: RunOptions, shard_starts: list[int]):
        self.dataset, self.count, self.run = dataset, count, run
        self.shard_starts = shard_starts
        self._cond = threading.Condition()
        self._wanted: dict[int, range] = {}
        self._done: set[int] = set()
        self._queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=2) for _ in range(count)]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.has_labels: bool | None = None
        self.error: BaseException | None = None  # why reading the rows failed

    def feed(self, member: int) -> Callable[[range], contextlib.AbstractContextManager[Any]]:
        """The batches of model ``member``: its ``extract``'s feed."""

        @contextlib.contextmanager
        def batches(todo: range) -> Iterator[Iterator[Batch]]:
            with self._cond:
                self._wanted[member] = todo
                self._start_when_ready()
            try:
                yield self._taken(member)
            finally:
                self.finished(member)

        return batches

    def finished(self, member: int) -> None:
        """Model ``member`` takes no more batches (done, failed, or never needed any)."""
        with self._cond:
            self._done.add(member)
            self._start_when_ready()

    def stop(self) -> None:
        """Stop the pass: every model still waiting for batches fails (its store partial)."""
        self._stop.set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _start_when_ready(self) -> None:
        if self._thread is None and len(self._wanted.keys() | self._done) == self.count:
            wanted = {m: r for m, r in self._wanted.items() if m not in self._done}
            self._thread = threading.Thread(
                target=self._read, args=(wanted,), name="featcache-pass", daemon=True
            )
            self._thread.start()

    def _taken(self, member: int) -> Iterator[Batch]:
        while True:
            try:
                item = self._queues[member].get(timeout=_POLL)
            except queue.Empty:
                if self._stop.is_set():
                    raise _Stopped(STOPPED) from None
                continue
            if item is _END:
                return
            yield item

    def _give(self, member: int, item: Any) -> None:
        """Hand ``item`` to ``member`` unless it has finished; raises when stopped."""
        while not self._stop.is_set():
            with self._cond:
                if member in self._done:
                    return
            try:
                self._queues[member].put(item, timeout=_POLL)
                return
            except queue.Full:
                continue
        raise _Stopped(STOPPED)

    def _read(self, wanted: dict[int, range]) -> None:
        try:
            if wanted:
                self._read_rows(wanted)
            for member in wanted:
                self._give(member, _END)
        except BaseException as exc:  # every model still reading stops (see _taken)
            if not isinstance(exc, _Stopped):
                self.error = exc
            self._stop.set()

    def _read_rows(self, wanted: dict[int, range]) -> None:
        span = range(min(r.start for r in wanted.values()), max(r.stop for r in wanted.values()))
        options = self.run.loader
        rows = SourceRows(self.dataset, span, has_labels=self.has_labels)
        grid = GridBatches(span, options.batch_size, self.shard_starts)
        device = resolve_device(self.run.runtime.device)
        collate = FanOutCollate(self.count, rows.pad_values)
        loader = make_loader(rows, grid, options, device, workers_for=len(span), collate=collate)
        bar = tqdm(
            total=span.stop,
            initial=span.start,
            unit="sample",
            desc=f"{len(wanted)} models",
            disable=not self.run.runtime.progress,
        )
        with bar, started(loader) as batches:
            for per_model in typing.cast(Iterator[list[Batch]], batches):
                first = _first_row(per_model[0])
                for member, todo in wanted.items():
                    if first is None or first in todo:
                        self._give(member, per_model[member])
                if first is not None:
                    bar.update(len(per_model[0].rows) + len(per_model[0].failed))


def _first_row(batch: Batch) -> int | None:
    """The first source row of a batch (None: a batch whose error names no row)."""
    rows = [*batch.rows.tolist(), *(row for row, _ in batch.failed)]
    return min(rows) if rows else None


def plan_of_run(
    run: ModelRun, dataset: Dataset, shared: RunOptions, **arguments: Any
) -> ExtractionPlan:
    """The plan of one model of a pass over ``dataset`` (the model's view of it): the
    ``shared`` options and `make_plan` ``arguments``, each with the run's own."""
    own = {k: v for k, v in run.options.items() if k in PLAN_ARGUMENTS}
    changes = {k: v for k, v in run.options.items() if k not in PLAN_ARGUMENTS}
    options = shared.replaced(**changes) if changes else shared
    return make_plan(run.model, dataset, run.layers, options, **{**arguments, **own})


def estimate_runs(
    runs: Sequence[ModelRun], dataset: Decoded, shared: RunOptions, **arguments: Any
) -> list[StoreEstimate]:
    """The size of each run's store, each model's first row made from the same decoded
    sample; ``shared`` and ``arguments`` as `plan_of_run` takes them."""
    return [
        estimate_store(
            plan_of_run(run, Transformed(dataset, run.transform), shared, **arguments),
            Path(run.path),
        )
        for run in runs
    ]


def extract_models(
    runs: Sequence[ModelRun],
    dataset: Dataset,
    *,
    ids: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    rows: range | None = None,
    dataset_fingerprint: str | None = None,
    check_space: bool = True,
    **options: Any,
) -> list[FeatureStore]:
    """Run several models over one pass of ``dataset``; one complete store each.

    ``dataset`` yields ``(sample, label)`` as [`extract`][featcache.extraction.api.extract]
    takes them, but decoded rather than preprocessed (a PIL image, say): each sample is
    read once and given to every run's ``transform``. Each model then runs as ``extract``
    would run it alone, with ``options`` and its run's own ``options``: it resumes its
    own partial store, finds its complete store complete, and its store equals the
    store of that run alone with the same loader options (the same batches). The
    loader options (``batch_size``, ``num_workers`` ...) are the pass's: one set for
    all. One progress bar counts the pass's samples. Returns the stores in the order of
    ``runs``.

    Raises:
        ConfigError: no runs, two runs writing one store, a loader option given to one
            run, or loader options a shared pass cannot take (``bucket_by_length``).
    """
    if not runs:
        raise ConfigError("extract_models needs at least one ModelRun")
    paths = [os.path.abspath(run.path) for run in runs]
    if len(set(paths)) != len(paths):
        raise ConfigError("two models of the run write the same store; give each its own path")
    for at, model_run in enumerate(runs):
        own = sorted(set(model_run.options) & (_LOADER_KEYS | {"progress"}))
        if own:
            raise ConfigError(
                f"runs[{at}] sets {', '.join(own)}, an option of the whole pass; give it "
                "to extract_models for all models"
            )
    return run_models(
        runs,
        dataset,
        RunOptions.from_kwargs(**options),
        ids=ids,
        class_names=class_names,
        rows=rows,
        dataset_fingerprint=dataset_fingerprint,
        check_space=check_space,
    )


def run_models(
    runs: Sequence[ModelRun],
    dataset: Dataset,
    shared: RunOptions,
    *,
    ids: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    rows: range | None = None,
    dataset_fingerprint: str | None = None,
    check_space: bool = True,
) -> list[FeatureStore]:
    """`extract_models` with the pass's options as `RunOptions`."""
    if shared.loader.bucket_by_length:
        raise ConfigError(
            "loader.bucket_by_length orders batches by each model's token lengths, which a "
            "shared pass cannot do; run each model alone, or turn it off"
        )
    decoded = dataset if isinstance(dataset, Decoded) else Decoded(dataset)
    base = decoded.dataset  # ids and classes as extract() finds them on it
    if ids is None:
        ids = dataset_ids(base) or [f"{type(base).__name__}:{i}" for i in range(len(decoded))]
    class_names = class_names if class_names is not None else dataset_classes(base)
    views = [Transformed(decoded, run.transform) for run in runs]
    sized = dict(rows=rows, dataset_fingerprint=dataset_fingerprint)
    common = dict(ids=ids, class_names=class_names, **sized)
    if check_space:  # every store, before any work
        check_free_space(estimate_runs(runs, decoded, shared, **sized), shared.overwrite)
    quiet = dataclasses.replace(shared, runtime=dataclasses.replace(shared.runtime, progress=False))
    fan_out = FanOut(decoded, [run.transform for run in runs])
    shared_pass = SharedPass(fan_out, len(runs), shared, shard_starts(dataset))
    first = first_sample(decoded, rows or range(len(decoded)))
    shared_pass.has_labels = getattr(dataset, "has_labels", None)
    if shared_pass.has_labels is None and first is not None:  # as each model's plan decides
        shared_pass.has_labels = first[1] is not None
    stores: list[FeatureStore | None] = [None] * len(runs)
    errors: list[BaseException | None] = [None] * len(runs)

    def work(member: int) -> None:
        model_run = runs[member]
        try:
            path = Path(model_run.path)
            with writer_lock(path):
                plan = plan_of_run(model_run, views[member], quiet, **common)
                stores[member] = run_plan(
                    plan, path, check_space=False, feed=shared_pass.feed(member)
                )
        except BaseException as exc:
            errors[member] = exc
            shared_pass.stop()
        finally:
            shared_pass.finished(member)

    threads = [
        threading.Thread(target=work, args=(m,), name=f"featcache-model-{m}", daemon=True)
        for m in range(len(runs))
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=_POLL)
    except KeyboardInterrupt:
        shared_pass.stop()
        for thread in threads:
            thread.join()
        raise
    shared_pass.join()
    failed = [e for e in [*errors, shared_pass.error] if e and not isinstance(e, _Stopped)]
    failed += [e for e in errors if e is not None]
    if failed:
        raise failed[0]
    return [store for store in stores if store is not None]
