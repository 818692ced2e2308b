"""A store reads only its own bytes: links, external storage and foreign virtual
datasets planted in a store are refused before a value is read."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from featcache import FeatureDataset
from featcache.commands.app import app
from featcache.commands.verify import verify_store
from featcache.errors import CorruptStoreError
from featcache.store import FeatureStore, combine_shards, seal
from featcache.store.paths import shard_path
from tests.stores import written_store

SECRET = b"SECRET-API-KEY=hunter2 " * 100


@pytest.fixture
def planted(tmp_path):
    """A store, a secret file and another HDF5 file beside it, and a function that swaps
    the store's layer ``a`` for what it is given (attributes kept, the store resealed,
    as anyone editing a store with h5py can)."""
    store = written_store(tmp_path / "s.h5")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["private"] = np.frombuffer(SECRET[: 20 * 8 * 2], dtype="<f2").reshape(20, 8)

    def plant(make) -> None:
        with h5py.File(store, "a") as f:
            old = f["features/a"]
            attrs, shape, dtype = dict(old.attrs), old.shape, old.dtype
            del f["features/a"]
            make(f, shape, dtype)
            if isinstance(f.get("features/a", getlink=True), h5py.HardLink):
                f["features/a"].attrs.update(attrs)
            seal(f)

    return store, secret, other, plant


def _external(secret):
    def make(f, shape, dtype):
        size = int(np.prod(shape)) * dtype.itemsize
        f.create_dataset("features/a", shape=shape, dtype=dtype, external=[(str(secret), 0, size)])

    return make


def _virtual(other):
    def make(f, shape, dtype):
        layout = h5py.VirtualLayout(shape=(20, 8), dtype="<f2")
        layout[:] = h5py.VirtualSource(str(other), "private", shape=(20, 8))
        f.create_virtual_dataset("features/a", layout)

    return make


def _link(other):
    def make(f, shape, dtype):
        f["features/a"] = h5py.ExternalLink(str(other), "private")

    return make


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("external", "features/a keeps its values in another file (HDF5 external storage)"),
        ("virtual", "features/a is a virtual dataset over {other}, which is not one of the"),
        ("link", "features/a is a link to {other}, not a dataset or group of the store"),
    ],
)
def test_a_store_that_takes_values_from_another_file_is_refused(planted, kind, problem):
    store, secret, other, plant = planted
    plant({"external": _external(secret), "virtual": _virtual(other), "link": _link(other)}[kind])
    expected = f"store {store} is damaged: {problem.format(other=other)}"
    for read in (
        lambda: FeatureStore(store).read("a", [0]),
        lambda: FeatureDataset(store, "a")[0],
    ):
        with pytest.raises(CorruptStoreError) as caught:
            read()
        assert str(caught.value).startswith(expected)
    assert not verify_store(store, quick=True).passed
    merged = CliRunner().invoke(app, ["merge", str(store), "-o", str(store.parent / "m.h5")])
    assert merged.exit_code != 0 and not (store.parent / "m.h5").exists()


def test_shards_must_lie_beside_the_store_and_hold_their_own_values(tmp_path):
    shards = [written_store(shard_path(tmp_path / "t.h5", r), seed=r) for r in range(2)]
    combined = combine_shards(tmp_path / "t.h5", shards).path
    with FeatureStore(combined) as store:  # a torchrun store opens (and closes its shards)
        assert store.read("a").shape[0] == 40
    renamed = tmp_path / "u.h5"
    shutil.copy(combined, renamed)
    with h5py.File(renamed, "a") as f:
        f.attrs["shards"] = ["/etc/passwd", shards[1].name]
        seal(f)
    with pytest.raises(CorruptStoreError, match="its shard list .* names files that are not"):
        FeatureStore(renamed)
    aside = shards[1].with_suffix(".aside")
    shards[1].rename(aside)  # its rows would read as zeros
    with pytest.raises(CorruptStoreError, match=f"its shard {shards[1].name} is missing"):
        FeatureStore(combined)
    aside.write_bytes(b"not HDF5")  # a shard that is no HDF5 file at all
    aside.rename(shards[1])
    with pytest.raises(CorruptStoreError, match=f"its shard {shards[1].name} is damaged: it can"):
        FeatureStore(combined)
    shards[1] = written_store(shards[1], seed=1)
    (tmp_path / "secret.txt").write_bytes(SECRET)
    with h5py.File(shards[1], "a") as f:  # a shard planted with external storage
        shape, dtype = f["features/a"].shape, f["features/a"].dtype
        del f["features/a"]
        _external(tmp_path / "secret.txt")(f, shape, dtype)
    with pytest.raises(CorruptStoreError, match=f"its shard {shards[1].name} is not self-cont"):
        FeatureStore(combined)
