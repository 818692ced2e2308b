"""Store metadata: checksummed headers, the attribute digest and the chunk index digests.
Damage to any of them fails the store's opening with one line, never a wrong value."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

from featcache.dataset import FeatureDataset
from featcache.errors import CorruptStoreError
from featcache.store import FeatureStore, combine_shards, copy_store, seal
from featcache.store.metadata import (
    CHUNKS_ATTR,
    DIGEST_ATTR,
    chunked_datasets,
    is_sealed,
    metadata_problem,
)
from featcache.store.paths import shard_path
from featcache.verify import verify_store
from tests.stores import synthetic_store, written_store

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
    shards = [written_store(shard_path(tmp_path / "t.h5", rank, 2)) for rank in range(2)]
    combined = combine_shards(tmp_path / "t.h5", shards).path
    for path in (clean, copied, combined, *shards):
        with h5py.File(path, "r") as f:
            assert is_sealed(f) and metadata_problem(f) == ""
            chunked = chunked_datasets(f)  # labels, index, ids and each layer; none when virtual
            assert len(chunked) >= (0 if path == combined else 3 + len(FeatureStore(path).layers))
            assert all(CHUNKS_ATTR in dataset.attrs for dataset in chunked)
        assert FeatureStore(path).complete
    assert verify_store(clean, quick=True).passed


def test_a_flipped_attribute_byte_fails_every_open(store):
    raw = store.read_bytes()
    assert raw.count(b"class_1") == 1  # the class names, in HDF5's global heap
    store.write_bytes(raw.replace(b"class_1", b"class_7"))  # bytes on disk, past HDF5
    message = _damaged(store, "its attributes differ from the digest recorded when it was written")
    for opening in (lambda: FeatureStore(store), lambda: FeatureDataset(store, "layer4")):
        with pytest.raises(CorruptStoreError) as caught:
            opening()
        assert str(caught.value) == message
    result = verify_store(store, quick=True)
    assert [(c.name, c.ok, c.detail) for c in result.checks] == [("metadata", False, message)]


def test_a_layer_attribute_edited_with_h5py_reads_as_damaged_until_sealed(store):
    with h5py.File(store, "r+") as f:
        f["features/layer4"].attrs["reduce"] = "max"
    with pytest.raises(CorruptStoreError, match="attributes differ from the digest"):
        FeatureStore(store)
    with h5py.File(store, "r+") as f:
        seal(f)
    assert FeatureStore(store).layer_attrs("layer4")["reduce"] == "max"


def test_a_damaged_chunk_index_fails_instead_of_serving_another_chunks_rows(store, clean):
    """Two entries of layer4's chunk index swapped: each chunk still matches its
    checksum, so only the index digest tells rows 0-3 from rows 4-7."""
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
    problem = "the chunk index of features/layer4 differs from the one recorded when it was written"
    with pytest.raises(CorruptStoreError) as caught:
        FeatureStore(store)
    assert str(caught.value) == _damaged(store, problem)


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
        f.visititems(
            lambda _, obj: obj.attrs.__delitem__(CHUNKS_ATTR) if CHUNKS_ATTR in obj.attrs else None
        )
    assert len(FeatureStore(store)) == 30
    result = verify_store(store, quick=True)
    assert result.passed
    assert next(c.detail for c in result.checks if c.name == "metadata").startswith(
        "every attribute reads (no digest recorded"
    )
