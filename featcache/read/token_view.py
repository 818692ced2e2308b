"""``TokenDataset``: the single tokens of a store's per-token rows (``reduce: none``), for
token-level training such as sparse autoencoders and token probes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from featcache.errors import ConfigError
from featcache.read.dataset import FeatureDataset, Features
from featcache.store.reader import FeatureStore
from featcache.store.rows import row_numbers


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

    A shuffled epoch lets the pages of the file it has read go as it goes, so that the
    process's resident memory stays its buffers rather than growing to the file's size.
    """

    release_pages = True

    def _count_rows(self, store: FeatureStore, allow_incomplete: bool) -> None:
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

    def _load(self, store: FeatureStore, layer: str) -> torch.Tensor:
        return store.read_tokens(layer)[0]  # every token of every row, in order

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
        values = self._rows(tokens)
        rows, positions = self.rows_and_positions(tokens)
        return [(self._item(values, j), rows[j], positions[j]) for j in range(len(tokens))]

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, tokens={self.num_tokens}, layers={self.layers})"
