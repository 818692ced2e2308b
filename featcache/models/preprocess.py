"""Eval preprocessing from a ``PreprocessSpec``: the transform, its sizes, ImageNet's mean/std."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torchvision import transforms as T

from featcache.config.spec import PreprocessSpec
from featcache.errors import ConfigError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INTERPOLATIONS = {
    "bilinear": T.InterpolationMode.BILINEAR,
    "bicubic": T.InterpolationMode.BICUBIC,
    "nearest": T.InterpolationMode.NEAREST,
}

#: Maps a PIL RGB image to a float32 tensor ``[3, H, W]``; picklable for DataLoader workers.
Transform = Callable[[Image.Image], torch.Tensor]


@dataclass(frozen=True)
class Preprocessing:
    """A model's eval preprocessing: the transform, the shorter side it resizes to first
    (None: none, or not one number; JPEG draft decoding stays above it) and the side of the
    centre crop that follows, if any."""

    transform: Transform
    decode_size: int | None = None
    crop_size: int | None = None


def spec_preprocessing(preprocess: PreprocessSpec) -> Preprocessing:
    """The preprocessing ``preprocess`` describes: :func:`build_transform` and its sizes."""
    return Preprocessing(build_transform(preprocess), preprocess.resize, preprocess.crop)


def build_transform(preprocess: PreprocessSpec) -> Transform:
    """Resize (shorter side) -> CenterCrop -> float32 in [0, 1] -> Normalize (ImageNet's by
    default), a picklable PIL RGB -> float32 [3, H, W] map; null sizes skip their step."""
    interpolation = INTERPOLATIONS.get(preprocess.interpolation)
    if interpolation is None:
        raise ConfigError(
            f"preprocess.interpolation is {preprocess.interpolation!r}; "
            f"choose one of: {', '.join(INTERPOLATIONS)}"
        )
    steps: list[Callable[..., Any]] = []
    if preprocess.resize is not None:
        steps.append(T.Resize(preprocess.resize, interpolation=interpolation, antialias=True))
    if preprocess.crop is not None:
        steps.append(T.CenterCrop(preprocess.crop))
    mean = preprocess.mean if preprocess.mean is not None else IMAGENET_MEAN
    std = preprocess.std if preprocess.std is not None else IMAGENET_STD
    steps += [T.ToTensor(), T.Normalize(list(mean), list(std))]
    return T.Compose(steps)


def single_size(value: Any) -> int | None:
    """``256`` or ``[256]`` -> 256; anything else (``None``, ``[H, W]``) -> ``None``."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if len(value) == 1 else None
    return int(value) if isinstance(value, int) else None
