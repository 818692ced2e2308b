"""The hf model kind with tiny transformers models saved into tmp_path: weights, preprocessing,
image towers, token layout, extraction end to end, and the one-line errors."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import featcache
from featcache.config.spec import DataSpec, ModelSpec, PreprocessSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.models import build_backbone, build_preprocessing, kind_for
from featcache.sources.synthetic import synthetic_source
from featcache.util.fingerprints import file_sha256

transformers = pytest.importorskip("transformers")

TINY = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
TEXT = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, bos_token_id=0
)
# featcache's pipeline rebuilds the processor's own steps (uint8 resize, floor crop, fused
# normalisation): what is left is float32 rounding of the normalisation.
PROCESSOR_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub access: offline mode and an empty cache, whatever the machine has."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    transformers.logging.set_verbosity_error()
    return cache


def tiny_config(kind: str):
    """Tiny configs of the families the kind supports."""
    t = transformers
    if kind == "vit":
        return t.ViTConfig(**TINY, intermediate_size=64)
    if kind == "deit":
        return t.DeiTConfig(**TINY, intermediate_size=64)
    if kind == "dinov2":
        return t.Dinov2Config(**TINY, mlp_ratio=2)
    if kind == "dinov2_registers":
        return t.Dinov2WithRegistersConfig(**TINY, mlp_ratio=2, num_register_tokens=4)
    if kind == "clip_vision":
        return t.CLIPVisionConfig(**TINY, intermediate_size=64)
    if kind == "clip":
        vision = t.CLIPVisionConfig(**TINY, intermediate_size=64)
        text = t.CLIPTextConfig(**TEXT, intermediate_size=64, eos_token_id=1)
        return t.CLIPConfig(
            vision_config=vision.to_dict(), text_config=text.to_dict(), projection_dim=16
        )
    if kind == "siglip":
        vision = t.SiglipVisionConfig(**TINY, intermediate_size=64)
        text = t.SiglipTextConfig(**TEXT, intermediate_size=64, eos_token_id=1)
        return t.SiglipConfig(vision_config=vision.to_dict(), text_config=text.to_dict())
    if kind == "beit":
        return t.BeitConfig(**TINY, intermediate_size=64)
    if kind == "convnext":
        return t.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32)
    raise AssertionError(kind)


def save(folder, kind: str = "vit", processor=None, seed: int = 7):
    """A randomly initialised tiny model of ``kind`` saved with save_pretrained; the model."""
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(tiny_config(kind)).eval()
    model.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    return model


def vit_processor():
    return transformers.ViTImageProcessor(size={"height": 32, "width": 32})


def spec(folder, weights=None, **kw) -> ModelSpec:
    return ModelSpec(name=f"hf:{folder}", weights=weights, **kw)


def build(folder, weights=None, seed: int = 0, **kw):
    return build_backbone(spec(folder, weights, **kw), PreprocessSpec(), seed)


def test_pretrained_folder_loads_exactly_the_saved_weights(tmp_path):
    saved = save(tmp_path / "vit", processor=vit_processor())
    backbone = build(tmp_path / "vit", "pretrained")
    expected, loaded = saved.state_dict(), backbone.model.state_dict()
    assert expected.keys() == loaded.keys()
    assert all(torch.equal(expected[k], loaded[k]) for k in expected)
    assert backbone.kind == "hf" and backbone.tokenizer is None
    assert backbone.prefix_tokens == 1 and backbone.sequence_first is False
    assert backbone.weights == {
        "model": f"hf:{tmp_path / 'vit'}",
        "source": "hf",
        "repo": str(tmp_path / "vit"),
        "revision": None,
        "files": {"model.safetensors": file_sha256(tmp_path / "vit" / "model.safetensors")},
    }
    assert next(backbone.model.parameters()).dtype == torch.float32


def test_weights_the_files_lack_are_seeded_and_named_and_misfits_refused(tmp_path):
    """A config with a third layer the saved weights lack: that layer starts at random,
    the same for the same seed, and the weights identity names its keys."""
    save(tmp_path / "vit")
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    (tmp_path / "vit" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    first, again = build(tmp_path / "vit", "pretrained"), build(tmp_path / "vit", "pretrained")
    random = first.weights["random"]
    assert random["seed"] == 0 and random["keys"]
    assert all("layer" in key and ".2." in key for key in random["keys"])  # the third layer
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            first.model.state_dict().values(), again.model.state_dict().values(), strict=True
        )
    )
    (tmp_path / "vit" / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    with pytest.raises(ConfigError, match="its weights do not fit its config"):
        build(tmp_path / "vit", "pretrained")


def test_relative_folder_and_sharded_weights(tmp_path, monkeypatch):
    torch.manual_seed(0)
    saved = transformers.AutoModel.from_config(tiny_config("vit"))
    saved.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    monkeypatch.chdir(tmp_path)
    backbone = build_backbone(
        ModelSpec(name="hf:sharded", weights="pretrained"), PreprocessSpec(resize=32), 0
    )
    assert list(backbone.weights["files"]) == shards
    assert all(
        torch.equal(v, backbone.model.state_dict()[k]) for k, v in saved.state_dict().items()
    )


def test_random_weights_are_seeded_and_identify_the_config(tmp_path):
    saved = save(tmp_path / "vit", processor=vit_processor())
    first, again, other = (build(tmp_path / "vit", None, seed) for seed in (0, 0, 1))
    params = [dict(b.model.named_parameters()) for b in (first, again, other)]
    name = "layers.0.attention.q_proj.weight"
    assert torch.equal(params[0][name], params[1][name])
    assert not torch.equal(params[0][name], params[2][name])
    assert not torch.equal(params[0][name], dict(saved.named_parameters())[name])
    assert first.weights == {
        "model": f"hf:{tmp_path / 'vit'}",
        "source": "random",
        "seed": 0,
        "config_sha256": file_sha256(tmp_path / "vit" / "config.json"),
    }


def _images() -> list[Image.Image]:
    """Odd sizes (odd crop offsets, both orientations), one from a grayscale image."""
    generator = np.random.default_rng(0)
    shapes = [(57, 43), (45, 70), (32, 32), (101, 33)]
    images = [
        Image.fromarray(generator.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes
    ]
    gray = Image.fromarray(generator.integers(0, 256, (50, 61), dtype=np.uint8))
    return images + [gray.convert("RGB")]


@pytest.mark.parametrize(
    "processor",
    [
        pytest.param(lambda t: t.ViTImageProcessor(size={"height": 32, "width": 32}), id="vit"),
        pytest.param(
            lambda t: t.CLIPImageProcessor(
                size={"shortest_edge": 37}, crop_size={"height": 32, "width": 32}
            ),
            id="clip",
        ),
        pytest.param(
            lambda t: t.BitImageProcessor(
                size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}, resample=2
            ),
            id="bit-bilinear",
        ),
        pytest.param(
            lambda t: t.SiglipImageProcessor(size={"height": 30, "width": 34}), id="siglip"
        ),
        pytest.param(
            lambda t: t.ViTImageProcessor(size={"height": 32, "width": 32}, resample=1),
            id="vit-lanczos",
        ),
        pytest.param(
            lambda t: t.ViTImageProcessor(size={"height": 32, "width": 32}, resample=0),
            id="vit-nearest",
        ),
    ],
)
def test_preprocessing_equals_the_image_processor(tmp_path, processor):
    hf_processor = processor(transformers)
    save(tmp_path / "m", processor=hf_processor)
    preprocessing = build_preprocessing(spec(tmp_path / "m"), PreprocessSpec())
    size = dict(hf_processor.size)
    assert preprocessing.decode_size == size.get(
        "shortest_edge", 32 if "height" in size and size["height"] == size["width"] else None
    )
    assert preprocessing.crop_size == (32 if hf_processor.do_center_crop else None)
    for image in _images():
        ours = preprocessing.transform(image)
        theirs = hf_processor(image, return_tensors="pt")["pixel_values"][0]
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape
        assert (ours - theirs).abs().max() <= PROCESSOR_TOLERANCE


def test_preprocessing_is_picklable(tmp_path):
    import pickle

    save(tmp_path / "m", processor=vit_processor())
    transform = build_preprocessing(spec(tmp_path / "m"), PreprocessSpec()).transform
    image = _images()[0]
    assert torch.equal(pickle.loads(pickle.dumps(transform))(image), transform(image))


def test_preprocessing_without_a_processor_uses_the_model_types_default(tmp_path):
    save(tmp_path / "clip", "clip")  # no preprocessor_config.json
    preprocessing = build_preprocessing(spec(tmp_path / "clip"), PreprocessSpec())
    assert (preprocessing.decode_size, preprocessing.crop_size) == (32, 32)  # 224/224 * 32
    default = transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    for image in _images():
        theirs = default(image, return_tensors="pt")["pixel_values"][0]
        assert (preprocessing.transform(image) - theirs).abs().max() <= PROCESSOR_TOLERANCE


def test_explicit_preprocess_wins(tmp_path):
    save(tmp_path / "m", processor=vit_processor())
    preprocessing = build_preprocessing(spec(tmp_path / "m"), PreprocessSpec(resize=40, crop=32))
    assert (preprocessing.decode_size, preprocessing.crop_size) == (40, 32)
    image = _images()[0]
    explicit = featcache.models.build_transform(PreprocessSpec(resize=40, crop=32))(image)
    assert torch.equal(preprocessing.transform(image), explicit)


@pytest.mark.parametrize(
    ("kind", "prefix"),
    [
        ("vit", 1),
        ("deit", 2),
        ("dinov2", 1),
        ("dinov2_registers", 5),
        ("clip_vision", 1),
        ("clip", 1),
        ("siglip", 0),
    ],
)
def test_prefix_tokens_match_the_token_outputs(tmp_path, kind, prefix):
    save(tmp_path / kind, kind, processor=vit_processor())
    backbone = build(tmp_path / kind, "pretrained")
    assert backbone.prefix_tokens == prefix and backbone.sequence_first is False
    with torch.no_grad():
        out = backbone.model(torch.randn(2, 3, 32, 32))  # one positional [B, 3, H, W]
    tokens = out.last_hidden_state
    assert tokens.shape == (2, prefix + (32 // 8) ** 2, 32)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_dual_encoders_give_their_vision_tower(tmp_path, kind):
    saved = save(tmp_path / kind, kind, processor=vit_processor())
    pretrained = build(tmp_path / kind, "pretrained").model
    random = build(tmp_path / kind, None).model
    tower = {"clip": transformers.CLIPVisionModel, "siglip": transformers.SiglipVisionModel}
    assert type(pretrained) is type(random) is tower[kind]
    expected = saved.vision_model.state_dict()
    assert all(torch.equal(v, pretrained.state_dict()[k]) for k, v in expected.items())
    assert [n for n, _ in pretrained.named_modules()] == [n for n, _ in random.named_modules()]
    assert "encoder.layers.1" in dict(pretrained.named_modules())


def test_extract_from_config_stores_the_hidden_states(tmp_path):
    processor = transformers.BitImageProcessor(
        size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}
    )
    saved = save(tmp_path / "dinov2", "dinov2", processor=processor)
    config = {
        "model": {"name": f"hf:{tmp_path / 'dinov2'}", "weights": "pretrained"},
        "layers": [{"name": "encoder.layer.1"}, {"name": "layernorm", "reduce": "none"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 45, "num_classes": 3},
            "splits": {"val": {"size": 6}},
        },
        "loader": {"batch_size": 4, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False, "device": "cpu"},
    }
    store = featcache.extract_from_config(config)["val"]
    source = synthetic_source(
        DataSpec(source="synthetic", kwargs={"image_size": 45, "num_classes": 3}),
        "val",
        {"size": 6},
        None,
    )
    images = [source[i][0] for i in range(6)]
    pixels = processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = saved(pixels, output_hidden_states=True)
    stored = store.read("encoder.layer.1")
    assert stored.shape == (6, 17, 32)  # the block outputs a tensor: no select needed
    torch.testing.assert_close(stored, out.hidden_states[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(store.read("layernorm"), out.last_hidden_state, atol=1e-4, rtol=1e-4)
    assert store.attrs["weights"]["source"] == "hf"


def test_folder_without_config_is_one_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json, so it is not a transformers"):
        build_preprocessing(spec(tmp_path / "empty"), PreprocessSpec())


@pytest.mark.parametrize("ref", ["not a repo", "a/b/c", "owner/name@"])
def test_bad_references_are_config_errors(ref):
    with pytest.raises(ConfigError, match="neither an existing folder nor a Hugging Face repo id"):
        build_preprocessing(ModelSpec(name=f"hf:{ref}"), PreprocessSpec(resize=32))


@pytest.mark.parametrize("weights", ["pretrained", None])
def test_hub_id_not_cached_offline_names_the_cache_and_the_download(offline, weights):
    model = ModelSpec(name="hf:facebook/dinov2-small@main", weights=weights)
    for call in (
        lambda: build_preprocessing(model, PreprocessSpec()),
        lambda: build_backbone(model, PreprocessSpec(resize=32)),
    ):
        with pytest.raises(FeatcacheError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message
        assert f"nor in the local Hugging Face cache {offline}" in message
        assert message.endswith("hf download facebook/dinov2-small --revision main")


def test_hub_id_in_the_cache_records_the_snapshot(offline, tmp_path):
    """A repository laid out as the hub cache does: revision is the snapshot folder's name."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = offline / "models--owner--tiny-vit" / "snapshots" / commit
    saved = save(snapshot, processor=vit_processor())
    (offline / "models--owner--tiny-vit" / "refs").mkdir()
    (offline / "models--owner--tiny-vit" / "refs" / "main").write_text(commit)
    backbone = build("owner/tiny-vit", "pretrained")
    assert backbone.weights == {
        "model": "hf:owner/tiny-vit",
        "source": "hf",
        "repo": "owner/tiny-vit",
        "revision": commit,
        "files": {"model.safetensors": file_sha256(snapshot / "model.safetensors")},
    }
    assert all(
        torch.equal(v, backbone.model.state_dict()[k]) for k, v in saved.state_dict().items()
    )
    random = build(f"owner/tiny-vit@{commit}", None)
    assert random.weights["config_sha256"] == file_sha256(snapshot / "config.json")


@pytest.mark.parametrize("weights", ["DEFAULT", "IMAGENET1K_V1", "/some/file.pt"])
def test_other_weights_are_refused(tmp_path, weights):
    save(tmp_path / "m", processor=vit_processor())
    with pytest.raises(ConfigError, match=f"model.weights '{weights}' is not available for hf"):
        build_preprocessing(spec(tmp_path / "m", weights), PreprocessSpec())


def test_kwargs_rejected_by_the_model_are_a_config_error(tmp_path):
    save(tmp_path / "m", processor=vit_processor())
    with pytest.raises(ConfigError, match="model.kwargs {'bogus': 1} rejected by hf:"):
        build(tmp_path / "m", None, kwargs={"bogus": 1})


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("weights", [None, "pretrained"])
def test_trust_remote_code_is_passed_as_set(tmp_path, monkeypatch, trust, weights):
    save(tmp_path / "m", processor=vit_processor())
    calls = []
    for cls, method in [
        (transformers.AutoConfig, "from_pretrained"),
        (transformers.AutoModel, "from_pretrained"),
        (transformers.AutoModel, "from_config"),
        (transformers.AutoImageProcessor, "from_pretrained"),
    ]:
        original = getattr(cls, method)

        def spy(*args, _original=original, _name=f"{cls.__name__}.{method}", **kwargs):
            calls.append((_name, dict(kwargs)))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, method, spy)
    model = spec(tmp_path / "m", weights, trust_remote_code=trust)
    build_backbone(model, PreprocessSpec(), 0)
    assert {name for name, _ in calls} >= {"AutoConfig.from_pretrained"}
    for name, kwargs in calls:  # always explicit: unset, transformers may ask on a terminal
        assert kwargs.get("trust_remote_code") is trust, name
    kind, ref = kind_for(model)
    described = kind.code_run(ref, model)
    if trust:
        assert described == (
            f"run the Python code of the Hugging Face repository {tmp_path / 'm'} "
            "(model.trust_remote_code)"
        )
    else:
        assert described is None


def test_missing_transformers_names_the_extra(tmp_path, monkeypatch):
    save(tmp_path / "m", processor=vit_processor())
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        FeatcacheError, match=r"needs transformers; install it with: pip install 'featcache\[hf\]'"
    ):
        build(tmp_path / "m", "pretrained")


def test_processors_with_steps_of_their_own_are_run_as_they_are(tmp_path):
    processor = transformers.ConvNextImageProcessor(size={"shortest_edge": 32})
    save(tmp_path / "m", processor=processor)
    preprocessing = build_preprocessing(spec(tmp_path / "m"), PreprocessSpec())
    assert (preprocessing.decode_size, preprocessing.crop_size) == (None, None)
    for image in _images():
        theirs = processor(image, return_tensors="pt")["pixel_values"][0]
        assert torch.equal(preprocessing.transform(image), theirs)
    assert "ConvNextImageProcessor" in repr(preprocessing.transform)
    # an explicit preprocess section still wins
    assert build_preprocessing(spec(tmp_path / "m"), PreprocessSpec(resize=32)).decode_size == 32


# Each zoo model with its own processor and a block to compare; the JPEG photos are many
# times the target size.
EXACT_PIXELS = [
    ("vit", "layers.1", lambda t: t.ViTImageProcessor(size={"height": 32, "width": 32})),
    (
        "dinov2",
        "encoder.layer.1",
        lambda t: t.BitImageProcessor(
            size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}
        ),
    ),
    (
        "clip",
        "encoder.layers.1",
        lambda t: t.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
    ),
    (
        "siglip",
        "encoder.layers.1",
        lambda t: t.SiglipImageProcessor(size={"height": 32, "width": 32}),
    ),
    (
        "convnext",
        "encoder.stages.1",
        lambda t: t.ConvNextImageProcessor(size={"shortest_edge": 32}),
    ),
    ("beit", "layers.1", lambda t: t.BeitImageProcessor(size={"height": 32, "width": 32})),
]


@pytest.mark.parametrize(
    ("kind", "last", "processor"), EXACT_PIXELS, ids=[kind for kind, _, _ in EXACT_PIXELS]
)
def test_features_of_large_jpeg_photos_are_those_of_the_models_own_processor(
    tmp_path, hymenoptera_root, kind, last, processor
):
    """By default the photos are decoded in full, as the processor is given them: the
    stored hidden states equal the model run on the processor's pixel_values."""
    import shutil

    folder = tmp_path / "photos" / "val"
    photos = sorted((hymenoptera_root / "val" / "bees").glob("*.jpg"))[:6]
    for photo in photos:
        (folder / "bees").mkdir(parents=True, exist_ok=True)
        shutil.copy(photo, folder / "bees" / photo.name)
    assert min(min(Image.open(p).size) for p in photos) >= 4 * 32  # draft decoding would apply
    hf_processor = processor(transformers)
    saved = save(tmp_path / kind, kind, processor=hf_processor)
    tower = getattr(saved, "vision_model", saved)
    config = {
        "model": {"name": f"hf:{tmp_path / kind}", "weights": "pretrained"},
        "layers": [{"name": last}],
        "data": {"source": "imagefolder", "root": str(tmp_path / "photos"), "splits": ["val"]},
        "loader": {"batch_size": 3, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False, "device": "cpu"},
    }
    store = featcache.extract_from_config(config)["val"]
    images = [Image.open(folder / "bees" / p.name).convert("RGB") for p in photos]
    pixels = hf_processor(images, return_tensors="pt")["pixel_values"]
    hidden: dict[str, torch.Tensor] = {}
    module = dict(tower.named_modules())[last]
    handle = module.register_forward_hook(
        lambda m, a, out: hidden.setdefault("out", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        tower(pixels)
    handle.remove()
    torch.testing.assert_close(store.read(last), hidden["out"], atol=1e-5, rtol=1e-5)


def test_featcache_layers_lists_a_saved_folder_with_its_token_layout(tmp_path):
    from typer.testing import CliRunner

    from featcache.commands.app import app

    save(tmp_path / "reg", "dinov2_registers", processor=vit_processor())
    result = CliRunner().invoke(app, ["layers", f"hf:{tmp_path / 'reg'}"])
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert "input 32px" in header  # the folder's image processor
    lines = {row.split()[0]: row for row in rows}
    # a class token and four register tokens before the 4 x 4 patch tokens
    assert lines["encoder.layer.1"].endswith("[21, 32] tokens (5 prefix)")


def test_verify_refuses_a_store_whose_config_trusts_remote_code(tmp_path):
    from typer.testing import CliRunner

    from featcache.commands.app import app

    path = _vit_store(tmp_path, trust_remote_code=True)
    result = CliRunner().invoke(app, ["verify", str(path)])
    assert result.exit_code == 2
    assert "would run the Python code of the Hugging Face repository" in result.stderr
    assert "--trust-factory" in result.stderr
    trusted = CliRunner().invoke(app, ["verify", str(path), "--trust-factory"])
    assert trusted.exit_code == 0, trusted.output


def planted_repository(folder, ran):
    """A model folder with code of its own, which creates the file ``ran`` when run."""
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "plantednet",
                "auto_map": {"AutoConfig": "configuration_planted.PlantedConfig"},
            }
        )
    )
    (folder / "configuration_planted.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(ran)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class PlantedConfig(PretrainedConfig):\n"
        "    model_type = 'plantednet'\n"
    )
    return folder


def test_code_of_an_untrusted_repository_never_runs(tmp_path, monkeypatch):
    ran = tmp_path / "ran"
    folder = planted_repository(tmp_path / "planted", ran)
    monkeypatch.setattr("builtins.input", lambda *args: "y")  # a user saying yes to a prompt
    with pytest.raises(ConfigError, match="trust_remote_code"):
        build_preprocessing(spec(folder, "pretrained"), PreprocessSpec())
    with pytest.raises(ConfigError) as err:
        build_preprocessing(spec(folder, kwargs={"trust_remote_code": True}), PreprocessSpec())
    assert str(err.value) == (
        "model.kwargs.trust_remote_code is refused for hf models: set model.trust_remote_code: "
        "true instead (verify and cam never take it from a store without --trust-factory)"
    )
    assert not ran.exists()
    trusted = spec(folder, "pretrained", trust_remote_code=True)
    with pytest.raises(ConfigError, match="has no image processor"):  # it loaded the config
        build_preprocessing(trusted, PreprocessSpec())
    assert ran.read_text() == "ran"  # the planted code is real: trusted, it runs


def _vit_store(tmp_path, **model):
    """A 4-row store of the class tokens of a saved ViT folder; ``model`` adds model keys."""
    save(tmp_path / "vit", "vit", processor=vit_processor())
    config = {
        "model": {"name": f"hf:{tmp_path / 'vit'}", "weights": "pretrained", **model},
        "layers": [{"name": "layers.1", "reduce": "cls"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 3},
            "splits": {"val": {"size": 4}},
        },
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    return featcache.extract_from_config(config)["val"].path


def _planted_store(tmp_path, model: dict) -> str:
    """A store made from a ViT folder, its recorded model updated with ``model``."""
    import h5py

    from featcache.store import codec, seal

    path = _vit_store(tmp_path)
    with h5py.File(path, "r+") as f:
        recorded = codec.read_attrs(f)["config"]
        recorded["model"].update(model)
        codec.write_attrs(f, {"config": recorded})
        seal(f)  # whoever crafts a store can seal it: the seal guards against damage only
    return str(path)


@pytest.mark.parametrize(
    "model", [{"trust_remote_code": True}, {"kwargs": {"trust_remote_code": True}}]
)
def test_verify_and_cam_run_no_code_a_store_names(tmp_path, monkeypatch, model):
    from typer.testing import CliRunner

    from featcache.commands.app import app
    from featcache.commands.visualize import source_image

    ran = tmp_path / "ran"
    folder = planted_repository(tmp_path / "planted", ran)
    path = _planted_store(tmp_path, {"name": f"hf:{folder}", **model})
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    result = CliRunner().invoke(app, ["verify", path])
    assert result.exit_code == 2
    assert "trust_remote_code" in result.stderr and "--trust-factory" in result.stderr
    with pytest.raises(ConfigError, match="trust_remote_code"):
        source_image(path, 0)
    assert not ran.exists()


@pytest.fixture
def closing_hub(monkeypatch):
    """A hub endpoint on 127.0.0.1 that accepts each connection and closes it at once
    (a network that answers nothing), counting the connections; online mode."""
    import socket
    import threading

    from huggingface_hub import constants

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    seen = {"connections": 0}
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                continue
            seen["connections"] += 1
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    yield seen
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_a_hub_reference_that_cannot_be_fetched_fails_after_one_request(closing_hub):
    """Not cached and the hub unreachable: one request, no retries, one line."""
    with pytest.raises(FeatcacheError) as caught:
        build_backbone(ModelSpec(name="hf:owner/absent-model"), PreprocessSpec(resize=32))
    message = str(caught.value)
    assert (
        "\n" not in message
        and "hf:owner/absent-model is not a folder owner/absent-model" in message
    )
    assert message.endswith("download it with: hf download owner/absent-model")
    assert closing_hub["connections"] == 1  # the hub client alone retries 5 times
