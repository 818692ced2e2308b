"""Bad inputs: each one gets its exact behaviour, and stores stay readable and aligned."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torch import nn
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.errors import ConfigError, FeatcacheError
from featcache.store import FeatureStore, partial_path

# The fixture lowers Pillow's pixel limit; images between the limit and twice it warn.
pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

GOOD = {
    "cats/rgb.png": lambda: Image.new("RGB", (40, 36), (200, 30, 30)),
    "cats/palette.png": lambda: Image.new("RGB", (40, 40), (10, 200, 10)).convert("P"),
    "cats/grey.jpg": lambda: Image.new("L", (30, 50), 90),
    "dogs/cmyk.jpg": lambda: Image.new("CMYK", (40, 40), (0, 120, 200, 10)),
    "dogs/rgba.png": lambda: Image.new("RGBA", (40, 40), (1, 2, 3, 128)),
    "dogs/sixteen.png": lambda: Image.fromarray(np.full((40, 40), 40000, dtype=np.uint16)),
}
BAD = {  # file -> the reason the store records
    "cats/z_empty.jpg": "the file is empty (0 bytes)",
    "cats/z_notes.jpg": "cannot identify image file",
    "dogs/truncated.jpg": "truncated",
    "dogs/huge.png": "decompression bomb",
}


@pytest.fixture
def messy_folder(tmp_path, monkeypatch) -> Path:
    """An ImageFolder split with valid images of every mode, broken files and an empty class."""
    root = tmp_path / "images" / "train"
    for relative, make in GOOD.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        make().save(root / relative)
    (root / "cats" / "z_empty.jpg").write_bytes(b"")
    (root / "cats" / "z_notes.jpg").write_text("shopping list, not a picture\n")
    Image.new("RGB", (64, 64), (5, 5, 5)).save(root / "dogs" / "truncated.jpg", quality=95)
    data = (root / "dogs" / "truncated.jpg").read_bytes()
    (root / "dogs" / "truncated.jpg").write_bytes(data[: len(data) // 2])
    Image.new("L", (64, 64), 7).save(root / "dogs" / "huge.png")
    (root / "zebras").mkdir()  # an empty class folder
    # A 64x64 image counts as a decompression bomb under this limit (PIL refuses > 2x).
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    return tmp_path


def _config(folder: Path, **loader) -> dict:
    return {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer4", "reduce": "avg"}],
        "data": {"root": str(folder / "images"), "splits": ["train"]},
        "preprocess": {"resize": 32, "crop": 32},
        "loader": {"batch_size": 2, "num_workers": 0, **loader},
        "output": {"dir": str(folder / "out")},
        "runtime": {"progress": False},
    }


def test_skip_policy_records_each_bad_file_and_keeps_rows_aligned(messy_folder):
    with pytest.warns(UserWarning, match="4 of 10 samples skipped"):
        store = featcache.extract_from_config(_config(messy_folder, on_error="skip"))["train"]
    assert store.class_names == ["cats", "dogs", "zebras"]
    assert sorted(store.ids) == sorted(GOOD)
    for sample_id, label in zip(store.ids, store.labels, strict=True):
        assert store.class_names[label] == sample_id.split("/")[0]
    assert store.attrs["skipped"] == 4
    skipped = {record["id"]: record["reason"] for record in store.skipped}
    assert set(skipped) == set(BAD)
    for sample_id, reason in BAD.items():
        assert reason in skipped[sample_id], skipped[sample_id]
        assert sample_id in skipped[sample_id]  # the reason names the file
    features = store.read("layer4")
    assert features.shape == (6, 512) and torch.isfinite(features.float()).all()
    dataset = featcache.FeatureDataset(store.path, "layer4")
    assert [int(dataset[i][1]) for i in range(6)] == store.labels.tolist()


def test_fail_policy_is_one_line_and_resumable_with_skip(messy_folder):
    runner = CliRunner()
    config = messy_folder / "c.yaml"
    config.write_text(yaml.safe_dump(_config(messy_folder)))
    result = runner.invoke(app, ["extract", str(config)])
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "cats/z_empty.jpg: the file is empty (0 bytes)" in lines[0]
    assert "loader.on_error=skip" in lines[0]
    store = messy_folder / "out" / "train.h5"
    assert partial_path(store).exists() and not store.exists()
    # The batch before lies in the store's one chunk (10 rows), which no mark counts yet.
    assert FeatureStore(store, allow_incomplete=True).rows_written == 0
    resumed = runner.invoke(app, ["extract", str(config), "--set", "loader.on_error=skip"])
    assert resumed.exit_code == 0, resumed.output
    assert len(FeatureStore(store).skipped) == 4
    with pytest.warns(UserWarning, match="4 of 10 samples skipped"):
        fresh = featcache.extract_from_config(
            _config(messy_folder / "fresh", on_error="skip")
            | {"data": {"root": str(messy_folder / "images"), "splits": ["train"]}}
        )["train"]
    assert torch.equal(FeatureStore(store).read("layer4"), fresh.read("layer4"))
    assert FeatureStore(store).ids == fresh.ids


class Spiky(nn.Module):
    """Gives NaN for images whose first pixel is above 1, and huge values for one image."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Identity()

    def forward(self, x):
        y = self.conv(x)
        y = torch.where((x[:, 0, 0, 0] > 1)[:, None, None, None], float("nan"), y)
        y = torch.where((x[:, 0, 0, 0] < -1)[:, None, None, None], 1e6, y)
        return self.head(y)


def _spiky_data(tmp_path):
    x = torch.zeros(12, 3, 8, 8)
    x[3, 0, 0, 0] = 2.0  # NaN
    x[7, 0, 0, 0] = 2.0  # NaN
    return torch.utils.data.TensorDataset(x, torch.arange(12) % 2)


def test_nonfinite_features_fail_skip_or_keep(tmp_path):
    torch.manual_seed(0)
    model, data = Spiky().eval(), _spiky_data(tmp_path)
    options = {"batch_size": 5, "progress": False, "num_workers": 0, "dtype": "float32"}
    with pytest.raises(FeatcacheError, match="non-finite .* in layer head for sample .*:3;"):
        featcache.extract(model, data, ["head"], tmp_path / "f.h5", **options)
    with pytest.warns(UserWarning, match="2 of 12 samples skipped"):
        store = featcache.extract(
            model, data, ["head"], tmp_path / "s.h5", on_nonfinite="skip", **options
        )
    assert store.index.tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]
    assert store.labels.tolist() == [i % 2 for i in store.index]
    assert [r["reason"] for r in store.skipped] == ["non-finite values in layer head"] * 2
    kept = featcache.extract(
        model, data, ["head"], tmp_path / "k.h5", on_nonfinite="keep", **options
    )
    assert len(kept) == 12 and torch.isnan(kept.read("head", [3, 7])).all()


def test_float16_overflow_is_reported_with_a_hint(tmp_path):
    torch.manual_seed(0)
    data = _spiky_data(tmp_path)
    data.tensors[0][5, 0, 0, 0] = -2.0  # 1e6 overflows float16
    data.tensors[0][3, 0, 0, 0] = data.tensors[0][7, 0, 0, 0] = 0.0
    with pytest.raises(FeatcacheError, match="sample .*:5 .float16 overflows above 65504"):
        featcache.extract(Spiky().eval(), data, ["head"], tmp_path / "o.h5", progress=False)


def test_output_folder_that_is_not_writable(tmp_path):
    if os.geteuid() == 0:
        folder = Path("/sys/kernel")  # read-only even for root
        if not folder.is_dir():
            pytest.skip("no read-only folder to test with on this machine")
    else:
        folder = tmp_path / "locked"
        folder.mkdir()
        folder.chmod(0o500)
    data = torch.utils.data.TensorDataset(torch.zeros(2, 3, 8, 8))
    with pytest.raises(ConfigError, match=f"output folder {folder} is not writable"):
        featcache.extract(Spiky(), data, ["head"], folder / "s.h5", progress=False)


def test_missing_data_root_and_unknown_names_are_config_errors(tmp_path):
    config = _config(tmp_path)
    with pytest.raises(ConfigError, match="data root not found"):
        featcache.extract_from_config(config)
    with pytest.raises(ConfigError, match="resnet18"):
        featcache.extract_from_config(config, ["model.name=resnet81"])
    with pytest.raises(ConfigError, match="unknown weights 'IMAGENET9K'"):
        featcache.extract_from_config(config, ["model.weights=IMAGENET9K"])


def test_images_of_different_sizes_without_a_crop(tmp_path):
    root = tmp_path / "images" / "train" / "things"
    root.mkdir(parents=True)
    Image.new("RGB", (32, 32)).save(root / "square.png")
    Image.new("RGB", (64, 32)).save(root / "wide.png")
    config = _config(tmp_path)
    config["preprocess"] = {"resize": 32}
    with pytest.raises(ConfigError, match=r"different sizes in one batch .*set preprocess.crop"):
        featcache.extract_from_config(config)


def test_nonfinite_row_check_is_exact():
    from featcache.extraction.nonfinite import nonfinite_rows as _nonfinite_rows

    x = torch.zeros(5, 10, dtype=torch.float16)
    x[1, 3] = float("nan")
    x[2, 0], x[2, 1] = float("inf"), -float("inf")  # their sum is NaN too
    x[3] = 60000  # finite, and its float32 sum does not overflow
    assert _nonfinite_rows(x).tolist() == [False, True, True, False, False]
    big = torch.full((2, 4), 3e38)  # finite rows whose float32 sum would overflow
    assert _nonfinite_rows(big).tolist() == [False, False]
