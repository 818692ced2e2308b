"""Which axis of a 4-d output holds the channels: ``[B, C, H, W]`` or ``[B, H, W, C]``.

In order: the layer's own ``layout`` option; what the model declares
(:func:`declared_layouts`); the input's grid, which a feature map's spatial axes follow
(:func:`channel_layout`); else PyTorch's ``[B, C, ...]``, where neither reading has the
grid. Where both do (``[B, 8, 8, 8]`` of a square input), it cannot be told, and a
reduction that needs it refuses, naming the option (``docs/concepts/reductions.md``).
"""

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
    """The layouts ``model`` declares for some of its modules' 4-d outputs, by module name: 2-d
    convolutions, norms and pools, timm's ``feature_info`` stages in its ``output_fmt``,
    torchvision's Swin stages, transformers' CNN stages and embeddings."""
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
        # transformers' CNN stages and embeddings give the NCHW maps of its hidden_states
        # (its Swin stages give tokens, which no 4-d layout concerns).
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
    """The layout of a 4-d output of per-sample ``shape`` ``(d1, d2, d3)``: ``declared``
    when given, else read from the input grid of an ``(H, W)`` image batch;
    :data:`AMBIGUOUS` when both readings fit it."""
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
    """Whether ``height x width`` can be the spatial grid of a feature map of an input of
    ``image_size``: equal sides for a square input, else sides in the input's proportions
    (within 15%: padding and strides round them) and no larger than its own."""
    in_height, in_width = image_size
    if height > in_height or width > in_width:
        return False
    if in_height == in_width:
        return height == width
    if height == width:
        return False
    ratio = (height / width) / (in_height / in_width)
    return 1 / 1.15 <= ratio <= 1.15
