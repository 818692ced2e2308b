"""Small stores the tests share, ways to damage a stored row on disk, and a writer crash."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

import featcache
from featcache.store import StorePlan, StoreWriter, codec
from featcache.store.layout import stored_checksums
from featcache.store.paths import open_readonly


def durable_rows(partial: Path) -> int:
    """The durable rows of the partial store file ``partial``, read while another process
    may be writing it (0 while it is absent or not yet readable)."""
    try:
        with h5py.File(partial, "r", locking=False) as f:
            return int(f["progress"][0])
    except (OSError, KeyError):
        return 0


def synthetic_config(out: Path, rows: int = 30, **store: Any) -> dict[str, Any]:
    """A config of ``rows`` synthetic 32 px images through a random resnet18, capturing
    layer2 ([128, 4, 4], after a ReLU: many zeros) and pooled layer4, batches of 8, into
    ``out / "val.h5"``; ``store`` gives the store section."""
    return {
        "model": {"name": "resnet18"},
        "preprocess": {"mean": [0.485, 0.456, 0.406]},  # 32px as it is
        "layers": [{"name": "layer2"}, {"name": "layer4", "reduce": "avg"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 4},
            "splits": {"val": {"size": rows}},
        },
        "loader": {"batch_size": 8, "num_workers": 0},
        "store": store,
        "output": {"dir": str(out)},
        "runtime": {"progress": False},
    }


def synthetic_store(folder: Path, dtype: str = "float16", **store: Any) -> Path:
    """30 rows of :func:`synthetic_config`, 4 rows per chunk, extracted into
    ``folder / "out" / "val.h5"``; ``store`` adds store options (``checksum=False`` ...)."""
    config = synthetic_config(folder / "out", dtype=dtype, chunk_rows=4, **store)
    return featcache.extract_from_config(config)["val"].path


def corrupt_row(
    path: Path, key: str, row: int, nbytes: int = 4, skip: int = 0, fill: int | None = None
) -> None:
    """Invert ``nbytes`` stored bytes of row ``row`` of dataset ``key`` (from ``skip``
    bytes into the row), or set them to ``fill``, directly in the file, past HDF5 and its
    checksums."""
    with open_readonly(path) as f:
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
    writer = StoreWriter(StorePlan(path, rows, ids_width=4, chunk_rows=4, checksum=checksum))
    index = np.arange(rows)
    encoded = codec.as_array(codec.encode(values, "float16"))
    writer.append(index, [f"{i:04d}" for i in index], index % 3, {"a": encoded})
    writer.close(complete=True)
    return path


def crash(writer: StoreWriter) -> None:
    """Stop ``writer`` as a kill would once the mark of its last append is recorded (marks
    sync on their own thread): nothing more is written, not even a mark."""
    writer.mark(wait=True)
    assert writer.fd is not None
    os.close(writer.fd)
    writer.fd = None


def break_chunk_key(path: Path, name: str, row: int, byte: int = 3, mask: int = 0xFF) -> None:
    """Change one byte of the B-tree key of the chunk at ``row`` of dataset ``name`` (byte
    ``byte`` of the last part of its position, the byte offset within an element, always
    0, xor ``mask``): HDF5's lookup of the chunk by position misses it, and HDF5 reads it
    as never written (zeros). Its listing is unchanged."""
    with open_readonly(path) as f:
        dataset = f[name]
        dims = dataset.ndim
        info = dataset.id.get_chunk_info_by_coord((row, *(0 for _ in dataset.shape[1:])))
    raw = bytearray(path.read_bytes())
    # A key: the chunk's stored size, its filter mask, its position, then that offset.
    key = struct.pack("<IIQ", info.size, info.filter_mask, row) + bytes(8 * dims)
    found = raw.find(key)
    assert found >= 0 and raw.find(key, found + 1) < 0, "the chunk's key is not unique"
    raw[found + 8 + 8 * dims + byte] ^= mask  # the offset within an element
    path.write_bytes(raw)


def overwrite_chunk(path: Path, name: str, entry: int, fill: int = 0xA5) -> None:
    """Overwrite the chunk of dataset ``name`` holding ``entry`` with ``fill`` bytes from
    ``entry`` on, as a write of the chunk cut off (or never done) leaves it."""
    with open_readonly(path) as f:
        dataset = f[name]
        origin = (entry - entry % dataset.chunks[0], *(0 for _ in dataset.shape[1:]))
        info = dataset.id.get_chunk_info_by_coord(origin)
        size = dataset.dtype.itemsize * int(np.prod(dataset.shape[1:], dtype=np.int64))
        start = info.byte_offset + (entry - origin[0]) * size
    with open(path, "r+b") as raw:
        raw.seek(start)
        raw.write(bytes([fill]) * (info.byte_offset + info.size - start))


def refresh_checksums(path: Path) -> None:
    """Record the checksums of every chunk as the chunks are now, as if the store had been
    written so (after an edit made with h5py, which does not know of them)."""
    with h5py.File(path, "r+", locking=False) as f:
        sums = f["checksums"]
        names: list[str] = []
        sums.visititems(
            lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None
        )
        for name in names:
            fresh = stored_checksums(f[name])
            sums[name][: len(fresh)] = fresh
