"""The built-in model kinds (torchvision, factory) and checkpoints loaded on top of them."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.models import (
    build_backbone,
    build_transform,
    import_factory,
    load_checkpoint,
    resolve_weights,
)
from featcache.util.fingerprints import file_sha256
from tests.cifar_resnet import resnet20

# isort: split
# After featcache, which makes torchvision importable where its compiled ops cannot load.
import torchvision
from torchvision.models import ResNet18_Weights, ResNet50_Weights

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"real test data not found at {DATA} (only present beside CI)"
)
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class NotATensor:
    """Pickled into a checkpoint to check that featcache refuses to unpickle it."""


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    def refuse(url, *args, **kwargs):
        raise AssertionError(f"a test tried to download {url}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)


@pytest.fixture
def fake_get_model(monkeypatch):
    """Replace torchvision's get_model with a tiny random model; record its arguments."""
    calls = []

    def get_model(name, **kwargs):
        calls.append((name, kwargs))
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))

    monkeypatch.setattr(torchvision.models, "get_model", get_model)
    return calls


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def gradient_image(width: int, height: int) -> Image.Image:
    x = torch.linspace(0, 255, width).expand(height, width)
    y = torch.linspace(0, 255, height)[:, None].expand(height, width)
    rgb = torch.stack([x, y, 255 - x]).permute(1, 2, 0).to(torch.uint8)
    return Image.fromarray(rgb.numpy(), "RGB")


# torchvision models


def test_torchvision_random_init_is_seeded():
    spec = ModelSpec(name="resnet18")
    a = build_backbone(spec, PreprocessSpec(), seed=0)
    b = build_backbone(spec, PreprocessSpec(), seed=0)
    c = build_backbone(spec, PreprocessSpec(), seed=1)
    assert isinstance(a.model, torchvision.models.ResNet)
    assert not any(m.training for m in a.model.modules())
    assert all(p.device.type == "cpu" for p in a.model.parameters())
    assert same_params(params(a.model), params(b.model))
    assert not same_params(params(a.model), params(c.model))
    assert a.weights == {"model": "resnet18", "source": "random", "seed": 0}


@pytest.mark.parametrize("weights", ["DEFAULT", "IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1"])
def test_resolve_weights(weights):
    assert resolve_weights("resnet18", weights) is ResNet18_Weights.IMAGENET1K_V1


def test_resolve_weights_other_versions():
    assert resolve_weights("resnet50", "IMAGENET1K_V2") is ResNet50_Weights.IMAGENET1K_V2
    assert resolve_weights("resnet50", "DEFAULT") is ResNet50_Weights.IMAGENET1K_V2
    assert resolve_weights("resnet50", None) is None


def test_unknown_weights_lists_available():
    with pytest.raises(ConfigError, match=r"IMAGENET1K_V3.*did you mean IMAGENET1K_V1"):
        resolve_weights("resnet18", "IMAGENET1K_V3")
    with pytest.raises(ConfigError, match="ResNet18_Weights"):
        resolve_weights("resnet18", "ResNet50_Weights.IMAGENET1K_V2")


def test_unknown_model_suggests_close_match():
    with pytest.raises(ConfigError, match=r"'resnet181'.*did you mean resnet18"):
        resolve_weights("resnet181", None)
    with pytest.raises(ConfigError, match="did you mean resnet18"):
        build_backbone(ModelSpec(name="resnet181"), PreprocessSpec())


def test_weights_without_preprocess_use_their_transforms(fake_get_model):
    backbone = build_backbone(ModelSpec(name="resnet18", weights="DEFAULT"), PreprocessSpec())
    enum = ResNet18_Weights.IMAGENET1K_V1
    assert fake_get_model == [("resnet18", {"weights": enum})]
    assert not backbone.model.training
    assert backbone.weights == {
        "model": "resnet18",
        "source": "torchvision",
        "enum": "ResNet18_Weights.IMAGENET1K_V1",
        "url": enum.url,
    }
    json.dumps(backbone.weights)
    assert type(backbone.transform) is type(enum.transforms())  # ImageClassification
    assert repr(backbone.transform) == repr(enum.transforms())
    image = gradient_image(48, 40)
    out = backbone.transform(image)
    assert out.dtype == torch.float32 and out.shape == (3, 224, 224)
    assert torch.equal(out, enum.transforms()(image))
    assert torch.equal(pickle.loads(pickle.dumps(backbone.transform))(image), out)


def test_explicit_preprocess_overrides_weights_transforms(fake_get_model):
    mean, std = [0.5, 0.25, 0.1], [0.2, 0.3, 0.4]
    preprocess = PreprocessSpec(resize=40, crop=32, mean=mean, std=std, interpolation="bicubic")
    backbone = build_backbone(ModelSpec(name="resnet18", weights="DEFAULT"), preprocess)
    rgb = (200, 30, 128)
    out = backbone.transform(Image.new("RGB", (64, 50), rgb))
    assert out.dtype == torch.float32 and out.shape == (3, 32, 32)
    expected = (torch.tensor(rgb) / 255 - torch.tensor(mean)) / torch.tensor(std)
    torch.testing.assert_close(out, expected[:, None, None].expand(3, 32, 32))


def test_build_transform_resize_crop_and_defaults():
    image = gradient_image(64, 48)
    resized = build_transform(PreprocessSpec(resize=36))(image)
    assert resized.shape == (3, 36, 48)  # shorter side to 36, aspect ratio kept
    plain = build_transform(PreprocessSpec())(image)
    assert plain.shape == (3, 48, 64)
    raw = torch.from_numpy(np.array(image)).permute(2, 0, 1) / 255
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(plain, (raw - mean[:, None, None]) / std[:, None, None])
    crop = build_transform(PreprocessSpec(crop=32))
    restored = pickle.loads(pickle.dumps(crop))
    assert torch.equal(restored(image), plain[:, 8:40, 16:48])


def test_build_transform_rejects_unknown_interpolation():
    with pytest.raises(ConfigError, match="bilinear, bicubic, nearest"):
        build_transform(PreprocessSpec(resize=32, interpolation="lanczos"))


def test_bad_torchvision_kwargs_and_failed_download(monkeypatch):
    with pytest.raises(ConfigError, match="bogus"):
        build_backbone(ModelSpec(name="resnet18", kwargs={"bogus": 1}), PreprocessSpec())

    def offline(name, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.models, "get_model", offline)
    with pytest.raises(FeatcacheError, match=r"could not download ResNet18_Weights\.IMAGENET1K_V1"):
        build_backbone(ModelSpec(name="resnet18", weights="DEFAULT"), PreprocessSpec())


# checkpoints


@pytest.fixture
def saved_model() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    return params(resnet20())


def save(obj, path: Path) -> Path:
    torch.save(obj, path)
    return path


@pytest.mark.parametrize(
    ("layout", "prefix"),
    [("plain", None), ("state_dict", "module."), ("model_state_dict", None), ("model", "net.")],
)
def test_checkpoint_loads_exactly(tmp_path, saved_model, layout, prefix):
    state = {(prefix or "") + k: v for k, v in saved_model.items()}
    obj = state if layout == "plain" else {layout: state, "epoch": 3}
    path = save(obj, tmp_path / "model.pt")
    spec = ModelSpec(
        factory="tests.cifar_resnet:resnet20", checkpoint=str(path), strip_prefix=prefix
    )
    backbone = build_backbone(spec, PreprocessSpec(crop=32), seed=0)
    assert same_params(params(backbone.model), saved_model)
    assert not backbone.model.training
    assert backbone.weights == {
        "model": "tests.cifar_resnet:resnet20",
        "source": "checkpoint",
        "path": str(path),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def test_checkpoint_prefix_mismatch_hints_strip_prefix(tmp_path, saved_model):
    state = {"module." + k: v for k, v in saved_model.items()}
    path = save({"state_dict": state, "best_prec1": 90.0}, tmp_path / "model.th")
    with pytest.raises(
        ConfigError, match=r"missing keys.*unexpected keys.*strip_prefix: 'module\.'"
    ):
        load_checkpoint(resnet20(), path)
    with pytest.raises(ConfigError, match="'mod.' matched no checkpoint key"):
        load_checkpoint(resnet20(), path, strip_prefix="mod.")
    assert load_checkpoint(resnet20(), path, "module.") == file_sha256(path)


def test_checkpoint_errors(tmp_path, saved_model):
    with pytest.raises(ConfigError, match="checkpoint not found"):
        load_checkpoint(resnet20(), tmp_path / "missing.pt")
    pickled = save({"state_dict": saved_model, "meta": NotATensor()}, tmp_path / "obj.pt")
    with pytest.raises(ConfigError, match=r"NotATensor.*weights_only=True.*never unpickles"):
        load_checkpoint(resnet20(), pickled)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="weights_only"):
        load_checkpoint(resnet20(), garbage)
    no_state = save({"epoch": 3, "lr": 0.1}, tmp_path / "meta.pt")
    with pytest.raises(ConfigError, match="holds no state dict.*epoch, lr"):
        load_checkpoint(resnet20(), no_state)
    plain = save(saved_model, tmp_path / "plain.pt")
    with pytest.raises(
        ConfigError, match=r"2 tensors of the wrong shape \(linear\.weight \(10, 64\) vs \(7, 64\)"
    ):
        load_checkpoint(resnet20(num_classes=7), plain)
    with pytest.raises(
        ConfigError, match=r"shape \(conv1.*missing keys \(layer2.*unexpected keys \(linear"
    ):
        load_checkpoint(torchvision.models.resnet18(), plain)


# factories


def test_factory_with_kwargs():
    spec = ModelSpec(factory="torchvision.models:resnet18", kwargs={"num_classes": 7})
    backbone = build_backbone(spec, PreprocessSpec(), seed=3)
    with torch.no_grad():
        assert backbone.model(torch.zeros(1, 3, 32, 32)).shape == (1, 7)
    assert backbone.weights == {
        "model": "torchvision.models:resnet18",
        "source": "random",
        "seed": 3,
    }
    again = build_backbone(spec, PreprocessSpec(), seed=3)
    assert same_params(params(backbone.model), params(again.model))


def test_import_factory_dotted_attribute():
    assert import_factory("torchvision.models:resnet.resnet18") is torchvision.models.resnet18


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        ("torchvision.models.resnet18", {}, "must look like 'package.module:callable'"),
        ("no_such_package_xyz.models:net", {}, "cannot import no_such_package_xyz"),
        ("torchvision.models:resnet181", {}, "did you mean resnet18"),
        ("torchvision.models:resnet.nothing", {}, "torchvision.models.resnet has no attribute"),
        ("torchvision:__version__", {}, "not callable"),
        ("builtins:dict", {}, "returned a dict, not a torch.nn.Module"),
        ("torchvision.models:resnet18", {"bogus": 1}, "model.kwargs"),
    ],
)
def test_bad_factory(factory, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_backbone(ModelSpec(factory=factory, kwargs=kwargs), PreprocessSpec())


def test_factory_with_torchvision_weights_is_refused():
    spec = ModelSpec(factory="tests.cifar_resnet:resnet20", weights="DEFAULT")
    with pytest.raises(ConfigError, match="use checkpoint"):
        build_backbone(spec, PreprocessSpec())


# real CIFAR-10 weights


@pytest.fixture(scope="module")
def cifar_test_images() -> tuple[list[Image.Image], list[int]]:
    """The first 30 test images of each CIFAR-10 class, read straight from the tar."""
    per_class: dict[str, list[tarfile.TarInfo]] = {}
    with tarfile.open(DATA / "cifar10-jpeg.tar") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isfile() and len(parts) == 4 and parts[1] == "test":
                per_class.setdefault(parts[2], []).append(member)
        classes = sorted(per_class)  # folder order is CIFAR-10's label order
        assert len(classes) == 10
        images, labels = [], []
        for label, name in enumerate(classes):
            for member in sorted(per_class[name], key=lambda m: m.name)[:30]:
                data = tar.extractfile(member).read()
                images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                labels.append(label)
    return images, labels


def cifar_backbone(name: str) -> tuple:
    path = next((DATA / "weights").glob(f"{name}-*.th"))
    spec = ModelSpec(
        factory=f"tests.cifar_resnet:{name}", checkpoint=str(path), strip_prefix="module."
    )
    preprocess = PreprocessSpec(mean=IMAGENET_MEAN, std=IMAGENET_STD)
    return build_backbone(spec, preprocess), path


def accuracy(backbone, images: list[Image.Image], labels: list[int]) -> float:
    batch = torch.stack([backbone.transform(image) for image in images])
    assert batch.shape == (len(images), 3, 32, 32)
    with torch.no_grad():
        predicted = backbone.model(batch).argmax(1)
    return (predicted == torch.tensor(labels)).float().mean().item()


@needs_data
def test_resnet20_real_weights_classify_cifar10(cifar_test_images):
    backbone, path = cifar_backbone("resnet20")
    assert backbone.weights["sha256"].startswith("12fca82f")
    assert backbone.weights["sha256"] == file_sha256(path)
    acc = accuracy(backbone, *cifar_test_images)
    print(f"resnet20 accuracy on {len(cifar_test_images[1])} CIFAR-10 JPEG test images: {acc:.3f}")
    assert acc > 0.70


@needs_data
def test_resnet56_real_weights_load_strictly(cifar_test_images):
    backbone, _ = cifar_backbone("resnet56")
    assert backbone.weights["sha256"].startswith("4bfd9763")
    assert sum(p.numel() for p in backbone.model.parameters()) == pytest.approx(0.85e6, rel=0.01)
    acc = accuracy(backbone, *cifar_test_images)
    print(f"resnet56 accuracy on {len(cifar_test_images[1])} CIFAR-10 JPEG test images: {acc:.3f}")
    assert acc > 0.70


def test_backbone_layers_probes_a_named_model_or_a_configs(tmp_path):
    from featcache.models import backbone_layers

    layers, shown = backbone_layers("resnet18", input_size=32)
    by_name = {info.name: info for info in layers}
    assert shown == "input 32px"
    assert by_name["layer4"].output == "[512, 1, 1]" and by_name["fc"].output == "[1000]"
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {name: resnet18}\nlayers: [layer1]\n"
        "data: {source: synthetic, splits: [train]}\npreprocess: {crop: 40}\n"
    )
    layers, shown = backbone_layers(str(config))  # the config's crop sizes the probe
    assert shown == "input 40px" and {i.name: i for i in layers}["layer1"].output == "[64, 10, 10]"
    with pytest.raises(ConfigError, match="input_size -3 is not a probe image side"):
        backbone_layers("resnet18", input_size=-3)


def test_random_torchvision_weights_get_the_architectures_standard_eval_transform(tmp_path):
    """weights: null and no preprocess: the default weights' transforms(), so photos of
    different sizes go through as the architecture expects (resize 256, crop 224)."""
    import numpy as np
    from PIL import Image

    import featcache
    from featcache.models import build_preprocessing

    preprocessing = build_preprocessing(ModelSpec(name="resnet18"), PreprocessSpec())
    assert (preprocessing.decode_size, preprocessing.crop_size) == (256, 224)
    detection = build_preprocessing(ModelSpec(name="fasterrcnn_resnet50_fpn"), PreprocessSpec())
    assert detection.crop_size is None  # its weights' transform takes other inputs
    for i, size in enumerate([(300, 200), (180, 250), (240, 240)]):
        folder = tmp_path / "photos" / "val" / "x"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.random.default_rng(i).integers(0, 256, (*size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    store = featcache.extract_from_config(
        {
            "model": {"name": "resnet18"},
            "layers": [{"name": "layer4", "reduce": "avg"}, "layer1"],
            "data": {"source": "imagefolder", "root": str(tmp_path / "photos"), "splits": ["val"]},
            "loader": {"num_workers": 0},
            "output": {"dir": str(tmp_path / "out")},
            "runtime": {"progress": False},
        }
    )["val"]
    assert len(store) == 3 and store.shape("layer1") == (64, 56, 56)
    assert "resize_size=[256]" in store.attrs["preprocessing"]
