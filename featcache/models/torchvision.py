"""The torchvision model kind: model names, their weights enums and the weights' own transforms.

Weights identity: ``{"source": "torchvision", "enum": "ResNet18_Weights.IMAGENET1K_V1",
"url": ...}``, or ``{"source": "random", "seed": seed}`` without weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torchvision
from torch import nn

from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError, FeatcacheError, did_you_mean, first_line
from featcache.models.preprocess import Preprocessing, single_size, spec_preprocessing
from featcache.models.registry import BuiltModel, Inputs, ModelKind, random_weights, refuse_text


class TorchvisionKind(ModelKind):
    """``torchvision.models.get_model(ref, weights=<enum of model.weights>, **model.kwargs)``."""

    name = "torchvision"
    refused_kwargs = {
        "weights_backbone": "it loads backbone weights that the recorded weights identity "
        "would not show; give the model's own weights as model.weights",
    }

    def preprocessing(
        self, ref: str, model: ModelSpec, preprocess: PreprocessSpec
    ) -> Preprocessing:
        # Resolving first makes a bad name or weights fail before anything is built.
        enum = resolve_weights(ref, model.weights)
        # Without an explicit preprocess, the weights' own transforms(); random weights get
        # those of the architecture's default weights (their files are not read).
        standard = None if preprocess.is_set() else enum or default_weights(ref)
        if standard is None:
            return spec_preprocessing(preprocess)
        transform = standard.transforms()
        resize, crop = (getattr(transform, key, None) for key in ("resize_size", "crop_size"))
        return Preprocessing(transform, single_size(resize), single_size(crop))

    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        if inputs != "image":
            raise refuse_text(model)
        enum = resolve_weights(ref, model.weights)
        module = _get_model(ref, enum, model.kwargs, seed)
        # torchvision's ViTs put one class token before the patch tokens.
        prefix = 1 if isinstance(module, torchvision.models.VisionTransformer) else None
        if enum is None:
            return BuiltModel(module, random_weights(seed), prefix_tokens=prefix)
        identity = {"source": "torchvision", "enum": enum_id(enum), "url": enum.url}
        return BuiltModel(module, identity, prefix_tokens=prefix)


def resolve_weights(name: str, weights: str | None) -> torchvision.models.WeightsEnum | None:
    """The weights enum member of torchvision model ``name`` called ``weights``
    (``"DEFAULT"``, ``"ResNet50_Weights.IMAGENET1K_V2"``), downloading nothing; an unknown
    name is a :class:`ConfigError` with close matches."""
    names = torchvision.models.list_models()
    if name not in names:
        hint = did_you_mean(name, names)
        raise ConfigError(
            f"unknown torchvision model {name!r}{hint} "
            "(torchvision.models.list_models() lists them all)"
        )
    if weights is None:
        return None
    enum_cls = torchvision.models.get_model_weights(name)
    cls_name, dot, member = weights.rpartition(".")
    if dot and cls_name != enum_cls.__name__:
        raise ConfigError(
            f"model.weights {weights!r} are not weights of {name}; "
            f"its weights are {enum_cls.__name__}.<name>"
        )
    available = list(enum_cls.__members__)
    if member not in available:
        hint = did_you_mean(member, available, parenthesised=True)
        raise ConfigError(
            f"unknown weights {weights!r} for {name}{hint}; available: {', '.join(available)}"
        )
    return enum_cls[member]


def default_weights(name: str) -> torchvision.models.WeightsEnum | None:
    """The ``DEFAULT`` weights of classifier ``name``, for their image ``transforms()``
    (None without them, or for other inputs: detection, video, optical flow)."""
    from torchvision.transforms._presets import ImageClassification

    try:
        weights = torchvision.models.get_model_weights(name)["DEFAULT"]
    except (KeyError, ValueError):
        return None
    return weights if isinstance(weights.transforms(), ImageClassification) else None


def enum_id(enum: Any) -> str:
    return f"{type(enum).__name__}.{enum.name}"


def _get_model(
    name: str, enum: torchvision.models.WeightsEnum | None, kwargs: dict[str, Any], seed: int
) -> nn.Module:
    torch.manual_seed(seed)
    try:
        return torchvision.models.get_model(name, weights=enum, **kwargs)
    except (TypeError, ValueError) as exc:  # torchvision rejects kwargs with either
        raise ConfigError(
            f"model.kwargs {kwargs} rejected by torchvision's {name}: {first_line(exc)}"
        ) from exc
    except OSError as exc:  # urllib's URLError is an OSError
        raise FeatcacheError(
            f"could not download {enum_id(enum)} from {getattr(enum, 'url', '?')} "
            f"({first_line(exc)}); check the network, or put the file in "
            f"{torch.hub.get_dir()}/checkpoints"
        ) from exc
