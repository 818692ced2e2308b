"""The synthetic source: deterministic class-dependent gratings, for demos and tests."""

from __future__ import annotations

import colorsys
import dataclasses
import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from featcache.config.spec import DataSpec
from featcache.config.validation import build, option
from featcache.sources.base import SourceDataset, Transform


class _SyntheticSource(SourceDataset):
    """Class k is a sinusoidal grating at orientation ``pi * k / num_classes`` (jittered)
    tinted by a class hue, with pixel noise; row i depends only on (seed, split, i)."""

    def __init__(
        self,
        split: str,
        size: int,
        image_size: int,
        num_classes: int,
        seed: int,
        transform: Transform | None,
    ) -> None:
        ids = [f"synthetic:{i}" for i in range(size)]
        names = [f"class_{k}" for k in range(num_classes)]
        super().__init__(ids, names, True, transform)
        self.image_size = image_size
        self.num_classes = num_classes
        self.entropy = (seed, zlib.crc32(split.encode()))  # each split its own stream

    def _load(self, i: int) -> tuple[Image.Image, int]:
        state = np.random.SeedSequence(self.entropy, spawn_key=(i,)).generate_state(1, np.uint64)
        gen = torch.Generator().manual_seed(int(state[0]))
        k = i % self.num_classes
        n = self.image_size
        jitter, freq, phase, contrast = torch.rand(4, generator=gen).tolist()
        theta = math.pi * (k + (jitter - 0.5) / 2) / self.num_classes
        coords = torch.linspace(-1.0, 1.0, n)
        y, x = torch.meshgrid(coords, coords, indexing="ij")
        along = x * math.cos(theta) + y * math.sin(theta)
        # 2 to 4 cycles across the image.
        wave = torch.sin(math.pi * (2 + 2 * freq) * along + 2 * math.pi * phase)
        tint = torch.tensor(colorsys.hsv_to_rgb(k / self.num_classes, 0.6, 1.0))
        image = (0.5 + (0.2 + 0.15 * contrast) * wave) * (0.5 + 0.5 * tint)[:, None, None]
        image = image + 0.05 * torch.randn(3, n, n, generator=gen)
        pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
        return Image.fromarray(pixels.numpy()), k


@dataclasses.dataclass
class SyntheticOptions:
    """The options of ``data.source: synthetic`` (from data.kwargs or a split's mapping)."""

    size: int = option(256, ge=1)  # images in the split
    image_size: int = option(64, ge=1)  # side of the square images, in pixels
    num_classes: int = option(10, ge=1)
    seed: int = option(0, ge=0)


def synthetic_source(
    data: DataSpec, split: str, value: Any, transform: Transform | None
) -> _SyntheticSource:
    per_split = dict(value) if isinstance(value, Mapping) else {}
    unknown = "unknown synthetic option {where}; known options: {known}"
    # Each part is checked on its own, so that an error names the key that was given.
    build(SyntheticOptions, data.kwargs, "data.kwargs", unknown=unknown)
    build(SyntheticOptions, per_split, f"data.splits.{split}", unknown=unknown)
    options = build(SyntheticOptions, {**data.kwargs, **per_split}, "data")
    return _SyntheticSource(split, transform=transform, **dataclasses.asdict(options))
