"""Reductions applied on the device to a captured batch: pooling, flattening, token picks."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from featcache.capture.channels import channels_last, declared_layouts
from featcache.capture.selectors import Tap
from featcache.errors import ConfigError


@dataclass(frozen=True)
class ReduceContext:
    """The model's token and channel layouts and the batch's shape, for the reductions."""

    attention_mask: torch.Tensor | None = None  # [B, T], 1 for real tokens; token inputs only
    # Class, distillation and register tokens before the patch tokens of [B, T, D] outputs;
    # None: no declared layout (token 0 is the class token, every token averaged).
    prefix_tokens: int | None = None
    sequence_first: bool = False  # the model's token outputs are [T, B, D]
    batch_size: int | None = None  # None: not checked
    # Attention modules that run sequence-first though the model does not declare it.
    sequence_first_modules: tuple[str, ...] = ()
    # (H, W) of an image batch, which its patch grid follows (None: a square grid).
    image_size: tuple[int, int] | None = None
    input_tokens: int | None = None  # T of a batch of token ids [B, T]; None for others
    # Module name -> the layout ("nchw", "nhwc") the model declares for its 4-d outputs.
    channel_layouts: Mapping[str, str] = field(default_factory=dict)

    def declared_layout(self, tap: Tap) -> str | None:
        """The channel layout of ``tap``'s 4-d outputs as its layer or the model says it."""
        return tap.layout or self.channel_layouts.get(tap.module_name)


NO_CONTEXT = ReduceContext()


def token_layout(
    model: nn.Module, prefix_tokens: int | None, sequence_first: bool
) -> ReduceContext:
    """The reductions' context for ``model``: ``prefix_tokens`` (default: its
    ``num_prefix_tokens``), ``sequence_first`` (else its sequence-first attention modules)
    and its declared channel layouts."""
    if prefix_tokens is None:
        declared = getattr(model, "num_prefix_tokens", None)
        prefix_tokens = declared if isinstance(declared, int) else None
    if prefix_tokens is not None and (
        not isinstance(prefix_tokens, int) or isinstance(prefix_tokens, bool) or prefix_tokens < 0
    ):
        raise ConfigError(f"prefix_tokens must be a whole number >= 0, got {prefix_tokens!r}")
    return ReduceContext(
        prefix_tokens=prefix_tokens,
        sequence_first=bool(sequence_first),
        sequence_first_modules=() if sequence_first else sequence_first_modules(model),
        channel_layouts=declared_layouts(model),
    )


def sequence_first_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s ``nn.MultiheadAttention`` modules that run ``[T, B, D]``."""
    return tuple(
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.MultiheadAttention) and not module.batch_first
    )


def reduce_tensor(x: torch.Tensor, tap: Tap, context: ReduceContext = NO_CONTEXT) -> torch.Tensor:
    """Apply ``tap.reduce`` to a batch ``x`` ``[B, ...]``; returns ``[B, ...]``: ``[B, C]``
    (``avg``, ``max``), ``[B, C, k, k]`` (``adaptive_avg``), ``[B, D]`` (``cls``, ``mean``,
    ``last`` of tokens ``[B, T, D]``), ``[B, 2D]`` (``cls+mean``), ``[B, D, h, w]``
    (``patches``). A padded batch is reduced over its real tokens (``none``: left padded).
    The rules: ``docs/concepts/reductions.md``, ``docs/concepts/tokens.md``."""
    x = _batch_first(x, tap, context)
    how = tap.reduce
    if how == "none":
        return x
    if context.attention_mask is not None:
        return _reduce_masked(x, tap, context.attention_mask)
    if how == "flatten":
        return x.flatten(1)
    tokens = x.dim() == 3 and (
        context.prefix_tokens is not None or x.shape[1] == context.input_tokens
    )
    if how in ("cls", "mean", "cls+mean", "patches", "last") or tokens:
        return _reduce_tokens(x, tap, context)
    if how in ("avg", "max"):
        _need_dims(x, tap, minimum=3, shape="[B, C, ...spatial]")
        if x.dim() == 4:
            x = channels_first(x, tap, context, f"reduce={how}")
        dims = tuple(range(2, x.dim()))
        return x.mean(dim=dims) if how == "avg" else x.amax(dim=dims)
    if how == "adaptive_avg":
        _need_dims(x, tap, minimum=4, maximum=4, shape="[B, C, H, W]")
        return _adaptive_avg(channels_first(x, tap, context, "reduce=adaptive_avg"), tap)
    raise ConfigError(f"layer {tap.key!r}: unknown reduce {how!r}")


def channels_first(x: torch.Tensor, tap: Tap, context: ReduceContext, need: str) -> torch.Tensor:
    """A 4-d batch as ``[B, C, H, W]``: as it is, or ``[B, H, W, C]`` permuted (a view)."""
    shape = tuple(x.shape[1:])
    if channels_last(shape, tap.key, context.declared_layout(tap), context.image_size, need):
        return x.permute(0, 3, 1, 2)
    return x


def layer_prefix(
    tokens: int, prefix: int | None, image_size: tuple[int, int] | None = None
) -> int | None:
    """The prefix tokens in an output of ``tokens`` tokens of a model declaring ``prefix``:
    0 where ``tokens`` makes a patch grid and ``tokens - prefix`` does not (a layer before
    the model adds them; ``docs/concepts/tokens.md``)."""
    if prefix and patch_grid(tokens, image_size) and not patch_grid(tokens - prefix, image_size):
        return 0
    return prefix


@functools.lru_cache(maxsize=256)
def patch_grid(tokens: int, image_size: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The ``(h, w)`` grid of ``tokens`` patch tokens of an ``(H, W)`` input: ``H // p`` by
    ``W // p`` (or rounded up: a padded input) for some patch side ``p``; square for a square
    or unknown input; None when there is none."""
    if tokens <= 0:
        return None
    if image_size is None or image_size[0] == image_size[1]:
        side = math.isqrt(tokens)
        return (side, side) if side * side == tokens else None
    height, width = image_size
    for patch in range(1, min(height, width) + 1):
        for h, w in ((height // patch, width // patch), (-(-height // patch), -(-width // patch))):
            if h * w == tokens:
                return h, w
    return None


def _reduce_tokens(x: torch.Tensor, tap: Tap, context: ReduceContext) -> torch.Tensor:
    _need_dims(x, tap, minimum=3, maximum=3, shape="[B, T, D] tokens")
    how = tap.reduce
    prefix = layer_prefix(x.shape[1], context.prefix_tokens, context.image_size)
    if how in ("cls", "cls+mean") and prefix == 0:
        why = (
            "this model's token outputs have none"
            if not context.prefix_tokens
            else f"its {x.shape[1]} tokens are the patch tokens alone (the model adds its "
            f"{context.prefix_tokens} prefix tokens after this layer)"
        )
        raise ConfigError(
            f"layer {tap.key!r}: reduce={how} needs a class token, and {why}; use mean (the "
            "patch tokens' average) or capture a later layer"
        )
    patches = x[:, prefix or 0 :]
    if how == "cls":
        return x[:, 0]
    if how == "last":
        return x[:, -1]
    if how in ("mean", "avg"):
        return patches.mean(dim=1)
    if how == "cls+mean":
        return torch.cat([x[:, 0], patches.mean(dim=1)], dim=1)
    if how == "max":
        return patches.amax(dim=1)
    grid = _patch_grid(patches, tap, context.image_size)  # patches, adaptive_avg
    return grid if how == "patches" else _adaptive_avg(grid, tap)


def _reduce_masked(x: torch.Tensor, tap: Tap, mask: torch.Tensor) -> torch.Tensor:
    """Reduce token outputs ``[B, T, ...]`` of a padded batch over the real tokens of its
    ``[B, T]`` attention ``mask``: ``mean``/``avg`` (special tokens included, as sentence
    encoders pool), ``max``, ``cls`` (token 0), ``last`` (the last real one), ``cls+mean``."""
    how = tap.reduce
    if x.dim() < 3 or tuple(x.shape[:2]) != tuple(mask.shape):
        raise ConfigError(
            f"layer {tap.key!r}: reduce={how} reads the tokens of a padded batch, but its "
            f"{tap.capture} of shape {list(x.shape)} has no token axis matching the attention "
            f"mask {list(mask.shape)}; capture a token output ([B, T, D]) or use reduce none"
        )
    if how not in ("mean", "avg", "max", "cls", "last", "cls+mean"):
        raise ConfigError(
            f"layer {tap.key!r}: reduce={how} would mix padding into the stored values of a "
            "padded token batch; use mean, max, cls, last, cls+mean, or none (one row of "
            "tokens per sample)"
        )
    real = (mask != 0).reshape(*mask.shape, *(1,) * (x.dim() - 2))
    if how == "cls":
        return x[:, 0]
    if how == "last":
        # The last real token: the highest position whose mask is set.
        positions = torch.arange(x.shape[1], device=x.device).expand(mask.shape)
        last = torch.where(mask != 0, positions, -1).amax(dim=1).clamp(min=0)
        return x[torch.arange(len(x), device=x.device), last]
    if how == "max":
        return x.masked_fill(~real, float("-inf")).amax(dim=1)
    counts = real.sum(dim=1).clamp(min=1)
    # Summed in float32 at least, as x.mean() accumulates: a float16 sum of a few dozen
    # tokens of a residual stream overflows, and bfloat16 cannot hold a count over 256.
    wide = torch.promote_types(x.dtype, torch.float32)
    total = x.masked_fill(~real, 0).sum(dim=1, dtype=wide)
    mean = (total / counts.to(wide)).to(x.dtype)
    return torch.cat([x[:, 0], mean], dim=1) if how == "cls+mean" else mean


def _adaptive_avg(grid: torch.Tensor, tap: Tap) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, C, size, size]``; a grid smaller than ``size`` is refused."""
    height, width = grid.shape[-2:]
    if tap.size is not None and tap.size > min(height, width):
        raise ConfigError(
            f"layer {tap.key!r}: adaptive_avg size {tap.size} is larger than its "
            f"{height}x{width} grid, so pooling would repeat values instead of averaging "
            f"them; use size {min(height, width)} or less, or reduce none"
        )
    return F.adaptive_avg_pool2d(grid, tap.size)


def _patch_grid(
    patches: torch.Tensor, tap: Tap, image_size: tuple[int, int] | None
) -> torch.Tensor:
    """``[B, N, D]`` row-major patch tokens -> ``[B, D, h, w]`` on :func:`patch_grid`'s grid."""
    n = patches.shape[1]
    grid = patch_grid(n, image_size)
    if grid is None:
        grid_of = "a square grid"
        if image_size is not None:
            grid_of = f"the patch grid of a {image_size[0]}x{image_size[1]} input"
        raise ConfigError(
            f"layer {tap.key!r}: its {n} patch tokens do not form {grid_of}; "
            "use reduce mean, cls or none"
        )
    return patches.transpose(1, 2).reshape(len(patches), -1, *grid)


def _batch_first(x: torch.Tensor, tap: Tap, context: ReduceContext) -> torch.Tensor:
    """``x`` batch-first (a declared ``[T, B, D]`` transposed), or refused if that is unclear."""
    b = context.batch_size
    if b is None or x.dim() < 2:
        return x
    first, second = x.shape[0] == b, x.shape[1] == b
    if context.sequence_first and second and (x.dim() == 3 or not first):
        return x.transpose(0, 1)
    if first:
        if second and x.dim() == 3 and context.sequence_first_modules:
            raise ConfigError(
                f"layer {tap.key!r}: its {tap.capture} of shape {list(x.shape)} has the batch "
                f"size {b} on axes 0 and 1, and the model runs attention sequence-first "
                f"({context.sequence_first_modules[0]} has batch_first=False), so its batch "
                "axis cannot be told; pass sequence_first=True to featcache.extract if its "
                f"token outputs are [T, B, D], or use a batch size other than {b}"
            )
        return x
    if second:
        # Transposing here would read a batch whose size equals T the other way round.
        raise ConfigError(
            f"layer {tap.key!r}: its {tap.capture} of shape {list(x.shape)} is "
            f"sequence-first (the batch size {b} is on axis 1) but the model does not say "
            "so; pass sequence_first=True to featcache.extract so that every batch is read "
            "the same way"
        )
    raise ConfigError(
        f"layer {tap.key!r}: its {tap.capture} of shape {list(x.shape)} has no axis of the "
        f"batch size {b}; capture another module"
    )


def _need_dims(
    x: torch.Tensor, tap: Tap, minimum: int, shape: str, maximum: int | None = None
) -> None:
    if x.dim() < minimum or (maximum is not None and x.dim() > maximum):
        raise ConfigError(
            f"layer {tap.key!r}: reduce={tap.reduce} needs a {shape} {tap.capture}, got shape "
            f"{list(x.shape)}; choose another reduce (none, flatten, avg, ...)"
        )
