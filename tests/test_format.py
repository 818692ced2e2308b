"""Store formats: a store newer than featcache reads is refused with one line; an older
one still reads, and a rerun leaves it alone; a partial store of another format does not
resume."""

from __future__ import annotations

from pathlib import Path

import h5py
import pytest
import torch
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.errors import ConfigError, FeatcacheError
from featcache.store import FeatureStore, codec
from featcache.store.metadata import seal
from featcache.store.paths import partial_path
from featcache.store.provenance import FORMAT_VERSION


def _record_format(path: Path, version: int) -> None:
    """Record ``version`` as the store's format, in its attribute and its key, and seal it
    again, so that only the format differs from a store featcache wrote."""
    with h5py.File(path, "r+") as f:
        key = dict(codec.attr(f, "resume_key"), featcache_format=version)
        codec.write_attrs(f, {"featcache_format": version, "resume_key": key})
        if codec.attr(f, "complete"):
            seal(f)


class FailsAt(torch.utils.data.Dataset):
    """The samples of ``images``, but sample ``bad`` raises."""

    def __init__(self, images: torch.utils.data.Dataset, bad: int):
        self.images, self.bad = images, bad

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        if i == self.bad:
            raise RuntimeError(f"sample {i} cannot be read")
        return self.images[i]


def test_a_store_in_a_newer_format_is_refused_with_one_line(resnet18, images, tmp_path):
    path = tmp_path / "s.h5"
    featcache.extract(resnet18, images, ["layer1"], path, progress=False)
    _record_format(path, FORMAT_VERSION + 1)
    before = path.read_bytes()
    newer = rf"store format {FORMAT_VERSION + 1}, newer than featcache .* upgrade featcache"
    with pytest.raises(ConfigError, match=newer):
        FeatureStore(path)
    with pytest.raises(ConfigError, match=newer):
        featcache.FeatureDataset(path, "layer1")
    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 2
    assert "upgrade featcache" in result.output and len(result.output.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="already exists.*--overwrite"):  # not replaced
        featcache.extract(resnet18, images, ["layer1"], path, progress=False)
    assert path.read_bytes() == before


def test_a_store_in_an_older_format_reads_and_a_rerun_leaves_it_alone(resnet18, images, tmp_path):
    path = tmp_path / "s.h5"
    made = featcache.extract(resnet18, images, ["layer1"], path, progress=False)
    features = made.read("layer1")
    made.close()
    _record_format(path, 1)
    before = path.read_bytes()
    store = featcache.extract(resnet18, images, ["layer1"], path, progress=False)
    assert path.read_bytes() == before
    assert torch.equal(store.read("layer1"), features) and store.attrs["featcache_format"] == 1
    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 0 and ", format 1" in result.output


def test_a_partial_store_of_another_format_does_not_resume(resnet18, images, tmp_path):
    path = tmp_path / "s.h5"
    source = FailsAt(images, 12)
    with pytest.raises(FeatcacheError, match="sample 12"):
        featcache.extract(resnet18, source, ["layer1"], path, batch_size=4, progress=False)
    source.bad = -1  # the same source, readable now
    _record_format(partial_path(path), 1)
    before = partial_path(path).read_bytes()
    with pytest.raises(
        ConfigError, match=rf"featcache format differs .*\(1 vs {FORMAT_VERSION}\).*--ov"
    ):
        featcache.extract(resnet18, source, ["layer1"], path, batch_size=4, progress=False)
    assert partial_path(path).read_bytes() == before
    store = featcache.extract(
        resnet18, source, ["layer1"], path, batch_size=4, overwrite=True, progress=False
    )
    assert store.complete and store.attrs["featcache_format"] == FORMAT_VERSION
