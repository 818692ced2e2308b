"""Build a :class:`Backbone` from a :class:`ModelSpec` through its kind, a checkpoint on top."""

from __future__ import annotations

import inspect
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcache.capture.layers import LayerInfo, describe_layers, text_example
from featcache.config.spec import ModelSpec, PreprocessSpec, Spec, load_config
from featcache.config.validation import check
from featcache.errors import ConfigError
from featcache.models.checkpoint import apply_checkpoint
from featcache.models.preprocess import Preprocessing, Transform, spec_preprocessing
from featcache.models.registry import INPUTS, Inputs, Tokenizer, kind_for, refuse_text


@dataclass
class Backbone:
    """A model ready for feature extraction, with the preprocessing its weights expect;
    fields after ``kind`` as in :class:`~featcache.models.registry.BuiltModel`."""

    model: nn.Module  # in eval() mode, on CPU
    transform: Transform  # PIL RGB -> float32 [3, H, W]
    # JSON-able identity of the weights: its kind's, or a checkpoint's over it, with "model"
    weights: dict[str, Any]
    decode_size: int | None = None  # shorter side ``transform`` resizes to first, if any
    _: KW_ONLY
    kind: str
    tokenizer: Tokenizer | None = None  # None: the model takes images
    prefix_tokens: int | None = None  # class/register tokens before the patch tokens
    sequence_first: bool = False  # token outputs are [T, B, D] rather than [B, T, D]


def build_backbone(
    model: ModelSpec, preprocess: PreprocessSpec, seed: int = 0, inputs: Inputs = "image"
) -> Backbone:
    """Build the model ``model`` describes (random weights seeded by ``seed``) and the
    transform of ``preprocess``, else the model's own. ``inputs="text"`` builds its text side
    and :attr:`Backbone.tokenizer` (called with ``input_ids`` and ``attention_mask``)."""
    check(model, "model")
    if inputs not in INPUTS:
        raise ConfigError(f"inputs {inputs!r} is neither 'image' nor 'text'")
    kind, ref = kind_for(model)
    if inputs == "text":
        preprocessing = spec_preprocessing(preprocess)
        if "inputs" not in inspect.signature(kind.build).parameters:
            raise refuse_text(model)
        built = kind.build(ref, model, seed, inputs=inputs)
        if built.tokenizer is None:
            raise ConfigError(
                f"model kind {kind.name!r} built {model.name or model.factory} for text "
                "without a tokenizer; its build must return BuiltModel(tokenizer=...)"
            )
    else:  # preprocessing before the model, so that a bad option fails before any download
        preprocessing = kind.preprocessing(ref, model, preprocess)
        built = kind.build(ref, model, seed)  # no inputs=, which older kinds lack
    weights = built.weights
    if model.checkpoint is not None:
        weights = apply_checkpoint(built.module, model.checkpoint, model.strip_prefix, weights)
    return Backbone(
        built.module.cpu().eval(),
        preprocessing.transform,
        {"model": model.name or model.factory, **weights},
        preprocessing.decode_size,
        kind=kind.name,
        tokenizer=built.tokenizer,
        prefix_tokens=built.prefix_tokens,
        sequence_first=built.sequence_first,
    )


def build_preprocessing(model: ModelSpec, preprocess: PreprocessSpec) -> Preprocessing:
    """The preprocessing :func:`build_backbone` would use, building and downloading nothing."""
    check(model, "model")
    kind, ref = kind_for(model)
    return kind.preprocessing(ref, model, preprocess)


def backbone_layers(
    model_or_config: str, *, input_size: int | None = None, text: bool = False
) -> tuple[list[LayerInfo], str]:
    """The modules of the model that ``model_or_config`` names, to choose layers from.

    ``model_or_config`` is a model name (``resnet50``, ``timm:vit_small_patch16_224``,
    ``hf:<repo or folder>``, ``open_clip:<architecture>``) or a YAML config file. One probe
    batch runs through the model: a square image of side ``input_size`` (default: for a
    config, the size its own first image reaches the model at, where the data can be read;
    else the size the model's preprocessing gives, else 224), or with ``text`` (or a
    config whose data is text) a short text through the model's tokenizer. Returns a
    `featcache.capture.layers.LayerInfo` per module (output ``"-"`` for those the forward
    never called) and the probe input in words (``"input 224px"``, ``"input 12 tokens"``).
    """
    spec = None
    if model_or_config.endswith((".yaml", ".yml")) or Path(model_or_config).is_file():
        spec = load_config(model_or_config)
        if spec.models:
            keys = ", ".join(entry.key for entry in spec.models)
            raise ConfigError(
                f"{model_or_config} runs several models ({keys}); list the layers of one by "
                "its name (featcache layers resnet50) or a config of that model alone"
            )
        model, preprocess = spec.model, spec.preprocess
        text = text or spec.data.inputs == "text"
    else:
        model, preprocess = ModelSpec(name=model_or_config), PreprocessSpec()
    size: int | tuple[int, int] = 0  # the probe is a text, not an image
    if not text:
        seen = build_preprocessing(model, preprocess)  # the size the model expects
        size = input_size or seen.crop_size or seen.decode_size or 224
        if size < 1:
            raise ConfigError(f"input_size {size} is not a probe image side; give 1 pixel or more")
    backbone = build_backbone(model, preprocess, inputs="text" if text else "image")
    if spec is not None and not text and input_size is None:
        size = _data_image_size(spec, backbone) or size
    example = text_example(backbone.tokenizer) if text else None
    layers = describe_layers(
        backbone.model,
        input_size=size,
        prefix_tokens=backbone.prefix_tokens,
        sequence_first=backbone.sequence_first,
        example=example,
    )
    if example is not None:
        return layers, f"input {example['input_ids'].shape[1]} tokens"
    height, width = size if isinstance(size, tuple) else (size, size)
    return layers, f"input {height}px" if height == width else f"input {height}x{width}px"


def _data_image_size(spec: Spec, backbone: Backbone) -> tuple[int, int] | None:
    """The ``(H, W)`` of the config's first image as the model sees it; None if unreadable."""
    from featcache.sources import build_source

    try:
        source = build_source(spec.data, next(iter(spec.data.splits)), backbone.transform)
        image = source[0][0]
    except Exception:  # no data on this machine: the preprocessing's size will do
        return None
    if not isinstance(image, torch.Tensor) or image.dim() != 3:
        return None
    return int(image.shape[1]), int(image.shape[2])
