"""A DataLoader collate for per-token rows: pad them to the batch's longest, with a mask."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import cast

import torch
from torch.nn.utils.rnn import pad_sequence

Features = torch.Tensor | dict[str, torch.Tensor]


class PadTokens:
    """Collate [`FeatureDataset`][featcache.read.dataset.FeatureDataset] items whose rows are
    per-token (``[T_i, *shape]``, of different lengths) into ``(features, mask, labels)``.

    ``features`` is ``[B, T, *shape]``, each row right-padded with ``pad_value`` to the
    longest ``T`` of the batch; for a dataset of several layers, a dict in which the
    layers named in ``per_token`` (default: all) are padded so and the others' rows
    stacked as they are. ``mask`` is bool ``[B, T]``, True at real tokens (the per-token
    layers of a store share their token counts); ``labels`` is int64 ``[B]``.
    ``FeatureDataset.pad_tokens`` is one for its own layers::

        loader = DataLoader(dataset, batch_size=32, collate_fn=dataset.pad_tokens)
        for features, mask, labels in loader: ...

    Picklable, for DataLoader workers."""

    def __init__(self, per_token: Collection[str] | None = None, pad_value: float = 0.0):
        self.per_token = None if per_token is None else frozenset(per_token)
        self.pad_value = pad_value

    def __call__(
        self, samples: Sequence[tuple[Features, torch.Tensor]]
    ) -> tuple[Features, torch.Tensor, torch.Tensor]:
        labels = torch.stack([torch.as_tensor(label) for _, label in samples])
        first = samples[0][0]
        if not isinstance(first, Mapping):
            tensors = [cast(torch.Tensor, features) for features, _ in samples]
            return self._pad(tensors), self._mask(tensors), labels
        padded, mask = {}, None
        for layer in first:
            rows = [cast(Mapping[str, torch.Tensor], features)[layer] for features, _ in samples]
            if self.per_token is None or layer in self.per_token:
                padded[layer] = self._pad(rows)
                mask = self._mask(rows) if mask is None else mask
            else:
                padded[layer] = torch.stack(rows)
        if mask is None:  # no per-token layer: one real position per row
            mask = torch.ones(len(samples), 1, dtype=torch.bool)
        return padded, mask, labels

    def _pad(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return pad_sequence(rows, batch_first=True, padding_value=self.pad_value)

    @staticmethod
    def _mask(rows: list[torch.Tensor]) -> torch.Tensor:
        lengths = torch.tensor([len(row) for row in rows])
        return torch.arange(int(lengths.max())) < lengths[:, None]

    def __repr__(self) -> str:
        layers = "all" if self.per_token is None else sorted(self.per_token)
        return f"{type(self).__name__}(per_token={layers}, pad_value={self.pad_value})"


pad_tokens = PadTokens()  # pads every layer's rows: for a dataset of per-token layers
