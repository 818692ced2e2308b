"""Chunk checksums: on by default, kept by copies, and a corrupted chunk fails every read
path with one line naming the store, the layer and the chunk's rows."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featcache
from featcache.errors import CorruptStoreError, FeatcacheError
from featcache.read.dataset import FeatureDataset
from featcache.store import (
    BadChunk,
    FeatureStore,
    StorePlan,
    StoreWriter,
    combine_shards,
    copy_store,
    has_checksums,
    merge_store,
    plan_resume,
    scan_chunks,
)
from featcache.store.metadata import seal
from featcache.store.paths import shard_path
from tests.stores import break_chunk_key, corrupt_row, synthetic_store, written_store

CHUNKED = ("features/layer2", "features/layer4", "labels", "index", "ids")
FIX = "re-extract it (featcache extract <config> --overwrite) or restore it from a copy"


def _message(path, what: str, rows: str) -> str:
    return f"store {path} is corrupted: {what} rows {rows} fail their checksum; {FIX}"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A clean store and a copy with a few bytes of row 17 of layer2 changed (rows 16-19)."""
    folder = tmp_path_factory.mktemp("integrity")
    clean = synthetic_store(folder / "clean")
    bad = folder / "bad.h5"
    bad.write_bytes(clean.read_bytes())
    corrupt_row(bad, "features/layer2", 17)
    return clean, bad


def test_stores_have_checksums_by_default_and_none_with_checksum_false(stores, tmp_path):
    clean, _ = stores
    with h5py.File(clean) as f:
        assert f["checksums"].attrs["algorithm"] == b"xxh3_64"
        for key in CHUNKED:  # one checksum per chunk, beside the data; no HDF5 filter
            assert len(f[f"checksums/{key}"]) == -(-len(f[key]) // f[key].chunks[0])
            assert f[key].id.get_create_plist().get_nfilters() == 0
    assert has_checksums(clean) and has_checksums(FeatureStore(clean))
    plain = synthetic_store(tmp_path, checksum=False)
    with h5py.File(plain) as f:
        assert "checksums" not in f
    assert not has_checksums(plain)
    # checksums leave the stored values and the config fingerprint as they are
    a, b = FeatureStore(clean), FeatureStore(plain)
    assert a.attrs["config_fingerprint"] == b.attrs["config_fingerprint"]
    assert a.attrs["config"]["store"]["checksum"] and not b.attrs["config"]["store"]["checksum"]
    for layer in a.layers:
        assert torch.equal(a.read(layer), b.read(layer))


def test_extract_takes_the_checksum_option(resnet18, images, tmp_path):
    store = featcache.extract(
        resnet18, images, ["layer1"], tmp_path / "s.h5", checksum=False, progress=False
    )
    assert not has_checksums(store.path) and scan_chunks(store) == []
    store = featcache.extract(resnet18, images, ["layer1"], tmp_path / "t.h5", progress=False)
    assert has_checksums(store.path)


def test_store_reads_fail_naming_the_layer_and_rows_of_the_bad_chunk(stores):
    clean, bad = stores
    message = _message(bad, "layer layer2", "16-19")
    store = FeatureStore(bad)
    for rows in (slice(None), slice(10, 18), [3, 17, 25], [17], np.array([19, 16])):
        with pytest.raises(CorruptStoreError) as caught:
            store.read("layer2", rows)
        assert str(caught.value) == message
        assert isinstance(caught.value, FeatcacheError) and caught.value.exit_code == 1
    good = FeatureStore(clean)
    for rows in (slice(0, 16), slice(20, None), slice(0, 30, 5), [0, 15, 20, 29]):
        assert torch.equal(store.read("layer2", rows), good.read("layer2", rows))
    assert torch.equal(store.read("layer4"), good.read("layer4"))
    assert store.ids == good.ids and np.array_equal(store.labels, good.labels)


def test_dataset_reads_fail_naming_the_layer_and_rows_of_the_bad_chunk(stores):
    clean, bad = stores
    message = _message(bad, "layer layer2", "16-19")
    dataset = FeatureDataset(bad, "layer2")
    for i in (16, 17, 19):
        with pytest.raises(CorruptStoreError) as caught:
            dataset[i]
        assert str(caught.value) == message
    good = FeatureDataset(clean, "layer2")
    for i in (0, 15, 20, 29):
        assert torch.equal(dataset[i][0], good[i][0])
    with pytest.raises(CorruptStoreError) as caught:
        list(dataset.batches(8, shuffle=True, seed=1))
    assert str(caught.value) == message
    with pytest.raises(CorruptStoreError) as caught:
        list(dataset.batches(8, shuffle=True, buffer_rows=4))  # one chunk per buffer
    assert str(caught.value) == message
    with pytest.raises(CorruptStoreError) as caught:
        list(DataLoader(dataset.shuffled(8), batch_size=None))
    assert str(caught.value) == message
    with pytest.raises(CorruptStoreError) as caught:
        list(DataLoader(dataset, batch_size=8, shuffle=True))  # __getitems__
    assert str(caught.value) == message
    both = FeatureDataset(bad, ["layer4", "layer2"])
    with pytest.raises(CorruptStoreError) as caught:
        both[18]
    assert str(caught.value) == message
    with pytest.raises(CorruptStoreError) as caught:
        FeatureDataset(bad, "layer2", in_memory=True)
    assert str(caught.value) == message
    assert len(list(FeatureDataset(bad, "layer4").batches(8))) == 4  # other layers read


def test_scan_chunks_finds_exactly_the_bad_chunks(stores, tmp_path):
    clean, bad = stores
    assert scan_chunks(clean) == [] and scan_chunks(FeatureStore(clean)) == []
    (found,) = scan_chunks(bad)
    assert isinstance(found, BadChunk)
    assert (found.key, found.start, found.stop) == ("features/layer2", 16, 20)
    assert found.message == "fails its checksum"
    assert scan_chunks(FeatureStore(bad)) == [found]
    labels = tmp_path / "labels.h5"
    labels.write_bytes(bad.read_bytes())
    corrupt_row(labels, "labels", 9)
    corrupt_row(labels, "labels", 29)
    chunks = {(b.key, b.start, b.stop) for b in scan_chunks(labels)}
    assert chunks == {("features/layer2", 16, 20), ("labels", 8, 12), ("labels", 28, 30)}
    with pytest.raises(CorruptStoreError) as caught:
        _ = FeatureStore(labels).labels
    assert str(caught.value) == _message(labels, "dataset labels", "8-11")
    with pytest.raises(CorruptStoreError, match="dataset labels rows 8-11 fail"):
        FeatureDataset(labels, "layer4")


def test_a_damaged_checksum_fails_its_chunk(stores, tmp_path):
    # The checksums are data like any other: a changed byte there fails the chunk it is
    # for, and nothing else.
    clean, _ = stores
    path = tmp_path / "sums.h5"
    path.write_bytes(clean.read_bytes())
    with h5py.File(path, "r") as f:
        at = f["checksums/features/layer4"].id.get_offset() + 8 * 2  # chunk 2: rows 8-11
    with open(path, "r+b") as raw:
        raw.seek(at)
        raw.write(b"\x00")
    assert [(b.key, b.start, b.stop) for b in scan_chunks(path)] == [("features/layer4", 8, 12)]
    with pytest.raises(CorruptStoreError, match=r"layer layer4 rows 8-11 fail their checksum"):
        FeatureStore(path).read("layer4", [9])
    assert torch.equal(FeatureStore(path).read("layer2"), FeatureStore(clean).read("layer2"))


def test_an_hdf5_read_that_fails_where_every_chunk_reads_says_so_in_one_line(tmp_path, monkeypatch):
    path = written_store(tmp_path / "s.h5")
    gzip = tmp_path / "gzip.h5"
    copy_store(path, gzip, "gzip")  # HDF5 reads a compressed store's rows

    def failing(*args, **kwargs) -> None:
        raise OSError("Can't synchronously read data (addr overflow, addr = 1, size = 2)")

    monkeypatch.setattr(h5py.Dataset, "read_direct", failing)
    with pytest.raises(FeatcacheError) as caught:
        FeatureStore(gzip).read("a", slice(10, 18))
    message = str(caught.value)
    assert not isinstance(caught.value, CorruptStoreError) and "\n" not in message
    assert message == (
        f"reading layer a rows 10-17 of store {gzip} failed (Can't synchronously read data "
        f"(addr overflow, addr = 1, size = 2)); check it with featcache verify --quick {gzip}"
    )


def test_a_copys_progress_bar_ends_at_every_byte_it_counted(tmp_path, capsys):
    path = written_store(tmp_path / "s.h5")
    copy_store(path, tmp_path / "copy.h5", progress=True)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    done, total = last.split("|")[2].split()[0].split("/")
    assert last.startswith("copy.h5: 100%") and done == total, last


def test_copies_and_merges_keep_checksums(tmp_path):
    path = written_store(tmp_path / "s.h5")
    copy_store(path, tmp_path / "copy.h5")
    copy_store(path, tmp_path / "gzip.h5", "gzip")
    for copy in ("copy.h5", "gzip.h5"):
        with h5py.File(tmp_path / copy) as f:
            assert all(f"checksums/{key}" in f for key in ("features/a", "labels", "index", "ids"))
            assert f.attrs["featcache_format"] == 3
    assert has_checksums(tmp_path / "gzip.h5") and scan_chunks(tmp_path / "gzip.h5") == []
    plain = written_store(tmp_path / "p.h5", checksum=False)
    copy_store(plain, tmp_path / "plain.h5")  # a copy is written in the current format
    assert not has_checksums(plain) and has_checksums(tmp_path / "plain.h5")

    shards = [written_store(shard_path(tmp_path / "t.h5", r), 10, seed=r) for r in (0, 1)]
    combined = combine_shards(tmp_path / "t.h5", shards)
    assert has_checksums(combined)  # through the virtual datasets' sources
    merged = merge_store(combined.path, tmp_path / "merged.h5", progress=False)
    with h5py.File(merged.path) as f:
        assert not f["features/a"].is_virtual and "checksums/features/a" in f
    assert torch.equal(merged.read("a"), combined.read("a"))

    corrupt_row(tmp_path / "copy.h5", "features/a", 6)
    with pytest.raises(CorruptStoreError, match="layer a rows 4-7 fail their checksum"):
        merge_store(tmp_path / "copy.h5", tmp_path / "again.h5", progress=False)
    assert sorted(p.name for p in tmp_path.glob("again*")) == []  # no half-made copy left

    corrupt_row(shards[1], "features/a", 5)  # the shard's rows 4-7: rows 14-17 of the store
    combined.close()  # a chunk is checked once while its file is open: read it anew
    with pytest.raises(CorruptStoreError) as caught:
        FeatureStore(combined.path).read("a", [15])
    assert str(caught.value) == _message(combined.path, "layer a", "14-17")
    assert [(b.key, b.start, b.stop) for b in scan_chunks(combined.path)] == [
        ("features/a", 14, 18)
    ]


def test_a_resumed_store_keeps_the_checksums_it_was_created_with(tmp_path):
    path = tmp_path / "r.h5"
    key = {"config_fingerprint": "abc"}
    first = StoreWriter(StorePlan(path, 8, ids_width=1, chunk_rows=4, attrs={"resume_key": key}))
    first.append(np.arange(4), list("abcd"), np.zeros(4), {"a": np.ones((4, 2), np.float16)})
    first.close()
    point = plan_resume(path, key, batch_size=4)
    assert point is not None and point.row == 4
    resumed = StoreWriter(StorePlan(path, 8, ids_width=1, chunk_rows=4, checksum=False), point)
    resumed.append(np.arange(4, 8), list("efgh"), np.ones(4), {"a": np.zeros((4, 2), np.float16)})
    resumed.close(complete=True)
    assert has_checksums(path) and scan_chunks(path) == []
    assert FeatureStore(path).read("a").sum() == 8


def test_a_chunk_the_index_lists_twice_is_refused_by_readers_and_verify(tmp_path):
    """A store whose chunk index lists a chunk twice (what a write through a damaged index
    key leaves, sealed as it was): featcache reads it as HDF5 finds it, and the copy HDF5
    finds fails its checksum, in readers and in verify --quick's scan."""
    path = written_store(tmp_path / "s.h5", rows=20)  # layer a, chunks of 4 rows
    with h5py.File(path, "r") as f:
        size = f["features/a"].id.get_chunk_info_by_coord((8, 0)).size
    break_chunk_key(path, "features/a", 8)
    with h5py.File(path, "r+") as f:
        f["features/a"].id.write_direct_chunk((8, 0), bytes(size))  # a zero copy, listed too
        seal(f)
    listed = []
    with h5py.File(path, "r") as f:
        f["features/a"].id.chunk_iter(lambda info: listed.append(info.chunk_offset[0]))
    assert sorted(listed) == [0, 4, 8, 8, 12, 16]
    message = f"store {path} is corrupted: layer a rows 8-11 fail their checksum; {FIX}"
    store = FeatureStore(path)
    for rows in (slice(None), [9], slice(4, 12)):
        with pytest.raises(CorruptStoreError) as caught:
            store.read("a", rows)
        assert str(caught.value) == message
    assert torch.equal(store.read("a", slice(0, 8)), FeatureStore(path).read("a", [*range(8)]))
    with pytest.raises(CorruptStoreError, match="rows 8-11 fail their checksum"):
        list(FeatureDataset(path, "a").batches(5, shuffle=False))
    assert [(b.key, b.start, b.stop) for b in scan_chunks(path)] == [("features/a", 8, 12)]
