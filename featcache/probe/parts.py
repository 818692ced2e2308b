"""The rows of a store that one pass of a probe reads (all of them, or a kept subset), the
datasets they are read from, and the pass's progress bar."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from featcache.probe.options import ProbeOptions
from featcache.probe.splits import Splits
from featcache.read.dataset import Batch, FeatureDataset


@dataclasses.dataclass
class Part:
    """The rows of one store that a pass uses: all, or those where ``keep`` is true;
    each scaled to unit L2 norm as it is read when ``l2``."""

    dataset: FeatureDataset
    keep: np.ndarray | None = None  # bool [N]
    l2: bool = False

    def __len__(self) -> int:
        return len(self.dataset) if self.keep is None else int(self.keep.sum())

    def kept(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept rows of a batch read ``with_index=True``: features flattened to
        float32 ``[b, D]``, labels int64 ``[b]``, their rows in the store int64 ``[b]``."""
        x, y, rows = unpack(batch)
        if self.keep is not None:
            mask = torch.from_numpy(self.keep[rows.numpy()])
            x, y, rows = x[mask], y[mask], rows[mask]
        x = x.reshape(len(x), -1)
        return (F.normalize(x, dim=1) if self.l2 else x), y, rows


def unpack(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(features [b, *shape], labels [b], rows [b])`` of a one-layer batch."""
    if len(batch) != 3 or not isinstance(batch[0], torch.Tensor):
        raise TypeError("expected (features, labels, rows) of one layer")
    return batch[0], batch[1], batch[2]


def in_order(
    parts: Sequence[Part], batch_size: int, buffer_rows: int | None = None
) -> Iterator[tuple[Part, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The kept rows of each part in store order: ``(part, x, y, rows, raw)`` as
    :meth:`Part.kept` gives them, ``raw`` every row of the batch as read (for hashing).
    ``buffer_rows`` bounds the read buffer (:meth:`FeatureDataset.batches`)."""
    for part in parts:
        batches = part.dataset.batches(
            batch_size, shuffle=False, with_index=True, buffer_rows=buffer_rows
        )
        for batch in batches:
            x, y, rows = part.kept(batch)
            yield part, x, y, rows, unpack(batch)[0]


@contextlib.contextmanager
def open_datasets(splits: Splits, layer: str) -> Iterator[dict[str, FeatureDataset]]:
    """Every store's ``layer`` as a float32 dataset, by role, closed on leaving."""
    with contextlib.ExitStack() as stack:
        yield {
            role: stack.enter_context(
                contextlib.closing(FeatureDataset(store.path, layer, dtype=torch.float32))
            )
            for role, store in splits.stores.items()
        }


def fit_and_val(
    splits: Splits, datasets: dict[str, FeatureDataset], l2: bool = False
) -> tuple[Part, Part]:
    """The rows the sweep fits on and the validation rows: the train and val stores, or
    the train store's rows outside and inside the held-out ones."""
    if splits.val_rows is None:
        return Part(datasets["train"], l2=l2), Part(datasets["val"], l2=l2)
    held = np.zeros(len(datasets["train"]), dtype=bool)
    held[splits.val_rows] = True
    return Part(datasets["train"], ~held, l2), Part(datasets["train"], held, l2)


def progress(options: ProbeOptions, iterable: Iterable[Any] | None = None, **bar: Any) -> tqdm:
    """A tqdm bar over ``iterable`` (``bar``: its options), shown with ``options.progress``."""
    return tqdm(iterable, disable=not options.progress, dynamic_ncols=True, **bar)
