"""A Hugging Face image processor as featcache preprocessing: a torchvision pipeline whose
output equals the processor's ``pixel_values`` (measured exactly equal on transformers
5.23), or, for a processor with steps of its own, the processor itself (:class:`RunProcessor`)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torchvision
from torchvision import transforms as T
from torchvision.transforms import functional as TF
from torchvision.transforms import v2

from featcache.models.preprocess import Preprocessing

# PIL resample numbers -> the modes transformers' torchvision backend resizes tensors with;
# LANCZOS needs torchvision 0.27 (transformers falls back to bicubic before, as here).
_LANCZOS_OK = tuple(int(n) for n in re.findall(r"\d+", torchvision.__version__)[:2]) >= (0, 27)
_RESAMPLE = {
    0: T.InterpolationMode.NEAREST_EXACT,
    1: T.InterpolationMode.LANCZOS if _LANCZOS_OK else T.InterpolationMode.BICUBIC,
    2: T.InterpolationMode.BILINEAR,
    3: T.InterpolationMode.BICUBIC,
}


def processor_preprocessing(processor: Any) -> Preprocessing:
    """A processor as a picklable pipeline: PIL RGB -> uint8 ``[3, H, W]`` -> resize
    (torchvision v2, antialiased: v1 rounds uint8 differently) -> centre crop -> float32
    rescaled and normalised, in the processor's order and rounding."""
    if not own_steps(processor):
        with contextlib.suppress(_Untranslatable):
            return _pipeline(processor)
    return Preprocessing(RunProcessor(processor))


class _Untranslatable(Exception):
    """A processor setting the torchvision pipeline does not reproduce."""


def _pipeline(processor: Any) -> Preprocessing:
    steps: list[Callable[..., Any]] = [T.PILToTensor()]
    decode_size = crop_size = None
    if getattr(processor, "do_resize", False):
        size = _size(processor, "size")
        resample = getattr(processor, "resample", None)
        if not isinstance(resample, T.InterpolationMode):
            resample = _RESAMPLE.get(2 if resample is None else int(resample))
        if resample is None:
            raise _Untranslatable(f"resample {processor.resample!r}")
        if "shortest_edge" in size:
            steps.append(v2.Resize(size["shortest_edge"], resample, antialias=True))
            decode_size = size["shortest_edge"]
        else:
            steps.append(v2.Resize((size["height"], size["width"]), resample, antialias=True))
            decode_size = size["height"] if size["height"] == size["width"] else None
    if getattr(processor, "do_center_crop", False):
        crop = _size(processor, "crop_size")
        if "height" not in crop:
            raise _Untranslatable(f"crop_size {crop}")
        steps.append(CenterCrop(crop["height"], crop["width"]))
        crop_size = crop["height"] if crop["height"] == crop["width"] else None
    normalize = getattr(processor, "do_normalize", False)
    scale = float(processor.rescale_factor) if getattr(processor, "do_rescale", False) else None
    mean = _triple(processor.image_mean) if normalize else None
    std = _triple(processor.image_std) if normalize else None
    steps.append(RescaleNormalize(scale, mean, std))
    return Preprocessing(T.Compose(steps), decode_size, crop_size)


@dataclass(frozen=True)
class CenterCrop:
    """Centre crop of a ``[C, H, W]`` tensor with transformers' offsets, rounded down
    (torchvision rounds half offsets to even: a one pixel shift would break equality)."""

    height: int
    width: int

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        h, w = image.shape[-2:]
        if self.height > h or self.width > w:  # padded, as both libraries do
            return TF.center_crop(image, [self.height, self.width])
        top, left = int((h - self.height) / 2.0), int((w - self.width) / 2.0)
        return image[..., top : top + self.height, left : left + self.width]


@dataclass(frozen=True)
class RescaleNormalize:
    """uint8 ``[3, H, W]`` -> float32 ``(x * scale - mean) / std``, fused as transformers
    does (``(x - mean / scale) / (std / scale)``); ``None`` skips a step."""

    scale: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        x = image.to(torch.float32)
        if self.mean is None or self.std is None:
            return x * self.scale if self.scale is not None else x
        mean, std = torch.tensor(self.mean), torch.tensor(self.std)
        if self.scale is not None:
            mean, std = mean * (1.0 / self.scale), std * (1.0 / self.scale)
        return TF.normalize(x, mean.tolist(), std.tolist())


class RunProcessor:
    """A processor run as it is: PIL RGB -> its float32 ``[3, H, W]`` ``pixel_values``."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, image: Any) -> torch.Tensor:
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"]
        return pixels[0].to(torch.float32)

    def __repr__(self) -> str:
        settings = json.dumps(self.processor.to_dict(), sort_keys=True, default=str)
        return f"{type(self).__name__}({type(self.processor).__name__}, {settings})"


def own_steps(processor: Any) -> list[str]:
    """A processor's steps beyond resize, crop and normalisation (crop_pct, padding), in words."""
    from transformers.image_processing_backends import TorchvisionBackend

    cls = type(processor)
    if not issubclass(cls, TorchvisionBackend):
        return ["a backend other than torchvision's"]
    own = [
        method
        for method in ("_preprocess", "resize", "center_crop", "rescale_and_normalize")
        if getattr(cls, method, None) is not getattr(TorchvisionBackend, method)
    ]
    if getattr(processor, "do_pad", False):
        own.append("padding")
    return own


def _size(processor: Any, attribute: str) -> dict[str, int]:
    size = {k: v for k, v in dict(getattr(processor, attribute)).items() if v is not None}
    if set(size) not in ({"shortest_edge"}, {"height", "width"}):
        raise _Untranslatable(f"{attribute} {size}")
    return size


def _triple(values: Any) -> tuple[float, float, float]:
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    a, b, c = (float(v) for v in values)
    return a, b, c
