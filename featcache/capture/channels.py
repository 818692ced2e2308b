"""Which axis of a 4-d output holds the channels: ``[B, C, H, W]`` or ``[B, H, W, C]``
(the rules: ``docs/concepts/reductions.md``)."""

from __future__ import annotations

from torch import nn

from featcache.config.spec import ChannelLayout
from featcache.errors import ConfigError

AMBIGUOUS = "ambiguous"


# Modules whose 4-d output is [B, C, H, W] by definition.
CHANNELS_FIRST_MODULES = (
    nn.Conv2d,
    nn.ConvTranspose2d,
    nn.BatchNorm2d,
    nn.InstanceNorm2d,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
)


def declared_layouts(model: nn.Module) -> dict[str, ChannelLayout]:
    """The layouts ``model`` declares for its modules' 4-d outputs, by module name."""
    import torchvision

    declared: dict[str, ChannelLayout] = {
        name: "nchw"
        for name, module in model.named_modules()
        if isinstance(module, CHANNELS_FIRST_MODULES)
    }
    info = getattr(model, "feature_info", None)
    fmt = getattr(model, "output_fmt", None)
    if isinstance(info, list) and isinstance(fmt, str) and fmt.upper() in ("NCHW", "NHWC"):
        layout: ChannelLayout = "nhwc" if fmt.upper() == "NHWC" else "nchw"
        for entry in info:  # timm: the stages it hands out as feature maps
            if isinstance(entry, dict) and isinstance(entry.get("module"), str):
                declared[entry["module"]] = layout
    for name, module in model.named_modules():
        # transformers' CNN stages and embeddings give NCHW hidden_states (Swin's are tokens).
        if type(module).__module__.startswith("transformers.") and type(module).__name__.endswith(
            ("Stage", "Embeddings", "Embedder")
        ):
            declared.setdefault(name, "nchw")
        if isinstance(module, torchvision.models.SwinTransformer):
            prefix = f"{name}." if name else ""
            for stage, _ in module.features.named_children():
                declared[f"{prefix}features.{stage}"] = "nhwc"
            declared[f"{prefix}norm"] = "nhwc"
    return declared


def channel_layout(
    shape: tuple[int, ...], declared: str | None, image_size: tuple[int, int] | None
) -> str:
    """The layout of a 4-d output of per-sample ``shape``: ``declared``, else read from the
    ``(H, W)`` input's grid; :data:`AMBIGUOUS` when both readings fit."""
    if declared is not None:
        return declared
    if image_size is None or len(shape) != 3:
        return "nchw"
    first, last = _is_grid(shape[0], shape[1], image_size), _is_grid(shape[1], shape[2], image_size)
    if first and last:
        return AMBIGUOUS
    return "nhwc" if first else "nchw"


def channels_last(
    shape: tuple[int, ...],
    key: str,
    declared: str | None,
    image_size: tuple[int, int] | None,
    need: str,
) -> bool:
    """Whether a 4-d output of per-sample ``shape`` holds its channels last.

    Raises:
        ConfigError: the layout cannot be told and ``need`` (in words) must know it.
    """
    layout = channel_layout(shape, declared, image_size)
    if layout == AMBIGUOUS:
        height, width = image_size or (0, 0)
        raise ConfigError(
            f"layer {key!r}: its output {list(shape)} per sample could hold its channels "
            f"first or last (either reading has the grid of the {height}x{width} input), so "
            f"{need} cannot tell its spatial axes; set the layer's layout: nchw ([C, H, W]) "
            "or nhwc ([H, W, C])"
        )
    return layout == "nhwc"


def _is_grid(height: int, width: int, image_size: tuple[int, int]) -> bool:
    """Whether ``height x width`` can be a feature map's grid for an ``image_size`` input: no
    larger, square for a square input, else in its proportions within 15% (strides round)."""
    in_height, in_width = image_size
    if height > in_height or width > in_width:
        return False
    if in_height == in_width:
        return height == width
    if height == width:
        return False
    ratio = (height / width) / (in_height / in_width)
    return 1 / 1.15 <= ratio <= 1.15
