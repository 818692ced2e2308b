"""What an incomplete store holds for sure: each dataset's durable entries, and the rule
for the chunk that its last progress mark falls inside.

A run writes a checksummed chunk still filling whole at each progress mark: its entries
so far, unchanged, then zero bytes, then their checksum. A run that dies while it
rewrites that chunk (a power cut mid-write) leaves the durable entries intact and tears
only later entries and the checksum, so the chunk fails its checksum while its durable
rows are good. Such a chunk is *as marked* when its durable entries followed by zero
bytes give the checksum stored after it, which a tear that kept the old checksum does.
Its durable rows are then read as they are; the resume writes the chunk again whole.
"""

from __future__ import annotations

import h5py
import numpy as np

from featcache.store import codec
from featcache.store.fletcher import CHECKSUM_BYTES, checksum_only, fletcher32

# Datasets holding one entry per row, besides the features stored by row.
ROW_DATASETS = frozenset({"/index", "/labels", "/ids"})


def as_marked(data: np.ndarray, expected: int, kept: int) -> bool:
    """Whether the chunk bytes ``data`` (``uint8``, without their checksum), of which the
    first ``kept`` bytes were durable, are as the mark wrote them: those bytes, then zero
    bytes, give the stored checksum ``expected``. False for a chunk durable whole."""
    if kept >= len(data):
        return False
    marked = np.zeros_like(data)
    marked[:kept] = data[:kept]
    return fletcher32(marked) == expected


def chunk_as_marked(data: np.ndarray, expected: int, first: int, durable: int, rows: int) -> bool:
    """:func:`as_marked` for the chunk of ``rows`` entries from entry ``first``, stored as
    ``data`` with the checksum ``expected``, of a dataset whose first ``durable`` entries
    were durable."""
    kept = min(max(durable - first, 0), rows)
    return as_marked(data, expected, kept * (len(data) // rows))


def marked_chunk(dataset: h5py.Dataset, first: int, durable: int) -> np.ndarray | None:
    """The entries of the checksummed chunk of ``dataset`` that starts at entry ``first``,
    read from its stored bytes (``[chunk_rows, *shape]`` of the dataset's dtype), where
    the dataset's first ``durable`` entries were durable; None when the chunk neither
    passes its checksum nor is as marked."""
    _, stored = dataset.id.read_direct_chunk((first, *(0 for _ in dataset.shape[1:])))
    raw = np.frombuffer(stored, dtype=np.uint8)
    data, expected = raw[:-CHECKSUM_BYTES], int.from_bytes(raw[-CHECKSUM_BYTES:], "little")
    chunk_rows = dataset.chunks[0]
    if fletcher32(data) != expected and not chunk_as_marked(
        data, expected, first, durable, chunk_rows
    ):
        return None
    return data.view(dataset.dtype).reshape(chunk_rows, *dataset.shape[1:])


def durable_entries(dataset: h5py.Dataset) -> int | None:
    """How many leading entries of ``dataset`` the last progress mark of its incomplete
    store made durable: the durable rows for a dataset indexed by row, one more for
    ``/offsets`` (its leading 0), the durable rows' tokens for a per-token dataset.

    None in a complete store, for a dataset outside the rows (``/progress``), and when the
    count cannot be read (the offsets of a per-token dataset fail their checks).
    """
    file = dataset.file
    try:
        if dataset.is_virtual or bool(file.attrs["complete"]) or "progress" not in file:
            return None
        rows = int(file["progress"][0])
        name = dataset.name
        if name == "/offsets":
            return rows + 1
        if name == "/token_ids" or codec.attr(dataset, "layout", "") == "tokens":
            return _offset(file["offsets"], rows)
    except (KeyError, OSError, ValueError):
        return None
    if name in ROW_DATASETS or name.startswith("/features/"):
        return rows
    return None


def _offset(offsets: h5py.Dataset, row: int) -> int | None:
    """``offsets[row]`` of an incomplete store whose first ``row`` rows are durable: the
    last durable entry, read from its chunk as marked when the chunk is checksummed."""
    if not checksum_only(offsets):
        return int(offsets[row])
    chunk_rows = offsets.chunks[0]
    first = row - row % chunk_rows
    entries = marked_chunk(offsets, first, row + 1)
    return None if entries is None else int(entries[row - first])
