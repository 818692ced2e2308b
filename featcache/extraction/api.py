"""``extract``: run a model over a dataset and store the activations of chosen layers."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from featcache.capture.reduce import ReduceContext, token_layout
from featcache.capture.runtime import Layout, choose_layout
from featcache.capture.selectors import Tap, resolve_taps, tap_record
from featcache.config.spec import (
    UPDATE_AND_OVERWRITE,
    LayerSpec,
    LoaderSpec,
    RuntimeSpec,
    StoreSpec,
)
from featcache.config.validation import build
from featcache.errors import ConfigError, FeatcacheWarning
from featcache.extraction.batches import (
    Batch,
    Collate,
    SourceRows,
    check_inputs,
    first_sample,
    num_workers,
    pins,
    source_length,
    started,
    token_lengths,
)
from featcache.extraction.bucketing import WINDOW_BATCHES, WindowReorder
from featcache.extraction.continuity import check_continues
from featcache.extraction.dataset_info import dataset_classes, dataset_ids, dataset_stamps
from featcache.extraction.estimate import StoreEstimate, check_free_space, estimate_store
from featcache.extraction.grid import GridBatches, shard_starts
from featcache.extraction.loop import LoopPlan, run_loop
from featcache.extraction.update import hashes_content, is_update_partial, update_store
from featcache.extraction.writer_thread import WriterThread
from featcache.sources.stamps import change_report, changed_rows
from featcache.store import (
    FeatureStore,
    ResumePoint,
    StorePlan,
    StoreWriter,
    check_output_path,
    interrupted_overwrite,
    partial_path,
    plan_resume,
    remove_partial,
    stored_resume_key,
)
from featcache.store.history import run_record
from featcache.store.lock import writer_lock
from featcache.store.paths import OVERWRITE
from featcache.store.provenance import StoreKey, store_attributes
from featcache.util.fingerprints import ids_fingerprint, module_fingerprint

# Batches of the source rows in a range, from a loader shared with other runs.
Feed = Callable[[range], contextlib.AbstractContextManager[Iterator[Batch]]]
_FEED: contextvars.ContextVar[Feed | None] = contextvars.ContextVar("feed", default=None)
_SECTIONS = {"loader": LoaderSpec, "store": StoreSpec, "runtime": RuntimeSpec}
_RUN_KEYS = ("overwrite", "update")  # options of the run itself, outside the sections


@dataclasses.dataclass
class RunOptions:
    """Options of one extraction, grouped as in the config's sections."""

    loader: LoaderSpec = dataclasses.field(default_factory=LoaderSpec)
    store: StoreSpec = dataclasses.field(default_factory=StoreSpec)
    runtime: RuntimeSpec = dataclasses.field(default_factory=RuntimeSpec)
    overwrite: bool = False
    update: bool = False  # compute only what the complete store lacks (extraction.update)

    def __post_init__(self) -> None:
        if self.overwrite and self.update:
            raise ConfigError(UPDATE_AND_OVERWRITE)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RunOptions:
        """Build from flat keyword arguments named like the config keys (``batch_size=...``)."""
        owner = {f.name: name for name, kind in _SECTIONS.items() for f in dataclasses.fields(kind)}
        unknown = sorted(set(kwargs) - set(owner) - set(_RUN_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown option {unknown[0]!r}; known options: overwrite, update, "
                + ", ".join(sorted(owner))
            )
        raw: dict[str, Any] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            if key in _RUN_KEYS:
                raw[key] = value
            else:
                raw[owner[key]][key] = value
        return build(cls, raw)


@dataclasses.dataclass
class _Plan:
    """Everything decided before the first batch: rows, ids, taps, layout, the store key."""

    taps: list[Tap]
    ids: Sequence[str]
    rows: range
    has_labels: bool
    class_names: list[str] | None
    layout: Layout
    key: Callable[[], StoreKey]  # the weights may still be being fingerprinted
    tokens: ReduceContext  # the model's token layout, for the reductions
    provenance: Mapping[str, Any]  # config, weights, source: written into the store
    # [source rows] tokens per row, for per-token rows and bucketing (None: not needed)
    row_tokens: np.ndarray | None = None
    bucket_window: int | None = None  # rows per window of length-bucketed batches
    unit: str = "img"  # what the progress bar counts
    shard_starts: list[int] = dataclasses.field(default_factory=list)  # batches restart there
    # [source rows] each row's change stamp, taken when the run starts (None: none known)
    stamps: np.ndarray | None = dataclasses.field(default=None, compare=False)

    @property
    def token_capacity(self) -> int | None:
        """The tokens of the store's rows, which per-token layers are sized for."""
        if self.row_tokens is None:
            return None
        return int(self.row_tokens[self.rows.start : self.rows.stop].sum())


def extract(
    model: nn.Module,
    dataset: Dataset,
    layers: Iterable[LayerSpec | str | Mapping[str, Any]] | str,
    path: str | os.PathLike,
    *,
    ids: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    provenance: Mapping[str, Any] | None = None,
    dataset_fingerprint: str | None = None,
    rows: range | None = None,
    prefix_tokens: int | None = None,
    sequence_first: bool = False,
    check_space: bool = True,
    **options: Any,
) -> FeatureStore:
    """Run ``model`` over ``dataset`` and store the activations of ``layers`` at ``path``.

    ``dataset`` is a map-style dataset yielding ``(input, label)`` (a bare input, or a
    label of None, means no labels); rows keep the dataset's order. ``input`` is a tensor
    of any rank (an image ``[3, H, W]`` as torchvision datasets give, a clip
    ``[C, T, H, W]``, audio ``[L]``), passed to the model as its one argument, or a
    mapping of named tensors (``{"input_ids": [T], "attention_mask": [T]}``), passed as
    keyword arguments. Tensors of a mapping that differ in length are padded per batch
    (with the dataset's ``pad_values``, else 0) and an ``attention_mask`` is added if the
    items have none; token reductions (``mean``, ``max``, ``cls``, ``last``) then read
    the real tokens only (``avg`` and ``max`` pool the tokens of an ``input_ids`` batch's
    ``[B, T, D]`` outputs, padded or not), and ``reduce: none`` on a token output of a
    padded batch stores per-token rows
    (see `featcache.store.StoreWriter`), sized from the dataset's
    ``token_lengths`` attribute when it has one (else one pass over its items).

    ``ids`` and ``class_names`` go into the store. By default they are the dataset's own
    (see `featcache.extraction.dataset_info`): its ``ids`` and ``class_names`` (or
    ``classes``) attributes, or for torchvision's ``ImageFolder`` and ``DatasetFolder``,
    also inside ``Subset`` and ``ConcatDataset``, the files' paths relative to the folder
    and its classes; else the ids are ``"<DatasetClass>:<index>"``.
    ``dataset_fingerprint`` defaults to a hash of the sorted ids. ``rows`` (a range of
    source positions, default all) limits the store to a contiguous block: one shard of
    a distributed run. ``options`` are the config keys
    of the loader, store and runtime sections (``batch_size``, ``num_workers``,
    ``on_error``, ``bucket_by_length``, ``dtype``, ``compression``,
    ``chunk_rows``, ``on_nonfinite``, ``checksum``, ``device``, ``amp``,
    ``channels_last``, ``progress`` ...) plus ``overwrite`` and ``update``.

    ``prefix_tokens`` and ``sequence_first`` describe the model's token outputs for the
    token reductions (see `featcache.capture.reduce.reduce_tensor`): the number of class or
    register tokens before the patch tokens (default: the model's ``num_prefix_tokens``
    attribute, as timm models have, else undeclared), and whether they are ``[T, B, D]``.

    The store is written to ``<path>.partial`` and moved to ``path`` when complete. If an
    earlier run with the same settings, data and model was interrupted, this one resumes
    it and the result is the same as an uninterrupted run; a partial store made
    differently is refused with the difference named. A complete store at ``path`` made
    the same way is returned as it is. Either way, the rows of two of its batches are
    recomputed first and must equal the stored ones (within the store dtype's rounding:
    `featcache.extraction.continuity`), since a fingerprint cannot see everything
    (a Python dataset's transform, another folder of the same file names). With
    ``update=True`` a complete store made otherwise is brought up to date instead of
    refused: only samples it lacks (by id, and by the ``content_hash`` the dataset's
    ``row_columns`` give, when it gives them) and layers it lacks are computed, the rest
    is copied (`featcache.extraction.update`). The model is
    put in eval mode and moved to the device (its train/eval flag is restored
    afterwards). Returns the complete store, opened for reading.

    One process writes a store at a time: the run holds ``<path>.lock`` (see
    `featcache.store.lock`) from before it touches anything of the store until the
    store is in place, and a second run, with or without ``overwrite``, raises
    [`StoreBusyError`][featcache.store.lock.StoreBusyError] naming the first and changes
    nothing.

    Before the first batch, one row runs through the hooked forward to size the store
    ([`estimate`][featcache.extraction.api.estimate]), and a run whose store the output
    filesystem cannot hold is refused in one line giving what it needs and what is free;
    ``check_space=False`` runs it anyway.
    """
    run = RunOptions.from_kwargs(**options)
    path = Path(path)
    with writer_lock(path):  # before anything of the store is touched, until it is in place
        tokens = token_layout(model, prefix_tokens, sequence_first)
        plan = _plan(
            model, dataset, layers, run, ids, class_names, provenance, dataset_fingerprint,
            rows, tokens,
        )  # fmt: skip
        return _extract(model, dataset, path, run, plan, check_space, _FEED.get())


@contextlib.contextmanager
def fed_by(feed: Feed) -> Iterator[None]:
    """Inside the block, :func:`extract` on this thread takes its batches from ``feed``
    (a pass shared with other models, :mod:`featcache.extraction.many`) instead of a
    loader of its own."""
    token = _FEED.set(feed)
    try:
        yield
    finally:
        _FEED.reset(token)


def estimate(
    model: nn.Module,
    dataset: Dataset,
    layers: Iterable[LayerSpec | str | Mapping[str, Any]] | str,
    path: str | os.PathLike,
    *,
    provenance: Mapping[str, Any] | None = None,
    dataset_fingerprint: str | None = None,
    rows: range | None = None,
    prefix_tokens: int | None = None,
    sequence_first: bool = False,
    **options: Any,
) -> StoreEstimate:
    """The size of the store that [`extract`][featcache.extraction.api.extract] with the same
    arguments writes at ``path``, without running the whole model: one row of ``dataset``
    runs through the hooked forward for each layer's stored shape, and nothing is written.

    Returns a [`StoreEstimate`][featcache.extraction.estimate.StoreEstimate]: the bytes of the
    finished store (exact for dense layers up to HDF5's own metadata, which is
    estimated; for per-token layers as exact as the dataset's token counts), and each
    layer's shape and bytes.
    """
    run = RunOptions.from_kwargs(**options)
    tokens = token_layout(model, prefix_tokens, sequence_first)
    plan = _plan(
        model, dataset, layers, run, None, None, provenance, dataset_fingerprint, rows, tokens
    )
    return estimate_store(model, dataset, Path(path), plan, run)


def _extract(
    model: nn.Module,
    dataset: Dataset,
    path: Path,
    run: RunOptions,
    plan: _Plan,
    check_space: bool = True,
    feed: Feed | None = None,
) -> FeatureStore:
    """Write (or resume, or find complete, or update) the store ``plan`` describes at
    ``path``, its batches from ``feed`` when given (an update reads its own)."""
    if plan.stamps is None:  # before any row is read: a change after that shows later
        plan = dataclasses.replace(plan, stamps=dataset_stamps(dataset))
    # Made otherwise, or holding rows replaced since (the key, and the weights' hash in
    # it, is wanted here only for an update: else the writer thread makes it).
    made_otherwise = (
        run.update and path.exists() and not plan.key().matches(stored_resume_key(path))
    )
    if made_otherwise or (run.update and path.exists() and stale_rows(path, plan)):
        return update_store(model, dataset, path, run, plan, check_space)
    if run.update and is_update_partial(path):
        remove_partial(path)  # a stopped update of a store no longer there
    if run.overwrite:
        remove_partial(path)  # a complete store stays until the new one replaces it
    elif is_update_partial(path):
        raise ConfigError(
            f"{partial_path(path)} is a stopped update of {path}; rerun with --update "
            f"(update=True in Python) to redo it, or pass {OVERWRITE} to extract afresh"
        )
    elif path.exists() and plan.key().matches(stored_resume_key(path)):
        # A rerun after this store completed: nothing left to do, once a few of its rows
        # recomputed now prove that it holds this computation's result.
        stale = stale_rows(path, plan)
        if stale:
            raise ConfigError(
                f"{path}: {stale}; rerun with --update (update=True in Python) to recompute "
                f"what changed, or pass {OVERWRITE} to extract it afresh"
            )
        check_continues(path, model, dataset, plan, run)
        return FeatureStore(path)
    # Only a partial store beside a complete one needs the key now; otherwise the weights
    # are hashed on the writer thread, overlapping the first batches.
    resumed_overwrite = partial_path(path).is_file() and interrupted_overwrite(
        path, plan.key().to_json()
    )
    check_output_path(path, run.overwrite or resumed_overwrite)  # before any work starts
    resume = None
    batch_size = run.loader.batch_size
    step = plan.bucket_window or batch_size  # the grid's unit: a batch, or a bucketed window
    if partial_path(path).exists():
        resume = plan_resume(
            path,
            plan.key().to_json(),
            step,
            plan.rows.start,
            plan.shard_starts,
            config=plan.provenance.get("config"),
        )
        if resume is not None and resume.row > 0:  # rows kept: they must be this run's
            stale = changes_since(resume.index, resume.stamps, plan)
            if stale:  # the rows keep the stamps they were read under: an update sees them
                warnings.warn(
                    f"{partial_path(path)}: {stale}; those rows keep what was read then, so "
                    "once this run completes, rerun with --update to recompute them",
                    FeatcacheWarning,
                    stacklevel=2,
                )
            check_continues(partial_path(path), model, dataset, plan, run, resume.position)
    todo = range(resume.position if resume else plan.rows.start, plan.rows.stop)
    if check_space:  # before the first batch, and before the store's file is created
        check_free_space([estimate_store(model, dataset, path, plan, run)], run.overwrite)
    device = plan.layout.device
    pin = pins(run.loader.pin_memory, device)
    source_rows = SourceRows(dataset, todo, has_labels=plan.has_labels)
    lengths = None  # sorts each window by length when bucketing
    if plan.bucket_window is not None:
        assert plan.row_tokens is not None  # counted whenever bucketing is on
        lengths = plan.row_tokens[todo.start : todo.stop]
    grid = GridBatches(todo, batch_size, plan.shard_starts, lengths, step)
    batches_of: contextlib.AbstractContextManager[Iterator[Batch]]
    if feed is None:
        loader = DataLoader(
            source_rows,
            batch_sampler=grid,
            num_workers=num_workers(run.loader.num_workers, len(todo), batch_size),
            pin_memory=pin,
            collate_fn=Collate(source_rows.pad_values),
        )
        batches_of = started(loader)
    else:
        batches_of = feed(todo)

    start = time.perf_counter()
    loop = LoopPlan(
        plan.taps, plan.ids, (run.loader, run.store, run.runtime), plan.layout, pin,
        total=len(plan.rows), done_before=len(plan.rows) - len(todo), tokens=plan.tokens,
        reorder=None if lengths is None else WindowReorder(grid.window_sizes()),
        unit=plan.unit,
    )  # fmt: skip
    with batches_of as batches:
        with WriterThread(open_writer_for(path, plan, run, resume=resume), path) as sink:
            timing = run_loop(model, batches, sink, loop)
        timing["seconds_waiting_for_disk"] = sink.waited
        timing["seconds"] = time.perf_counter() - start
        timing["images_per_second"] = len(todo) / max(timing["seconds"], 1e-9)
        writer = sink.writer
        assert writer is not None  # the thread raised otherwise
        layers = (len(plan.taps), 0)
        kept = resume.row if resume else 0  # rows a stopped run wrote: resumed, not computed
        computed = (writer.rows_appended - kept, 0)
        record = run_record("extract", computed, layers, plan.key().to_json(), resumed=kept)
        attrs = {**timing, "row_unit": ROW_UNITS[plan.unit], "history": [record]}
        writer.close(complete=True, attrs=attrs, row_columns=getattr(dataset, "row_columns", None))
    if writer.skipped:
        warnings.warn(
            f"{len(writer.skipped)} of {len(plan.rows)} samples skipped (first: "
            f"{writer.skipped[0]['reason']}); the store lists them under /skipped",
            FeatcacheWarning,
            stacklevel=2,
        )
    return FeatureStore.just_sealed(path)


def open_writer_for(
    path: Path,
    plan: _Plan,
    run: RunOptions,
    mark: Mapping[str, Any] | None = None,
    resume: ResumePoint | None = None,
) -> Callable[[], StoreWriter]:
    """What opens the writer of the store ``plan`` describes at ``path`` (on the writer
    thread: the weights may still be being fingerprinted). ``mark`` adds entries to the
    store key recorded while it is written (an update's); ``resume`` continues a
    partial store."""

    def open_writer() -> StoreWriter:
        key = plan.key()
        attrs = store_attributes(
            key, plan.provenance, device=str(plan.layout.device), class_names=plan.class_names
        )
        if mark:
            attrs["resume_key"] = {**key.to_json(), **mark}
        store = StorePlan(
            path,
            len(plan.rows),
            ids_width=max((len(str(i).encode()) for i in plan.ids), default=1),
            dtype=run.store.dtype,
            compression=run.store.compression,
            chunk_rows=run.store.chunk_rows,
            checksum=run.store.checksum,
            has_labels=plan.has_labels,
            attrs=attrs,
            token_capacity=plan.token_capacity,
            stamps=plan.stamps,
        )
        return StoreWriter(store, resume)

    return open_writer


def changes_since(index: np.ndarray, stamps: np.ndarray | None, plan: _Plan) -> str:
    """The rows (source positions ``index``, recorded with ``stamps``) whose change stamp
    differs from the one ``plan`` took now, named (see
    `featcache.sources.stamps.change_report`); "" when none does, when either
    side has no stamps, or when content hashes decide instead (``data.content_hash``:
    the store key then holds every file's hash)."""
    if stamps is None or plan.stamps is None or hashes_content(plan):
        return ""
    current = plan.stamps[index]
    changed = changed_rows(stamps, current)
    if not len(changed):
        return ""
    ids = [str(plan.ids[i]) for i in index[changed]]
    return change_report(changed.tolist(), ids, stamps[changed], current[changed])


def stale_rows(path: Path, plan: _Plan) -> str:
    """The rows of the complete store at ``path`` that `changes_since` names."""
    if plan.stamps is None or hashes_content(plan):
        return ""
    with FeatureStore(path) as store:
        return changes_since(store.index, store.stamps, plan)


def check_unique(ids: Sequence[str]) -> None:
    """Refuse ids that repeat: a row is found, resumed and verified by its id.

    Raises:
        ConfigError: naming the first repeated id and the two rows that have it.
    """
    if len(set(map(str, ids))) == len(ids):
        return
    first_row: dict[str, int] = {}
    for row, sample_id in enumerate(ids):
        earlier = first_row.setdefault(str(sample_id), row)
        if earlier != row:
            raise ConfigError(
                f"id {sample_id!r} is given to rows {earlier} and {row}; every row needs its "
                "own id (list each image once, or pass distinct ids)"
            )


def _plan(
    model: nn.Module,
    dataset: Dataset,
    layers: Iterable[LayerSpec | str | Mapping[str, Any]] | str,
    run: RunOptions,
    ids: Sequence[str] | None,
    class_names: Sequence[str] | None,
    provenance: Mapping[str, Any] | None,
    dataset_fingerprint: str | None,
    rows: range | None,
    tokens: ReduceContext,
) -> _Plan:
    """Check the arguments of :func:`extract` and decide what the run will do."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model must be a torch.nn.Module, got {type(model).__name__} {model!r:.40}; to "
            "name a model, use featcache.extract_from_config with model.name"
        )
    taps = resolve_taps(model, layers)  # type: ignore[arg-type]
    num_rows = source_length(dataset)
    if num_rows == 0:
        raise ConfigError(
            f"the dataset ({type(dataset).__name__}) has no rows, so there is nothing to "
            "extract; check its files or arguments"
        )
    if ids is None:
        ids = dataset_ids(dataset)
    if ids is None:
        ids = [f"{type(dataset).__name__}:{i}" for i in range(num_rows)]
    if len(ids) != num_rows:
        raise ConfigError(f"{len(ids)} ids given for a dataset of {num_rows} rows")
    check_unique(ids)
    if isinstance(class_names, str):
        raise ConfigError(f"class_names must be a list of names, got the string {class_names!r}")
    rows = range(num_rows) if rows is None else rows
    if not isinstance(rows, range):
        raise ConfigError(f"rows must be a range of source positions, got {type(rows).__name__}")
    if rows.step != 1 or not rows or rows.start < 0 or rows.stop > num_rows:
        raise ConfigError(f"rows must be a non-empty range within the {num_rows} source rows")
    if class_names is None:
        class_names = dataset_classes(dataset)
    has_labels = getattr(dataset, "has_labels", None)
    first = first_sample(dataset, rows)
    row_tokens = bucket_window = None
    tokenised = first is not None and isinstance(first[0], Mapping)
    if first is not None:
        check_inputs(model, first[0])
        if has_labels is None:
            has_labels = first[1] is not None
    if run.loader.bucket_by_length:
        if not tokenised:
            raise ConfigError(
                "loader.bucket_by_length groups token inputs of similar lengths; this "
                "dataset's items are not mappings of token tensors, so turn it off"
            )
        bucket_window = run.loader.batch_size * WINDOW_BATCHES
    if tokenised and (bucket_window or any(tap.reduce == "none" for tap in taps)):
        row_tokens = token_lengths(dataset)
    layout = choose_layout(model, run.runtime)
    weights = (provenance or {}).get("weights")
    key_parts = dict(
        config_fingerprint=(provenance or {}).get("config_fingerprint"),
        dataset_fingerprint=dataset_fingerprint or ids_fingerprint(ids),
        source_rows=num_rows,
        rows=(rows.start, rows.stop),
        taps=tuple(tap_record(tap) for tap in taps),
        store_dtype=run.store.dtype,
        chunk_rows=run.store.chunk_rows,
        compression=run.store.compression,
        batch_size=run.loader.batch_size,
        on_nonfinite=run.store.on_nonfinite,
        layout=layout.describe(),
        tokens=None
        if tokens.prefix_tokens is None and not tokens.sequence_first
        else {"prefix_tokens": tokens.prefix_tokens, "sequence_first": tokens.sequence_first},
        bucket_window=bucket_window,
    )
    made: list[StoreKey] = []

    def key() -> StoreKey:
        # Made from Python, the weights are identified by their values. Hashing them takes
        # a while on big models, so it happens on first need: on the writer thread, while
        # the first batches run, unless an existing store must be checked first.
        if not made:
            identity = weights or {"source": "module", "sha256": module_fingerprint(model)}
            made.append(StoreKey(weights=identity, **key_parts))  # type: ignore[arg-type]
        return made[0]

    return _Plan(
        taps=taps,
        ids=ids,
        rows=rows,
        has_labels=True if has_labels is None else bool(has_labels),
        class_names=None if class_names is None else [str(n) for n in class_names],
        layout=layout,
        key=key,
        tokens=tokens,
        provenance=dict(provenance or {}),
        row_tokens=row_tokens,
        bucket_window=bucket_window,
        unit=_unit(first[0] if first is not None else None),
        shard_starts=shard_starts(dataset),
    )


# What a store's rows are, in the plural, for its speed (``row_unit``: "texts/s").
ROW_UNITS = {"img": "images", "text": "texts", "sample": "samples"}


def _unit(value: Any) -> str:
    """What one row is, for the progress bar: an image, a text, or a sample."""
    if isinstance(value, torch.Tensor) and value.dim() == 3:
        return "img"
    return "text" if isinstance(value, Mapping) and "input_ids" in value else "sample"
