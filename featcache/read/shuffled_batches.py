"""ShuffledBatches: a FeatureDataset's chunk-aware shuffled batches, shared out among
DataLoader workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import IterableDataset, get_worker_info

if TYPE_CHECKING:
    from featcache.read.dataset import Batch, FeatureDataset


class ShuffledBatches(IterableDataset):
    """Chunk-aware shuffled batches of a
    [`FeatureDataset`][featcache.read.dataset.FeatureDataset], for a DataLoader.

    Iterating gives one epoch of
    [`FeatureDataset.batches`][featcache.read.dataset.FeatureDataset.batches] (same options);
    use it as ``DataLoader(ShuffledBatches(dataset, 256), batch_size=None, num_workers=k)``.
    Each worker reads a disjoint share of the blocks, so every row still comes exactly once
    per epoch (each worker may end with one smaller batch, unless ``drop_last``). With
    ``shuffle=False`` each worker keeps store order within its share, but the DataLoader
    takes batches from the workers in turn: for rows in store order, use
    [`FeatureDataset.batches`][featcache.read.dataset.FeatureDataset.batches] or one worker.

    Call [`set_epoch`][featcache.read.shuffled_batches.ShuffledBatches.set_epoch] before each
    epoch for a different order; the order depends only on ``seed``, the epoch and the
    number of workers. The epoch lives in shared memory, so it also reaches workers kept
    alive with ``persistent_workers=True``."""

    def __init__(
        self,
        dataset: FeatureDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        buffer_rows: int | None = None,
        drop_last: bool = False,
        with_index: bool = False,
        read_ahead: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.buffer_rows = buffer_rows
        self.drop_last = drop_last
        self.with_index = with_index
        self.read_ahead = read_ahead
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next iteration on."""
        self._epoch.fill_(epoch)

    def __iter__(self) -> Iterator[Batch]:
        worker = get_worker_info()
        shard, shards = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        return self.dataset._batches(
            self.batch_size,
            self.shuffle,
            self.seed,
            self.epoch,
            self.buffer_rows,
            self.drop_last,
            self.with_index,
            shard,
            shards,
            read_ahead=self.read_ahead,
        )
