"""Proof that a run continues a store: a few stored rows, recomputed now, must equal it.

Some differences are invisible to the store key's fingerprints (a Python dataset's
transform, another folder with the same file names), so a run that resumes or returns a
store first recomputes the batches holding its first and last stored rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from featcache.errors import ConfigError
from featcache.extraction.compare import (
    first_over,
    relative_differences,
    token_differences,
    tolerance_of,
)
from featcache.extraction.plan import ExtractionPlan
from featcache.extraction.run import recompute
from featcache.store import FeatureStore
from featcache.store.paths import OVERWRITE


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
    store_file: Path, plan: ExtractionPlan, before: int | None = None, *, batches: int = 2
) -> None:
    """Refuse to continue (or return as done) the store in ``store_file`` unless the rows
    it holds come out the same when recomputed now.

    ``before`` (a source position) limits the check to the rows an interrupted run keeps.
    Recomputes at most ``batches`` batches: those holding the last and (with 2) the first
    of those rows.

    Raises:
        ConfigError: one line naming the rows that differ, by how much, and the fixes.
    """
    incomplete = before is not None
    with FeatureStore(store_file, allow_incomplete=incomplete) as store:
        index = store.index
        if before is not None:
            index = index[index < before]
        if not len(index) or not batches:
            return
        ends = [int(index[-1]), int(index[0])][:batches]
        mismatch = _first_mismatch(store, index, plan, _batches_holding(plan, ends))
    if mismatch is None:
        return
    dtype = tolerance_of(plan.options.store.dtype, plan.layout.amp)[1]
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


def _batches_holding(plan: ExtractionPlan, positions: Sequence[int]) -> list[list[int]]:
    """The batches of the run's grid (as positions into ``plan.rows``) that hold the
    source ``positions``, as they were when stored."""
    wanted = {p - plan.rows.start for p in positions}
    found = []
    for batch in plan.grid():
        if wanted.intersection(batch):
            found.append(batch)
            wanted.difference_update(batch)
            if not wanted:
                break
    return found


def _first_mismatch(
    store: FeatureStore, index: np.ndarray, plan: ExtractionPlan, batches: list[list[int]]
) -> Mismatch | None:
    dtype = plan.options.store.dtype
    tolerance = tolerance_of(dtype, plan.layout.amp)[0]
    labels = store.labels

    def mismatch(row: int, layer: str, difference: float, what: str = "") -> Mismatch:
        return Mismatch(int(row), str(plan.ids[int(index[row])]), layer, difference, what)

    for captured in recompute(plan, batches):
        positions = captured.index
        rows = np.searchsorted(index, positions)
        held = (rows < len(index)) & (index[np.minimum(rows, len(index) - 1)] == positions)
        stored_rows = rows[held]
        if labels is not None:
            for at, j in enumerate(np.flatnonzero(held)):
                if labels[stored_rows[at]] != captured.labels[j]:
                    what = f"label {captured.labels[j]} vs {labels[stored_rows[at]]} stored"
                    return mismatch(stored_rows[at], "", 0.0, what)
        for key in captured.features:
            recomputed = captured.values(key, dtype)
            notes: list[str] = []
            if key in captured.ragged:
                assert captured.lengths is not None
                stored, offsets = store.read_tokens(key, stored_rows)
                starts = np.concatenate([[0], np.cumsum(captured.lengths)])
                kept = [recomputed[starts[j] : starts[j + 1]] for j in np.flatnonzero(held)]
                relative, notes = token_differences(
                    torch.cat(kept) if kept else recomputed[:0],
                    captured.lengths[held],
                    stored.float(),
                    offsets,
                )
            else:
                stored = store.read(key, stored_rows).float()
                relative = relative_differences(recomputed[torch.from_numpy(held)], stored)
            over = first_over(relative, tolerance)
            if over is not None:
                what = notes[over] if notes else ""
                return mismatch(stored_rows[over], key, float(relative[over]), what)
    return None
