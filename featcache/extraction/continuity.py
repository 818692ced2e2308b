"""Proof that a run continues a store: a few stored rows, recomputed now, must equal it.

The store key (:class:`~featcache.store.provenance.StoreKey`) compares fingerprints of the
config, the weights and the sample ids, and some differences are invisible to all of
them: a Python dataset's transform, or another folder whose files have the same relative
names. So before a run resumes a partial store, or returns a finished one as already
done, it recomputes the rows of two batches already stored (the one holding the first
stored row and the one holding the last) with the current model, data and transform,
exactly as the run that stored them batched them, and refuses when they differ by more
than the store dtype's rounding (:data:`RELATIVE_TOLERANCE`, relative to the row's
largest magnitude, or the autocast dtype's where that is coarser).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from featcache.capture.runtime import placed
from featcache.capture.taps import TapSet
from featcache.errors import ConfigError
from featcache.extraction.batches import Batch, Collate, SourceRows
from featcache.extraction.grid import GridBatches
from featcache.extraction.loop import forward
from featcache.extraction.writer_thread import CapturedBatch
from featcache.store import FeatureStore
from featcache.store.codec import encode, torch_dtype, values
from featcache.store.paths import OVERWRITE

if TYPE_CHECKING:
    from featcache.extraction.api import RunOptions, _Plan

# Largest difference allowed between a stored value and its recomputation, relative to
# the largest magnitude in the row: a few units in the last place of the stored dtype (a
# recomputation on other hardware, or in another batch, rounds differently), or of the
# autocast dtype the forward ran in. Features of other data differ by tens of percent.
RELATIVE_TOLERANCE = {
    torch.float16: 4 * 2.0**-10,
    torch.bfloat16: 4 * 2.0**-7,
    torch.float32: 1e-4,
}


@dataclass(frozen=True)
class Mismatch:
    """A stored row that its recomputation does not reproduce."""

    row: int  # the row in the store
    sample_id: str
    layer: str
    difference: float  # largest absolute difference over the row's largest magnitude
    what: str = ""  # for a label or a token count: what differs, in words

    def describe(self) -> str:
        where = f"row {self.row} (id {self.sample_id!r})"
        if self.layer:
            where += f", layer {self.layer!r}"
        if self.what:
            return f"{where}: {self.what}"
        if self.difference == float("inf"):
            return f"{where}: non-finite values differ"
        return f"{where}: values differ by {self.difference:.1%} of the row's largest"


def check_continues(
    store_file: Path,
    model: nn.Module,
    dataset: Dataset,
    plan: _Plan,
    run: RunOptions,
    before: int | None = None,
) -> None:
    """Refuse to continue (or return as done) the store in ``store_file`` unless the rows
    it holds come out the same when recomputed now.

    ``before`` (a source position) limits the check to the rows an interrupted run keeps
    (those a resume redoes from there are not compared). Recomputes at most two batches.

    Raises:
        ConfigError: one line naming the rows that differ, by how much, and the fixes.
    """
    incomplete = before is not None
    with FeatureStore(store_file, allow_incomplete=incomplete) as store:
        index = store.index
        if before is not None:
            index = index[index < before]
        if not len(index):
            return
        batches = _batches_holding(plan, run, [int(index[0]), int(index[-1])])
        mismatch = _first_mismatch(store, index, model, dataset, plan, run, batches)
    if mismatch is None:
        return
    dtype = tolerance_of(run.store.dtype, plan.layout.amp)[1]
    if incomplete:
        what = f"cannot resume {store_file}"
        fix = f"pass {OVERWRITE} to start over, or write to another path"
    else:
        what = f"store {store_file} was not made by this computation"
        fix = f"pass {OVERWRITE} to replace it, or write to another path"
    raise ConfigError(
        f"{what}: {mismatch.describe()} when recomputed now, beyond {dtype} "
        "rounding, although its settings, weights and ids match; the data, its transform or "
        f"the model changed in a way the store's fingerprints cannot see; {fix}"
    )


def _batches_holding(plan: _Plan, run: RunOptions, positions: Sequence[int]) -> list[list[int]]:
    """The batches of the run's grid (as positions into ``plan.rows``) that hold the
    source ``positions``: the same samples, in the same order, as when they were stored."""
    lengths = None
    if plan.bucket_window is not None:
        assert plan.row_tokens is not None
        lengths = plan.row_tokens[plan.rows.start : plan.rows.stop]
    grid = GridBatches(
        plan.rows, run.loader.batch_size, plan.shard_starts, lengths, plan.bucket_window
    )
    wanted = {p - plan.rows.start for p in positions}
    found = []
    for batch in grid:
        if wanted.intersection(batch):
            found.append(batch)
            wanted.difference_update(batch)
            if not wanted:
                break
    return found


def _first_mismatch(
    store: FeatureStore,
    index: np.ndarray,
    model: nn.Module,
    dataset: Dataset,
    plan: _Plan,
    run: RunOptions,
    batches: list[list[int]],
) -> Mismatch | None:
    tolerance = tolerance_of(run.store.dtype, plan.layout.amp)[0]
    labels = store.labels
    for captured in recompute(model, dataset, plan, run, batches):
        positions = captured.index
        rows = np.searchsorted(index, positions)
        held = (rows < len(index)) & (index[np.minimum(rows, len(index) - 1)] == positions)
        stored_rows = rows[held]
        if labels is not None:
            for at, j in enumerate(np.flatnonzero(held)):
                if labels[stored_rows[at]] != captured.labels[j]:
                    what = f"label {captured.labels[j]} vs {labels[stored_rows[at]]} stored"
                    return _mismatch(plan, index, stored_rows[at], "", 0.0, what)
        for key, value in captured.features.items():
            recomputed = values(value, run.store.dtype).float()
            if key in captured.ragged:
                assert captured.lengths is not None
                stored, offsets = store.read_tokens(key, stored_rows)
                new_offsets = np.concatenate([[0], np.cumsum(captured.lengths)])
                found = _token_mismatch(
                    recomputed, new_offsets, held, stored.float(), offsets, tolerance
                )
            else:
                stored = store.read(key, stored_rows).float()
                found = row_mismatch(recomputed[torch.from_numpy(held)], stored, tolerance)
            if found is not None:
                at, difference, what = found
                return _mismatch(plan, index, stored_rows[at], key, difference, what)
    return None


def _mismatch(
    plan: _Plan, index: np.ndarray, row: int, layer: str, difference: float, what: str
) -> Mismatch:
    return Mismatch(int(row), str(plan.ids[int(index[row])]), layer, difference, what)


def row_mismatch(
    recomputed: torch.Tensor, stored: torch.Tensor, tolerance: float
) -> tuple[int, float, str] | None:
    """The first of the rows ``[n, ...]`` whose recomputation differs from the stored
    values by more than ``tolerance`` of the row's largest magnitude (or in where they
    are not finite): ``(row, relative difference, "")``; None when none does."""
    if not len(stored):
        return None
    new, old = recomputed.flatten(1), stored.flatten(1)
    finite = torch.isfinite(new) & torch.isfinite(old)
    same_nonfinite = (new == old) | (new.isnan() & old.isnan())
    differ = ~(finite | same_nonfinite)
    if bool(differ.any()):
        return int(differ.any(dim=1).nonzero()[0, 0]), float("inf"), ""
    new, old = new.where(finite, 0.0), old.where(finite, 0.0)
    scale = old.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
    relative = (new - old).abs().amax(dim=1) / scale
    over = (relative > tolerance).nonzero()
    if not len(over):
        return None
    at = int(over[0, 0])
    return at, float(relative[at]), ""


def _token_mismatch(
    recomputed: torch.Tensor,
    new_offsets: np.ndarray,
    held: np.ndarray,
    stored: torch.Tensor,
    offsets: np.ndarray,
    tolerance: float,
) -> tuple[int, float, str] | None:
    """Per-token rows: each held row's token count, then its tokens as one flat row."""
    for at, j in enumerate(np.flatnonzero(held)):
        new = recomputed[new_offsets[j] : new_offsets[j + 1]]
        old = stored[offsets[at] : offsets[at + 1]]
        if len(new) != len(old):
            return at, float("inf"), f"{len(new)} tokens vs {len(old)} stored"
        found = row_mismatch(new.reshape(1, -1), old.reshape(1, -1), tolerance)
        if found is not None:
            return at, found[1], ""
    return None


def tolerance_of(store_dtype: str, amp: torch.dtype | None) -> tuple[float, str]:
    """The relative tolerance of a recomputation, and the dtype that sets it: the store
    dtype's, or the autocast dtype's where that is coarser."""
    dtype = torch_dtype(store_dtype)
    if amp is not None and RELATIVE_TOLERANCE[amp] > RELATIVE_TOLERANCE[dtype]:
        dtype = amp
    return RELATIVE_TOLERANCE[dtype], str(dtype).removeprefix("torch.")


def recompute(
    model: nn.Module, dataset: Dataset, plan: _Plan, run: RunOptions, batches: list[list[int]]
) -> list[CapturedBatch]:
    """The captured values of ``batches`` (positions into ``plan.rows``), run as the run
    loop runs them; rows that cannot be read, or that the non-finite policy drops, are
    left out."""
    source_rows = SourceRows(dataset, plan.rows, has_labels=plan.has_labels)
    loader = DataLoader(
        source_rows,
        batch_sampler=batches,
        num_workers=0,
        collate_fn=Collate(source_rows.pad_values),
    )
    was_training = model.training
    model.eval()
    convert = functools.partial(encode, dtype=run.store.dtype)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(placed(model, plan.layout))
            tapset = stack.enter_context(TapSet(model, plan.taps, convert=convert))
            return [_captured(tapset, batch, plan, run) for batch in loader]
    finally:
        model.train(was_training)


def _captured(tapset: TapSet, batch: Batch, plan: _Plan, run: RunOptions) -> CapturedBatch:
    if batch.error:
        raise ConfigError(batch.error)
    captured = CapturedBatch(batch.rows.numpy(), [], batch.labels.numpy(), {}, None, [])
    if batch.inputs is not None:
        forward(
            tapset, batch, captured, plan.layout, False, run.store, plan.ids, None,
            tokens=plan.tokens,
        )  # fmt: skip
    return captured
