"""How values and attributes are encoded in a store: the dtype table and attribute JSON.

HDF5 has no bfloat16, so bfloat16 rows are stored as their raw 16 bits in a ``uint16``
dataset whose ``dtype`` attribute says ``"bfloat16"``. This module is the only place that
knows it: tensors go in through :func:`encode` and :func:`to_numpy`, and come back out
through :func:`decode`; :func:`as_array` and :func:`from_array` give tensors of any
dtype, bfloat16 included, a numpy view for HDF5 reads and numpy gathers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np
import torch

# store dtype name -> (torch dtype of the values, numpy dtype of the HDF5 dataset)
DTYPES: dict[str, tuple[torch.dtype, type[np.generic]]] = {
    "float16": (torch.float16, np.float16),
    "float32": (torch.float32, np.float32),
    "bfloat16": (torch.bfloat16, np.uint16),
}

# File attributes that hold JSON text rather than a plain HDF5 scalar.
JSON_ATTRS = frozenset(
    {
        "config",
        "weights",
        "versions",
        "class_names",
        "source",
        "taps",
        "resume_key",
        "layout",
        "shards",
        "merged_from",
    }
)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a store dtype name stands for (``"bfloat16"`` -> torch.bfloat16)."""
    return DTYPES[name][0]


def numpy_dtype(name: str) -> np.dtype:
    """The dtype of the HDF5 dataset holding values of store dtype ``name``."""
    return np.dtype(DTYPES[name][1])


def encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Cast a batch to the store's dtype on its own device; bfloat16 as its int16 bits.

    The result is contiguous in the default layout (one pass on the device), whatever the
    layout the model ran in, so rows copy to the host and into HDF5 as flat blocks.
    """
    out = x.to(dtype=torch_dtype(dtype), memory_format=torch.contiguous_format)
    return out.view(torch.int16) if dtype == "bfloat16" else out


def values(encoded: torch.Tensor, dtype: str) -> torch.Tensor:
    """The float view of an :func:`encode` result (no copy)."""
    return encoded.view(torch.bfloat16) if dtype == "bfloat16" else encoded


def to_numpy(encoded: torch.Tensor) -> np.ndarray:
    """A host tensor from :func:`encode` as the array HDF5 stores (no copy)."""
    if encoded.dtype == torch.int16:  # bfloat16 bits
        return encoded.numpy().view(np.uint16)
    return encoded.numpy()


def decode(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Stored rows (as read from HDF5) back to a tensor of the store dtype (no copy)."""
    return from_array(array, torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(array)


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array over the same memory; bfloat16, which numpy lacks,
    as its ``uint16`` bits (the stored form). Undone by :func:`from_array`."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def from_array(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """An array from :func:`as_array` (or read from HDF5) as a tensor of ``dtype``, no copy."""
    tensor = torch.from_numpy(array)
    if dtype == torch.bfloat16:
        return tensor.view(torch.int16).view(torch.bfloat16)
    return tensor


def write_attrs(target: h5py.File | h5py.Group | h5py.Dataset, attrs: Mapping[str, Any]) -> None:
    """Write attributes, JSON-encoding those listed in :data:`JSON_ATTRS`."""
    for key, value in attrs.items():
        target.attrs[key] = json.dumps(value) if key in JSON_ATTRS else value


def read_attrs(source: h5py.File | h5py.Group | h5py.Dataset) -> dict[str, Any]:
    """All attributes as Python data, JSON ones decoded, numpy scalars made plain."""
    out: dict[str, Any] = {}
    for key, value in source.attrs.items():
        if key in JSON_ATTRS and isinstance(value, str):
            value = json.loads(value)
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out
