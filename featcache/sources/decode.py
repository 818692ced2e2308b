"""Robust image decoding: any file or array to an RGB PIL image, JPEGs in draft mode."""

from __future__ import annotations

import io
import math
import os
from typing import Any

import numpy as np
import torch
from PIL import Image

from featcache.errors import FeatcacheError, first_line

_DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def load_rgb(path: str | os.PathLike, min_side: int | None = None) -> Image.Image:
    """Open and fully decode an image file as an 8-bit RGB PIL image (alpha dropped,
    integer grey scaled from the 16-bit range). With ``min_side``, a JPEG is decoded at
    the smallest 1/2, 1/4 or 1/8 scale (Pillow's draft mode) still covering ``min_side``.

    Raises:
        FeatcacheError: ``cannot decode image {path}: {reason}`` for missing, empty,
            truncated or unrecognised files.
    """
    try:
        return _decode(path, min_side)
    except _DECODE_ERRORS as exc:
        if isinstance(exc, FileNotFoundError):
            reason = "file not found"
        elif os.path.isfile(path) and os.path.getsize(path) == 0:
            reason = "the file is empty (0 bytes)"
        else:
            reason = first_line(exc)
        raise FeatcacheError(f"cannot decode image {path}: {reason}") from exc


def decode_bytes(data: bytes, where: str, min_side: int | None = None) -> Image.Image:
    """Encoded image bytes as an 8-bit RGB PIL image, as :func:`load_rgb` decodes a file.

    Raises:
        FeatcacheError: ``cannot decode image {where}: {reason}``.
    """
    if not data:
        raise FeatcacheError(f"cannot decode image {where}: no bytes (0 bytes)")
    try:
        return _decode(io.BytesIO(data), min_side)
    except _DECODE_ERRORS as exc:
        raise FeatcacheError(f"cannot decode image {where}: {first_line(exc)}") from exc


def _decode(file: str | os.PathLike | io.BytesIO, min_side: int | None) -> Image.Image:
    with Image.open(file) as image:
        if min_side and image.format == "JPEG" and min(image.size) >= 2 * min_side:
            image.draft(image.mode, _draft_size(image.size, min_side))
        image.load()
        return _to_rgb(image)


def _draft_size(size: tuple[int, int], min_side: int) -> tuple[int, int]:
    """The (w, h) a draft must cover so that the shorter side stays >= ``min_side``."""
    width, height = size
    shorter = min(width, height)
    return (math.ceil(width * min_side / shorter), math.ceil(height * min_side / shorter))


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image.copy()
    if image.mode == "F":  # PIL would clip to 0..255: an image of values in 0..1 goes black
        raise ValueError(
            "a 32-bit float image (mode F) has no set value range; convert it to an 8- or "
            "16-bit image"
        )
    if image.mode.startswith("I"):  # "I", "I;16", "I;16B", ...: 16-bit range -> 8 bits
        values = np.asarray(image.convert("I"), dtype=np.float32)
        grey = np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    if image.mode == "PA" or (image.mode == "P" and "transparency" in image.info):
        # Palette transparency must go through RGBA; a direct P -> RGB conversion warns.
        image = image.convert("RGBA")
    try:
        return image.convert("RGB")
    except ValueError as exc:
        raise ValueError(f"unsupported image mode {image.mode}") from exc


def _array_to_rgb(image: Any, where: str) -> Image.Image:
    """A PIL image of any mode, or a uint8/uint16 tensor or array (HxW, HxWxC; CxHxW tensor)."""
    if isinstance(image, Image.Image):
        return _to_rgb(image)
    if isinstance(image, torch.Tensor):
        array = image.detach().cpu().numpy()
        if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
            array = array.transpose(1, 2, 0)  # torchvision tensors are CxHxW
    else:
        array = np.asarray(image)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    shape_ok = array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (3, 4))
    if not shape_ok or array.dtype not in (np.uint8, np.uint16):
        raise FeatcacheError(
            f"{where}: cannot make an RGB image from a {array.dtype} array of shape "
            f"{tuple(array.shape)}; expected a PIL image or uint8 HxW / HxWxC"
        )
    if array.dtype == np.uint16:
        array = np.rint(array / 257.0).astype(np.uint8)
    return _to_rgb(Image.fromarray(np.ascontiguousarray(array)))
