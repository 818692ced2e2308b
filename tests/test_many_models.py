"""Several models over one pass: each sample decoded once, each model's store equal to
that model's run alone, resumable per store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
import yaml
from PIL import Image
from torch import nn
from torch.utils.data import Dataset
from torchvision import transforms as T

import featcache
from featcache.commands.verify import verify_store
from featcache.config.spec import load_config
from featcache.errors import ConfigError, FeatcacheError
from featcache.extraction.many import ModelRun, extract_models
from featcache.sources import files as files_module
from featcache.store import FeatureStore, partial_path
from featcache.store.provenance import config_fingerprint
from tests.test_update import image_folder

MODELS = [
    {
        "key": "resnet18",
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer2", "reduce": "avg"}, {"name": "layer4", "reduce": "avg"}],
        "preprocess": {"mean": [0.485, 0.456, 0.406]},
    },
    {
        "key": "mobilenet",
        "model": {"name": "mobilenet_v3_small"},
        "layers": [{"name": "features.3", "reduce": "avg"}],
        "preprocess": {"resize": 40},
    },
    {
        "key": "resnet18-crop",
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer3", "reduce": "max"}],
        "preprocess": {"crop": 24},
    },
]


def models_config(root: Path, out: Path, **loader: Any) -> dict[str, Any]:
    return {
        "models": MODELS,
        "data": {"source": "imagefolder", "root": str(root), "splits": ["train"]},
        "loader": {"batch_size": 8, "num_workers": 0, **loader},
        "store": {"dtype": "float32"},
        "output": {"dir": str(out)},
        "runtime": {"progress": False},
    }


def alone(config: dict[str, Any], entry: dict[str, Any], out: Path) -> dict[str, Any]:
    """The config of one model of ``config`` run by itself."""
    one = {k: v for k, v in config.items() if k != "models"}
    return {**one, **{k: v for k, v in entry.items() if k != "key"}, "output": {"dir": str(out)}}


def assert_same_rows(a: FeatureStore, b: FeatureStore) -> None:
    assert a.ids == b.ids and np.array_equal(a.labels, b.labels)
    assert a.layers == b.layers
    for layer in a.layers:
        assert torch.equal(a.read(layer), b.read(layer)), layer


@pytest.fixture
def counted_decodes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the images the image-folder source decodes (in this process)."""
    count = {"decodes": 0}
    real = files_module.load_rgb

    def counting(path: Any, min_side: int | None = None) -> Image.Image:
        count["decodes"] += 1
        return real(path, min_side)

    monkeypatch.setattr(files_module, "load_rgb", counting)
    return count


def test_three_models_decode_each_image_once_and_equal_their_runs_alone(tmp_path, counted_decodes):
    image_folder(tmp_path / "images", 30)
    config = models_config(tmp_path / "images", tmp_path / "out")
    stores = featcache.extract_from_config(config)
    assert counted_decodes["decodes"] == 30  # the models' checks reuse the first rows read
    assert sorted(stores) == sorted(f"{m['key']}/train" for m in MODELS)
    for entry in MODELS:
        store = stores[f"{entry['key']}/train"]
        assert store.path == tmp_path / "out" / entry["key"] / "train.h5"
        single = alone(config, entry, tmp_path / "alone" / entry["key"])
        reference = featcache.extract_from_config(single)["train"]
        assert_same_rows(store, reference)
        # Recorded as that model's own config: a run of it alone finds the store complete.
        assert store.attrs["config_fingerprint"] == config_fingerprint(load_config(single))
        assert store.attrs["resume_key"] == reference.attrs["resume_key"]
    again = featcache.extract_from_config(config)  # complete: nothing computed again
    assert all(
        s.path.stat().st_mtime_ns == stores[k].path.stat().st_mtime_ns for k, s in again.items()
    )
    result = verify_store(stores["mobilenet/train"].path, samples=4)  # its own config
    assert result.passed and len(result.rows) >= 4, result


class Fails(nn.Module):
    """resnet18 whose forward raises from its ``fail_at``-th call on."""

    def __init__(self, fail_at: int | None):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.fail_at, self.calls = torchvision.models.resnet18(), fail_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("the device fell over")
        return self.net(x)


class Pictures(Dataset):
    """Seeded random PIL images with labels, not yet preprocessed."""

    def __init__(self, count: int):
        self.count, self.decodes = count, 0

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        self.decodes += 1
        pixels = np.random.default_rng(i).integers(0, 256, (36, 36, 3), dtype=np.uint8)
        return Image.fromarray(pixels), i % 3


def test_a_failing_model_stops_the_pass_and_a_rerun_resumes_every_store(tmp_path):
    data = Pictures(96)
    small = T.Compose([T.Resize(32), T.ToTensor()])
    crop = T.Compose([T.CenterCrop(28), T.ToTensor()])
    torch.manual_seed(1)
    other = torchvision.models.resnet18()
    layer = [{"name": "net.layer3", "reduce": "avg"}]
    options = dict(batch_size=8, num_workers=0, chunk_rows=8, progress=False)

    def runs(fail_at: int | None) -> list[ModelRun]:
        return [
            ModelRun(other, [{"name": "layer2", "reduce": "avg"}], tmp_path / "a.h5", small),
            ModelRun(Fails(fail_at), layer, tmp_path / "b.h5", crop),
        ]

    with pytest.raises(FeatcacheError, match="the device fell over"):
        extract_models(runs(fail_at=6), data, dtype="float32", **options)
    for name in ("a.h5", "b.h5"):  # both partial, nothing complete
        assert partial_path(tmp_path / name).exists() and not (tmp_path / name).exists()
    assert FeatureStore(tmp_path / "b.h5", allow_incomplete=True).rows_written >= 8
    stores = extract_models(runs(fail_at=None), data, dtype="float32", **options)
    assert stores[1].ids[:2] == ["Pictures:0", "Pictures:1"]  # as extract names its rows
    for at, (model, transform, layers) in enumerate(
        [(other, small, [{"name": "layer2", "reduce": "avg"}]), (Fails(None), crop, layer)]
    ):
        view = [(transform(image), label) for image, label in (data[i] for i in range(96))]
        reference = featcache.extract(
            model, view, layers, tmp_path / f"alone{at}.h5", dtype="float32", ids=stores[at].ids,
            batch_size=8, progress=False,
        )  # fmt: skip
        assert_same_rows(stores[at], reference)


def test_a_config_of_several_models_is_refused_where_it_cannot_run(tmp_path):
    image_folder(tmp_path / "images", 4)
    config = models_config(tmp_path / "images", tmp_path / "out")
    with pytest.raises(ConfigError, match="remove the top-level model, layers and preprocess"):
        load_config({**config, "model": {"name": "resnet18"}})
    with pytest.raises(ConfigError, match="key 'resnet18' is used twice"):
        load_config({**config, "models": [MODELS[0], MODELS[0]]})
    with pytest.raises(ConfigError, match=r"models\[0\].key '../up' must be a plain folder"):
        load_config({**config, "models": [{**MODELS[0], "key": "../up"}]})
    with pytest.raises(ConfigError, match=r"models\[1\].layers: name at least one layer"):
        load_config({**config, "models": [MODELS[0], {**MODELS[1], "layers": []}]})
    with pytest.raises(ConfigError, match="set loader.decode: exact"):
        featcache.extract_from_config(
            models_config(tmp_path / "images", tmp_path / "o", decode="fast")
        )
    with pytest.raises(ConfigError, match="model: set exactly one of model.name"):
        load_config({k: v for k, v in config.items() if k != "models"} | {"layers": ["layer1"]})


def test_the_cli_extracts_plans_and_lists_a_config_of_several_models(tmp_path):
    from typer.testing import CliRunner

    from featcache.commands.app import app

    image_folder(tmp_path / "images", 12)
    config = models_config(tmp_path / "images", tmp_path / "out")
    config["models"] = MODELS[:2]
    config_file = tmp_path / "models.yaml"
    config_file.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["extract", str(config_file)])
    assert result.exit_code == 0, result.output
    for entry in MODELS[:2]:
        assert f"{tmp_path / 'out' / entry['key'] / 'train.h5'}: 12 rows" in result.output
    result = CliRunner().invoke(app, ["plan", str(config_file), "--batches", "1"])
    assert result.exit_code == 0, result.output
    assert "model resnet18:" in result.output and "model mobilenet:" in result.output
    result = CliRunner().invoke(app, ["layers", str(config_file)])
    assert result.exit_code == 2  # a usage error, in one line
    assert "runs several models (resnet18, mobilenet); list the layers of one" in result.output


def test_update_brings_each_model_store_up_to_date(tmp_path):
    from tests.test_update import write_image

    image_folder(tmp_path / "images", 12)
    config = models_config(tmp_path / "images", tmp_path / "out")
    config["models"] = MODELS[:2]
    featcache.extract_from_config(config)
    for i in range(12, 16):  # four new photos
        write_image(tmp_path / "images" / "train" / "ants" / f"new{i}.png", i)
    updated = featcache.extract_from_config(config, update=True)
    for entry in MODELS[:2]:
        store = updated[f"{entry['key']}/train"]
        last = store.attrs["history"][-1]
        assert (last["kind"], last["rows_computed"], last["rows_reused"]) == ("update", 4, 12)
        fresh = featcache.extract_from_config(alone(config, entry, tmp_path / entry["key"]))
        assert_same_rows(store, fresh["train"])


@pytest.mark.slow
def test_under_torchrun_each_model_store_equals_the_one_process_run(tmp_path):
    from tests.test_distributed import _torchrun
    from tests.test_distributed import assert_same_rows as same_datasets

    config = {
        "models": MODELS[:2],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 3},
            "splits": {"train": {"size": 48}},
        },
        "loader": {"batch_size": 8, "num_workers": 0},
        "store": {"chunk_rows": 8},
        "runtime": {"progress": False},
    }
    one = featcache.extract_from_config({**config, "output": {"dir": str(tmp_path / "one")}})
    config_file = tmp_path / "models.yaml"
    config_file.write_text(yaml.safe_dump({**config, "output": {"dir": str(tmp_path / "two")}}))
    process = _torchrun(config_file)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    for entry in MODELS[:2]:
        sharded = tmp_path / "two" / entry["key"] / "train.h5"
        same_datasets(sharded, one[f"{entry['key']}/train"].path)
