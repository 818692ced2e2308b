"""``FeatureDataset``: cached features as a torch Dataset for downstream training."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from featcache.errors import ConfigError
from featcache.store import FeatureStore, open_for_reading, read_rows

Features = torch.Tensor | dict[str, torch.Tensor]


class FeatureDataset(Dataset):
    """Rows of one or more stored layers with their labels.

    ``dataset[i]`` is ``(features, label)``: ``features`` is a tensor of the layer's row
    shape (a dict ``{layer: tensor}`` when several layers are asked for), converted to
    ``dtype`` (float32 by default); ``label`` is an int64 scalar tensor, -1 when the store
    has no labels.

    The HDF5 file is opened lazily in each process, so the dataset works with DataLoader
    workers. A DataLoader with automatic batching calls :meth:`__getitems__`, which reads
    a whole batch with one sorted read per layer instead of one call per row.
    ``in_memory=True`` loads the layers once and serves rows from memory.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layers: str | Sequence[str],
        *,
        in_memory: bool = False,
        dtype: torch.dtype | None = torch.float32,
        allow_incomplete: bool = False,
    ):
        self.path = Path(path)
        store = FeatureStore(self.path, allow_incomplete=allow_incomplete)
        self.single = isinstance(layers, str)
        self.layers = [layers] if isinstance(layers, str) else list(layers)
        if not self.layers:
            raise ConfigError("FeatureDataset needs at least one layer")
        for layer in self.layers:
            store.shape(layer)  # raises a clear error for a missing layer
        self.num_rows = store.rows_written if allow_incomplete else len(store)
        labels = store.labels
        self.has_labels = labels is not None
        self.labels = torch.from_numpy(
            labels[: self.num_rows]
            if labels is not None
            else np.full(self.num_rows, -1, dtype=np.int64)
        )
        self.class_names = store.class_names
        self.dtype = dtype
        self._memory: dict[str, torch.Tensor] | None = None
        if in_memory:
            self._memory = {
                layer: self._convert(store.read(layer, slice(0, self.num_rows)))
                for layer in self.layers
            }
        store.close()
        self._file: h5py.File | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self.num_rows

    def _h5(self) -> h5py.File:
        if self._file is None or self._pid != os.getpid():
            self._file = open_for_reading(self.path)
            self._pid = os.getpid()
        return self._file

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = None
        state["_pid"] = None
        return state

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def _rows(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        if self._memory is not None:
            index = torch.from_numpy(rows)
            return {layer: self._memory[layer][index] for layer in self.layers}
        group = self._h5()["features"]
        return {layer: self._convert(read_rows(group[layer], rows)) for layer in self.layers}

    def _check(self, rows: np.ndarray) -> np.ndarray:
        rows = np.where(rows < 0, rows + self.num_rows, rows)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise IndexError(f"row index out of range for a dataset of {self.num_rows} rows")
        return rows

    def __getitem__(self, i: int) -> tuple[Features, torch.Tensor]:
        (sample,) = self.__getitems__([i])
        return sample

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Features, torch.Tensor]]:
        """A batch of samples, read with one sorted HDF5 read per layer."""
        rows = self._check(np.asarray(indices, dtype=np.int64))
        features = self._rows(rows)
        labels = self.labels[torch.from_numpy(rows)]
        if self.single:
            (values,) = features.values()
            return [(values[j], labels[j]) for j in range(len(rows))]
        return [
            ({layer: features[layer][j] for layer in self.layers}, labels[j])
            for j in range(len(rows))
        ]

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None
