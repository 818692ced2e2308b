"""Small stores the tests share, and a way to damage a stored row on disk."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

import featcache
from featcache.store import StoreWriter, codec


def synthetic_store(folder: Path, dtype: str = "float16", **store: Any) -> Path:
    """30 rows of a random resnet18's layer2 ([128, 4, 4]) and pooled layer4, 4 rows per
    chunk, extracted from a config into ``folder / "out" / "val.h5"``; ``store`` adds
    store options (``checksum=False`` ...)."""
    config = {
        "model": {"name": "resnet18"},
        "preprocess": {"mean": [0.485, 0.456, 0.406]},  # 32px as it is
        "layers": [{"name": "layer2"}, {"name": "layer4", "reduce": "avg"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 4},
            "splits": {"val": {"size": 30}},
        },
        "loader": {"batch_size": 8},
        "store": {"dtype": dtype, "chunk_rows": 4, **store},
        "output": {"dir": str(folder / "out")},
        "runtime": {"progress": False},
    }
    return featcache.extract_from_config(config)["val"].path


def corrupt_row(
    path: Path, key: str, row: int, nbytes: int = 4, skip: int = 0, fill: int | None = None
) -> None:
    """Invert ``nbytes`` stored bytes of row ``row`` of dataset ``key`` (from ``skip``
    bytes into the row), or set them to ``fill``, directly in the file, past HDF5 and its
    checksums."""
    with h5py.File(path, "r") as f:
        dataset = f[key]
        chunk_rows = dataset.chunks[0]
        row_bytes = int(np.prod(dataset.shape[1:])) * dataset.dtype.itemsize
        info = dataset.id.get_chunk_info_by_coord(
            (row // chunk_rows * chunk_rows,) + (0,) * (dataset.ndim - 1)
        )
        offset = info.byte_offset + (row % chunk_rows) * row_bytes + skip
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(nbytes)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF if fill is None else fill for b in data))


def written_store(path, rows=20, *, checksum=True, seed=0):
    """A store of seeded normal rows in layer ``a`` ([8] float16), 4 rows per chunk."""
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, 8)))
    writer = StoreWriter(path, rows, ids_width=4, chunk_rows=4, checksum=checksum)
    index = np.arange(rows)
    encoded = codec.to_numpy(codec.encode(values, "float16"))
    writer.append(index, [f"{i:04d}" for i in index], index % 3, {"a": encoded})
    writer.close(complete=True)
    return path


def tear_chunk(path: Path, name: str, entry: int) -> None:
    """Overwrite dataset ``name`` of a partial store from ``entry`` to the end of that
    entry's chunk, keeping the chunk's checksum, as a rewrite of the chunk cut off before
    its last bytes leaves it: the chunk no longer passes its Fletcher-32 check."""
    with h5py.File(path, "r") as f:
        dataset = f[name]
        origin = (entry - entry % dataset.chunks[0], *(0 for _ in dataset.shape[1:]))
        info = dataset.id.get_chunk_info_by_coord(origin)
        size = dataset.dtype.itemsize * int(np.prod(dataset.shape[1:], dtype=np.int64))
        start = info.byte_offset + (entry - origin[0]) * size
        stop = info.byte_offset + info.size - 4  # the checksum's four bytes kept
    with open(path, "r+b") as raw:
        raw.seek(start)
        raw.write(b"\xa5" * (stop - start))


def break_chunk_key(path: Path, name: str, row: int) -> None:
    """Change one byte of the B-tree key of the chunk at ``row`` of dataset ``name``: the
    last part of its position (the byte offset within an element, always 0), which HDF5
    ignores when it looks the chunk up to read it but not when it writes it, so that a
    write of that chunk adds a second copy. Its listing is unchanged."""
    with h5py.File(path, "r") as f:
        dataset = f[name]
        dims = dataset.ndim
        info = dataset.id.get_chunk_info_by_coord((row, *(0 for _ in dataset.shape[1:])))
    raw = bytearray(path.read_bytes())
    # A key: the chunk's stored size, its filter mask, its position, then that offset.
    key = struct.pack("<IIQ", info.size, info.filter_mask, row) + bytes(8 * dims)
    found = raw.find(key)
    assert found >= 0 and raw.find(key, found + 1) < 0, "the chunk's key is not unique"
    raw[found + 8 + 8 * dims + 2] ^= 0x10  # the offset within an element
    path.write_bytes(raw)
