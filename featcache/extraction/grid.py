"""The batch grid: which rows go into which batch, the same in every run over a source.

Batches hold consecutive rows, starting at the first row of the run and again at every
shard boundary of a sharded source (a WebDataset's shards: its ``shard_starts``), so no
batch straddles two shards and a torchrun rank that takes whole shards runs exactly the
batches a one-process run does. With length bucketing the grid's unit is a window of
batches, whose rows run longest first (see :mod:`featcache.extraction.bucketing`).
Resuming restarts on the same grid (:func:`~featcache.store.resume.grid_start`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Dataset, Sampler


def shard_starts(dataset: Dataset) -> list[int]:
    """The first source row of each shard after the first (``[]`` for an unsharded source)."""
    starts = getattr(dataset, "shard_starts", None)
    return [] if starts is None else [int(s) for s in starts if int(s) > 0]


class GridBatches(Sampler[list[int]]):
    """The batches of the rows ``rows`` on the batch grid, as positions ``0 ..
    len(rows) - 1`` into them (what a DataLoader over those rows indexes).

    Segments run from ``rows.start`` and from each of ``boundaries`` inside ``rows``;
    each is cut into windows of ``window`` rows (default ``batch_size``), and each window
    into batches of ``batch_size``. With ``lengths`` (``[len(rows)]`` tokens per row) a
    window's rows are sorted by length first, longest first, ties in order.
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
        self.segments = [
            (a - rows.start, b - rows.start) for a, b in zip(edges[:-1], edges[1:], strict=True)
        ]

    def __iter__(self) -> Iterator[list[int]]:
        for first, stop in self.segments:
            for start in range(first, stop, self.window):
                end = min(start + self.window, stop)
                if self.lengths is None:
                    order = np.arange(start, end)
                else:
                    order = start + np.argsort(-self.lengths[start:end], kind="stable")
                for at in range(0, len(order), self.batch_size):
                    yield order[at : at + self.batch_size].tolist()

    def window_sizes(self) -> Iterator[int]:
        """The rows of each window, in order."""
        for first, stop in self.segments:
            for start in range(first, stop, self.window):
                yield min(start + self.window, stop) - start

    def __len__(self) -> int:
        count = 0
        for first, stop in self.segments:
            full, rest = divmod(stop - first, self.window)
            count += full * -(-self.window // self.batch_size) + -(-rest // self.batch_size)
        return count
