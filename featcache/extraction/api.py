"""``extract``: run a model over a dataset and store the activations of chosen layers."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from featcache.config.spec import LayerSpec
from featcache.errors import ConfigError, FeatcacheWarning
from featcache.extraction.bucketing import WindowReorder
from featcache.extraction.continuity import check_continues
from featcache.extraction.dataset_info import dataset_stamps
from featcache.extraction.estimate import StoreEstimate, check_free_space, estimate_store
from featcache.extraction.plan import ROW_UNITS, ExtractionPlan, RunOptions, make_plan
from featcache.extraction.run import Feed, loaded_batches, run_rows
from featcache.extraction.update import update_store
from featcache.extraction.writer_thread import WriterThread
from featcache.store import (
    FeatureStore,
    check_output_path,
    partial_path,
    plan_resume,
    remove_partial,
)
from featcache.store.history import run_record
from featcache.store.lock import writer_lock
from featcache.store.paths import OVERWRITE
from featcache.store.state import store_state


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
    padded batch stores per-token rows, sized from the dataset's ``token_lengths``
    attribute when it has one (else one pass over its items).

    ``ids`` and ``class_names`` go into the store. By default they are the dataset's own:
    its ``ids`` and ``class_names`` (or ``classes``) attributes, or for torchvision's
    ``ImageFolder`` and ``DatasetFolder``, also inside ``Subset`` and ``ConcatDataset``,
    the files' paths relative to the folder and its classes; else the ids are
    ``"<DatasetClass>:<index>"``. ``dataset_fingerprint`` defaults to a hash of the
    sorted ids. ``rows`` (a range of source positions, default all) limits the store to
    a contiguous block: one shard of a distributed run. ``options`` are the config keys
    of the loader, store and runtime sections (``batch_size``, ``num_workers``,
    ``on_error``, ``bucket_by_length``, ``dtype``, ``compression``, ``chunk_rows``,
    ``on_nonfinite``, ``checksum``, ``device``, ``amp``, ``channels_last``,
    ``progress`` ...) plus ``overwrite`` and ``update``.

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
    is copied (`featcache.extraction.update`). The model is put in eval mode and moved
    to the device (its train/eval flag is restored afterwards). Returns the complete
    store, opened for reading.

    One process writes a store at a time: the run holds ``<path>.lock`` until the store
    is in place, and a second run, with or without ``overwrite``, raises
    [`StoreBusyError`][featcache.store.lock.StoreBusyError] naming the first and changes
    nothing.

    Before the first batch, one row runs through the hooked forward to size the store
    ([`estimate`][featcache.extraction.api.estimate]), and a run whose store the output
    filesystem cannot hold is refused in one line giving what it needs and what is free;
    ``check_space=False`` runs it anyway.
    """
    options_ = RunOptions.from_kwargs(**options)
    path = Path(path)
    with writer_lock(path):  # before anything of the store is touched, until it is in place
        plan = make_plan(
            model,
            dataset,
            layers,
            options_,
            ids=ids,
            class_names=class_names,
            provenance=provenance,
            dataset_fingerprint=dataset_fingerprint,
            rows=rows,
            prefix_tokens=prefix_tokens,
            sequence_first=sequence_first,
        )
        return run_plan(plan, path, check_space=check_space)


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
    plan = make_plan(
        model,
        dataset,
        layers,
        RunOptions.from_kwargs(**options),
        provenance=provenance,
        dataset_fingerprint=dataset_fingerprint,
        rows=rows,
        prefix_tokens=prefix_tokens,
        sequence_first=sequence_first,
    )
    return estimate_store(plan, Path(path))


def run_plan(
    plan: ExtractionPlan,
    path: Path,
    *,
    check_space: bool = True,
    feed: Feed | None = None,
    seal: bool = False,
    launch: str | None = None,
    continuity: int = 2,
) -> FeatureStore:
    """Write (or resume, or find complete, or update) the store ``plan`` describes at
    ``path``, its batches from ``feed`` when given (an update reads its own). The caller
    holds the store's writer lock.

    With ``seal``, the partial store at ``path`` was made for rows that go on past
    ``plan.rows`` and keeps exactly ``plan.rows`` (a shard another run stopped): it is
    completed as it is. ``launch`` names the launch in the store's history record (the
    processes of a run of several share one). ``continuity``: the batches of a stopped
    run's rows recomputed and compared before they are kept."""
    if plan.stamps is None:  # before any row is read: a change after that shows later
        plan.stamps = dataset_stamps(plan.dataset)
    options = plan.options
    state = store_state(path)
    # Made otherwise, or holding rows replaced since (only an update makes the key here).
    if (
        options.update
        and state.complete
        and (not plan.key().matches(state.key) or plan.stale_rows(path))
    ):
        return update_store(plan, path, check_space=check_space)
    if options.update and state.update_partial:
        # A stopped update this run does not redo: its store is gone, or current again.
        remove_partial(path)
        state = store_state(path)
    if options.overwrite:
        remove_partial(path)  # a complete store stays until the new one replaces it
    elif state.update_partial:
        raise ConfigError(
            f"{partial_path(path)} is a stopped update of {path}; rerun with --update "
            f"(update=True in Python) to redo it, or pass {OVERWRITE} to extract afresh"
        )
    elif state.complete and plan.key().matches(state.key):
        # A rerun after this store completed: done, once a few rows recomputed prove it.
        stale = plan.stale_rows(path)
        if stale:
            raise ConfigError(
                f"{path}: {stale}; rerun with --update (update=True in Python) to recompute "
                f"what changed, or pass {OVERWRITE} to extract it afresh"
            )
        check_continues(path, plan)
        return FeatureStore(path)
    # Only a partial store beside a complete one needs the key now; otherwise the weights
    # are hashed on the writer thread, overlapping the first batches.
    resumed_overwrite = state.partial and state.interrupted_overwrite(plan.key().to_json())
    check_output_path(path, options.overwrite or resumed_overwrite)  # before any work starts
    resume = None
    if partial_path(path).exists():
        resume = plan_resume(
            path,
            plan.key().to_json(),
            plan.bucket_window or options.loader.batch_size,  # the grid's unit
            plan.rows.start,
            plan.shard_starts,
            config=plan.provenance.get("config"),
            seal=seal,
        )
        if resume is not None and resume.row > 0:  # rows kept: they must be this run's
            stale = plan.changes_since(resume.index, resume.stamps)
            if stale:  # the rows keep the stamps they were read under: an update sees them
                warnings.warn(
                    f"{partial_path(path)}: {stale}; those rows keep what was read then, so "
                    "once this run completes, rerun with --update to recompute them",
                    FeatcacheWarning,
                    stacklevel=2,
                )
            check_continues(partial_path(path), plan, resume.position, batches=continuity)
    todo = range(resume.position if resume else plan.rows.start, plan.rows.stop)
    if check_space:  # before the first batch, and before the store's file is created
        check_free_space([estimate_store(plan, path)], options.overwrite)
    grid = plan.grid(todo)
    reorder = None if plan.bucket_window is None else WindowReorder(grid.window_sizes())
    start = time.perf_counter()
    with loaded_batches(plan, grid, rows=todo, workers_for=len(todo), feed=feed) as batches:
        with WriterThread(plan.writer(path, resume=resume), path) as sink:
            done_before = len(plan.rows) - len(todo)
            timing = run_rows(plan, batches, sink, done_before=done_before, reorder=reorder)
        timing["seconds_waiting_for_disk"] = sink.waited
        timing["seconds"] = time.perf_counter() - start
        timing["images_per_second"] = len(todo) / max(timing["seconds"], 1e-9)
        writer = sink.writer
        assert writer is not None  # the thread raised otherwise
        layers = (len(plan.taps), 0)
        kept = resume.row if resume else 0  # rows a stopped run wrote: resumed, not computed
        computed = (writer.rows_appended - kept, 0)
        key = plan.key().to_json()
        record = run_record("extract", computed, layers, key, resumed=kept, launch=launch)
        attrs = {**timing, "row_unit": ROW_UNITS[plan.unit], "history": [record]}
        if seal:  # the rows it holds now, no longer those it was made for
            attrs["resume_key"] = key
        columns = getattr(plan.dataset, "row_columns", None)
        writer.close(complete=True, attrs=attrs, row_columns=columns)
    if writer.skipped:
        warnings.warn(
            f"{len(writer.skipped)} of {len(plan.rows)} samples skipped (first: "
            f"{writer.skipped[0]['reason']}); the store lists them under /skipped",
            FeatcacheWarning,
            stacklevel=2,
        )
    return FeatureStore.just_sealed(path)
