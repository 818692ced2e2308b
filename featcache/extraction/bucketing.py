"""Length-bucketed batching: fewer padded tokens per batch, rows still stored in order.

Rows are read in windows of :data:`WINDOW_BATCHES` batches, longest first within a
window; :class:`WindowReorder` gives each window back in source order, so the store is
written and resumed as any other (a resume restarts at a window boundary).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from featcache.extraction.writer_thread import CapturedBatch

WINDOW_BATCHES = 16  # batches per window of rows sorted by length


class WindowReorder:
    """Collects the captured batches of one window (``sizes``: the rows of each window);
    :meth:`add` returns None until the window is complete, then it as one batch in source
    order, on the CPU."""

    def __init__(self, sizes: Iterable[int]) -> None:
        self.sizes = iter(sizes)
        self.size = next(self.sizes, 0)
        self.pending: list[CapturedBatch] = []
        self.seen = 0

    def add(self, captured: CapturedBatch) -> CapturedBatch | None:
        self.pending.append(captured)
        self.seen += len(captured.index) + len(captured.skipped)
        if self.seen < self.size:
            return None
        merged = merge_in_order(self.pending)
        self.pending, self.seen = [], 0
        self.size = next(self.sizes, 0)
        return merged


def merge_in_order(batches: list[CapturedBatch]) -> CapturedBatch:
    """One batch of the rows of ``batches``, sorted by source position, on the CPU
    (per-token layers move each row's block of tokens with it)."""
    index = np.concatenate([b.index for b in batches])
    order = np.argsort(index, kind="stable")
    labels = np.concatenate([b.labels for b in batches])[order]
    skipped = sorted((r for b in batches for r in b.skipped), key=lambda r: r["index"])
    ragged = frozenset().union(*(b.ragged for b in batches))
    lengths = token_ids = None
    token_order = torch.from_numpy(order)
    if ragged:
        # Batches of unreadable rows only have no tokens, and add no rows.
        with_tokens = [b for b in batches if b.lengths is not None]
        counts = np.concatenate([b.lengths for b in with_tokens])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        lengths = counts[order]
        new_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        shift = np.repeat(starts[order] - new_starts, lengths)
        token_order = torch.from_numpy(np.arange(int(lengths.sum())) + shift)
        parts = [b.token_ids for b in with_tokens if b.token_ids is not None]
        if len(parts) == len(with_tokens):
            token_ids = np.concatenate(parts)[token_order.numpy()]
    computed = [b for b in batches if b.features]  # a batch of unreadable rows has none
    features, scales = {}, {}
    for key in computed[0].features if computed else ():
        picked = token_order if key in ragged else torch.from_numpy(order)
        values = torch.cat([b.features[key] for b in computed])
        features[key] = values[picked.to(values.device)].cpu()
        if key in computed[0].scales:  # int8: each row's (token's) scale moves with it
            scale = torch.cat([b.scales[key] for b in computed])
            scales[key] = scale[picked.to(scale.device)].cpu()
    return CapturedBatch(
        index[order],
        [],
        labels,
        features,
        None,
        skipped,
        None,
        ragged,
        lengths,
        token_ids,
        scales,
    )
