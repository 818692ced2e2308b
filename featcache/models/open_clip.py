"""The open_clip model kind: ``"open_clip:<architecture>[/<tag>]"``, built as its image tower
(``visual``) or, on text data, :class:`OpenClipTextTower` (``docs/guides/model-zoos.md``).

Weights identity: ``{"source": "open_clip", "architecture", "tag" (null for a local
file), "files": {<file name>: <sha256>}}``, or ``{"source": "random", "seed": seed,
"config_sha256": <sha256 of the architecture's config as open_clip registers it>}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError, FeatcacheError, did_you_mean, first_line
from featcache.models.checkpoint import pickled_objects_error
from featcache.models.preprocess import Preprocessing, spec_preprocessing
from featcache.models.registry import BuiltModel, Inputs, ModelKind, random_weights
from featcache.util.extras import require
from featcache.util.fingerprints import file_sha256

PRETRAINED = "pretrained"  # the model.weights value that names the tag's weights


@dataclass(frozen=True)
class OpenClipRef:
    """A parsed reference: an ``architecture`` and the pretrained ``tag`` as open_clip lists it."""

    architecture: str
    tag: str | None = None

    def __str__(self) -> str:
        return self.architecture if self.tag is None else f"{self.architecture}/{self.tag}"


class OpenClipKind(ModelKind):
    """``open_clip.create_model(architecture, pretrained=..., **model.kwargs).visual``."""

    name = "open_clip"
    refused_kwargs = {
        "weights_only": "featcache reads weight files with torch.load(weights_only=True) "
        "only (tensors, never pickled objects); convert the checkpoint to a state dict",
        **dict.fromkeys(
            (
                "load_weights",
                "pretrained",
                "pretrained_image",
                "pretrained_text",
                "pretrained_image_path",
                "pretrained_text_path",
                "require_pretrained",
            ),
            "it loads or skips weights that the recorded weights identity would not show; "
            "give them as the name's tag or model.weights",
        ),
    }

    def preprocessing(
        self, ref: str, model: ModelSpec, preprocess: PreprocessSpec
    ) -> Preprocessing:
        open_clip = require("open_clip", f"model.name {model.name!r}")
        parsed = parse_ref(open_clip, ref)
        weights_file(parsed, model.weights)  # a bad model.weights fails here already
        if preprocess.is_set():
            return spec_preprocessing(preprocess)
        return eval_preprocessing(open_clip, parsed, model.kwargs)

    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        open_clip = require("open_clip", f"model.name {model.name!r}")
        parsed = parse_ref(open_clip, ref)
        path = weights_file(parsed, model.weights)
        pretrained = model.weights == PRETRAINED
        path = cached_weights(open_clip, parsed) if pretrained else path
        torch.manual_seed(seed)
        clip = _create_model(open_clip, parsed.architecture, path, model.kwargs)
        if path is None:
            weights = {
                **random_weights(seed),
                "config_sha256": config_sha256(open_clip, parsed.architecture),
            }
        else:
            weights = {
                "source": "open_clip",
                "architecture": parsed.architecture,
                "tag": parsed.tag if pretrained else None,
                "files": {Path(path).name: file_sha256(path)},
            }
        if inputs == "text":
            return text_built(open_clip, parsed, clip, weights)
        visual = getattr(clip, "visual", None)
        if not isinstance(visual, nn.Module):
            raise ConfigError(f"open_clip's {parsed} has no image tower (model.visual)")
        return BuiltModel(visual, weights, None, *token_layout(visual))


class OpenClipTextTower(nn.Module):
    """The text tower of an open_clip model: ``tower(input_ids) == clip.encode_text(ids)``
    for int64 ``[B, T]`` ids. ``attention_mask`` is ignored: a causal tower never sees the
    padding after the end-of-text token; other towers get the padding from their tokenizer."""

    positional_embedding: torch.Tensor  # [context length, width]
    text_projection: Any  # [width, E] parameter, nn.Linear or None
    attn_mask: torch.Tensor | None  # additive causal mask; None: attention both ways

    def __init__(self, text: Any) -> None:
        """``text``: a ``CLIP`` model or a ``TextTransformer``, whose modules it shares."""
        import open_clip

        super().__init__()
        self.token_embedding = text.token_embedding
        self.positional_embedding = text.positional_embedding
        self.transformer = text.transformer
        self.ln_final = text.ln_final
        self.text_projection = text.text_projection
        self.register_buffer("attn_mask", text.attn_mask, persistent=False)
        self.context_length = int(text.context_length)
        if isinstance(text, open_clip.CLIP):
            self.pool_type, self.eos_id = text.text_pool_type, text.text_eos_id
        else:
            self.pool_type, self.eos_id = text.pool_type, text.eos_id

    @property
    def fixed_length(self) -> bool:
        """Whether texts keep their padding: attention both ways, or last-position pooling."""
        return self.attn_mask is None or self.pool_type == "last"

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int64 ``[B, T]`` ids -> the projected text embedding ``[B, E]`` (float32)."""
        from open_clip.transformer import text_global_pool

        length = input_ids.shape[1]
        dtype = self.transformer.get_cast_dtype()
        x = self.token_embedding(input_ids).to(dtype)
        x = x + self.positional_embedding[:length].to(dtype)
        mask = None if self.attn_mask is None else self.attn_mask[:length, :length]
        x = self.ln_final(self.transformer(x, attn_mask=mask))
        x = text_global_pool(x, input_ids, self.pool_type, eos_token_id=self.eos_id)
        if isinstance(self.text_projection, nn.Linear):
            return self.text_projection(x)
        return x if self.text_projection is None else x @ self.text_projection


def text_built(
    open_clip: ModuleType, ref: OpenClipRef, clip: nn.Module, weights: dict[str, Any]
) -> BuiltModel:
    """``clip``'s text tower and tokenizer: a ``CLIP`` model's, or a ``TextTransformer``'s
    without a class token (CoCa) or padding mask; any other is a :class:`ConfigError`."""
    from featcache.models.text import open_clip_tokenizer

    text = clip if isinstance(clip, open_clip.CLIP) else getattr(clip, "text", None)
    supported = isinstance(text, open_clip.CLIP) or (
        isinstance(text, open_clip.transformer.TextTransformer)
        and text.cls_emb is None
        and not text.use_pad_mask
    )
    if not supported:
        raise ConfigError(
            f"open_clip's {ref} has a text tower ({type(text).__name__}) that featcache does "
            "not run on text data; for a Hugging Face text tower use hf:<its repo>, or call "
            "featcache.extract with a module of your own"
        )
    tower = OpenClipTextTower(text)
    tokenizer = open_clip_tokenizer(
        open_clip, ref.architecture, tower.context_length, tower.fixed_length
    )
    _, sequence_first = token_layout(tower)
    return BuiltModel(tower, weights, tokenizer, None, sequence_first)


def parse_ref(open_clip: ModuleType, ref: str) -> OpenClipRef:
    """``"ViT-B-32/laion2b_s34b_b79k"`` -> ``OpenClipRef("ViT-B-32", "laion2b_s34b_b79k")``,
    the tag matched as open_clip matches it; unknown names are a :class:`ConfigError`."""
    architecture, slash, tag = ref.partition("/")
    names = open_clip.list_models()
    if architecture not in names:
        hint = did_you_mean(architecture, names)
        raise ConfigError(
            f"unknown open_clip architecture {architecture!r}{hint} "
            "(open_clip.list_models() lists them all; model.name is "
            "'open_clip:<architecture>[/<pretrained tag>]')"
        )
    if not slash:
        return OpenClipRef(architecture)
    tags = open_clip.list_pretrained_tags_by_model(architecture)
    by_key = {_tag_key(known): known for known in tags}
    if _tag_key(tag) not in by_key:
        hint = did_you_mean(tag, tags, parenthesised=True)
        available = f"its tags: {', '.join(tags)}" if tags else "it has no pretrained tags"
        raise ConfigError(
            f"unknown pretrained tag {tag!r} for open_clip {architecture}{hint}; {available}"
        )
    return OpenClipRef(architecture, by_key[_tag_key(tag)])


def weights_file(ref: OpenClipRef, weights: str | None) -> str | None:
    """The local file ``model.weights`` names (None for null, ``"pretrained"``), or ConfigError."""
    if weights == PRETRAINED and ref.tag is None:
        raise ConfigError(
            f"model.weights 'pretrained' needs a pretrained tag in model.name: "
            f"'open_clip:{ref.architecture}/<tag>' (open_clip."
            f"list_pretrained_tags_by_model({ref.architecture!r}) lists them)"
        )
    if weights is None or weights == PRETRAINED:
        return None
    if os.path.isfile(weights):
        return weights
    raise ConfigError(
        f"model.weights {weights!r} is neither 'pretrained' nor an existing file; "
        "for open_clip models use null (random, seeded), 'pretrained' (the tag's weights, e.g. "
        "open_clip:ViT-B-32/laion2b_s34b_b79k) or the path of a CLIP state dict file"
    )


def cached_weights(open_clip: ModuleType, ref: OpenClipRef) -> str:
    """The tag's weights file from open_clip's cache (the hub's, or ``~/.cache/clip`` for
    URLs), downloaded there when online; else a :class:`FeatcacheError` naming the fix."""
    assert ref.tag is not None
    cfg = open_clip.get_pretrained_cfg(ref.architecture, ref.tag)
    try:
        path = open_clip.pretrained.download_pretrained(cfg)
    except (OSError, RuntimeError) as exc:  # a failed hub or URL download
        raise FeatcacheError(_not_cached(open_clip, ref, cfg, exc)) from exc
    if not path or not os.path.isfile(path):
        raise FeatcacheError(_not_cached(open_clip, ref, cfg, None))
    return str(path)


def eval_preprocessing(
    open_clip: ModuleType, ref: OpenClipRef, kwargs: dict[str, Any]
) -> Preprocessing:
    """The eval transform ``create_model_and_transforms`` gives (PIL RGB -> float32
    [3, H, W]), from the configs alone: the architecture's image size, the tag's mean/std,
    interpolation and resize mode (OpenAI's without a tag), then ``kwargs``'
    ``force_image_size`` and ``force_preprocess_cfg``. Only a square ``shortest`` resize
    has sizes to report (``squash`` has no crop, ``longest`` neither)."""
    from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict

    # model.kwargs replace top-level config keys whole, as create_model applies them
    vision_cfg = (
        kwargs.get("vision_cfg") or open_clip.get_model_config(ref.architecture)["vision_cfg"]
    )
    size = kwargs.get("force_image_size") or vision_cfg.get("image_size", 224)
    tag_cfg = open_clip.get_pretrained_cfg(ref.architecture, ref.tag) if ref.tag else {}
    values = merge_preprocess_dict(PreprocessCfg(), tag_cfg)
    values["size"] = size
    values = merge_preprocess_dict(values, kwargs.get("force_preprocess_cfg") or {})
    cfg = PreprocessCfg(**values)
    transform = image_transform_v2(cfg, is_train=False)
    height, width = (cfg.size, cfg.size) if isinstance(cfg.size, int) else tuple(cfg.size)
    if height != width or cfg.resize_mode == "longest":
        return Preprocessing(transform)
    crop = height if cfg.resize_mode == "shortest" else None
    return Preprocessing(transform, int(height), crop)


def token_layout(visual: nn.Module) -> tuple[int, bool]:
    """``(prefix_tokens, sequence_first)`` of an open_clip tower's token outputs: one class
    token in a ``VisionTransformer`` (sequence-first unless ``transformer.batch_first``), a
    timm trunk's ``num_prefix_tokens`` (batch-first), none in ``ModifiedResNet``."""
    if isinstance(getattr(visual, "class_embedding", None), torch.Tensor):
        prefix = 1
    else:
        prefix = int(getattr(getattr(visual, "trunk", None), "num_prefix_tokens", 0) or 0)
    transformer = getattr(visual, "transformer", None)
    sequence_first = hasattr(transformer, "resblocks") and not getattr(
        transformer, "batch_first", False
    )
    return prefix, sequence_first


def config_sha256(open_clip: ModuleType, architecture: str) -> str:
    """sha256 of the architecture's config (canonical JSON), as open_clip registers it."""
    config = open_clip.get_model_config(architecture)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _tag_key(tag: str) -> str:
    return tag.lower().replace("-", "_")  # how open_clip normalises tags


def _create_model(
    open_clip: ModuleType, architecture: str, path: str | None, kwargs: dict[str, Any]
) -> nn.Module:
    # pretrained_hf=False: a random model must not fetch a Hugging Face text tower's
    # weights; a weights file sets every weight anyway.
    options = {"pretrained_hf": False, **kwargs}
    try:
        return open_clip.create_model(architecture, pretrained=path, **options)
    except TypeError as exc:  # an unknown keyword of create_model or the model class
        raise ConfigError(
            f"model.kwargs {kwargs} rejected by open_clip's {architecture}: {first_line(exc)}"
        ) from exc
    except OSError as exc:  # a download open_clip makes besides the weights (an HF text config)
        raise FeatcacheError(
            f"open_clip could not build {architecture}: {first_line(exc)}"
        ) from exc
    except pickle.UnpicklingError as exc:  # weights_only=True met something besides tensors
        if path is None:
            raise
        raise pickled_objects_error(path, exc) from exc
    except (RuntimeError, ValueError, KeyError, EOFError) as exc:
        if path is not None:
            raise ConfigError(
                f"open_clip could not load the weights file {path} into {architecture} "
                f"({first_line(exc, with_type=True)}); it must hold the whole CLIP model's "
                "state dict"
            ) from exc
        with_kwargs = f" with model.kwargs {kwargs}" if kwargs else ""
        raise ConfigError(
            f"open_clip could not build {architecture}{with_kwargs}: {first_line(exc)}"
        ) from exc


def _not_cached(
    open_clip: ModuleType, ref: OpenClipRef, cfg: dict[str, Any], exc: BaseException | None
) -> str:
    if cfg.get("hf_hub") and open_clip.pretrained.has_hf_hub():
        from huggingface_hub import constants

        cache = constants.HF_HUB_CACHE  # read now: tests and users may repoint it
        where = f"Hugging Face hub repo {cfg['hf_hub'].rstrip('/')}"
        offline = constants.HF_HUB_OFFLINE
    else:
        cache = os.path.expanduser("~/.cache/clip")
        where = cfg.get("url") or "no download source"
        offline = False
    reason = f" and could not be downloaded ({first_line(exc)})" if exc is not None else ""
    if offline:
        reason = " and HF_HUB_OFFLINE is set"
    fetch = (
        f"python -c \"import open_clip; open_clip.create_model('{ref.architecture}', "
        f"pretrained='{ref.tag}')\""
    )
    return (
        f"the weights of open_clip:{ref} ({where}) are not in the local cache {cache}{reason}; "
        f"fetch them with network access: {fetch} (then copy {cache} here if needed), "
        "or set model.weights to a local weights file"
    )
