"""Raw chunk reads: rows read straight from plain or checksummed chunks equal HDF5's reads,
a chunk is checked once while its file is open, and a bad chunk fails before its rows
return."""

from __future__ import annotations

import gc
import os
import weakref

import h5py
import numpy as np
import pytest
import torch

from featcache.dataset import FeatureDataset
from featcache.errors import CorruptStoreError
from featcache.store import FeatureStore, StoreWriter, codec, combine_shards, fletcher, read_rows
from featcache.store import raw_chunks as raw_module
from featcache.store.paths import shard_path
from featcache.store.raw_chunks import SourcedChunks, raw_chunks
from featcache.store.rows import read_runs
from tests.stores import corrupt_row


def _store(path, rows=23, dtype="float16", checksum=True, compression=None, seed=2):
    """Rows of seeded normal values in layer ``a`` ([3, 5]), 4 rows per chunk."""
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, 3, 5)))
    writer = StoreWriter(
        path, rows, ids_width=2, chunk_rows=4, dtype=dtype, checksum=checksum,
        compression=compression,
    )  # fmt: skip
    index = np.arange(rows)
    encoded = codec.to_numpy(codec.encode(values.float(), dtype))
    writer.append(index, [str(i) for i in index], index, {"a": encoded})
    writer.close(complete=True)
    return path, encoded


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rows_read_from_raw_chunks_equal_hdf5s(tmp_path, dtype, checksum):
    path, encoded = _store(tmp_path / "s.h5", dtype=dtype, checksum=checksum)
    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        assert raw_chunks(dataset) is not None
        for rows in ([22, 0, 5, 5, 13], [3, 4], list(range(23)), [21, 22]):
            got = codec.as_array(read_rows(dataset, np.array(rows)))
            np.testing.assert_array_equal(got, encoded[rows])
        for part in (slice(None), slice(2, 19), slice(20, 23), slice(8, 8)):
            np.testing.assert_array_equal(codec.as_array(read_rows(dataset, part)), encoded[part])
        out = np.zeros((9, 3, 5), dtype=dataset.dtype)
        read_runs(dataset, [(1, 3), (14, 21)], out, at=0)
        np.testing.assert_array_equal(out, encoded[np.r_[1:3, 14:21]])


def test_each_chunk_is_checked_once_while_its_file_is_open(tmp_path, monkeypatch):
    path, _ = _store(tmp_path / "s.h5")
    sums = []
    original = raw_module.fletcher32
    monkeypatch.setattr(raw_module, "fletcher32", lambda data: sums.append(1) or original(data))
    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        for row in [1, 2, 3, 1, 0]:  # all in chunk 0
            read_rows(dataset, np.array([row]))
        assert len(sums) == 1
        read_rows(dataset, slice(None))  # the other five chunks
        assert len(sums) == 6
        read_rows(f["features/a"], np.array([1]))  # another object, the same open file
        with FeatureStore(path) as store:  # another handle on the same open file
            store.read("a", [5, 9])
        assert len(sums) == 6
    with h5py.File(path, "r") as f:  # opened anew: checked anew
        read_rows(f["features/a"], np.array([1]))
        assert len(sums) == 7


def test_a_bad_chunk_fails_even_after_its_neighbours_were_read(tmp_path):
    path, encoded = _store(tmp_path / "s.h5")
    with h5py.File(path, "r+") as f:
        info = f["features/a"].id.get_chunk_info_by_coord((8, 0, 0))  # rows 8-11
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset + 7)
        byte = raw.read(1)[0]
        raw.seek(info.byte_offset + 7)
        raw.write(bytes([byte ^ 0x10]))
    with FeatureStore(path) as store:
        np.testing.assert_array_equal(codec.as_array(store.read("a", slice(0, 8))), encoded[:8])
        with pytest.raises(CorruptStoreError, match="layer a rows 8-11 fail their checksum"):
            store.read("a", [9])
        with pytest.raises(CorruptStoreError, match="rows 8-11") as caught:
            store.read("a", slice(4, 12))
        assert "Fletcher-32 of the chunk at byte" in str(caught.value.__cause__)


def test_a_chunk_caught_mid_rewrite_is_read_again_before_it_is_reported(tmp_path, monkeypatch):
    # A store still being written rewrites the chunk of its last rows at each mark; a
    # read that lands in that write sees part old bytes, part new, just once.
    path, encoded = _store(tmp_path / "s.h5")
    original, torn = raw_module._pread_into, []

    def pread_into(fd, targets, offset):
        original(fd, targets, offset)
        if isinstance(targets, list) and not torn:  # the first checked read of a chunk
            torn.append(offset)
            targets[0][:2] ^= 0xFF

    monkeypatch.setattr(raw_module, "_pread_into", pread_into)
    with FeatureStore(path) as store:
        np.testing.assert_array_equal(codec.as_array(store.read("a", [9])), encoded[[9]])
    assert len(torn) == 1
    monkeypatch.setattr(raw_module, "fletcher32", lambda data: 1)  # fails on every read
    with FeatureStore(path) as store, pytest.raises(CorruptStoreError, match="rows 8-11"):
        store.read("a", [9])


@pytest.mark.parametrize("checksum", [True, False])
def test_compressed_stores_are_read_by_hdf5(tmp_path, checksum):
    path, encoded = _store(tmp_path / "s.h5", checksum=checksum, compression="gzip")
    with h5py.File(path, "r") as f:
        assert raw_chunks(f["features/a"]) is None
        np.testing.assert_array_equal(read_rows(f["features/a"], np.array([5, 1])), encoded[[5, 1]])


def test_a_dataset_whose_file_was_closed_is_not_read_from_a_stale_descriptor(tmp_path):
    path, encoded = _store(tmp_path / "s.h5")
    f = h5py.File(path, "r")
    dataset = f["features/a"]
    np.testing.assert_array_equal(codec.as_array(read_rows(dataset, np.array([2]))), encoded[[2]])
    f.close()
    with open(tmp_path / "other", "wb") as other:  # may take the closed descriptor's number
        other.write(bytes(4096))
        with pytest.raises((ValueError, OSError, RuntimeError)):
            read_rows(dataset, np.array([2]))


def test_values_not_stored_as_native_numbers_are_read_by_hdf5(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        swapped = f.create_dataset("swapped", data=np.arange(40, dtype=">f4"), chunks=(8,))
        text = f.create_dataset("text", data=[str(i) for i in range(40)], chunks=(8,))
        plain = f.create_dataset("plain", data=np.arange(40, dtype="<i8"), chunks=(8,))
        assert raw_chunks(swapped) is None and raw_chunks(text) is None
        assert raw_chunks(plain) is not None
        for dataset in (swapped, text, plain):
            out = np.empty(7, dtype=dataset.dtype)
            read_runs(dataset, [(3, 5), (12, 17)], out)
            np.testing.assert_array_equal(out, dataset[np.r_[3:5, 12:17]])


def _stored_chunks(path):
    """(byte offset, stored size) of each chunk of layer ``a``, in row order."""
    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        return [
            (info.byte_offset, info.size)
            for info in (
                dataset.id.get_chunk_info_by_coord((start, 0, 0))
                for start in range(0, len(dataset), dataset.chunks[0])
            )
        ]


def _record_advice(monkeypatch, error=None):
    asked = []

    def advise(fd, offset, length, advice):
        asked.append((offset, length, advice))
        if error is not None:
            raise error

    monkeypatch.setattr(raw_module.os, "posix_fadvise", advise)
    return asked


@pytest.mark.parametrize("checksum", [True, False])
def test_advice_names_each_chunk_of_the_rows_as_stored(tmp_path, monkeypatch, checksum):
    path, encoded = _store(tmp_path / "s.h5", checksum=checksum)
    chunks = _stored_chunks(path)
    asked = _record_advice(monkeypatch)
    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        raw = raw_chunks(dataset)
        raw.advise(dataset, 5, 14)  # rows of chunks 1 to 3, none read yet
        read_rows(dataset, slice(4, 8))  # chunk 1 read (and checked): its address known
        raw.advise(dataset, 4, 6)
        np.testing.assert_array_equal(
            codec.as_array(read_rows(dataset, slice(5, 14))), encoded[5:14]
        )
    willneed = raw_module.os.POSIX_FADV_WILLNEED
    assert asked == [(*chunks[c], willneed) for c in (1, 2, 3, 1)]
    assert all(size == 4 * 15 * 2 + 4 * checksum for _, size in chunks)


def test_refused_advice_changes_no_read(tmp_path, monkeypatch):
    path, encoded = _store(tmp_path / "s.h5")
    asked = _record_advice(monkeypatch, error=OSError(22, "Invalid argument"))
    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        raw_chunks(dataset).advise(dataset, 0, 23)
        np.testing.assert_array_equal(codec.as_array(read_rows(dataset, slice(None))), encoded)
    assert len(asked) == 1  # the first refusal ends the advice


@pytest.mark.parametrize("read_ahead", [True, False])
def test_an_epoch_of_batches_advises_every_chunk_before_reading_it(
    tmp_path, monkeypatch, read_ahead
):
    path, encoded = _store(tmp_path / "s.h5")
    chunks = _stored_chunks(path)
    asked = _record_advice(monkeypatch)
    read = []
    original = raw_module.RawChunks.read

    def record_read(self, dataset, start, stop, out):
        if dataset.name == "/features/a":  # not the labels read when the dataset opens
            read.append(len(asked))  # how much advice had been given before this read
        original(self, dataset, start, stop, out)

    monkeypatch.setattr(raw_module.RawChunks, "read", record_read)
    dataset = FeatureDataset(path, "a", dtype=None)
    batches = list(dataset.batches(5, buffer_rows=8, with_index=True, read_ahead=read_ahead))
    dataset.close()
    rows = torch.cat([index for *_, index in batches])
    assert sorted(rows.tolist()) == list(range(23))
    features = torch.cat([features for features, *_ in batches])
    np.testing.assert_array_equal(codec.as_array(features), encoded[rows.numpy()])
    assert sorted(offset for offset, *_ in asked) == sorted(offset for offset, _ in chunks)
    # the first buffer's blocks are all advised before the first of them is read
    assert read[0] >= 2


def test_advice_looks_chunks_up_one_by_one_where_hdf5_cannot_list_them(tmp_path, monkeypatch):
    path, encoded = _store(tmp_path / "s.h5")
    chunks = _stored_chunks(path)
    asked = _record_advice(monkeypatch)
    monkeypatch.setattr(fletcher, "_list_chunks", lambda dataset, note: False)
    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        raw_chunks(dataset).advise(dataset, 3, 23)
        np.testing.assert_array_equal(codec.as_array(read_rows(dataset, slice(None))), encoded)
    assert [offset for offset, *_ in asked] == [offset for offset, _ in chunks]


def _combined(tmp_path):
    """A store combined from two shards of 23 and 10 rows, and its rows as written."""
    shards, encoded = [], []
    for rank, rows in enumerate((23, 10)):
        path, values = _store(shard_path(tmp_path / "t.h5", rank, 2), rows, seed=rank)
        shards.append(path)
        encoded.append(values)
    return combine_shards(tmp_path / "t.h5", shards).path, np.concatenate(encoded)


def test_a_combined_store_is_read_straight_from_its_shards(tmp_path, monkeypatch):
    path, encoded = _combined(tmp_path)
    sums = []
    original = raw_module.fletcher32
    monkeypatch.setattr(raw_module, "fletcher32", lambda data: sums.append(1) or original(data))

    def no_hdf5_read(*args, **kwargs):
        raise AssertionError("a plain chunk of a shard was read through HDF5")

    with h5py.File(path, "r") as f:
        dataset = f["features/a"]
        assert dataset.is_virtual and isinstance(raw_chunks(dataset), SourcedChunks)
        monkeypatch.setattr(h5py.Dataset, "read_direct", no_hdf5_read)
        for rows in ([32, 0, 23, 22, 5], list(range(33)), [24, 25]):
            got = codec.as_array(read_rows(dataset, np.array(rows)))
            np.testing.assert_array_equal(got, encoded[rows])
        out = np.zeros((12, 3, 5), dtype=dataset.dtype)
        read_runs(dataset, [(20, 27), (28, 33)], out)  # runs across the two shards
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
    corrupt_row(shard_path(tmp_path / "t.h5", 1, 2), "features/a", 5)  # store rows 27
    with pytest.raises(CorruptStoreError, match=r"layer a rows 27-30 fail their checksum"):
        FeatureStore(path).read("a", [28])
    dataset = FeatureDataset(path, "a", dtype=None)
    assert dataset[26][0].shape == (3, 5)  # the other chunks still read
    with pytest.raises(CorruptStoreError, match=r"layer a rows 27-30 fail their checksum"):
        list(dataset.batches(8, seed=0))


def test_a_closed_combined_store_lets_go_of_its_shards(tmp_path):
    path, _ = _combined(tmp_path)
    with h5py.File(path, "r") as f:
        reads = raw_chunks(f["features/a"])
        assert isinstance(reads, SourcedChunks)
        shard_fds = [part.chunks.fd for part in reads.parts]
        shard = shard_path(tmp_path / "t.h5", 1, 2)
        assert os.fstat(shard_fds[1]).st_ino == os.stat(shard).st_ino
        forgotten = weakref.ref(reads)
        del reads
    other, _ = _store(tmp_path / "other.h5")
    with h5py.File(other, "r") as f:
        raw_chunks(f["features/a"])  # a new entry: those of closed files are dropped
    gc.collect()
    assert forgotten() is None  # and its own descriptors on the shards closed with it
