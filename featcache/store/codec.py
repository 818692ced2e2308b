"""How values and attributes are encoded in a store: the dtype table and attribute JSON.

HDF5 has no bfloat16: bfloat16 rows are stored as their 16 bits in a ``uint16`` dataset
whose ``dtype`` attribute says ``"bfloat16"``; tensors go in through :func:`encode` and
:func:`as_array` and come back through :func:`from_array`. ``int8`` rows are symmetric
8-bit codes with one float32 scale per row (per token for per-token rows) in
``/scales/<layer>``: value = code * scale (:func:`quantize`, :func:`dequantize`).
Text attributes are fixed-length UTF-8 (:func:`set_attr`), kept in HDF5's checksummed
headers, never in its global heap, which has no checksum (a damaged length there can
hang HDF5, HDFGroup/hdf5#1707); :func:`attr` and :func:`read_attrs` give them back as ``str``.
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
SCALES = "scales"  # the group of the scale datasets of quantized layers: /scales/<layer>
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
    """The torch dtype readers give the values of store dtype ``name`` in: its own, or
    float32 for quantized codes (dequantized)."""
    import torch

    return torch.float32 if name in QUANTIZED else torch_dtype(name)


def scales_name(key: str) -> str:
    """The dataset holding the scales of the quantized layer ``key``."""
    return f"{SCALES}/{key}"


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` ``[n, ...]`` (finite floats) as int8 codes of the same shape and one
    float32 scale per row ``[n]``: the row's largest magnitude over 127, so that
    ``code * scale`` is within half a scale of the value. On ``x``'s device."""
    import torch

    flat = x.detach().float().flatten(1)
    scales = flat.abs().amax(dim=1) / CODE_MAX if flat.shape[1] else flat.new_zeros(len(flat))
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(flat / step[:, None]).clamp_(-CODE_MAX, CODE_MAX).to(torch.int8)
    return codes.view(x.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, ...]`` values of int8 ``codes`` ``[n, ...]`` with their ``[n]``
    ``scales``."""
    # int8 times float32 is float32 in one pass, without a float copy of the codes first.
    return codes * scales.float().view(-1, *([1] * (codes.dim() - 1)))


def numpy_dtype(name: str) -> np.dtype:
    """The dtype of the HDF5 dataset holding values of store dtype ``name``."""
    return np.dtype(DTYPES[name])


def encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Cast a batch to the store's dtype on its own device; bfloat16 as its int16 bits.

    The result is contiguous in the default layout, whatever the layout the model ran in,
    so rows copy to the host and into HDF5 as flat blocks: one pass on an accelerator.
    On the CPU a cast that also reorders runs a strided loop about twice as slow as a cast
    in the input's own layout followed by a reorder of the narrower values, so float16 is
    made that way; both give the same bits for every float32 input, NaNs included.
    bfloat16 keeps the one pass, since the vectorized cast writes NaNs with other bits.
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
    """A CPU tensor as the numpy array HDF5 stores, over the same memory: bfloat16 (or
    the int16 bits :func:`encode` makes of it) as ``uint16`` bits. Undone by
    :func:`from_array`."""
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
    """``texts`` as fixed-length UTF-8 strings (an ``S<n>`` array, ``n`` the longest's
    bytes and at least 1): what HDF5 keeps inside checksummed headers and chunks."""
    raw = [text.encode("utf-8") for text in texts]
    width = max((len(r) for r in raw), default=1) or 1
    return np.array(raw, dtype=h5py.string_dtype("utf-8", width))


def set_attr(target: HDF5Object, key: str, value: Any) -> None:
    """Write one attribute as featcache stores it: text fixed-length, the rest as given."""
    target.attrs[key] = fixed_texts([value]).reshape(()) if isinstance(value, str) else value


def copy_attrs(source: HDF5Object, target: HDF5Object, skip: Collection[str] = ()) -> None:
    """Copy every attribute of ``source`` but those in ``skip`` to ``target``, as
    :func:`set_attr` writes them (text written variable-length before becomes fixed)."""
    for key, value in source.attrs.items():
        if key not in skip:
            set_attr(target, key, value)


def write_attrs(target: HDF5Object, attrs: Mapping[str, Any]) -> None:
    """Write attributes as :func:`set_attr` does, JSON-encoding the file's ones listed in
    :data:`JSON_ATTRS` (as :func:`read_attrs` decodes them)."""
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
    """All attributes as Python data: text as ``str`` (stored fixed-length or
    variable-length), the file's JSON ones (:data:`JSON_ATTRS`) decoded, numpy scalars
    made plain."""
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
    if isinstance(value, np.generic):
        return value.item()
    return value
