"""The open_clip model kind: tiny architectures registered from configs the tests write.

Everything runs offline: the models are random or loaded from files written here, and the
pretrained-tag path reads a Hugging Face hub cache laid out in a temporary folder.
"""

from __future__ import annotations

import json
import pickle
import sys

import pytest
import torch
from PIL import Image

import featcache
from featcache.config.spec import ModelSpec, PreprocessSpec, load_config
from featcache.errors import ConfigError, FeatcacheError
from featcache.models import build_backbone, build_preprocessing, kind_for
from featcache.models.open_clip import OpenClipKind, token_layout
from featcache.sources import build_source
from featcache.util.fingerprints import file_sha256

open_clip = pytest.importorskip("open_clip")

VIT = "featcache-test-vit"  # test-only architecture names, registered below
RESNET = "featcache-test-rn"
TIMM_VIT = "featcache-test-timm-vit"
TIMM_NOCLS = "featcache-test-timm-nocls"
TEXT = {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1}
CONFIGS = {
    VIT: {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16},
    RESNET: {"image_size": 64, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8},
    TIMM_VIT: {"timm_model_name": "test_vit", "timm_pool": "", "image_size": 160},
    TIMM_NOCLS: {"timm_model_name": "test_vit_relpos", "timm_pool": "", "image_size": 160},
}
TAG = "fctest"  # a pretrained tag of VIT, added to open_clip's registry by one fixture
HUB_REPO = "featcache-test/tiny-clip"


@pytest.fixture(scope="module", autouse=True)
def tiny_architectures(tmp_path_factory):
    """Register the test architectures with open_clip (one JSON file each); undo it after."""
    folder = tmp_path_factory.mktemp("open_clip_configs")
    for name, vision in CONFIGS.items():
        config = {"embed_dim": 16, "vision_cfg": vision, "text_cfg": TEXT}
        (folder / f"{name}.json").write_text(json.dumps(config))
    open_clip.add_model_config(folder)
    yield
    factory = open_clip.factory
    factory._MODEL_CONFIG_PATHS.remove(folder)
    for name in CONFIGS:
        factory._MODEL_CONFIGS.pop(name, None)


def _clip(name: str, seed: int = 0) -> torch.nn.Module:
    """The whole CLIP model, built by open_clip directly (not through featcache)."""
    torch.manual_seed(seed)
    return open_clip.create_model(name, pretrained=None).eval()


def _tokens(visual: torch.nn.Module, blocks: str, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """The outputs of the direct children of ``blocks`` in one forward of ``visual``."""
    outputs: dict[str, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(lambda m, i, o, n=name: outputs.__setitem__(n, o))
        for name, module in visual.get_submodule(blocks).named_children()
    ]
    with torch.no_grad():
        visual(images)
    for handle in handles:
        handle.remove()
    return outputs


def _image(width: int = 45, height: int = 37) -> Image.Image:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(3))
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def _spec(name: str, weights: str | None = None, **kwargs) -> ModelSpec:
    return ModelSpec(name=f"open_clip:{name}", weights=weights, kwargs=kwargs)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _assert_same_weights(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = module.state_dict()
    assert set(got) == set(state)
    for key, value in state.items():
        assert torch.equal(got[key], value), key


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache, in offline mode; its folder."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # open_clip's ~/.cache/clip
    # huggingface_hub reads the variables once, on import: repoint what it read
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_the_kind_is_registered():
    kind, ref = kind_for(_spec(f"{VIT}/{TAG}"))
    assert isinstance(kind, OpenClipKind) and kind.name == "open_clip"
    assert ref == f"{VIT}/{TAG}" and kind.code_run(ref, _spec(VIT)) is None


def test_random_weights_are_seeded_and_the_module_is_the_image_tower():
    first = build_backbone(_spec(VIT), PreprocessSpec(), seed=0)
    again = build_backbone(_spec(VIT), PreprocessSpec(), seed=0)
    other = build_backbone(_spec(VIT), PreprocessSpec(), seed=1)
    assert type(first.model).__name__ == "VisionTransformer"
    assert first.kind == "open_clip" and first.tokenizer is None
    assert (first.prefix_tokens, first.sequence_first) == (1, False)
    _assert_same_weights(again.model, first.model.state_dict())
    assert not torch.equal(first.model.conv1.weight, other.model.conv1.weight)
    # the same weights open_clip itself builds after the same seed
    _assert_same_weights(first.model, _clip(VIT, seed=0).visual.state_dict())
    assert first.weights["source"] == "random" and first.weights["seed"] == 0
    assert first.weights["model"] == f"open_clip:{VIT}"
    assert len(first.weights["config_sha256"]) == 64
    assert first.weights == again.weights and other.weights["seed"] == 1
    assert "transformer.resblocks.1" in dict(first.model.named_modules())


@pytest.mark.parametrize(
    "name, blocks, prefix",
    [
        (VIT, "transformer.resblocks", 1),
        (TIMM_VIT, "trunk.blocks", 1),
        (TIMM_NOCLS, "trunk.blocks", 0),
    ],
)
def test_token_layout_matches_the_block_outputs(name, blocks, prefix):
    backbone = build_backbone(_spec(name), PreprocessSpec(), seed=0)
    assert (backbone.prefix_tokens, backbone.sequence_first) == (prefix, False)
    side = CONFIGS[name]["image_size"]
    outputs = _tokens(backbone.model, blocks, torch.randn(3, 3, side, side))
    grid = side // 8 if name == VIT else side // 16  # timm's test ViTs have 16 px patches
    for output in outputs.values():
        assert output.shape[:2] == (3, prefix + grid * grid)  # [B, T, D]


def test_a_sequence_first_transformer_is_reported():
    visual = _clip(VIT).visual
    visual.transformer.batch_first = False  # the stack then runs [T, B, D] between blocks
    assert token_layout(visual) == (1, True)
    outputs = _tokens(visual, "transformer.resblocks", torch.randn(3, 3, 32, 32))
    assert outputs["0"].shape[:2] == (1 + 16, 3)


def test_a_resnet_tower_has_no_tokens():
    backbone = build_backbone(_spec(RESNET), PreprocessSpec(), seed=0)
    assert type(backbone.model).__name__ == "ModifiedResNet"
    assert (backbone.prefix_tokens, backbone.sequence_first) == (0, False)
    with torch.no_grad():
        assert backbone.model(torch.randn(2, 3, 64, 64)).shape == (2, 16)


def test_extraction_stores_what_a_hooked_forward_gives(tmp_path):
    config = {
        "model": {"name": f"open_clip:{VIT}"},
        "layers": [{"name": "transformer.resblocks.1"}, {"name": "."}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 4},
            "splits": {"val": {"size": 6}},
        },
        "loader": {"batch_size": 4, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False, "device": "cpu", "seed": 7},
    }
    store = featcache.extract_from_config(config)["val"]
    got = store.read("transformer.resblocks.1")
    assert got.shape == (6, 17, 32)

    clip = _clip(VIT, seed=7)
    _, _, preprocess = open_clip.create_model_and_transforms(VIT)
    source = build_source(load_config(config).data, "val", preprocess)
    images = torch.stack([source[i][0] for i in range(6)])
    want = _tokens(clip.visual, "transformer.resblocks", images)["1"]
    _close(got, want)
    with torch.no_grad():
        _close(store.read("output"), clip.encode_image(images))  # the projected embedding
    assert store.attrs["resume_key"]["weights"]["seed"] == 7


def test_a_saved_checkpoint_loads_through_open_clip(tmp_path):
    clip = _clip(VIT, seed=5)
    path = tmp_path / "tiny_clip.pt"
    torch.save(clip.state_dict(), path)
    backbone = build_backbone(_spec(VIT, str(path)), PreprocessSpec(), seed=0)
    _assert_same_weights(backbone.model, clip.visual.state_dict())
    assert backbone.weights == {
        "model": f"open_clip:{VIT}",
        "source": "open_clip",
        "architecture": VIT,
        "tag": None,
        "files": {"tiny_clip.pt": file_sha256(path)},
    }


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "resnet_clip.pt"
    torch.save(_clip(RESNET).state_dict(), path)
    with pytest.raises(ConfigError, match=r"could not load the weights file .*resnet_clip\.pt"):
        build_backbone(_spec(VIT, str(path)), PreprocessSpec())


@pytest.fixture
def tiny_tag(monkeypatch):
    """A pretrained tag of VIT, with SigLIP-like preprocessing, stored on the hub repo
    HUB_REPO (which does not exist: the file only ever comes from a local cache)."""
    cfg = {
        "url": "",
        "hf_hub": f"{HUB_REPO}/",
        "mean": (0.5, 0.5, 0.5),
        "std": (0.5, 0.5, 0.5),
        "interpolation": "bilinear",
        "resize_mode": "squash",
    }
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, VIT, {TAG: cfg})


def _put_in_hub_cache(cache, state) -> str:
    """Lay out HUB_REPO's main revision with open_clip's default weights file name."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{HUB_REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    path = snapshot / "open_clip_pytorch_model.bin"
    torch.save(state, path)
    return str(path)


def test_pretrained_weights_come_from_the_local_hub_cache(tiny_tag, offline_hub):
    clip = _clip(VIT, seed=9)
    path = _put_in_hub_cache(offline_hub, clip.state_dict())
    backbone = build_backbone(_spec(f"{VIT}/{TAG}", "pretrained"), PreprocessSpec(), seed=0)
    _assert_same_weights(backbone.model, clip.visual.state_dict())
    assert backbone.weights == {
        "model": f"open_clip:{VIT}/{TAG}",
        "source": "open_clip",
        "architecture": VIT,
        "tag": TAG,
        "files": {"open_clip_pytorch_model.bin": file_sha256(path)},
    }
    # open_clip's own transform for the tag, from the same cache
    _, _, preprocess = open_clip.create_model_and_transforms(VIT, pretrained=TAG)
    ours = build_preprocessing(_spec(f"{VIT}/{TAG}", "pretrained"), PreprocessSpec())
    assert (ours.decode_size, ours.crop_size) == (32, None)  # squash: no crop
    _close(ours.transform(_image()), preprocess(_image()))


@pytest.mark.parametrize("name", [VIT, RESNET])
def test_preprocessing_equals_open_clips_eval_transform(name):
    _, _, preprocess = open_clip.create_model_and_transforms(name)
    ours = build_preprocessing(_spec(name), PreprocessSpec())
    side = CONFIGS[name]["image_size"]
    assert (ours.decode_size, ours.crop_size) == (side, side)
    for image in (_image(), _image(30, 90)):
        got = ours.transform(image)
        assert got.dtype == torch.float32 and got.shape == (3, side, side)
        _close(got, preprocess(image))
    _close(pickle.loads(pickle.dumps(ours.transform))(_image()), preprocess(_image()))


def test_preprocessing_of_builtin_tags_needs_no_download(offline_hub):
    clip = build_preprocessing(_spec("ViT-B-32/laion2b_s34b_b79k", "pretrained"), PreprocessSpec())
    assert (clip.decode_size, clip.crop_size) == (224, 224)
    assert clip.transform.transforms[-1].mean == pytest.approx(open_clip.OPENAI_DATASET_MEAN)
    siglip = build_preprocessing(_spec("ViT-B-16-SigLIP/webli", "pretrained"), PreprocessSpec())
    assert (siglip.decode_size, siglip.crop_size) == (224, None)
    assert siglip.transform.transforms[-1].mean == pytest.approx((0.5, 0.5, 0.5))
    bigger = build_preprocessing(_spec("ViT-B-32", force_image_size=256), PreprocessSpec())
    assert (bigger.decode_size, bigger.crop_size) == (256, 256)
    assert bigger.transform(_image()).shape == (3, 256, 256)


def test_explicit_preprocess_keys_win():
    ours = build_preprocessing(_spec(VIT), PreprocessSpec(resize=40, crop=36))
    assert (ours.decode_size, ours.crop_size) == (40, 36)
    assert ours.transform(_image()).shape == (3, 36, 36)
    assert ours.transform.transforms[-1].mean == [0.485, 0.456, 0.406]  # featcache's default


def test_an_unknown_architecture_gives_close_matches():
    with pytest.raises(ConfigError) as err:
        build_preprocessing(_spec("ViT-B-33"), PreprocessSpec())
    assert "unknown open_clip architecture 'ViT-B-33'; did you mean ViT-B-32" in str(err.value)
    assert "open_clip.list_models()" in str(err.value)


def test_an_unknown_tag_gives_close_matches():
    with pytest.raises(ConfigError) as err:
        build_preprocessing(_spec("ViT-B-32/laion2b_s34b_b78k"), PreprocessSpec())
    message = str(err.value)
    assert "unknown pretrained tag 'laion2b_s34b_b78k' for open_clip ViT-B-32" in message
    assert "did you mean laion2b_s34b_b79k" in message and "openai" in message


def test_tags_match_as_open_clip_matches_them():
    spec = _spec("ViT-B-32/LAION2B-S34B-B79K")
    kind, ref = kind_for(spec)
    assert kind.preprocessing(ref, spec, PreprocessSpec()).crop_size == 224


def test_pretrained_weights_need_a_tag():
    with pytest.raises(ConfigError, match="'pretrained' needs a pretrained tag") as err:
        build_preprocessing(_spec("ViT-B-32", "pretrained"), PreprocessSpec())
    assert "'open_clip:ViT-B-32/<tag>'" in str(err.value)


@pytest.mark.parametrize("weights", ["DEFAULT", "IMAGENET1K_V1", "/no/such/file.pt"])
def test_other_weights_values_are_refused(weights):
    with pytest.raises(
        ConfigError,
        match="is neither 'pretrained' nor an existing file; for open_clip models use null",
    ):
        build_backbone(_spec(VIT, weights), PreprocessSpec())


def test_a_tag_missing_from_the_offline_cache_names_the_cache_and_the_fetch(offline_hub):
    with pytest.raises(FeatcacheError) as err:
        build_backbone(_spec("ViT-B-32/laion2b_s34b_b79k", "pretrained"), PreprocessSpec())
    message = str(err.value)
    assert "\n" not in message
    assert f"not in the local cache {offline_hub} and HF_HUB_OFFLINE is set" in message
    assert "laion/CLIP-ViT-B-32-laion2B-s34B-b79K" in message
    assert "open_clip.create_model('ViT-B-32', pretrained='laion2b_s34b_b79k')" in message


class _Planted:
    """Unpickling it creates the file ``path``: the stand-in for code in a checkpoint."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_kwargs_that_would_unpickle_are_refused(tmp_path):
    path, planted = tmp_path / "planted.pt", tmp_path / "ran"
    torch.save({"visual.proj": _Planted(planted)}, path)
    model = _spec(VIT, str(path), weights_only=False)
    with pytest.raises(ConfigError) as err:
        build_backbone(model, PreprocessSpec())
    assert str(err.value).startswith(
        "model.kwargs.weights_only is refused for open_clip models: featcache reads weight "
        "files with torch.load(weights_only=True) only"
    )
    assert not planted.exists()
    with pytest.raises(ConfigError, match="model.kwargs.weights_only is refused"):
        kind_for(model)  # so verify refuses it before anything is built
    refused = "cannot be loaded with torch.load.weights_only=True.: it contains a pickled io.open"
    with pytest.raises(ConfigError, match=refused):
        build_backbone(_spec(VIT, str(path)), PreprocessSpec())
    assert not planted.exists()


def test_bad_kwargs_are_one_config_error():
    with pytest.raises(ConfigError, match=r"model.kwargs \{'bogus': 1\} rejected by open_clip"):
        build_backbone(_spec(VIT, bogus=1), PreprocessSpec())


def test_missing_open_clip_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)
    with pytest.raises(FeatcacheError) as err:
        build_preprocessing(_spec(VIT), PreprocessSpec())
    assert str(err.value) == (
        f"model.name 'open_clip:{VIT}' needs open_clip; "
        "install it with: pip install 'featcache[open_clip]'"
    )


def test_featcache_layers_lists_the_image_tower_with_its_token_layout():
    from typer.testing import CliRunner

    from featcache.commands.app import app

    result = CliRunner().invoke(app, ["layers", f"open_clip:{VIT}"])
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert "input 32px" in header
    lines = {row.split()[0]: row for row in rows}
    assert lines["transformer.resblocks.1"].endswith("[17, 32] tokens (1 prefix)")
