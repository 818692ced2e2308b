"""``TokenDataset``: the single tokens of a store's per-token rows, for token-level training.

A store written with ``reduce: none`` on a text model's token outputs holds each layer as
one ``[total_tokens, D]`` dataset plus row offsets. Sparse-autoencoder and token-probe
training reads those tokens one at a time in a random order; :class:`TokenDataset` serves
them with the row and position each came from, and shuffles by chunk exactly as
:class:`~featcache.FeatureDataset` does for rows, so a shuffled epoch over tokens costs
about what indexing the same array in memory does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from featcache.errors import ConfigError
from featcache.read.dataset import FeatureDataset, Features, _take
from featcache.store.reader import FeatureStore, StoreFile
from featcache.store.rows import read_rows, row_numbers, rows_of


class TokenDataset(FeatureDataset):
    """The tokens of one or more per-token layers, one token per item.

    ``dataset[k]`` is ``(features, row, position)``: ``features`` is token ``k``'s
    ``[D]`` values (a dict ``{layer: tensor}`` for several layers) in ``dtype``; ``row``
    (int64) is the store row it belongs to and ``position`` (int64) its place in that
    row's sequence. `batches` and `shuffled` give
    ``(features [b, D], rows [b], positions [b])`` (plus the token numbers with
    ``with_index=True``), shuffled by chunk with the options of
    [`FeatureDataset.batches`][featcache.read.dataset.FeatureDataset.batches]; ``in_memory=True``
    loads the tokens once.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layers: str | Sequence[str],
        *,
        in_memory: bool = False,
        dtype: torch.dtype | None = torch.float32,
        allow_incomplete: bool = False,
        chunk_cache: int | None = None,
    ):
        store = FeatureStore(path, allow_incomplete=allow_incomplete)
        self.path = Path(path)
        self.single = isinstance(layers, str)
        self.layers = [layers] if isinstance(layers, str) else list(layers)
        if not self.layers:
            raise ConfigError("TokenDataset needs at least one layer")
        for layer in self.layers:
            if not store.is_per_token(layer):
                raise ConfigError(
                    f"layer {layer!r} of {store.path} holds one row per sample, not per-token "
                    "rows; read it with FeatureDataset"
                )
        offsets = store.offsets
        assert offsets is not None
        self.row_offsets = offsets
        self.num_rows = int(offsets[-1])  # the items of this dataset are tokens
        self.per_token = []  # every layer is per token, and each token is one item
        self.offsets = None
        self.has_labels = False
        self.labels = torch.empty(0, dtype=torch.int64)
        self.class_names = store.class_names
        self.dtype = dtype
        self._read_layouts(store, chunk_cache)  # a block: whole chunks of tokens
        self._memory = None
        if in_memory:
            group = store.file["features"]
            every = slice(0, self.num_rows)
            self._memory = {
                layer: self._convert(read_rows(rows_of(group[layer]), every))
                for layer in self.layers
            }
        store.close()
        self._handle = StoreFile(self.path)
        self._spare = None

    @property
    def num_tokens(self) -> int:
        """The tokens served (every token of the store's per-token rows)."""
        return self.num_rows

    def rows_and_positions(self, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The row and the position in it of each token number in ``tokens``."""
        rows = np.searchsorted(self.row_offsets, tokens, side="right") - 1
        positions = tokens - self.row_offsets[rows]
        return torch.from_numpy(rows.astype(np.int64)), torch.from_numpy(positions)

    def _targets(self, index: np.ndarray) -> tuple[torch.Tensor, ...]:
        return self.rows_and_positions(index)

    def __getitem__(self, i: int) -> tuple[Features, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (sample,) = self.__getitems__([i])
        return sample

    def __getitems__(  # type: ignore[override]
        self, indices: Sequence[int]
    ) -> list[tuple[Features, torch.Tensor, torch.Tensor]]:
        """Tokens ``indices``, read in increasing order: one slice per run of tokens."""
        tokens = row_numbers(indices, self.num_rows)
        if self._memory is not None:
            values = {layer: _take(self._memory[layer], tokens) for layer in self.layers}
        else:
            values = {
                layer: self._convert(read_rows(self._reader(layer), tokens))
                for layer in self.layers
            }
        rows, positions = self.rows_and_positions(tokens)
        out = []
        for j in range(len(tokens)):
            item: Features = (
                values[self.layers[0]][j]
                if self.single
                else {layer: values[layer][j] for layer in self.layers}
            )
            out.append((item, rows[j], positions[j]))
        return out

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, tokens={self.num_tokens}, layers={self.layers})"
