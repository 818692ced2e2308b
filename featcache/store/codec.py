"""How values and attributes are encoded in a store: the dtype table and attribute JSON.

bfloat16 rows are stored as their bits in ``uint16`` datasets, int8 rows as codes with a
float32 scale per row (docs/store-format.md). Text attributes are fixed-length UTF-8,
kept in HDF5's checksummed headers, never in its global heap, which has no checksum (a
damaged length there can hang HDF5, HDFGroup/hdf5#1707).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import h5py
import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: metadata reads need none
    import torch

# store dtype name -> numpy dtype of the HDF5 dataset; the values' torch dtype has the name
DTYPES: dict[str, type[np.generic]] = {
    "float16": np.float16,
    "float32": np.float32,
    "bfloat16": np.uint16,
    "int8": np.int8,
}
QUANTIZED = frozenset({"int8"})  # store dtypes kept as codes with a scale per row
CODE_MAX = 127  # int8 codes run from -127 to 127: symmetric, -128 unused

# File attributes that hold JSON text rather than a plain HDF5 scalar.
JSON_ATTRS = frozenset(
    [
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
        "history",
    ]
)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a store dtype name stands for (``"bfloat16"`` -> torch.bfloat16;
    ``"int8"`` -> torch.int8, its codes)."""
    import torch

    if name not in DTYPES:
        raise KeyError(name)
    return getattr(torch, name)


def value_dtype(name: str) -> torch.dtype:
    """The torch dtype values of store dtype ``name`` are read in (float32 for quantized codes)."""
    import torch

    return torch.float32 if name in QUANTIZED else torch_dtype(name)


def scales_name(key: str) -> str:
    """The dataset holding the scales of the quantized layer ``key``."""
    return f"scales/{key}"


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` ``[n, ...]`` (finite floats) as int8 codes of the same shape and one
    float32 scale per row ``[n]`` (its largest magnitude over 127), on ``x``'s device."""
    import torch

    flat = x.detach().float().flatten(1)
    scales = flat.abs().amax(dim=1) / CODE_MAX if flat.shape[1] else flat.new_zeros(len(flat))
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(flat / step[:, None]).clamp_(-CODE_MAX, CODE_MAX).to(torch.int8)
    return codes.view(x.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, ...]`` values of int8 ``codes`` ``[n, ...]`` with their ``[n]`` ``scales``."""
    # int8 times float32 is float32 in one pass, without a float copy of the codes first.
    return codes * scales.float().view(-1, *([1] * (codes.dim() - 1)))


def numpy_dtype(name: str) -> np.dtype:
    """The dtype of the HDF5 dataset holding values of store dtype ``name``."""
    return np.dtype(DTYPES[name])


def encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Cast a batch to the store's dtype on its own device, contiguous in the default
    layout; bfloat16 as its int16 bits.

    On the CPU a cast that also reorders is about twice as slow as a cast followed by a
    reorder of the narrower values, so float16 is made that way (same bits, NaNs too);
    bfloat16 keeps the one pass, since its vectorized cast writes NaNs with other bits.
    """
    import torch

    if dtype in QUANTIZED:  # quantized once the row is known finite (see quantize)
        return x.to(dtype=torch.float32, memory_format=torch.contiguous_format)
    target = torch_dtype(dtype)
    if x.device.type == "cpu" and target == torch.float16 and not x.is_contiguous():
        out = x.to(target).contiguous()
    else:
        out = x.to(dtype=target, memory_format=torch.contiguous_format)
    return out.view(torch.int16) if dtype == "bfloat16" else out


def values(encoded: torch.Tensor, dtype: str) -> torch.Tensor:
    """The float view of an :func:`encode` result (no copy; float32 before quantizing)."""
    import torch

    return encoded.view(torch.bfloat16) if dtype == "bfloat16" else encoded


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array HDF5 stores, over the same memory: bfloat16 (or its
    int16 bits from :func:`encode`) as ``uint16`` bits."""
    import torch

    if tensor.dtype in (torch.bfloat16, torch.int16):
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def from_array(array: np.ndarray, dtype: torch.dtype | str) -> torch.Tensor:
    """Stored values (from :func:`as_array`, or read from HDF5) as a tensor of ``dtype``
    (a torch dtype or a store dtype name), no copy."""
    import torch

    tensor = torch.from_numpy(array)
    if dtype in (torch.bfloat16, "bfloat16"):
        return tensor.view(torch.int16).view(torch.bfloat16)
    return tensor


HDF5Object: TypeAlias = h5py.File | h5py.Group | h5py.Dataset


def fixed_texts(texts: Sequence[str]) -> np.ndarray:
    """``texts`` as fixed-length UTF-8: an ``S<n>`` array, ``n`` the longest's bytes, at least 1."""
    raw = [text.encode("utf-8") for text in texts]
    width = max((len(r) for r in raw), default=1) or 1
    return np.array(raw, dtype=h5py.string_dtype("utf-8", width))


def set_attr(target: HDF5Object, key: str, value: Any) -> None:
    """Write one attribute as featcache stores it: text fixed-length, the rest as given."""
    target.attrs[key] = fixed_texts([value]).reshape(()) if isinstance(value, str) else value


def copy_attrs(source: HDF5Object, target: HDF5Object, skip: Collection[str] = ()) -> None:
    """Copy the attributes of ``source`` but ``skip`` to ``target``, as :func:`set_attr` writes."""
    for key, value in source.attrs.items():
        if key not in skip:
            set_attr(target, key, value)


def write_attrs(target: HDF5Object, attrs: Mapping[str, Any]) -> None:
    """Write attributes as :func:`set_attr` does, the file's :data:`JSON_ATTRS` as JSON."""
    json_attrs = JSON_ATTRS if _is_file(target) else frozenset()
    for key, value in attrs.items():
        set_attr(target, key, json.dumps(value) if key in json_attrs else value)


def attr(source: HDF5Object, key: str, default: Any = None) -> Any:
    """One attribute of an HDF5 file, group or dataset as Python data: text as ``str``
    (stored fixed-length or variable-length), the file's JSON attributes decoded, numpy
    scalars made plain; ``default`` when it is absent."""
    if key not in source.attrs:
        return default
    return _plain(source.attrs[key], key in JSON_ATTRS and _is_file(source))


def read_attrs(source: HDF5Object) -> dict[str, Any]:
    """All attributes as Python data, as :func:`attr` gives each."""
    json_attrs = JSON_ATTRS if _is_file(source) else frozenset()
    return {key: _plain(value, key in json_attrs) for key, value in source.attrs.items()}


def _is_file(source: HDF5Object) -> bool:
    # JSON attributes are the file's; a dataset's "layout" is plain text ("tokens").
    return bool(source.name == "/")


def _plain(value: Any, is_json: bool) -> Any:
    if isinstance(value, bytes):  # a fixed-length string (numpy.bytes_)
        value = value.decode("utf-8")
    if is_json and isinstance(value, str):
        return json.loads(value)
    return value.item() if isinstance(value, np.generic) else value
