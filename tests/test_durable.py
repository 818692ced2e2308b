"""featcache.store.durable: the durable entries of an incomplete store, and a chunk torn
after its last mark."""

from __future__ import annotations

import h5py
import numpy as np
import torch

from featcache.store import StoreWriter, codec, partial_path
from featcache.store.durable import as_marked, durable_entries, marked_chunk
from featcache.store.fletcher import fletcher32
from tests.stores import tear_chunk, written_store


def stopped_store(path, rows=7, *, tokens=False):
    """A store of 12 rows (4 per chunk) whose run stopped after ``rows`` durable rows;
    with ``tokens``, layer ``t`` holds row ``i``'s ``i % 3 + 1`` tokens of [2] values."""
    lengths = np.arange(12) % 3 + 1
    writer = StoreWriter(
        path, 12, ids_width=4, chunk_rows=4, token_capacity=int(lengths.sum()) if tokens else None
    )
    index = np.arange(rows)
    values = np.random.default_rng(0).standard_normal((int(lengths[:rows].sum()), 2))
    layer = values if tokens else np.random.default_rng(1).standard_normal((rows, 3))
    writer.append(
        index,
        [f"{i:04d}" for i in index],
        index % 2,
        {"t": codec.to_numpy(codec.encode(torch.from_numpy(layer), "float16"))},
        **({"lengths": lengths[:rows], "ragged": frozenset({"t"})} if tokens else {}),
    )
    writer.mark()
    writer.close()
    return partial_path(path)


def test_durable_entries_of_each_dataset_of_an_incomplete_store(tmp_path):
    partial = stopped_store(tmp_path / "rows.h5")
    with h5py.File(partial, "r") as f:
        for name in ("index", "labels", "ids", "features/t"):
            assert durable_entries(f[name]) == 7
        assert durable_entries(f["progress"]) is None
    partial = stopped_store(tmp_path / "tokens.h5", tokens=True)
    with h5py.File(partial, "r") as f:
        assert durable_entries(f["offsets"]) == 8  # its leading 0, then one per row
        tokens = int(f["offsets"][7])
        assert tokens == sum(i % 3 + 1 for i in range(7))
        assert durable_entries(f["features/t"]) == tokens
        assert durable_entries(f["index"]) == 7


def test_a_complete_store_has_no_durable_mark(tmp_path):
    with h5py.File(written_store(tmp_path / "s.h5"), "r") as f:
        assert durable_entries(f["features/a"]) is None and durable_entries(f["index"]) is None


def test_a_chunk_torn_after_its_durable_entries_is_as_marked(tmp_path):
    partial = stopped_store(tmp_path / "rows.h5")
    with h5py.File(partial, "r") as f:
        before = marked_chunk(f["features/t"], 4, 7)  # rows 4-6 durable, row 7 zero
    tear_chunk(partial, "features/t", 7)
    with h5py.File(partial, "r") as f:
        torn = marked_chunk(f["features/t"], 4, 7)
        assert torn is not None and np.array_equal(torn[:3], before[:3])
        assert not np.array_equal(torn[3], before[3])
        assert marked_chunk(f["features/t"], 4, 8) is None  # row 7 was never durable
    raw = bytearray(partial.read_bytes())
    with h5py.File(partial, "r") as f:
        address = f["features/t"].id.get_chunk_info_by_coord((4, 0)).byte_offset
    raw[address] ^= 0x01  # row 4, durable: no tear
    partial.write_bytes(bytes(raw))
    with h5py.File(partial, "r") as f:
        assert marked_chunk(f["features/t"], 4, 7) is None


def test_as_marked_compares_the_durable_bytes_then_zeros():
    data = np.frombuffer(bytes(range(1, 33)), dtype=np.uint8)
    kept = np.concatenate([data[:10], np.zeros(22, dtype=np.uint8)])
    assert as_marked(data, fletcher32(kept), 10)
    assert not as_marked(data, fletcher32(kept), 11)
    assert not as_marked(data, fletcher32(data), 32)  # a chunk durable whole must pass as is
