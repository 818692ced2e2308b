"""Model kinds on text data: hf text models and dual encoders, open_clip text towers, their
tokenizers, and the image-only kinds' refusal. Tiny random models saved here, offline."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import nn

import featcache
from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError
from featcache.models import build_backbone
from featcache.models.text import HFTokenizer, tokenizer_sha256

transformers = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")

TEXTS = ["a cat", "a rather longer sentence about dogs", "hi"]
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
CLIP_TEXT_ARCH = "featcache-test-text-clip"  # registered with open_clip by a fixture below


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub access: offline mode and an empty cache."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    transformers.logging.set_verbosity_error()


def save(folder, config, tokenizer=None, seed: int = 5) -> nn.Module:
    """A random model of ``config`` (and a ByT5 tokenizer unless given) saved to ``folder``."""
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config).eval()
    model.save_pretrained(folder)
    (tokenizer or transformers.ByT5Tokenizer()).save_pretrained(folder)
    return model


def bert_config():
    return transformers.BertConfig(vocab_size=384, max_position_embeddings=128, **SMALL)


def clip_config():
    vision = transformers.CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    text = transformers.CLIPTextConfig(
        vocab_size=384, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, **SMALL
    )
    return transformers.CLIPConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), projection_dim=16
    )


def text_backbone(folder, weights="pretrained", seed: int = 0):
    model = ModelSpec(name=f"hf:{folder}", weights=weights)
    return build_backbone(model, PreprocessSpec(), seed, inputs="text")


def padded(ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask``, as the loader makes them."""
    width = max(map(len, ids))
    input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    return input_ids, mask


def run(module: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor):
    with torch.no_grad():
        return module(input_ids=input_ids, attention_mask=mask)


# hf text models


def test_bert_folder_gives_the_model_and_its_tokenizer(tmp_path):
    save(tmp_path / "bert", bert_config())
    backbone = text_backbone(tmp_path / "bert")
    tokenizer = backbone.tokenizer
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.pad_id == 0 and tokenizer.max_length == 128  # the config's positions
    tokenized = tokenizer(TEXTS, None)
    byt5 = transformers.ByT5Tokenizer()
    assert tokenized.ids == byt5(TEXTS)["input_ids"]
    assert tokenized.truncated == [False, False, False]

    input_ids, mask = padded(tokenized.ids, tokenizer.pad_id)
    reference = transformers.AutoModel.from_pretrained(tmp_path / "bert").eval()
    expected = run(reference, input_ids, mask).last_hidden_state
    got = run(backbone.model, input_ids, mask).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert backbone.kind == "hf" and backbone.prefix_tokens is None
    assert backbone.sequence_first is False
    assert not backbone.model.training


def test_text_weights_identity_is_the_image_one_and_the_tokenizer_is_named(tmp_path):
    save(tmp_path / "bert", bert_config())
    backbone = text_backbone(tmp_path / "bert")
    assert backbone.weights["source"] == "hf"
    assert set(backbone.weights["files"]) == {"model.safetensors"}  # no tokenizer files
    digest = tokenizer_sha256(tmp_path / "bert")
    assert backbone.tokenizer is not None
    assert backbone.tokenizer.name == f"hf:{tmp_path / 'bert'} sha256:{digest}"
    random = text_backbone(tmp_path / "bert", weights=None, seed=3)
    assert random.weights["source"] == "random" and random.weights["seed"] == 3
    # another vocabulary, another name; the weights are unchanged
    (tmp_path / "bert" / "added_tokens.json").write_text(json.dumps({"<extra>": 384}))
    assert tokenizer_sha256(tmp_path / "bert") != digest


def test_truncation_flags_and_lengths(tmp_path):
    save(tmp_path / "bert", bert_config())
    tokenizer = text_backbone(tmp_path / "bert").tokenizer
    assert tokenizer is not None
    cut = tokenizer(["hello world", "hey", "abcd"], 5)
    # ByT5 ends each text with </s> (1), also when cut: 4 bytes and the end token
    assert cut.ids == [[107, 104, 111, 111, 1], [107, 104, 124, 1], [100, 101, 102, 103, 1]]
    assert cut.truncated == [True, False, False]
    long = tokenizer(["x" * 300], None)  # the model's limit: 128 positions
    assert len(long.ids[0]) == 128 and long.truncated == [True]
    assert tokenizer(["x" * 300], 1000).ids == long.ids  # never past the model's positions
    assert pickle.loads(pickle.dumps(tokenizer))(TEXTS, None) == tokenizer(TEXTS, None)


def gpt2_tokenizer():
    """A word-level fast tokenizer with an end token and no pad token, as GPT-2's."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eos>", "<unk>", "a", "cat", "dog", "sat", "on", "the", "mat"]
    model = models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    core = Tokenizer(model)
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", unk_token="<unk>"
    )


def test_gpt2_without_a_pad_token_pads_with_its_end_token(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=384, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    saved = save(tmp_path / "gpt2", config, tokenizer=gpt2_tokenizer())
    backbone = text_backbone(tmp_path / "gpt2")
    tokenizer = backbone.tokenizer
    assert tokenizer is not None
    assert tokenizer.pad_id == 0 and tokenizer.max_length == 64
    assert "tokenizer.json" in {p.name for p in (tmp_path / "gpt2").iterdir()}
    tokenized = tokenizer(["the cat sat on the mat", "a dog"], None)
    assert tokenized.ids == [[7, 3, 5, 6, 7, 8], [2, 4]]
    input_ids, mask = padded(tokenized.ids, tokenizer.pad_id)
    got = run(backbone.model, input_ids, mask).last_hidden_state
    torch.testing.assert_close(got, run(saved, input_ids, mask).last_hidden_state)
    alone = run(backbone.model, input_ids[1:, :2], mask[1:, :2]).last_hidden_state
    torch.testing.assert_close(got[1:, :2], alone, rtol=1e-5, atol=1e-5)  # causal


def test_t5_gives_its_encoder(tmp_path):
    config = transformers.T5Config(
        vocab_size=384, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2
    )
    saved = save(tmp_path / "t5", config)
    backbone = text_backbone(tmp_path / "t5")
    assert type(backbone.model).__name__ == "T5Stack"
    assert backbone.tokenizer is not None and backbone.tokenizer.max_length is None
    input_ids, mask = padded(backbone.tokenizer(TEXTS, None).ids, 0)
    expected = run(saved.get_encoder(), input_ids, mask).last_hidden_state
    torch.testing.assert_close(run(backbone.model, input_ids, mask).last_hidden_state, expected)


def test_clip_folder_gives_the_text_tower_on_text_and_the_image_tower_on_images(tmp_path):
    saved = save(tmp_path / "clip", clip_config())
    text = text_backbone(tmp_path / "clip")
    assert type(text.model).__name__ == "CLIPTextModel"
    assert text.tokenizer is not None and text.tokenizer.max_length == 32
    assert text.prefix_tokens is None
    assert "encoder.layers.1" in dict(text.model.named_modules())
    input_ids, mask = padded(text.tokenizer(TEXTS, None).ids, text.tokenizer.pad_id)
    expected = run(saved.text_model, input_ids, mask)
    got = run(text.model, input_ids, mask)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output)

    image = build_backbone(ModelSpec(name=f"hf:{tmp_path / 'clip'}", weights="pretrained"),
                           PreprocessSpec(resize=32, crop=32))  # fmt: skip
    assert type(image.model).__name__ == "CLIPVisionModel" and image.tokenizer is None
    assert image.prefix_tokens == 1
    assert image.weights == text.weights


def test_missing_tokenizer_and_image_models_are_one_line(tmp_path):
    torch.manual_seed(0)
    transformers.AutoModel.from_config(bert_config()).save_pretrained(tmp_path / "bare")
    with pytest.raises(ConfigError, match=r"has no tokenizer files .*tokenizer\.save_pretrained\("):
        text_backbone(tmp_path / "bare")
    vit = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    save(tmp_path / "vit", vit)
    with pytest.raises(ConfigError, match="is an image model with no text tower"):
        text_backbone(tmp_path / "vit")


# image-only kinds


@pytest.mark.parametrize(
    ("model", "api"),
    [
        (ModelSpec(name="resnet18"), False),
        (ModelSpec(name="timm:resnet18"), False),
        (ModelSpec(factory="torchvision.models:resnet18"), True),
    ],
)
def test_image_kinds_refuse_text(model, api):
    with pytest.raises(ConfigError) as error:
        build_backbone(model, PreprocessSpec(), inputs="text")
    line = str(error.value)
    assert "\n" not in line
    assert line.startswith(f"model {model.name or model.factory} takes images; text data needs")
    assert "hf:<text model or dual encoder> or open_clip:<architecture>" in line
    assert ("featcache.extract takes any model" in line) is api


def test_inputs_must_be_image_or_text():
    with pytest.raises(ConfigError, match="inputs 'audio' is neither"):
        build_backbone(ModelSpec(name="resnet18"), PreprocessSpec(), inputs="audio")  # type: ignore[arg-type]


# open_clip text towers


@pytest.fixture(scope="module")
def clip_text_arch(tmp_path_factory):
    """A tiny CLIP whose text tower reads open_clip's own BPE ids (vocabulary 49408)."""
    folder = tmp_path_factory.mktemp("open_clip_text_configs")
    vision = {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16}
    text = {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 2}
    config = {"embed_dim": 16, "vision_cfg": vision, "text_cfg": text}
    (folder / f"{CLIP_TEXT_ARCH}.json").write_text(json.dumps(config))
    open_clip.add_model_config(folder)
    yield CLIP_TEXT_ARCH
    open_clip.factory._MODEL_CONFIG_PATHS.remove(folder)
    open_clip.factory._MODEL_CONFIGS.pop(CLIP_TEXT_ARCH, None)


def test_open_clip_text_tower_equals_encode_text(clip_text_arch):
    backbone = build_backbone(
        ModelSpec(name=f"open_clip:{clip_text_arch}"), PreprocessSpec(), seed=3, inputs="text"
    )
    torch.manual_seed(3)
    clip = open_clip.create_model(clip_text_arch, pretrained=None).eval()
    texts = [
        "a photo of a cat",
        "hi",
        "a much longer sentence that will need cutting to fit, surely",
    ]
    with torch.no_grad():
        expected = clip.encode_text(open_clip.get_tokenizer(clip_text_arch)(texts))
    tokenizer = backbone.tokenizer
    assert tokenizer is not None
    assert (tokenizer.name, tokenizer.pad_id, tokenizer.max_length) == (
        f"open_clip:{clip_text_arch}",
        0,
        12,
    )
    tokenized = tokenizer(texts, None)
    assert [len(ids) for ids in tokenized.ids] == [7, 3, 12]  # up to the end token
    assert all(ids[0] == 49406 and ids[-1] == 49407 for ids in tokenized.ids)
    assert tokenized.truncated == [False, False, True]

    input_ids, mask = padded(tokenized.ids, tokenizer.pad_id)
    torch.testing.assert_close(run(backbone.model, input_ids, mask), expected, rtol=1e-5, atol=1e-5)
    for i, ids in enumerate(tokenized.ids):  # each text alone, unpadded
        alone = run(backbone.model, torch.tensor([ids]), torch.ones(1, len(ids)))
        torch.testing.assert_close(alone[0], expected[i], rtol=1e-5, atol=1e-5)
    names = dict(backbone.model.named_modules())
    assert {"token_embedding", "transformer.resblocks.1", "ln_final"} <= set(names)
    assert backbone.prefix_tokens is None and backbone.sequence_first is False
    assert backbone.weights["source"] == "random" and "config_sha256" in backbone.weights


def test_open_clip_tokenizer_cuts_to_max_length_and_pickles(clip_text_arch):
    backbone = build_backbone(
        ModelSpec(name=f"open_clip:{clip_text_arch}"), PreprocessSpec(), inputs="text"
    )
    tokenizer = pickle.loads(pickle.dumps(backbone.tokenizer))
    cut = tokenizer(["a photo of a cat", "a cat"], 4)
    assert cut.ids[0] == [49406, 320, 1125, 49407] and cut.truncated == [True, False]
    assert cut.ids[1] == [49406, 320, 2368, 49407]
    exact = tokenizer(["a photo of a"], 6)  # start, 4 words, end: exactly 6
    assert len(exact.ids[0]) == 6 and exact.truncated == [False]
    assert tokenizer(["a photo of a"], 5).truncated == [True]


def test_featcache_is_imported_first():
    assert featcache.__name__ == "featcache"


# extraction from a config


def test_extract_from_config_on_text_uses_the_text_model(tmp_path):
    saved = save(tmp_path / "bert", bert_config())
    texts = ["a cat", "two dogs and a bird", "x", "the end"]
    lines = [json.dumps({"id": f"t{i}", "text": t, "label": i % 2}) for i, t in enumerate(texts)]
    (tmp_path / "val.jsonl").write_text("\n".join(lines) + "\n")
    config = {
        "model": {"name": f"hf:{tmp_path / 'bert'}", "weights": "pretrained"},
        "layers": [{"name": "encoder.layer.1", "reduce": "mean"}],
        "data": {"source": "text", "root": str(tmp_path), "splits": {"val": "val.jsonl"}},
        "loader": {"batch_size": 3, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False, "device": "cpu"},
    }
    store = featcache.extract_from_config(config)["val"]
    tokenizer = text_backbone(tmp_path / "bert").tokenizer
    assert tokenizer is not None
    stored = store.read("encoder.layer.1")
    assert stored.shape == (4, 32)
    for i, ids in enumerate(tokenizer(texts, None).ids):  # each text alone: no padding
        hidden = run(saved, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        expected = hidden.last_hidden_state[0].mean(dim=0)
        torch.testing.assert_close(torch.as_tensor(stored[i]), expected, rtol=1e-4, atol=1e-4)
    provenance = store.attrs
    assert provenance["preprocessing"] == f"tokenizer {tokenizer.name}, max_length 128"
    assert provenance["weights"]["source"] == "hf"


@pytest.mark.parametrize(
    ("config", "block"),
    [
        (
            lambda t: t.T5Config(
                vocab_size=384, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2
            ),
            "block.0",
        ),
        (lambda t: t.DebertaV2Config(vocab_size=384, max_position_embeddings=128, **SMALL), None),
        (lambda t: t.MPNetConfig(vocab_size=384, max_position_embeddings=130, **SMALL), None),
    ],
    ids=["t5", "deberta-v2", "mpnet"],
)
def test_blocks_with_tuple_outputs_give_their_hidden_states(tmp_path, config, block):
    """transformers blocks return (hidden states, ...): featcache takes element 0 without
    select, as the library's own hidden_states do, and records that it did."""
    saved = save(tmp_path / "m", config(transformers))
    encoder = saved.get_encoder() if isinstance(saved, transformers.T5Model) else saved
    block = block or "encoder.layer.0"
    texts = ["a cat", "two dogs and a bird", "x"]
    (tmp_path / "val.txt").write_text("\n".join(texts) + "\n")
    store = featcache.extract_from_config(
        {
            "model": {"name": f"hf:{tmp_path / 'm'}", "weights": "pretrained"},
            "layers": [{"name": block, "reduce": "mean"}],
            "data": {"source": "text", "root": str(tmp_path), "splits": {"val": "val.txt"}},
            "loader": {"batch_size": 1, "num_workers": 0},
            "store": {"dtype": "float32"},
            "output": {"dir": str(tmp_path / "out")},
            "runtime": {"progress": False, "device": "cpu"},
        }
    )["val"]
    assert store.layer_attrs(block)["select"] == "0"
    tokenizer = text_backbone(tmp_path / "m").tokenizer
    assert tokenizer is not None
    for i, ids in enumerate(tokenizer(texts, None).ids):
        mask = torch.ones(1, len(ids), dtype=torch.long)
        with torch.no_grad():
            hidden = encoder(
                input_ids=torch.tensor([ids]), attention_mask=mask, output_hidden_states=True
            )
        expected = hidden.hidden_states[1][0].mean(dim=0)
        torch.testing.assert_close(store.read(block)[i], expected, rtol=1e-4, atol=1e-4)
