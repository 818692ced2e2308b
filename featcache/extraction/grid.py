"""The batch grid: which rows go into which batch, the same in every run over a source.

Batches hold consecutive rows from the run's first row, restarting at every shard
boundary of a sharded source, so a torchrun rank that takes whole shards runs exactly
the batches a one-process run does. A resume restarts on the same grid.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Dataset, Sampler


def shard_starts(dataset: Dataset) -> list[int]:
    """The first source row of each shard after the first (``[]`` for an unsharded source)."""
    starts = getattr(dataset, "shard_starts", None)
    return [] if starts is None else [int(s) for s in starts if int(s) > 0]


class GridBatches(Sampler[list[int]]):
    """The batches of the rows ``rows`` on the batch grid, as positions into them.

    Segments run from ``rows.start`` and each of ``boundaries``; each is cut into windows
    of ``window`` rows (default ``batch_size``), each window into batches. With
    ``lengths`` (``[len(rows)]`` tokens per row) a window's rows run longest first.
    """

    def __init__(
        self,
        rows: range,
        batch_size: int,
        boundaries: Sequence[int] = (),
        lengths: np.ndarray | None = None,
        window: int | None = None,
    ) -> None:
        self.rows = rows
        self.batch_size = batch_size
        self.window = window or batch_size
        self.lengths = None if lengths is None else np.asarray(lengths)
        inner = sorted({b for b in boundaries if rows.start < b < rows.stop})
        edges = [rows.start, *inner, rows.stop]
        self.segments = [(a - rows.start, b - rows.start) for a, b in itertools.pairwise(edges)]

    def _windows(self) -> Iterator[tuple[int, int]]:
        """The ``(start, stop)`` positions of each window, in order."""
        for first, stop in self.segments:
            for start in range(first, stop, self.window):
                yield start, min(start + self.window, stop)

    def __iter__(self) -> Iterator[list[int]]:
        for start, end in self._windows():
            if self.lengths is None:
                order = np.arange(start, end)
            else:
                order = start + np.argsort(-self.lengths[start:end], kind="stable")
            for at in range(0, len(order), self.batch_size):
                yield order[at : at + self.batch_size].tolist()

    def window_sizes(self) -> Iterator[int]:
        """The rows of each window, in order."""
        return (end - start for start, end in self._windows())

    def __len__(self) -> int:
        return sum(-(-(end - start) // self.batch_size) for start, end in self._windows())
