"""The timm model kind: references, seeded and local/cached weights, timm's own preprocessing."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.config.spec import ModelSpec, PreprocessSpec, load_config
from featcache.errors import ConfigError, FeatcacheError
from featcache.models import build_backbone, build_preprocessing, build_transform
from featcache.sources import build_source
from featcache.util.fingerprints import file_sha256

timm = pytest.importorskip("timm")
safetensors_torch = pytest.importorskip("safetensors.torch")

VIT = "timm:vit_tiny_patch16_224"
TINY_VIT = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}
NONE = PreprocessSpec()


def _backbone(name=VIT, kwargs=TINY_VIT, weights=None, seed=0, preprocess=NONE):
    return build_backbone(
        ModelSpec(name=name, weights=weights, kwargs=dict(kwargs)), preprocess, seed
    )


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _image(width=50, height=40, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, offline: env and huggingface_hub's constants."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _put_in_hub_cache(cache, repo, filename, state):
    """Lay out ``state`` as ``repo``'s ``filename`` at revision main, as huggingface_hub does."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    safetensors_torch.save_file(state, str(snapshot / filename))
    return snapshot / filename


def test_random_weights_are_seeded_and_the_vit_has_one_prefix_token():
    first, again, other = _backbone(seed=0), _backbone(seed=0), _backbone(seed=1)
    assert _same_state(_state(first.model), _state(again.model))
    assert not _same_state(_state(first.model), _state(other.model))
    assert first.weights == {"model": VIT, "source": "random", "seed": 0}
    assert first.kind == "timm"
    assert first.prefix_tokens == 1 and not first.sequence_first
    tokens = first.model.blocks[1](first.model.patch_embed(torch.zeros(1, 3, 32, 32)))
    assert tokens.shape == (1, 16, 32)  # the hook-level layout is [B, T, D]


@pytest.mark.parametrize(
    ("name", "kwargs", "prefix"),
    [
        (VIT, {**TINY_VIT, "reg_tokens": 4}, 5),
        (VIT, {**TINY_VIT, "class_token": False, "global_pool": "avg"}, 0),
        ("timm:deit_tiny_distilled_patch16_224", TINY_VIT, 2),
        ("timm:resnet10t", {}, 0),
    ],
)
def test_prefix_tokens_count_class_distillation_and_register_tokens(name, kwargs, prefix):
    backbone = _backbone(name, kwargs)
    assert backbone.prefix_tokens == prefix and not backbone.sequence_first


def test_a_small_cnn_is_seeded_too():
    first, again = _backbone("timm:resnet10t", {}), _backbone("timm:resnet10t", {})
    assert _same_state(_state(first.model), _state(again.model))
    with torch.no_grad():
        assert first.model(torch.zeros(1, 3, 32, 32)).shape == (1, 1000)


def test_preprocessing_is_timms_eval_transform():
    image = _image()
    preprocessing = build_preprocessing(ModelSpec(name="timm:resnet10t"), NONE)
    model = timm.create_model("resnet10t", pretrained=False)
    expected = timm.data.create_transform(
        **timm.data.resolve_model_data_config(model), is_training=False
    )
    assert torch.equal(preprocessing.transform(image), expected(image))
    assert preprocessing.crop_size == 176 and preprocessing.decode_size == int(176 / 0.875)
    tagged = build_preprocessing(ModelSpec(name="timm:vit_small_patch16_224.augreg_in21k"), NONE)
    reference = timm.data.create_transform(
        **timm.data.resolve_data_config(
            pretrained_cfg=timm.models.get_pretrained_cfg(
                "vit_small_patch16_224.augreg_in21k"
            ).to_dict()
        ),
        is_training=False,
    )
    assert torch.equal(tagged.transform(image), reference(image))
    assert tagged.crop_size == 224 and tagged.decode_size == int(224 / 0.9)


def test_img_size_in_kwargs_sets_the_crop():
    image = _image()
    preprocessing = build_preprocessing(ModelSpec(name=VIT, kwargs=TINY_VIT), NONE)
    expected = timm.data.create_transform(
        input_size=(3, 32, 32),
        interpolation="bicubic",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        crop_pct=0.9,
        crop_mode="center",
        is_training=False,
    )
    out = preprocessing.transform(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    assert torch.equal(out, expected(image))
    assert preprocessing.crop_size == 32 and preprocessing.decode_size == int(32 / 0.9)


def test_a_model_the_meta_device_cannot_build_still_gets_its_crop(monkeypatch):
    create = timm.create_model

    def no_meta(*args, **kwargs):
        if torch.get_default_device().type == "meta":
            raise NotImplementedError("not on meta")
        return create(*args, **kwargs)

    monkeypatch.setattr(timm, "create_model", no_meta)
    preprocessing = build_preprocessing(ModelSpec(name=VIT, kwargs=TINY_VIT), NONE)
    assert preprocessing.crop_size == 32 and preprocessing.decode_size == int(32 / 0.9)
    assert preprocessing.transform(_image()).shape == (3, 32, 32)


def test_explicit_preprocess_wins():
    explicit = PreprocessSpec(resize=40, crop=36, mean=[0.1, 0.2, 0.3], std=[0.4, 0.5, 0.6])
    preprocessing = build_preprocessing(ModelSpec(name=VIT, kwargs=TINY_VIT), explicit)
    assert (preprocessing.decode_size, preprocessing.crop_size) == (40, 36)
    image = _image()
    assert torch.equal(preprocessing.transform(image), build_transform(explicit)(image))


def test_extraction_stores_the_hooked_forward_of_the_same_model(tmp_path):
    config = {
        "model": {"name": VIT, "kwargs": TINY_VIT},
        "layers": [
            {"name": "blocks.1"},
            {"name": "norm", "reduce": "none"},
            {"name": "blocks[-1]", "reduce": "patches", "key": "grid"},
        ],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 40, "num_classes": 3},
            "splits": {"val": {"size": 6}},
        },
        "loader": {"batch_size": 4, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    store = featcache.extract_from_config(config)["val"]
    assert store.attrs["weights"] == {"model": VIT, "source": "random", "seed": 0}
    stored = store.read("blocks.1")
    assert stored.shape == (6, 17, 32)

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY_VIT).eval()
    transform = timm.data.create_transform(
        input_size=(3, 32, 32),
        interpolation="bicubic",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        crop_pct=0.9,
        is_training=False,
    )
    source = build_source(load_config(config).data, "val", transform)
    images = torch.stack([source[i][0] for i in range(len(source))])
    captured = []
    handle = model.blocks[1].register_forward_hook(lambda m, i, o: captured.append(o))
    with torch.no_grad():
        model(images)
    handle.remove()
    torch.testing.assert_close(stored, captured[0], rtol=1e-5, atol=1e-5)
    # timm's own API: the last block's patch tokens as a [D, h, w] map, prefix tokens dropped
    with torch.no_grad():
        (grid,) = model.forward_intermediates(images, indices=[1], intermediates_only=True)
    torch.testing.assert_close(store.read("grid"), grid, rtol=1e-5, atol=1e-5)


def test_register_tokens_stay_out_of_the_patch_mean(tmp_path):
    kwargs = {**TINY_VIT, "depth": 5, "reg_tokens": 4}
    backbone = _backbone(kwargs=kwargs)
    assert backbone.prefix_tokens == 5  # the class token and four register tokens
    layers = [
        {"name": "blocks[-4:]", "reduce": "mean"},
        {"name": "blocks[-1]", "reduce": "none", "key": "tokens"},
    ]
    images = torch.utils.data.TensorDataset(torch.randn(3, 3, 32, 32))
    store = featcache.extract(
        backbone.model, images, layers, tmp_path / "s.h5", dtype="float32", progress=False
    )  # prefix_tokens from the model's num_prefix_tokens
    assert store.layers == ["blocks.1", "blocks.2", "blocks.3", "blocks.4", "tokens"]
    tokens = store.read("tokens")  # [3, 5 + 16, 32]
    torch.testing.assert_close(store.read("blocks.4"), tokens[:, 5:].mean(1))
    with pytest.raises(ConfigError, match=r"index 99 is out of range; blocks has 5 entries"):
        featcache.extract(backbone.model, images, ["blocks[99]"], tmp_path / "t.h5", progress=False)


def test_the_patch_embedding_holds_no_class_token(tmp_path):
    """patch_embed runs before the ViT adds its class token: its 16 tokens are all patches,
    so mean averages all of them and cls is refused, where blocks carry the class token."""
    backbone = _backbone()
    x = torch.randn(3, 3, 32, 32)
    images = torch.utils.data.TensorDataset(x)
    layers = [{"name": "patch_embed", "reduce": "mean"}, {"name": "blocks[0]", "reduce": "mean"}]
    store = featcache.extract(
        backbone.model, images, layers, tmp_path / "s.h5", dtype="float32", progress=False
    )
    with torch.no_grad():
        patches = backbone.model.patch_embed(x)  # [3, 16, 32]
        tokens = backbone.model.blocks[0](backbone.model._pos_embed(patches))  # [3, 1 + 16, 32]
    torch.testing.assert_close(store.read("patch_embed"), patches.mean(1))
    torch.testing.assert_close(store.read("blocks.0"), tokens[:, 1:].mean(1))
    with pytest.raises(ConfigError, match=r"16 tokens are the patch tokens alone"):
        featcache.extract(
            backbone.model, images, [{"name": "patch_embed", "reduce": "cls"}], tmp_path / "c.h5"
        )
    listed = CliRunner().invoke(app, ["layers", VIT]).output  # at 224px: 14 x 14 patches
    assert re.search(r"patch_embed +PatchEmbed +\[196, 192\] tokens \(0 prefix\)", listed)
    assert re.search(r"blocks\.0 +Block +\[197, 192\] tokens \(1 prefix\)", listed)
    small = CliRunner().invoke(app, ["layers", VIT, "--input-size", "32"])
    assert small.exit_code == 2 and small.output.strip() == (
        "featcache: error: the probe batch of 32px images does not run through the model "
        "(AssertionError: Input height (32) doesn't match model (224)); give an input size "
        "the model takes (--input-size)"
    )


def test_a_rectangular_input_keeps_its_class_token_and_patch_grid(tmp_path):
    """32x48 images make a 4x6 grid: 24 patches and a class token, 25 tokens, which a
    square-grid rule would read as 5x5 patches and no class token."""
    backbone = _backbone(kwargs={**TINY_VIT, "img_size": (32, 48)})
    x = torch.randn(3, 3, 32, 48)
    layers = [
        {"name": "blocks[0]", "reduce": "mean"},
        {"name": "blocks[0]", "reduce": "patches", "key": "grid"},
        {"name": "patch_embed", "reduce": "patches", "key": "embedded"},
    ]
    store = featcache.extract(
        backbone.model, torch.utils.data.TensorDataset(x), layers, tmp_path / "s.h5",
        dtype="float32", progress=False,
    )  # fmt: skip
    with torch.no_grad():
        patches = backbone.model.patch_embed(x)  # [3, 24, 32]
        tokens = backbone.model.blocks[0](backbone.model._pos_embed(patches))  # [3, 25, 32]
    torch.testing.assert_close(store.read("blocks.0"), tokens[:, 1:].mean(1))
    grid = tokens[:, 1:].transpose(1, 2).reshape(3, 32, 4, 6)
    torch.testing.assert_close(store.read("grid"), grid)
    torch.testing.assert_close(store.read("embedded"), patches.transpose(1, 2).reshape(3, 32, 4, 6))


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_local_weights_file_is_loaded_through_timm(tmp_path, suffix):
    source = _backbone(seed=7)
    state = _state(source.model)
    path = tmp_path / f"tiny{suffix}"
    if suffix == ".safetensors":
        safetensors_torch.save_file(state, str(path))
    else:
        torch.save(state, path)
    loaded = _backbone(weights=str(path), seed=0)
    assert _same_state(_state(loaded.model), state)
    assert loaded.weights == {
        "model": VIT,
        "source": "timm",
        "name": "vit_tiny_patch16_224",
        "tag": timm.models.get_pretrained_cfg("vit_tiny_patch16_224").tag,
        "files": {path.name: file_sha256(path)},
    }
    assert loaded.prefix_tokens == 1
    # Other weights in the same file: another identity.
    state["head.bias"] = state["head.bias"] + 1
    if suffix == ".safetensors":
        safetensors_torch.save_file(state, str(path))
    else:
        torch.save(state, path)
    assert _backbone(weights=str(path)).weights["files"] != loaded.weights["files"]


def test_a_local_file_loads_whole_or_names_what_it_lacks(tmp_path):
    """timm loads a file leniently when num_classes differs from its tag's: the file's
    own classifier, a missing block or another model's weights must not pass silently."""
    tuned = _backbone(kwargs={**TINY_VIT, "num_classes": 10}, seed=7)  # a fine-tuned head
    path = tmp_path / "tuned.pth"
    torch.save(_state(tuned.model), path)
    loaded = _backbone(kwargs={**TINY_VIT, "num_classes": 10}, weights=str(path))
    assert _same_state(_state(loaded.model), _state(tuned.model)) and "random" not in loaded.weights
    fresh = _backbone(kwargs={**TINY_VIT, "num_classes": 5}, weights=str(path), seed=3)
    assert fresh.weights["random"] == {"seed": 3, "keys": ["head.bias", "head.weight"]}
    body = {k: v for k, v in _state(tuned.model).items() if not k.startswith("blocks.1.")}
    torch.save(body, tmp_path / "part.pth")
    with pytest.raises(ConfigError, match=r"holds no values for 12 weights of .*blocks\.1\."):
        _backbone(kwargs={**TINY_VIT, "num_classes": 10}, weights=str(tmp_path / "part.pth"))
    deeper = _backbone(kwargs={**TINY_VIT, "depth": 3, "num_classes": 10})
    torch.save(_state(deeper.model), tmp_path / "deeper.pth")
    with pytest.raises(ConfigError, match=r"weights that timm:.* does not have .*another model"):
        _backbone(kwargs={**TINY_VIT, "num_classes": 10}, weights=str(tmp_path / "deeper.pth"))


def test_a_local_file_that_does_not_fit_is_one_config_error(tmp_path):
    path = tmp_path / "other.pth"
    torch.save(_state(_backbone("timm:resnet10t", {}).model), path)
    with pytest.raises(ConfigError, match=r"timm could not load .*other\.pth into timm:vit_tiny"):
        _backbone(weights=str(path))


def test_pretrained_weights_are_read_from_the_hub_cache(offline_hub):
    ref = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    state = _state(_backbone(f"timm:{ref}", seed=5).model)
    cached = _put_in_hub_cache(offline_hub, f"timm/{ref}", "model.safetensors", state)
    loaded = _backbone(f"timm:{ref}", weights="pretrained", seed=0)
    assert _same_state(_state(loaded.model), state)
    assert loaded.weights == {
        "model": f"timm:{ref}",
        "source": "timm",
        "name": "vit_tiny_patch16_224",
        "tag": "augreg_in21k_ft_in1k",
        "files": {"model.safetensors": file_sha256(cached)},
    }


def test_pretrained_offline_and_not_cached_is_one_line_naming_the_cache(offline_hub):
    ref = "timm:resnet10t.c3_in1k"
    assert build_preprocessing(ModelSpec(name=ref, weights="pretrained"), NONE).crop_size == 176
    with pytest.raises(FeatcacheError) as caught:
        build_backbone(ModelSpec(name=ref, weights="pretrained"), NONE)
    message = str(caught.value)
    assert "\n" not in message
    assert str(offline_hub) in message and "HF_HUB_OFFLINE" in message
    assert "hf download timm/resnet10t.c3_in1k" in message


@pytest.mark.parametrize(
    ("name", "weights", "kwargs", "match"),
    [
        (
            "timm:vit_smal_patch16_224",
            None,
            {},
            r"unknown timm model 'vit_smal_patch16_224'; did you mean vit_small_patch16_224",
        ),
        (
            "timm:resnet50.a1_in1kk",
            None,
            {},
            r"unknown pretrained tag 'a1_in1kk' for timm model resnet50; "
            r"did you mean resnet50\.a1_in1k",
        ),
        (
            "timm:convnext_tiny_in22ft1k",
            None,
            {},
            r"deprecated; use timm:convnext_tiny\.fb_in22k_ft_in1k",
        ),
        (
            "timm:resnet50",
            "DEFAULT",
            {},
            r"model.weights 'DEFAULT' for timm:resnet50: use null \(random weights\), "
            r"'pretrained' .* or the path of an existing weights file",
        ),
        ("timm:resnet50", "missing/weights.pth", {}, r"'missing/weights.pth' .*no such file"),
        ("timm:resnet10t", None, {"no_such_kwarg": 1}, r"model.kwargs .* rejected by timm's"),
    ],
)
def test_bad_references_are_one_config_error(name, weights, kwargs, match):
    spec = ModelSpec(name=name, weights=weights, kwargs=kwargs)
    with pytest.raises(ConfigError, match=match) as caught:
        build_preprocessing(spec, NONE)  # before anything is built or read
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=match):
        build_backbone(spec, NONE)


def test_missing_timm_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    for call in (build_preprocessing, build_backbone):
        with pytest.raises(FeatcacheError, match=r"pip install 'featcache\[timm\]'") as caught:
            call(ModelSpec(name="timm:resnet10t"), NONE)
        assert "\n" not in str(caught.value) and "timm:resnet10t" in str(caught.value)


class _FailsAt(torch.utils.data.Dataset):
    """12 seeded 32 px images; reading row ``fail_at`` raises, as a crash mid-run would."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.images = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == self.fail_at:
            raise OSError("the disk went away")
        return self.images[i], 0


def test_a_changed_weights_file_is_refused_on_resume(tmp_path):
    path = tmp_path / "tiny.pth"
    torch.save(_state(_backbone(seed=3).model), path)
    store = tmp_path / "s.h5"

    def run(dataset):
        backbone = _backbone(weights=str(path))
        return featcache.extract(
            backbone.model, dataset, ["blocks.1"], store, provenance={"weights": backbone.weights},
            batch_size=4, num_workers=0, progress=False,
        )  # fmt: skip

    with pytest.raises(FeatcacheError, match="the disk went away"):
        run(_FailsAt(fail_at=9))  # rows 0-7 are kept in the partial store
    torch.save(_state(_backbone(seed=4).model), path)  # other weights in the same file
    with pytest.raises(ConfigError, match=r"cannot resume .*: its weights differs"):
        run(_FailsAt())
    torch.save(_state(_backbone(seed=3).model), path)  # the original weights again
    assert len(run(_FailsAt())) == 12  # resumes


def test_featcache_layers_lists_a_timm_model_with_its_token_layout(tmp_path):
    config = tmp_path / "c.yaml"
    model = {"name": VIT, "kwargs": TINY_VIT}
    config.write_text(yaml.safe_dump({"model": model, "layers": ["blocks.1"]}))
    result = CliRunner().invoke(app, ["layers", str(config)])
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert "input 32px" in header  # timm's data config for img_size=32
    lines = {row.split()[0]: row for row in rows}
    assert lines["blocks.1"].endswith("[17, 32] tokens (1 prefix)")
    assert lines["patch_embed.proj"].endswith("[32, 4, 4]")
