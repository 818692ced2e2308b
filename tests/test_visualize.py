"""Feature-map grids and Grad-CAM overlays from a store, in Python and on the command line."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from featcache.commands.app import app
from featcache.commands.visualize import (
    cam_overlay,
    feature_grid,
    grad_cam,
    save_feature_grid,
    source_image,
    store_cam,
)
from featcache.config.spec import load_config
from featcache.errors import ConfigError
from featcache.extraction import extract_from_config
from featcache.models import build_backbone
from featcache.sources import build_source

runner = CliRunner()


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("vis")
    config = {
        "model": {"name": "resnet18", "weights": None},
        "layers": [
            "layer2",
            {"name": "layer2", "capture": "grad", "target": "predicted"},
            {"name": "layer4", "reduce": "avg"},
        ],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 64, "num_classes": 4},
            "splits": {"train": {"size": 4}},
        },
        "preprocess": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
        "loader": {"batch_size": 4, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(out)},
        "runtime": {"progress": False},
    }
    return extract_from_config(config)["train"].path


def test_store_cam_equals_direct_grad_cam(store_path):
    spec = load_config({**_config_of(store_path)})
    backbone = build_backbone(spec.model, spec.preprocess, seed=spec.runtime.seed)
    model = backbone.model
    image, _ = build_source(spec.data, "train", backbone.transform)[2]
    outputs = {}
    model.layer2.register_forward_hook(lambda m, a, o: outputs.setdefault("x", o))
    logits = model(image[None])
    (gradient,) = torch.autograd.grad(logits.max(), outputs["x"])
    direct = grad_cam(outputs["x"][0].detach(), gradient[0])
    torch.testing.assert_close(store_cam(store_path, "layer2", 2), direct, atol=1e-5, rtol=1e-4)
    assert direct.shape == (8, 8) and direct.max() == 1 and direct.min() == 0


def test_grad_cam_definition():
    act = torch.rand(3, 4, 4)
    grad = torch.tensor([1.0, -2.0, 0.5])[:, None, None].expand(3, 4, 4)
    cam = torch.relu(act[0] - 2 * act[1] + 0.5 * act[2])
    cam = (cam - cam.min()) / (cam.max() - cam.min())
    torch.testing.assert_close(grad_cam(act, grad), cam)


def test_feature_grid_python(store_path, tmp_path):
    grid = feature_grid(store_path, "layer2", 1, max_channels=16, nrow=4, padding=2)
    assert grid.shape == (3, 4 * 10 + 2, 4 * 10 + 2)  # 4x4 channels of 8x8, padding 2
    path = save_feature_grid(store_path, "layer2", 1, tmp_path / "g.png", max_channels=16)
    assert _png(path).shape == (42, 42, 3)


def test_show_and_cam_cli(store_path, tmp_path):
    grid_png, cam_png = tmp_path / "grid.png", tmp_path / "cam.png"
    result = runner.invoke(
        app,
        [
            "show",
            str(store_path),
            "--layer",
            "layer2",
            "--row",
            "1",
            "-o",
            str(grid_png),
            "--max-channels",
            "9",
            "--scale",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    grid = _png(grid_png)
    assert grid.shape == (3 * 18 + 2, 3 * 18 + 2, 3)  # 3x3 channels of 16x16, padding 2
    assert grid.std() > 10
    result = runner.invoke(
        app, ["cam", str(store_path), "-l", "layer2", "-r", "3", "-o", str(cam_png)]
    )
    assert result.exit_code == 0, result.output
    overlay = _png(cam_png)
    assert overlay.shape == (64, 64, 3) and overlay.std() > 10
    assert source_image(store_path, 3).size == (64, 64)


def test_errors(store_path, tmp_path):
    result = runner.invoke(
        app, ["show", str(store_path), "-l", "layer4", "-o", str(tmp_path / "x.png")]
    )
    assert result.exit_code == 2
    assert "no spatial map left" in result.output and len(result.output.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="no stored gradients"):
        cam_overlay(store_path, "layer4", 0, tmp_path / "y.png")
    result = runner.invoke(
        app, ["cam", str(store_path), "-l", "layer4", "-o", str(tmp_path / "y.png")]
    )
    assert result.exit_code == 2 and "no stored gradients" in result.output
    with pytest.raises(ConfigError, match="out of range"):
        feature_grid(store_path, "layer2", 9)
    for nrow in (0, -3):
        with pytest.raises(ConfigError, match=f"nrow must be a whole number >= 1 .*got {nrow}"):
            feature_grid(store_path, "layer2", 0, nrow=nrow)
    result = runner.invoke(
        app,
        ["show", str(store_path), "-l", "layer2", "-o", str(tmp_path / "z.png"), "--nrow", "-3"],
    )
    assert result.exit_code == 2 and "nrow must be a whole number >= 1" in result.output


def _config_of(path):
    from featcache.store import FeatureStore

    with FeatureStore(path) as fs:
        return fs.config


def _png(path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB")).astype(np.float32)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("grid.txt", r"picture .*grid.txt does not end in .png or .jpg .* such as .*grid.png$"),
        ("folder", r"picture .*folder is a folder; give a file name such as .*out.png$"),
    ],
)
def test_a_picture_name_that_cannot_be_written_fails_in_one_line(
    store_path, tmp_path, name, message
):
    (tmp_path / "folder").mkdir()
    for command in ("show", "cam"):
        result = runner.invoke(
            app, [command, str(store_path), "-l", "layer2", "-o", str(tmp_path / name)]
        )
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
        assert re.search(message, result.output.strip()), result.output


def test_cam_shows_the_photo_as_the_zoos_own_transform_gave_it(tmp_path, hymenoptera_root):
    """timm with random weights uses timm's eval transform (resize 235, centre crop 224):
    the picture under the CAM is that crop, not the whole photo."""
    import shutil

    timm = pytest.importorskip("timm")
    from torchvision.transforms import functional as TF

    photo = sorted((hymenoptera_root / "val" / "bees").glob("*.jpg"))[0]
    (tmp_path / "photos" / "val" / "bees").mkdir(parents=True)
    shutil.copy(photo, tmp_path / "photos" / "val" / "bees" / photo.name)
    config = {
        "model": {"name": "timm:resnet18"},
        "layers": ["layer3", {"name": "layer3", "capture": "grad", "target": "predicted"}],
        "data": {"source": "imagefolder", "root": str(tmp_path / "photos"), "splits": ["val"]},
        "loader": {"num_workers": 0},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    store = extract_from_config(config)["val"].path
    picture = source_image(store, 0)
    assert picture.size == (224, 224) and Image.open(photo).size != (224, 224)
    model = timm.create_model("resnet18", pretrained=False)
    data_config = timm.data.resolve_model_data_config(model)
    seen = timm.data.create_transform(**data_config, is_training=False)(
        Image.open(photo).convert("RGB")
    )
    mean = torch.tensor(data_config["mean"])[:, None, None]
    std = torch.tensor(data_config["std"])[:, None, None]
    expected = (seen * std + mean).clamp(0, 1)
    assert (TF.to_tensor(picture) - expected).abs().max() <= 1 / 255 + 1e-6
    overlay = cam_overlay(store, "layer3", 0, tmp_path / "cam.png")
    assert _png(overlay).shape == (224, 224, 3)
