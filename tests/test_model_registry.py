"""The registry of model kinds: lookup, registration, and what every built Backbone reports."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError
from featcache.models import (
    Backbone,
    BuiltModel,
    ModelKind,
    Preprocessing,
    build_backbone,
    build_preprocessing,
    kind_for,
    register,
    registered,
    unregister,
)
from featcache.models.preprocess import build_transform, spec_preprocessing

# isort: split
# After featcache, which makes torchvision importable where its compiled ops cannot load.
import torchvision
from torchvision.models import ResNet18_Weights

ENUM = ResNet18_Weights.IMAGENET1K_V1


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
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    monkeypatch.setattr(torchvision.models, "get_model", get_model)
    return calls


def tokenize(texts):
    ids = torch.tensor([[len(t)] for t in texts])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class ToyKind(ModelKind):
    """A test-local kind: ``toy:<width>`` is a linear layer of that width, its own resize."""

    name = "toy"
    built: list[tuple[str, int]] = []

    def preprocessing(self, ref, model, preprocess):
        if not ref.isdigit():
            raise ConfigError(f"toy model {ref!r} must be a width, e.g. toy:8")
        if preprocess.is_set():
            return spec_preprocessing(preprocess)
        return Preprocessing(build_transform(PreprocessSpec(resize=12, crop=8)), 12, 8)

    def build(self, ref, model, seed):
        self.built.append((ref, seed))
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, int(ref), **model.kwargs))
        return BuiltModel(
            module.train(),  # build_backbone puts it in eval mode
            {"source": "toy", "release": "v2"},
            tokenizer=tokenize,
            prefix_tokens=1,
            sequence_first=True,
        )


@pytest.fixture
def toy():
    kind = register(ToyKind())
    ToyKind.built = []
    yield kind
    unregister("toy")


# looking kinds up


def test_kind_for_maps_spec_fields_to_kinds(toy):
    assert registered()[:2] == ["torchvision", "factory"]
    tv, ref = kind_for(ModelSpec(name="resnet18"))
    assert (tv.name, ref) == ("torchvision", "resnet18")
    assert kind_for(ModelSpec(name="torchvision:resnet18")) == (tv, "resnet18")
    factory, ref = kind_for(ModelSpec(factory="pkg.mod:make"))
    assert (factory.name, ref) == ("factory", "pkg.mod:make")
    assert kind_for(ModelSpec(name="toy:8")) == (toy, "8")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tim:vit_small_patch16_224", r"unknown model kind .tim. .*\(did you mean timm\?\)"),
        ("torchvison:resnet18", r"'torchvison'.*\(did you mean torchvision\?\)"),
        ("factory:torchvision.models:resnet18", "a factory goes in model.factory"),
    ],
)
def test_unknown_kind_is_one_clear_error(name, message):
    with pytest.raises(ConfigError, match=message) as caught:
        build_backbone(ModelSpec(name=name), PreprocessSpec())
    assert "\n" not in str(caught.value) and name in str(caught.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            ModelSpec(name="torchvision:resnet181"),
            r"unknown torchvision model 'resnet181'.*resnet18",
        ),
        (ModelSpec(name="toy:wide"), r"toy model 'wide' must be a width"),
        (ModelSpec(factory="no_such_package_xyz:net"), "cannot import no_such_package_xyz"),
    ],
)
def test_unknown_reference_is_one_clear_error_before_building(toy, spec, message):
    with pytest.raises(ConfigError, match=message) as caught:
        build_backbone(spec, PreprocessSpec())
    assert "\n" not in str(caught.value)
    assert toy.built == []


def test_register_refuses_taken_and_bad_names(toy):
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register(ToyKind())
    assert register(ToyKind(), replace=True) is not toy

    class Bad(ToyKind):
        name = "Bad:kind"

    with pytest.raises(ValueError, match="lower-case identifier"):
        register(Bad())
    assert "Bad:kind" not in registered()


def test_unregistered_kind_is_unknown(toy):
    unregister("toy")
    with pytest.raises(ConfigError, match="unknown model kind 'toy'"):
        kind_for(ModelSpec(name="toy:8"))


# building through a registered kind


def test_new_kind_builds_through_build_backbone(toy):
    spec = ModelSpec(name="toy:5", kwargs={"bias": False})
    backbone = build_backbone(spec, PreprocessSpec(), seed=7)
    assert toy.built == [("5", 7)]
    assert isinstance(backbone, Backbone) and backbone.kind == "toy"
    assert not backbone.model.training
    assert backbone.model[1].bias is None and backbone.model[1].out_features == 5
    assert backbone.weights == {"model": "toy:5", "source": "toy", "release": "v2"}
    assert (backbone.decode_size, backbone.prefix_tokens, backbone.sequence_first) == (12, 1, True)
    assert backbone.tokenizer is tokenize
    image = Image.new("RGB", (20, 16), (10, 20, 30))
    x = backbone.transform(image)
    assert x.dtype == torch.float32 and x.shape == (3, 8, 8)
    with torch.no_grad():
        assert backbone.model(x[None]).shape == (1, 5)
    again = build_backbone(spec, PreprocessSpec(), seed=7)
    assert torch.equal(again.model[1].weight, backbone.model[1].weight)

    explicit = build_backbone(spec, PreprocessSpec(resize=20, crop=16))
    assert explicit.decode_size == 20 and explicit.transform(image).shape == (3, 16, 16)


def test_checkpoint_loads_on_top_of_any_kind(toy, tmp_path):
    torch.manual_seed(99)
    saved = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4)).state_dict()
    path = tmp_path / "toy.pt"
    torch.save(saved, path)
    backbone = build_backbone(ModelSpec(name="toy:4", checkpoint=str(path)), PreprocessSpec())
    assert torch.equal(backbone.model[1].weight, saved["1.weight"])
    assert backbone.kind == "toy"
    assert backbone.weights == {
        "model": "toy:4",
        "source": "checkpoint",
        "path": str(path),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "release": "v2",  # what the kind had loaded underneath
    }


# what every built Backbone reports


def checkpoint_of(tmp_path: Path, module: nn.Module) -> tuple[str, str]:
    path = tmp_path / "weights.pt"
    torch.save(module.state_dict(), path)
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_backbone_reports_its_weights_identity(tmp_path, fake_get_model):
    path, sha256 = checkpoint_of(tmp_path, nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    cases = [
        (ModelSpec(name="resnet18"), {"source": "random", "seed": 5}),
        (
            ModelSpec(name="resnet18", weights="DEFAULT"),
            {"source": "torchvision", "enum": "ResNet18_Weights.IMAGENET1K_V1", "url": ENUM.url},
        ),
        (
            ModelSpec(name="resnet18", weights="DEFAULT", checkpoint=path),
            {
                "source": "checkpoint",
                "path": path,
                "sha256": sha256,
                "enum": "ResNet18_Weights.IMAGENET1K_V1",
                "url": ENUM.url,
            },
        ),
        (
            ModelSpec(name="resnet18", checkpoint=path),  # the seed no longer matters
            {"source": "checkpoint", "path": path, "sha256": sha256},
        ),
        (ModelSpec(factory="torch.nn:Identity"), {"source": "random", "seed": 5}),
    ]
    for spec, expected in cases:
        backbone = build_backbone(spec, PreprocessSpec(), seed=5)
        assert backbone.weights == {"model": spec.name or spec.factory, **expected}
        assert list(backbone.weights)[:2] == ["model", "source"]  # the order stores show
        assert json.loads(json.dumps(backbone.weights)) == backbone.weights
        assert backbone.kind == ("factory" if spec.factory else "torchvision")
        # CNNs: no tokenizer and no token layout declared
        assert (backbone.tokenizer, backbone.prefix_tokens, backbone.sequence_first) == (
            None,
            None,
            False,
        )
    assert [name for name, _ in fake_get_model] == ["resnet18"] * 4


def test_prefixed_torchvision_name_builds_the_same_model(fake_get_model):
    backbone = build_backbone(
        ModelSpec(name="torchvision:resnet18", weights="DEFAULT"), PreprocessSpec()
    )
    assert fake_get_model == [("resnet18", {"weights": ENUM})]
    assert backbone.weights["model"] == "torchvision:resnet18"
    assert backbone.weights["enum"] == "ResNet18_Weights.IMAGENET1K_V1"


def test_backbone_keeps_its_positional_fields():
    module = nn.Identity()
    backbone = Backbone(module, build_transform(PreprocessSpec()), {"source": "x"}, 32, kind="x")
    assert backbone.model is module and backbone.decode_size == 32 and backbone.kind == "x"
    assert (backbone.tokenizer, backbone.prefix_tokens, backbone.sequence_first) == (
        None,
        None,
        False,
    )
    with pytest.raises(TypeError):
        Backbone(module, build_transform(PreprocessSpec()), {}, 32, "x")  # kind is keyword-only


# preprocessing without building


def test_build_preprocessing_matches_build_backbone_without_building(fake_get_model):
    weights = ModelSpec(name="resnet18", weights="DEFAULT")
    own = build_preprocessing(weights, PreprocessSpec())
    assert (own.decode_size, own.crop_size) == (256, 224)
    assert repr(own.transform) == repr(ENUM.transforms())
    explicit = build_preprocessing(weights, PreprocessSpec(resize=40, crop=32))
    assert (explicit.decode_size, explicit.crop_size) == (40, 32)
    plain = build_preprocessing(ModelSpec(factory="torch.nn:Identity"), PreprocessSpec())
    assert (plain.decode_size, plain.crop_size) == (None, None)
    assert fake_get_model == []  # nothing was built
    backbone = build_backbone(weights, PreprocessSpec())
    assert backbone.decode_size == own.decode_size
    assert repr(backbone.transform) == repr(own.transform)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("timm:resnet18", "checkpoint_path"),
        ("timm:resnet18", "pretrained_cfg_overlay"),
        ("open_clip:ViT-B-32", "load_weights"),
        ("open_clip:ViT-B-32", "pretrained_image_path"),
        ("hf:some/repo", "ignore_mismatched_sizes"),
        ("lraspp_mobilenet_v3_large", "weights_backbone"),
    ],
)
def test_kwargs_that_choose_weights_behind_the_identity_are_refused(name, key):
    """Weights read (or skipped) through model.kwargs would leave the recorded weights
    identity saying something else: random, or a file whose values were not all used."""
    with pytest.raises(ConfigError, match=f"model.kwargs.{key} is refused for .*identity"):
        kind_for(ModelSpec(name=name, kwargs={key: "x"}))
