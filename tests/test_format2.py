"""Stores of format 2, written by the featcache of that format (tests/fixtures/format2,
made by scripts/make_format2_fixtures.py): every reader, info, verify and merge take them,
and give the rows featcache read from them then."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from featcache import FeatureDataset, FeatureStore, TokenDataset
from featcache.commands.app import app
from featcache.commands.verify import verify_store
from featcache.errors import CorruptStoreError
from featcache.store import merge_store, scan_chunks
from tests.stores import corrupt_row

FIXTURES = Path(__file__).parent / "fixtures" / "format2"
STORES = sorted(p.name.removesuffix(".npz") for p in FIXTURES.glob("*.npz"))


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> Path:
    """Every fixture file, unpacked into one folder (a torchrun store beside its shards)."""
    folder = tmp_path_factory.mktemp("format2")
    for packed in FIXTURES.glob("*.h5.gz"):
        with gzip.open(packed) as source, open(folder / packed.name[: -len(".gz")], "wb") as out:
            shutil.copyfileobj(source, out)
    return folder


def _expected(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


def _as_stored(values: torch.Tensor) -> np.ndarray:
    return (values.view(torch.int16) if values.dtype == torch.bfloat16 else values).numpy()


def _assert_reads(store: FeatureStore, expected: dict[str, np.ndarray]) -> None:
    for layer in store.layers:
        got = store.read_tokens(layer)[0] if store.is_per_token(layer) else store.read(layer)
        np.testing.assert_array_equal(_as_stored(got), expected[f"features/{layer}"], layer)
    for name in ("labels", "index", "offsets", "token_ids"):
        if name in expected:
            np.testing.assert_array_equal(getattr(store, name), expected[name], name)
    assert store.ids == expected["ids"].tolist()
    assert store.skipped == json.loads(str(expected["skipped"]))


def test_every_fixture_is_a_format_2_store():
    assert set(STORES) == {
        "combined", "compressed", "dense_bfloat16", "dense_float16", "dense_float32",
        "nochecksum", "skipped", "tokens",
    }  # fmt: skip


@pytest.mark.parametrize("name", STORES)
def test_format_2_stores_read_as_they_were_written(unpacked, name):
    path = unpacked / f"{name}.h5"
    expected = _expected(name)
    with h5py.File(path, "r") as f:
        assert f.attrs["featcache_format"] == 2 and "checksums" not in f
    with FeatureStore(path) as store:
        _assert_reads(store, expected)
        rows = np.array([len(store) - 1, 0, 3, 3])
        for layer in store.layers:
            if not store.is_per_token(layer):
                got = _as_stored(store.read(layer, rows))
                np.testing.assert_array_equal(got, expected[f"features/{layer}"][rows])
        dense = [layer for layer in store.layers if not store.is_per_token(layer)]
        per_token = [layer for layer in store.layers if store.is_per_token(layer)]
    if dense:
        dataset = FeatureDataset(path, dense, dtype=None)
        for features, labels, rows_read in dataset.batches(4, seed=1, with_index=True):
            index = rows_read.numpy()
            for layer in dense:
                got = _as_stored(features[layer])
                np.testing.assert_array_equal(got, expected[f"features/{layer}"][index])
            if "labels" in expected:
                assert labels.tolist() == expected["labels"][index].tolist()
        dataset.close()
    for layer in per_token:
        tokens = TokenDataset(path, layer, dtype=None)
        values, rows, positions = next(tokens.batches(64, shuffle=False))
        np.testing.assert_array_equal(_as_stored(values), expected[f"features/{layer}"])
        assert rows.tolist() == np.repeat(np.arange(len(expected["index"])),
                                          np.diff(expected["offsets"])).tolist()  # fmt: skip
    assert scan_chunks(path) == []
    result = verify_store(path, quick=True)
    assert result.passed, [(c.name, c.detail) for c in result.checks]
    info = CliRunner().invoke(app, ["info", str(path)])
    assert info.exit_code == 0 and ", format 2" in info.stdout


@pytest.mark.parametrize("name", STORES)
def test_a_merge_of_a_format_2_store_writes_format_3(unpacked, name, tmp_path):
    merged = merge_store(unpacked / f"{name}.h5", tmp_path / "merged.h5", progress=False)
    assert merged.attrs["featcache_format"] == 3
    assert merged.attrs["resume_key"]["featcache_format"] == 3
    with h5py.File(merged.path, "r") as f:
        assert "checksums/index" in f and not f["index"].fletcher32
    _assert_reads(merged, _expected(name))
    assert scan_chunks(merged.path) == [] and verify_store(merged.path, quick=True).passed


def test_a_damaged_format_2_chunk_is_named_by_hdf5s_own_check(unpacked, tmp_path):
    path = tmp_path / "damaged.h5"
    shutil.copy(unpacked / "dense_float16.h5", path)
    corrupt_row(path, "features/conv", 5)  # rows 4-7, checksummed by Fletcher-32
    with FeatureStore(path) as store:
        with pytest.raises(CorruptStoreError, match=r"layer conv rows 4-7 cannot be read by HDF5"):
            store.read("conv", [6])
        np.testing.assert_array_equal(
            store.read("conv", [0, 9]).numpy(), _expected("dense_float16")["features/conv"][[0, 9]]
        )
    assert [(b.key, b.start, b.stop) for b in scan_chunks(path)] == [("features/conv", 4, 8)]
