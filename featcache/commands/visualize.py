"""Pictures from a store: feature-map grids and Grad-CAM overlays (Selvaraju et al., 2017)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import functional as TF
from torchvision.utils import make_grid, save_image

from featcache.capture.selectors import Tap
from featcache.capture.taps import zero_gradient_note
from featcache.config.recorded import recorded_spec
from featcache.errors import ConfigError, FeatcacheWarning
from featcache.store import FeatureStore
from featcache.util.files import output_file
from featcache.util.plotting import require_matplotlib

# Picture formats save_image (PIL) writes, by the file's suffix.
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")

StoreLike = FeatureStore | str | os.PathLike


def _open(store: StoreLike) -> FeatureStore:
    return store if isinstance(store, FeatureStore) else FeatureStore(store)


def _row(fs: FeatureStore, row: int) -> int:
    n = len(fs)
    if not -n <= row < n:
        raise ConfigError(f"row {row} is out of range for store {fs.path} of {n} rows")
    return row % n


def _spatial(fs: FeatureStore, layer: str, row: int) -> torch.Tensor:
    """Row ``row`` of ``layer`` as float32 ``[C, H, W]`` (a map stored as the module gave
    it, ``[H, W, C]``, is permuted); a pooled layer is an error."""
    shape = fs.shape(layer)
    if fs.is_per_token(layer):
        raise ConfigError(
            f"layer {layer!r} holds per-token rows (text), not a spatial map; there is no "
            "image grid to show"
        )
    if len(shape) != 3:
        raise ConfigError(
            f"layer {layer!r} is stored as {list(shape)} per row: no spatial map left; "
            "capture it with reduce: none (or adaptive_avg) to show it"
        )
    values = fs.read(layer, [_row(fs, row)])[0].float()
    if fs.layer_attrs(layer).get("channel_layout") == "nhwc":
        values = values.permute(2, 0, 1)  # [H, W, C] as the module gave it
    return values


def normalize_channels(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Scale each channel of ``x`` ``[C, H, W]`` to [0, 1] on its own (constant: 0)."""
    flat = x.flatten(1)
    low = flat.amin(dim=1)[:, None, None]
    span = (flat.amax(dim=1) - flat.amin(dim=1))[:, None, None]
    return torch.where(span > eps, (x - low) / span.clamp_min(eps), torch.zeros_like(x))


def feature_grid(
    store: StoreLike,
    layer: str,
    row: int,
    max_channels: int = 64,
    nrow: int | None = None,
    scale: int = 1,
    padding: int = 2,
) -> torch.Tensor:
    """The first ``max_channels`` channels of one row's feature map as an image grid.

    Each channel is normalised to [0, 1] on its own and enlarged ``scale`` times (nearest
    neighbour); ``nrow`` channels per grid row (default: about a square). Returns float32
    ``[3, H', W']`` in [0, 1], with white ``padding`` pixels between channels.
    """
    if max_channels < 1 or scale < 1:
        raise ConfigError("max_channels and scale must be whole numbers >= 1")
    if nrow is not None and nrow < 1:
        raise ConfigError(
            f"nrow must be a whole number >= 1 (or None for about a square), got {nrow}"
        )
    x = normalize_channels(_spatial(_open(store), layer, row)[:max_channels])
    if scale > 1:
        x = F.interpolate(x[None], scale_factor=scale, mode="nearest")[0]
    nrow = nrow if nrow is not None else math.ceil(math.sqrt(len(x)))
    return make_grid(x[:, None], nrow=nrow, padding=padding, pad_value=1.0)


def save_feature_grid(
    store: StoreLike, layer: str, row: int, path: str | os.PathLike, **kwargs: Any
) -> Path:
    """Write [`feature_grid`][featcache.commands.visualize.feature_grid] (same keywords) to ``path``
    (a picture in the format its suffix names: PNG, JPEG, ...)."""
    path = output_file(path, PICTURE_SUFFIXES, "picture")
    save_image(feature_grid(store, layer, row, **kwargs), path)
    return path


def grad_cam(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """Grad-CAM of one sample: float32 ``[H, W]`` in [0, 1].

    ``activation`` and ``gradient`` are ``[C, H, W]``: a layer's output and the gradient of
    the target score with respect to it. Channel weights are the spatial means of the
    gradient; the map is ``relu(sum_c w_c * activation_c)``, scaled to [0, 1] by its
    minimum and maximum (all zeros when it is constant).
    """
    if activation.shape != gradient.shape or activation.dim() != 3:
        raise ConfigError(
            f"Grad-CAM needs an activation and a gradient of the same [C, H, W] shape, got "
            f"{list(activation.shape)} and {list(gradient.shape)}"
        )
    weights = gradient.float().mean(dim=(1, 2))
    cam = torch.relu((weights[:, None, None] * activation.float()).sum(dim=0))
    return normalize_channels(cam[None])[0]


def gradient_key(store: StoreLike, layer: str) -> str:
    """The dataset holding the gradients of the module stored as ``layer``."""
    fs = _open(store)
    module = fs.layer_attrs(layer).get("module", layer)
    if f"{layer}@grad" in fs.layers:
        return f"{layer}@grad"
    for key in fs.layers:
        attrs = fs.layer_attrs(key)
        if attrs.get("capture") == "grad" and attrs.get("module") == module:
            return key
    raise ConfigError(
        f"layer {layer!r} has no stored gradients in {fs.path}; capture them with "
        f"{{name: {module}, capture: grad}} in layers"
    )


def store_cam(store: StoreLike, layer: str, row: int) -> torch.Tensor:
    """Grad-CAM ``[H, W]`` of one row from the stored activation and gradient of ``layer``."""
    fs = _open(store)
    if fs.layer_attrs(layer).get("capture") == "grad":
        raise ConfigError(f"layer {layer!r} holds gradients; name the activation layer")
    grad = gradient_key(fs, layer)
    gradient = _spatial(fs, grad, row)
    if not bool(gradient.any()):
        attrs = fs.layer_attrs(grad)
        tap = Tap(grad, str(attrs.get("module")), "grad", target=attrs.get("target"))
        note = zero_gradient_note(tap, f"its gradient at row {row}")
        warnings.warn(note, FeatcacheWarning, stacklevel=2)
    return grad_cam(_spatial(fs, layer, row), gradient)


def source_image(store: StoreLike, row: int, *, trust_factory: bool = False) -> Image.Image:
    """The source image of one row as the model saw it: through the model's own
    preprocessing (its resize and crop, a zoo's transform or image processor), the
    normalisation undone.

    The store's recorded config names the data and preprocessing (relative paths from the
    folder its run started in: `featcache.config.recorded`), and its ids check that the
    source still holds the same sample at that position. A store is data: a recorded
    model whose preprocessing would run code it names (a Hugging Face repository's own
    code) is refused unless ``trust_factory``.
    """
    from featcache.models import build_preprocessing, refuse_recorded_code
    from featcache.sources import build_source

    fs = _open(store)
    row = _row(fs, row)
    config = fs.config
    if config is None:
        raise ConfigError(
            f"store {fs.path} was made from Python and records no source; pass the image"
        )
    spec = recorded_spec(config, fs.attrs).spec
    if spec.data.inputs == "text":
        raise ConfigError(f"store {fs.path} was made from text; there is no source image to show")
    split = fs.attrs.get("split") or next(iter(spec.data.splits))
    source = build_source(spec.data, split, transform=None)
    index = int(fs.index[row])
    if index >= len(source) or source.ids[index] != fs.ids[row]:
        raise ConfigError(
            f"the source of {fs.path} no longer holds sample {fs.ids[row]} at position {index}"
        )
    image, _ = source[index]
    if spec.model.name is not None:
        refuse_recorded_code(spec.model, fs.path, "cam", trust_factory)
    transform = build_preprocessing(spec.model, spec.preprocess).transform
    return as_seen(transform(image), normalisation(transform))


def normalisation(transform: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The per-channel ``(mean, std)`` a preprocessing normalises with (float32 ``[3]``
    each, in [0, 1] units), found in its steps; None when it has none."""
    processor = getattr(transform, "processor", None)  # a Hugging Face processor run as is
    if processor is not None:
        if not getattr(processor, "do_normalize", False):
            return None
        return _triple(processor.image_mean), _triple(processor.image_std)
    mean, std = getattr(transform, "mean", None), getattr(transform, "std", None)
    if mean is not None and std is not None:
        return _triple(mean), _triple(std)
    if getattr(transform, "scale", None) is not None:  # rescaled to [0, 1], not normalised
        return _triple(0.0), _triple(1.0)
    found = None
    for step in getattr(transform, "transforms", []):
        found = normalisation(step) or found
    return found


def as_seen(pixels: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor] | None) -> Image.Image:
    """A preprocessed image ``[3, H, W]`` as a picture, its normalisation undone (or, when
    that is not known, stretched to [0, 1])."""
    pixels = pixels.detach().float().cpu()
    if norm is not None:
        mean, std = norm
        pixels = pixels * std[:, None, None] + mean[:, None, None]
    else:
        low, high = float(pixels.min()), float(pixels.max())
        pixels = (pixels - low) / max(high - low, 1e-12)
    return TF.to_pil_image(pixels.clamp(0, 1))


def _triple(values: Any) -> torch.Tensor:
    values = torch.as_tensor(values, dtype=torch.float32).flatten()
    return values.expand(3).clone() if values.numel() == 1 else values


def jet(x: torch.Tensor) -> torch.Tensor:
    """matplotlib's ``jet`` colour map: ``[H, W]`` in [0, 1] -> float32 RGB ``[3, H, W]``.

    Raises:
        FeatcacheError: matplotlib (the ``plot`` extra) is not installed.
    """
    require_matplotlib("colouring a Grad-CAM")
    from matplotlib import colormaps

    rgba = colormaps["jet"](x.detach().float().clamp(0, 1).cpu().numpy())  # float64 [H, W, 4]
    return torch.from_numpy(rgba[..., :3]).permute(2, 0, 1).float()


def cam_overlay(
    store: StoreLike,
    layer: str,
    row: int,
    path: str | os.PathLike,
    alpha: float = 0.5,
    image: Image.Image | None = None,
    scale: int = 1,
    trust_factory: bool = False,
) -> Path:
    """Write the Grad-CAM of one row of ``layer``, blended over its source image, to ``path``.

    The CAM is upsampled (bilinear) to the image size, coloured with `jet` and
    mixed in with weight ``alpha``. ``image`` (PIL) replaces the looked-up source image.
    The PNG has the size of the image as the model saw it, times ``scale`` (the image
    enlarged bicubic, for small inputs such as CIFAR's 32 x 32). ``trust_factory``: see
    [`source_image`][featcache.commands.visualize.source_image].
    """
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha must lie in [0, 1], got {alpha}")
    if scale < 1:
        raise ConfigError(f"scale must be a whole number >= 1, got {scale}")
    path = output_file(path, PICTURE_SUFFIXES, "picture")
    fs = _open(store)
    cam = store_cam(fs, layer, row)
    picture = image.convert("RGB") if image else source_image(fs, row, trust_factory=trust_factory)
    if scale > 1:
        size = (picture.height * scale, picture.width * scale)
        picture = TF.resize(picture, size, interpolation=TF.InterpolationMode.BICUBIC)
    picture = TF.to_tensor(picture)
    size = picture.shape[1:]
    cam = F.interpolate(cam[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
    blended = (1 - alpha) * picture + alpha * jet(cam)
    save_image(blended, path)
    return path
