"""Row reads: rows read through the memory map equal HDF5's reads, a chunk is checked once
while its file is open, a bad chunk fails before its rows return, and a store combined
from shards is read from the shards."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from featcache.errors import CorruptStoreError
from featcache.read import dataset as dataset_module
from featcache.read.dataset import FeatureDataset
from featcache.store import FeatureStore, StorePlan, StoreWriter, codec, combine_shards, read_rows
from featcache.store import rows as rows_module
from featcache.store.layout import chunk_addresses
from featcache.store.paths import shard_path
from featcache.store.rows import Known, PartRows, read_runs, rows_of
from tests.stores import corrupt_row


def _store(path, rows=23, dtype="float16", checksum=True, compression=None, seed=2):
    """Rows of seeded normal values in layer ``a`` ([3, 5]), 4 rows per chunk."""
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, 3, 5)))
    plan = StorePlan(
        path, rows, ids_width=2, chunk_rows=4, dtype=dtype, checksum=checksum,
        compression=compression,
    )  # fmt: skip
    writer = StoreWriter(plan)
    index = np.arange(rows)
    encoded = codec.as_array(codec.encode(values.float(), dtype))
    writer.append(index, [str(i) for i in index], index, {"a": encoded})
    writer.close(complete=True)
    return path, encoded


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rows_read_through_the_memory_map_equal_hdf5s(tmp_path, dtype, checksum):
    path, encoded = _store(tmp_path / "s.h5", dtype=dtype, checksum=checksum)
    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        assert rows_of(dataset).direct
        for rows in ([22, 0, 5, 5, 13], [3, 4], list(range(23)), [21, 22]):
            got = codec.as_array(read_rows(rows_of(dataset), np.array(rows)))
            np.testing.assert_array_equal(got, encoded[rows])
            np.testing.assert_array_equal(
                got, dataset[sorted(set(rows))][np.unique(rows, return_inverse=True)[1]]
            )
        for part in (slice(None), slice(2, 19), slice(20, 23), slice(8, 8), slice(1, 20, 3)):
            np.testing.assert_array_equal(
                codec.as_array(read_rows(rows_of(dataset), part)), encoded[part]
            )
        out = np.zeros((9, 3, 5), dtype=dataset.dtype)
        read_runs(rows_of(dataset), [(1, 3), (14, 21)], out)
        np.testing.assert_array_equal(out, encoded[np.r_[1:3, 14:21]])
        for name in ("index", "ids", "labels"):  # every dataset of rows reads the same way
            assert rows_of(f[name]).direct
            np.testing.assert_array_equal(
                read_rows(rows_of(f[name]), slice(None)).numpy(), f[name][()]
            ) if name != "ids" else None


def test_rows_whose_mapped_pages_were_let_go_read_the_same_again(tmp_path):
    path, encoded = _store(tmp_path / "s.h5", rows=23)
    with h5py.File(path, "r") as f:
        rows = rows_of(f["features/a"])
        out = np.zeros((23, 3, 5), dtype=encoded.dtype)
        for _ in range(2):
            rows.read(0, 23, out)
            np.testing.assert_array_equal(out, encoded)
            rows.release(5, 23)  # from mid-chunk to the end: whole pages go
            rows.release(0, 0)


def test_each_chunk_is_checked_once_while_its_file_is_open(tmp_path, monkeypatch):
    path, _ = _store(tmp_path / "s.h5")
    sums = []
    original = rows_module.checksum
    monkeypatch.setattr(rows_module, "checksum", lambda data: sums.append(1) or original(data))
    with FeatureStore(path) as store:
        store.read("a", [0, 1])
        store.read("a", [2, 5])  # chunk 0 again, chunk 1 for the first time
        store.read("a", slice(None))  # the other four
        assert len(sums) == 6
    with FeatureStore(path) as store:  # a file opened again is checked again
        store.read("a", [9])
        assert len(sums) == 7


def test_a_bad_chunk_fails_even_after_its_neighbours_were_read(tmp_path):
    path, encoded = _store(tmp_path / "s.h5")
    corrupt_row(path, "features/a", 9)
    with FeatureStore(path) as store:
        np.testing.assert_array_equal(codec.as_array(store.read("a", [3, 14])), encoded[[3, 14]])
        for rows in ([9], [8, 12], slice(0, 23)):
            with pytest.raises(CorruptStoreError, match="layer a rows 8-11 fail their checksum"):
                store.read("a", rows)


@pytest.mark.parametrize("checksum", [True, False])
def test_compressed_stores_are_read_by_hdf5_and_checked_on_their_stored_bytes(tmp_path, checksum):
    path, encoded = _store(tmp_path / "s.h5", checksum=checksum, compression="gzip")
    with h5py.File(path, "r") as f:
        assert f["features/a"].compression == "gzip" and not rows_of(f["features/a"]).direct
        np.testing.assert_array_equal(
            read_rows(rows_of(f["features/a"]), np.array([5, 1])), encoded[[5, 1]]
        )
        chunk = f["features/a"].id.get_chunk_info_by_coord((8, 0, 0))
    with open(path, "r+b") as raw:  # a changed byte of a compressed chunk
        raw.seek(chunk.byte_offset + chunk.size // 2)
        byte = raw.read(1)
        raw.seek(chunk.byte_offset + chunk.size // 2)
        raw.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptStoreError, match="layer a rows 8-11 (fail their checksum|cannot)"):
        FeatureStore(path).read("a", [9])


def test_a_dataset_whose_file_was_closed_is_not_read(tmp_path):
    path, encoded = _store(tmp_path / "s.h5")
    f = h5py.File(path, "r")
    dataset = f["features/a"]
    np.testing.assert_array_equal(
        codec.as_array(read_rows(rows_of(dataset), np.array([2]))), encoded[[2]]
    )
    f.close()
    with pytest.raises((ValueError, OSError, RuntimeError)):
        read_rows(rows_of(dataset), np.array([2]))


def test_values_not_stored_as_native_numbers_are_read_by_hdf5(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        swapped = f.create_dataset("swapped", data=np.arange(40, dtype=">f4"), chunks=(8,))
        text = f.create_dataset("text", data=[str(i) for i in range(40)], chunks=(8,))
        plain = f.create_dataset("plain", data=np.arange(40, dtype="<i8"), chunks=(8,))
        assert not rows_of(swapped).direct and not rows_of(text).direct
        assert rows_of(plain).direct == (chunk_addresses(plain) is not None)
        for dataset in (swapped, text, plain):
            out = np.empty(7, dtype=dataset.dtype)
            read_runs(rows_of(dataset), [(3, 5), (12, 17)], out)
            np.testing.assert_array_equal(out, dataset[np.r_[3:5, 14 - 2 : 17]])


def test_chunks_that_do_not_lie_back_to_back_read_the_same(tmp_path):
    # A dataset whose chunks HDF5 placed apart (here: written by another program, one
    # chunk at a time between the chunks of another dataset) reads the same.
    with h5py.File(tmp_path / "apart.h5", "w", rdcc_nbytes=0) as f:  # each chunk placed as written
        a = f.create_dataset("a", shape=(4000, 3), dtype="<f4", chunks=(200, 3))
        values = np.arange(12000, dtype="<f4").reshape(4000, 3)
        for start in range(0, 4000, 200):
            a[start : start + 200] = values[start : start + 200]
            f[f"between/{start}"] = np.zeros(700)  # raw data allocated after the chunk
        addresses = chunk_addresses(a)
        assert addresses is not None and (np.diff(addresses) != 2400).any()
        assert rows_of(a).direct
        rows = np.array([0, 3, 199, 200, 1700, 1899, 3999])
        np.testing.assert_array_equal(read_rows(rows_of(a), rows).numpy(), values[rows])
        np.testing.assert_array_equal(read_rows(rows_of(a), slice(2, 3700)).numpy(), values[2:3700])


def test_an_epoch_of_batches_advises_every_block_before_reading_it(tmp_path, monkeypatch):
    path, encoded = _store(tmp_path / "s.h5")
    events = []
    advise, read = rows_module.Rows.advise, rows_module.Rows.read

    def record_advise(self, start, stop):
        events.append(("advise", start, stop))
        advise(self, start, stop)

    def record_read(self, start, stop, out):
        if self.name == "features/a":
            events.append(("read", start, stop))
        read(self, start, stop, out)

    monkeypatch.setattr(rows_module.Rows, "advise", record_advise)
    monkeypatch.setattr(rows_module.Rows, "read", record_read)
    monkeypatch.setattr(dataset_module, "BLOCK_BYTES", 1)  # a block: one chunk of 4 rows
    dataset = FeatureDataset(path, "a", dtype=None)
    batches = list(dataset.batches(5, buffer_rows=8, with_index=True, read_ahead=False))
    dataset.close()
    rows = torch.cat([index for *_, index in batches])
    assert sorted(rows.tolist()) == list(range(23))
    features = torch.cat([features for features, *_ in batches])
    np.testing.assert_array_equal(codec.as_array(features), encoded[rows.numpy()])
    advised = {(a, b) for kind, a, b in events if kind == "advise"}
    reads = [(a, b) for kind, a, b in events if kind == "read"]
    assert advised == set(reads) and len(reads) == 6  # blocks of 4 rows, the last of 3
    first_read = next(i for i, event in enumerate(events) if event[0] == "read")
    assert [e[0] for e in events[:first_read]] == ["advise", "advise"]  # a buffer: 2 blocks


def _combined(tmp_path):
    """A store combined from two shards of 23 and 10 rows, and its rows as written."""
    shards, encoded = [], []
    for rank, rows in enumerate((23, 10)):
        path, values = _store(shard_path(tmp_path / "t.h5", rank), rows, seed=rank)
        shards.append(path)
        encoded.append(values)
    return combine_shards(tmp_path / "t.h5", shards).path, np.concatenate(encoded)


def test_a_combined_store_is_read_from_its_shards_through_the_same_path(tmp_path, monkeypatch):
    path, encoded = _combined(tmp_path)
    sums = []
    original = rows_module.checksum
    monkeypatch.setattr(rows_module, "checksum", lambda data: sums.append(1) or original(data))

    def no_hdf5_read(*args, **kwargs):
        raise AssertionError("rows were read through HDF5")

    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        known: Known = {}  # what the reads learn, kept as a store handle keeps it
        reader = rows_of(dataset, known)
        assert dataset.is_virtual and isinstance(reader, PartRows) and reader.direct
        monkeypatch.setattr(h5py.Dataset, "read_direct", no_hdf5_read)
        monkeypatch.setattr(h5py.Dataset, "__getitem__", no_hdf5_read)
        for rows in ([32, 0, 23, 22, 5], list(range(33)), [24, 25]):
            got = codec.as_array(read_rows(rows_of(dataset, known), np.array(rows)))
            np.testing.assert_array_equal(got, encoded[rows])
        out = np.zeros((12, 3, 5), dtype=dataset.dtype)
        read_runs(reader, [(20, 27), (28, 33)], out)  # across the two shards
        np.testing.assert_array_equal(out, encoded[np.r_[20:27, 28:33]])
        assert len(sums) == 6 + 3  # each chunk of each shard checked once
    monkeypatch.undo()
    dataset = FeatureDataset(path, "a", dtype=None)
    rows = [32, 3, 24, 23, 22]
    got = torch.stack([value for value, _ in dataset.__getitems__(rows)])
    np.testing.assert_array_equal(codec.as_array(got), encoded[rows])
    batches = list(dataset.batches(5, seed=0, with_index=True))
    features = codec.as_array(torch.cat([b[0] for b in batches]))
    order = torch.cat([b[2] for b in batches]).numpy()
    assert sorted(order.tolist()) == list(range(33))
    np.testing.assert_array_equal(features, encoded[order])


def test_a_bad_chunk_of_a_shard_is_named_by_the_combined_rows(tmp_path):
    path, _ = _combined(tmp_path)
    corrupt_row(shard_path(tmp_path / "t.h5", 1), "features/a", 5)  # store rows 27
    with pytest.raises(CorruptStoreError, match=r"layer a rows 27-30 fail their checksum"):
        FeatureStore(path).read("a", [28])
    dataset = FeatureDataset(path, "a", dtype=None)
    assert dataset[26][0].shape == (3, 5)  # the other chunks still read
    with pytest.raises(CorruptStoreError, match=r"layer a rows 27-30 fail their checksum"):
        list(dataset.batches(8, seed=0))


def test_a_store_reopened_after_its_file_was_replaced_reads_the_new_file(tmp_path):
    # What a handle remembers (row count, layouts, chunk checks) goes with it.
    path, _ = _store(tmp_path / "s.h5")
    store = FeatureStore(path)
    assert len(store) == 23 and store.read("a", [3]).dtype == torch.float16
    store.close()
    other, encoded = _store(tmp_path / "other.h5", rows=9, dtype="bfloat16", seed=5)
    os.replace(other, path)
    assert len(store) == 9 and store.read("a", [8]).dtype == torch.bfloat16
    np.testing.assert_array_equal(codec.as_array(store.read("a", [8, 0])), encoded[[8, 0]])
    store.close()


def test_a_closed_combined_store_lets_go_of_its_shards(tmp_path):
    path, encoded = _combined(tmp_path)
    shard = shard_path(tmp_path / "t.h5", 1)
    store = FeatureStore(path)
    np.testing.assert_array_equal(codec.as_array(store.read("a", [30])), encoded[[30]])
    with pytest.raises(OSError, match="locking flag"):  # held by the store's reads of it
        h5py.File(shard, "r", locking=False)
    store.close()
    h5py.File(shard, "r", locking=False).close()  # closed with the store: opened anew as asked
    np.testing.assert_array_equal(codec.as_array(store.read("a", [30])), encoded[[30]])
    store.close()


def _opened(path: Path) -> bool:
    """Whether this process holds a file descriptor of ``path``."""
    fds = Path("/proc/self/fd")
    return any(os.path.realpath(fd) == os.path.realpath(path) for fd in fds.iterdir())


def test_a_store_the_garbage_collector_closes_inside_a_read_does_not_hang_it(tmp_path, monkeypatch):
    # A dropped store in a reference cycle is closed by the garbage collector, which can run
    # in the middle of another store's read, here while that read sizes up its dataset.
    dropped, _ = _store(tmp_path / "dropped.h5")
    read, encoded = _store(tmp_path / "read.h5", seed=3)
    store = FeatureStore(dropped)
    store.read("a", [0])
    store.cycle = store  # only the collector frees it
    del store
    assert _opened(dropped)
    real_chunks = rows_module.Chunks

    def collecting(dataset):
        gc.collect()
        return real_chunks(dataset)

    monkeypatch.setattr(rows_module, "Chunks", collecting)
    results: list[np.ndarray] = []

    def reading():
        with FeatureStore(read) as other:
            results.append(codec.as_array(other.read("a", [5, 1])))

    gc.disable()  # the collection is the one inside the read
    try:
        thread = threading.Thread(target=reading, daemon=True)
        thread.start()
        thread.join(timeout=30)
    finally:
        gc.enable()
    assert not thread.is_alive(), "the read waited on itself"
    assert results, "the read failed"
    np.testing.assert_array_equal(results[0], encoded[[5, 1]])
    assert not _opened(dropped)  # the collector closed it
