"""Store metadata: checksummed headers, the attribute digest, chunk indexes. Damage to any
of them fails the store's opening or the rows it touches with one line, never a wrong
value."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from featcache.commands.app import app
from featcache.commands.verify import verify_store
from featcache.errors import CorruptStoreError
from featcache.read.dataset import FeatureDataset
from featcache.store import (
    FeatureStore,
    StorePlan,
    StoreWriter,
    codec,
    combine_shards,
    copy_store,
    scan_chunks,
    seal,
)
from featcache.store.metadata import DIGEST_ATTR, is_sealed, metadata_problem
from featcache.store.paths import partial_path, shard_path
from tests.stores import break_chunk_key, synthetic_store, written_store

FIX = "re-extract it (featcache extract <config> --overwrite) or restore it from a copy"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("metadata"))


@pytest.fixture
def store(clean, tmp_path):
    """A fresh copy of the clean store, to damage."""
    return shutil.copy(clean, tmp_path / "s.h5")


def _damaged(path, problem: str) -> str:
    return f"store {path} is damaged: {problem}; {FIX}"


def test_stores_copies_and_combined_shards_are_sealed(clean, tmp_path):
    assert clean.read_bytes()[8] == 2  # superblock version 2: version-2 object headers
    copied = tmp_path / "copied.h5"
    copy_store(clean, copied, compression="gzip")
    shards = [written_store(shard_path(tmp_path / "t.h5", rank)) for rank in range(2)]
    combined = combine_shards(tmp_path / "t.h5", shards).path
    for path in (clean, copied, combined, *shards):
        with h5py.File(path, "r") as f:
            assert is_sealed(f) and metadata_problem(f) == ""
        assert FeatureStore(path).complete
    assert verify_store(clean, quick=True).passed


def test_a_flipped_attribute_byte_fails_every_open(store):
    raw = store.read_bytes()
    assert raw.count(b"class_1") == 1  # the class names, in a checksummed attribute heap
    store.write_bytes(raw.replace(b"class_1", b"class_7"))  # bytes on disk, past HDF5
    start = f"store {store} is damaged: its metadata cannot be read ("
    reason = "(incorrect metadata checksum after all read attempts)); "
    for opening in (lambda: FeatureStore(store), lambda: FeatureDataset(store, "layer4")):
        with pytest.raises(CorruptStoreError) as caught:
            opening()
        message = str(caught.value)
        assert message.startswith(start) and message.endswith(reason + FIX), message
    result = verify_store(store, quick=True)
    assert [(c.name, c.ok, c.detail) for c in result.checks] == [("metadata", False, message)]


def test_a_partial_store_whose_attributes_cannot_be_read_fails_in_one_line(tmp_path):
    """Many long attributes live in a checksummed heap of their own: a changed byte there
    fails only when they are all read, as describe does, so an open must read them all."""
    path = tmp_path / "p.h5"
    notes = {f"note{i}": "z" * 200 + str(i) for i in range(12)}
    writer = StoreWriter(StorePlan(path, 8, ids_width=1, chunk_rows=4, attrs=notes))
    writer.append(np.arange(4), list("abcd"), np.zeros(4), {"a": np.ones((4, 2), np.float16)})
    writer.close()  # interrupted: four durable rows in p.h5.partial
    partial = partial_path(path)
    raw = bytearray(partial.read_bytes())
    raw[raw.index(b"z" * 200 + b"7") + 5] ^= 0xFF
    partial.write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError, match=f"^store {partial} is damaged: its metadata"):
        FeatureStore(path, allow_incomplete=True)
    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "is damaged: its metadata cannot be read" in result.output


def test_a_layer_attribute_edited_with_h5py_reads_as_damaged_until_sealed(store):
    with h5py.File(store, "r+") as f:
        f["features/layer4"].attrs["reduce"] = "max"
    with pytest.raises(CorruptStoreError, match="attributes differ from the digest"):
        FeatureStore(store)
    with h5py.File(store, "r+") as f:
        seal(f)
    assert FeatureStore(store).layer_attrs("layer4")["reduce"] == "max"


def test_a_damaged_chunk_index_fails_the_rows_instead_of_serving_another_chunks(store, clean):
    """Two entries of layer4's chunk index swapped: HDF5 alone serves rows 4-7 as rows
    0-3; featcache finds each chunk where the index says, and the checksum kept for that
    place in the dataset fails it."""
    with h5py.File(store, "r") as f:
        info = [f["features/layer4"].id.get_chunk_info(i) for i in range(2)]
    first, second = (int(i.byte_offset).to_bytes(8, "little") for i in info)
    raw = store.read_bytes()
    assert raw.count(first) == raw.count(second) == 1  # each address once, in the index
    damaged = bytearray(raw)
    at_first, at_second = raw.index(first), raw.index(second)
    damaged[at_first : at_first + 8], damaged[at_second : at_second + 8] = second, first
    store.write_bytes(bytes(damaged))
    with h5py.File(store, "r") as f:  # HDF5 alone serves rows 4-7 as rows 0-3
        assert np.array_equal(f["features/layer4"][:4], FeatureStore(clean).read("layer4")[4:8])
    with FeatureStore(store) as opened:
        for rows, named in (([1], "0-3"), ([6], "4-7")):
            with pytest.raises(CorruptStoreError, match=f"layer layer4 rows {named} fail their"):
                opened.read("layer4", rows)
        assert torch.equal(opened.read("layer4", [9]), FeatureStore(clean).read("layer4", [9]))
    bad = [(b.key, b.start, b.stop) for b in scan_chunks(store)]
    assert bad == [("features/layer4", 0, 4), ("features/layer4", 4, 8)]


def test_a_damaged_object_header_fails_with_one_line(store, tmp_path):
    raw = store.read_bytes()
    headers = [i for i in range(len(raw)) if raw.startswith(b"OHDR", i)]
    assert len(headers) >= 8  # root, features, 5 datasets, progress: each checksummed
    for at in headers:
        damaged = bytearray(raw)
        damaged[at + 10] ^= 0xFF
        path = tmp_path / f"h{at}.h5"
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptStoreError) as caught:
            FeatureStore(path)
        assert str(caught.value).startswith(
            f"store {path} is damaged: its metadata cannot be read ("
        ) and str(caught.value).endswith(FIX)


def test_a_store_without_digests_still_opens(store):
    """Stores written before featcache sealed them carry no digests."""
    with h5py.File(store, "r+") as f:
        del f.attrs[DIGEST_ATTR]
    assert len(FeatureStore(store)) == 30
    result = verify_store(store, quick=True)
    assert result.passed
    assert next(c.detail for c in result.checks if c.name == "metadata").startswith(
        "every attribute reads (no digest recorded"
    )


def _skipping_store(path):
    """A store of 6 rows whose source had 8 samples; 2 and 5 were skipped."""
    writer = StoreWriter(StorePlan(path, 8, ids_width=4, chunk_rows=4))
    index = np.array([0, 1, 3, 4, 6, 7])
    values = torch.from_numpy(np.random.default_rng(0).standard_normal((6, 8)))
    skipped = [
        {"index": 2, "id": "s2", "reason": "unreadable: ünï"},
        {"index": 5, "id": "s5", "reason": "x"},
    ]
    writer.append(
        index,
        [f"{i:04d}" for i in index],
        index % 3,
        {"a": codec.as_array(codec.encode(values, "float16"))},
        {"a": {"module": "layer4", "layout": "rows"}},
        skipped=skipped,
    )
    writer.close(complete=True)
    return path, skipped


def test_no_text_is_kept_in_hdf5s_unchecked_global_heap(clean, tmp_path):
    """Text attributes and skip records are fixed-length strings, inside checksummed
    headers and chunks: HDF5's global heap, which has no checksum and whose damage can
    hang a reader, is never written."""
    skipping, skipped = _skipping_store(tmp_path / "skipping.h5")
    copied = tmp_path / "copied.h5"
    copy_store(skipping, copied, compression="gzip")
    shards = [written_store(shard_path(tmp_path / "t.h5", rank)) for rank in range(2)]
    combined = combine_shards(tmp_path / "t.h5", shards).path
    for path in (clean, skipping, copied, combined, *shards):
        if path != combined:  # HDF5 keeps a virtual dataset's sources there, checksummed
            assert b"GCOL" not in path.read_bytes()  # the signature of a heap collection
        with h5py.File(path, "r") as f:
            names: list[str] = []
            f.visit(names.append)
            for obj in [f, *(f[name] for name in names)]:
                types = [obj.attrs.get_id(key).dtype for key in obj.attrs]
                if isinstance(obj, h5py.Dataset):
                    types.append(obj.dtype)
                text = [h5py.check_string_dtype(t) for t in types]
                assert all(t is None or t.length is not None for t in text), (path, obj.name)
    for path in (skipping, copied):
        assert FeatureStore(path).skipped == skipped
        assert FeatureStore(path).layer_attrs("a") == {
            "module": "layer4",
            "layout": "rows",
            "dtype": "float16",
        }
        assert FeatureStore(path).attrs["skipped"] == 2


def test_a_damaged_source_map_of_a_combined_store_fails_its_opening(tmp_path):
    shards = [written_store(shard_path(tmp_path / "t.h5", r), seed=r) for r in range(2)]
    combined = combine_shards(tmp_path / "t.h5", shards).path
    raw = bytearray(combined.read_bytes())
    heap = raw.find(b"GCOL")  # the virtual datasets' sources: shard file and dataset names
    at = raw.find(b"shard-000000000001", heap)
    raw[at + len("shard-00000000000")] = ord("0")  # rows 20-39 would come from shard 0 again
    combined.write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError) as caught:
        FeatureStore(combined).read("a")
    assert str(caught.value).startswith(f"store {combined} is damaged: its metadata cannot be")
    assert "checksum" in str(caught.value) and str(caught.value).endswith(FIX)


def _key_extent_byte(raw: bytes, dataset: h5py.Dataset, chunk: int) -> int:
    """Where the file holds the last offset (the one for the element's bytes, always 0) of
    the key of chunk ``chunk`` in the version-1 B-tree that indexes ``dataset``."""
    addresses: list[int] = []
    dataset.id.chunk_iter(lambda info: addresses.append(info.byte_offset))
    rank = len(dataset.shape)
    key_bytes = 8 + 8 * (rank + 1)  # chunk size, filter mask, one offset per axis + 1
    node = raw.find(b"TREE")
    while node >= 0:
        entries = int.from_bytes(raw[node + 6 : node + 8], "little")
        first = node + 24  # signature, type, level, entries, two sibling addresses
        children = [
            int.from_bytes(raw[at : at + 8], "little")
            for at in range(first + key_bytes, first + entries * (key_bytes + 8), key_bytes + 8)
        ]
        if raw[node + 4] == 1 and raw[node + 5] == 0 and children == addresses:
            return first + chunk * (key_bytes + 8) + 8 + 8 * rank
        node = raw.find(b"TREE", node + 1)
    raise AssertionError(f"no B-tree leaf of {dataset.name} found")


def test_rows_ids_and_labels_read_right_past_a_damaged_chunk_key(store):
    """A changed byte in the part of a chunk's B-tree key that HDF5's chunk listing does
    not report can make HDF5's own reads return that chunk as never written (zeros), with
    no error; featcache finds chunks through the listing and reads the stored rows."""
    with FeatureStore(store) as clean:  # closed: HDF5 would reuse its open file
        want = {"labels": clean.labels, "index": clean.index, "ids": clean.ids}
    raw = bytearray(store.read_bytes())
    with h5py.File(store, "r") as f:
        for name in want:  # byte 3 of the key's last offset, chunk 5 (rows 20-23)
            raw[_key_extent_byte(bytes(raw), f[name], chunk=5) + 3] ^= 0xFF
    store.write_bytes(bytes(raw))
    with h5py.File(store, "r") as f:  # HDF5 is misled
        assert not f["labels"][20:24].any() and not f["index"][20:24].any()
        assert list(f["ids"][20:24]) == [b""] * 4
    damaged = FeatureStore(store)
    assert np.array_equal(damaged.labels, want["labels"])
    assert np.array_equal(damaged.index, want["index"]) and damaged.ids == want["ids"]
    # verify --quick says so, as plain HDF5 readers of the store are misled.
    checks = {c.name: c for c in verify_store(store, quick=True).checks}
    assert checks["checksums"].detail == (
        "corrupted chunks: ids rows 20-23; index rows 20-23; labels rows 20-23"
    )


def test_skip_records_read_right_past_a_damaged_chunk_key(tmp_path):
    path = tmp_path / "s.h5"
    writer = StoreWriter(StorePlan(path, 4004, ids_width=4))
    skipped = [{"index": 4 + i, "id": f"s{i}", "reason": f"unreadable {i}"} for i in range(4000)]
    values = codec.as_array(codec.encode(torch.ones(4, 8), "float16"))
    ids = ["0", "1", "2", "3"]
    writer.append(np.arange(4), ids, np.zeros(4), {"a": values}, {"a": {}}, skipped=skipped)
    writer.close(complete=True)
    raw = bytearray(path.read_bytes())
    with h5py.File(path, "r") as f:  # several chunks each: the last one's key is damaged
        for name in ("index", "ids", "reasons"):
            dataset = f[f"skipped/{name}"]
            last = dataset.id.get_num_chunks() - 1
            raw[_key_extent_byte(bytes(raw), dataset, chunk=last) + 3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with h5py.File(path, "r") as f:  # HDF5 is misled
        assert f["skipped/index"].chunks == (256,) and not f["skipped/index"][3840:].any()
        assert not any(f["skipped/reasons"][3840:])  # its last chunk: 160 records
    assert FeatureStore(path).skipped == skipped


def test_skip_records_in_variable_length_text_read_as_before(tmp_path):
    """Stores written before skip records were fixed-length text hold them as h5py's
    variable-length strings."""
    path, skipped = _skipping_store(tmp_path / "old.h5")
    with h5py.File(path, "r+") as f:
        for name in ("ids", "reasons"):
            texts = f[f"skipped/{name}"].asstr()[:]
            del f[f"skipped/{name}"]
            f["skipped"].create_dataset(name, data=texts, dtype=h5py.string_dtype(), chunks=True)
        seal(f)
    with h5py.File(path, "r") as f:
        assert h5py.check_string_dtype(f["skipped/reasons"].dtype).length is None
    assert FeatureStore(path).skipped == skipped


def test_stores_with_variable_length_text_read_verify_and_copy_as_before(tmp_path):
    """Stores written before text attributes were fixed-length hold h5py's default
    variable-length strings: they read the same, and a copy stores fixed-length text."""
    path, skipped = _skipping_store(tmp_path / "old.h5")
    with h5py.File(path, "r+") as f:
        codec.write_attrs(f, {"class_names": ["cat", "dög"], "split": "train"})
        names: list[str] = []
        f.visit(names.append)
        for obj in [f, *(f[name] for name in names)]:
            for key in list(obj.attrs):
                if isinstance(obj.attrs[key], bytes):
                    obj.attrs[key] = obj.attrs[key].decode()  # as h5py writes a str
        seal(f)
        assert h5py.check_string_dtype(f.attrs.get_id("class_names").dtype).length is None
    store = FeatureStore(path)
    assert store.class_names == ["cat", "dög"] and store.attrs["split"] == "train"
    assert store.skipped == skipped and store.layer_attrs("a")["layout"] == "rows"
    assert store.dtype("a") == torch.float16
    checks = {c.name: c.ok for c in verify_store(path, quick=True).checks}
    assert checks["metadata"]  # (verify stops at the key: a bare StoreWriter records none)
    copied = tmp_path / "copied.h5"
    copy_store(path, copied)
    with h5py.File(copied, "r") as f:
        assert h5py.check_string_dtype(f.attrs.get_id("class_names").dtype).length is not None
    attrs = FeatureStore(copied).attrs
    assert attrs.pop(DIGEST_ATTR) != store.attrs[DIGEST_ATTR]  # the copy's own seal
    assert attrs == {k: v for k, v in store.attrs.items() if k != DIGEST_ATTR}


def test_a_compressed_stores_chunk_indexes_fail_loudly_when_damaged(tmp_path):
    """A compressed store is a copy written whole, in HDF5's 1.10 format: its chunk indexes
    are fixed arrays whose blocks carry checksums, not B-trees, which a changed byte can
    send to no chunk (read as zeros) without an error. Every byte of every index data
    block, changed in turn, fails the store's opening or its reads with one line."""
    path = synthetic_store(tmp_path, compression="gzip")
    with FeatureStore(path) as clean:
        want = {layer: clean.read(layer) for layer in clean.layers}
        want_rows = (clean.labels, clean.index, clean.ids)
    raw = path.read_bytes()
    assert b"TREE" not in raw  # no version-1 B-tree anywhere
    blocks = [at for at in range(len(raw)) if raw.startswith(b"FADB", at)]
    assert len(blocks) == 5  # layer2, layer4, labels, index, ids
    damaged = tmp_path / "damaged.h5"
    for at in blocks:
        for offset in range(at, at + 40, 3):
            changed = bytearray(raw)
            changed[offset] ^= 0xFF
            damaged.write_bytes(bytes(changed))
            damage = f"^store {damaged} is (damaged|corrupted)|^reading"
            with pytest.raises(CorruptStoreError, match=damage):
                with FeatureStore(damaged) as store:
                    got = {layer: store.read(layer) for layer in store.layers}
                    rows = (store.labels, store.index, store.ids)
                    # Reaching here, every value must be the stored one (and then the
                    # test fails, for no error was raised).
                    assert all(torch.equal(got[k], v) for k, v in want.items())
                    assert all(np.array_equal(a, b) for a, b in zip(rows, want_rows, strict=True))


def test_a_damaged_chunk_key_of_a_shard_fails_verify_of_the_combined_store(tmp_path):
    """HDF5's reads of a shard are misled into zeros by a damaged key of its chunk index;
    featcache's own reads find each shard's chunks through the listing of its chunk
    index, as a single file's, and the scan of verify --quick, which looks each chunk up
    as HDF5 does, names the combined store's rows."""
    shards = [written_store(shard_path(tmp_path / "t.h5", r), seed=r) for r in range(2)]
    store = combine_shards(tmp_path / "t.h5", shards)
    combined, before = store.path, store.read("a")
    store.close()
    assert scan_chunks(combined) == []
    break_chunk_key(shards[1], "features/a", 8)  # chunk 2 of shard 1: rows 28-31 of the store
    with h5py.File(shards[1], "r") as f:
        assert not f["features/a"][8:12].any()  # HDF5 is misled
    assert before[28:32].any() and torch.equal(FeatureStore(combined).read("a"), before)
    (bad,) = scan_chunks(combined)  # what verify --quick reports
    assert (bad.key, bad.start, bad.stop) == ("features/a", 28, 32)
    assert bad.message.startswith("cannot be read by HDF5 (")
