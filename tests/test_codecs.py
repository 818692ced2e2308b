"""``store.compression`` with HDF5's own filters and hdf5plugin's codecs: the rows read back
bit for bit, the chunk checksums hold, ``plan`` predicts the compressed size, and a value
or a missing filter is refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.commands.verify import verify_store
from featcache.config.spec import load_config
from featcache.errors import ConfigError
from featcache.extraction.plan import RunOptions
from featcache.read.dataset import FeatureDataset
from featcache.store import FeatureStore
from featcache.store.checks import scan_chunks
from featcache.store.merge import copy_store, merge_store
from featcache.util import compression
from tests.stores import synthetic_config

pytest.importorskip("hdf5plugin")

REPO = Path(__file__).resolve().parents[1]
FORMS = (
    "choose gzip, gzip:<1-9>, lzf, zstd, zstd:<1-22>, blosc2-lz4 or blosc2-zstd (optionally "
    "-shuffle or -bitshuffle, then :<0-9>, e.g. blosc2-zstd-bitshuffle:5), or null"
)
ROW_DATASETS = ("features/layer2", "features/layer4", "index", "ids", "labels")
runner = CliRunner()


def config(folder: Path, compression: str | None = None) -> dict:
    """40 rows of :func:`tests.stores.synthetic_config`, 8 rows per chunk."""
    return synthetic_config(folder, rows=40, chunk_rows=8, compression=compression)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """The uncompressed store of :func:`config`."""
    folder = tmp_path_factory.mktemp("plain")
    return featcache.extract_from_config(config(folder))["val"].path


def assert_same_rows(path: Path, plain: Path) -> None:
    """Every dataset of rows of ``path`` holds the bytes of ``plain``'s, through h5py and
    through featcache's readers."""
    with h5py.File(path, "r") as got, h5py.File(plain, "r") as want:
        for name in ROW_DATASETS:
            assert np.array_equal(got[name][()], want[name][()]), name
    store, reference = FeatureStore(path), FeatureStore(plain)
    for key in ("layer2", "layer4"):
        assert torch.equal(store.read(key).view(torch.int16), reference.read(key).view(torch.int16))
    rows = FeatureDataset(path, "layer4")
    assert torch.equal(rows[len(rows) - 1][0], FeatureDataset(plain, "layer4")[len(rows) - 1][0])


@pytest.mark.parametrize(
    "codec",
    [
        "gzip",
        "gzip:9",
        "lzf",
        "zstd",
        "zstd:19",
        "blosc2-lz4",
        "blosc2-zstd",
        "blosc2-lz4-bitshuffle:9",
        "blosc2-zstd-shuffle:1",
    ],
)
def test_each_codec_keeps_the_rows_bit_for_bit_and_their_checksums(plain, tmp_path, codec):
    path = tmp_path / "copy.h5"
    copy_store(plain, path, codec)  # what a run does at completion
    with h5py.File(path, "r") as f:
        assert f["features/layer2"].id.get_create_plist().get_nfilters() == 1
    assert_same_rows(path, plain)
    assert scan_chunks(path) == []  # every compressed chunk against its checksum
    assert verify_store(path, quick=True).passed
    assert path.stat().st_size < plain.stat().st_size


@pytest.mark.parametrize("codec, level", [("gzip", 4), ("lzf", None)])
def test_gzip_and_lzf_stores_are_written_as_h5py_writes_them(plain, tmp_path, codec, level):
    path = tmp_path / "copy.h5"
    copy_store(plain, path, codec)
    with h5py.File(path, "r") as f, h5py.File(tmp_path / "h5py.h5", "w") as own:
        stored = f["features/layer2"]
        assert (stored.compression, stored.compression_opts) == (codec, level)
        data = stored[()]
        shape, chunks = data.shape, stored.chunks
        same = own.create_dataset(
            "x", shape=shape, dtype=data.dtype, chunks=chunks, compression=codec
        )
        same[...] = data
        for start in range(0, len(data), chunks[0]):
            origin = (start, 0, 0, 0)
            assert stored.id.read_direct_chunk(origin) == same.id.read_direct_chunk(origin)


@pytest.mark.parametrize("codec", ["zstd", "blosc2-zstd-bitshuffle:5"])
def test_a_compressed_run_verifies_and_plan_predicts_its_size(plain, tmp_path, codec):
    planned = featcache.plan(config(tmp_path, codec), batches=1)
    estimate = planned.splits[0].estimate
    assert estimate.compression == codec and estimate.compressed is not None
    text = planned.format()
    assert text.splitlines()[0].split() == ["split", "rows", "store", "compressed", "path"]
    assert f"once compressed with {codec})" in text

    path = featcache.extract_from_config(config(tmp_path, codec))["val"].path
    assert 0.5 <= estimate.compressed / path.stat().st_size <= 2
    assert estimate.compressed < estimate.bytes
    assert_same_rows(path, plain)
    quick = verify_store(path, quick=True)
    assert quick.passed, quick.checks
    full = verify_store(path, samples=-1)
    assert full.passed and full.rows, full.checks
    info = runner.invoke(app, ["info", str(path)])
    assert info.exit_code == 0, info.output
    merged = merge_store(path, tmp_path / "merged.h5", codec, progress=False)
    assert_same_rows(merged.path, plain)


@pytest.mark.parametrize(
    "value",
    ["zstd:0", "zstd:23", "gzip:10", "lzf:3", "zstd-bitshuffle", "blosc2", "blosc2-lz4:10", "br"],
)
def test_a_malformed_value_is_refused_at_load_in_one_line(value):
    with pytest.raises(ConfigError) as raised:
        load_config(config(Path("out")), [f"store.compression={value}"])
    assert str(raised.value) == f"store.compression is {value!r}; {FORMS}"
    with pytest.raises(ConfigError, match=r"^store.compression is .*; choose gzip, gzip:<1-9>"):
        RunOptions.from_kwargs(compression=value)  # featcache.extract(..., compression=)


def test_a_codec_without_hdf5plugin_names_the_extra(monkeypatch):
    monkeypatch.setattr(compression, "load_plugins", lambda: None)
    with pytest.raises(ConfigError) as raised:
        load_config(config(Path("out"), "blosc2-lz4"))
    assert str(raised.value) == (
        "store.compression 'blosc2-lz4' needs hdf5plugin; install it with: "
        "pip install 'featcache[codecs]'"
    )
    assert load_config(config(Path("out"), "gzip:9")).store.compression == "gzip:9"


def _sharded_zstd_store(folder: Path) -> Path:
    """A zstd store combined from two ``--shard`` jobs' shards: virtual layers."""
    for job in ("0/2", "1/2"):
        stores = featcache.extract_from_config(config(folder, "zstd"), shard=job)
    with h5py.File(stores["val"].path, "r") as file:
        assert file["features/layer2"].is_virtual
    return stores["val"].path


@pytest.mark.parametrize("combined", [False, True], ids=["one-file", "shards"])
def test_a_store_whose_filter_is_not_installed_is_refused_in_one_line(plain, tmp_path, combined):
    path = tmp_path / "zstd.h5"
    if combined:  # the filter is the shards' own
        path = _sharded_zstd_store(tmp_path)
    else:
        copy_store(plain, path, "zstd")
    code = (
        "import sys; sys.modules['hdf5plugin'] = None\n"  # as if it were not installed
        "from featcache.errors import FeatcacheError\n"
        "from featcache.store import FeatureStore\n"
        f"try:\n    FeatureStore({str(path)!r})\n"
        "except FeatcacheError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert done.stdout == (
        f"store {path} is compressed with zstd (HDF5 filter 32015, in features/layer2), which "
        "is not available here; install hdf5plugin with: pip install 'featcache[codecs]'\n"
    )
