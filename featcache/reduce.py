"""Reductions applied on the device to a captured batch: pooling, flattening, token picks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from featcache.errors import ConfigError

if TYPE_CHECKING:
    from featcache.taps import Tap


@dataclass(frozen=True)
class ReduceContext:
    """What a reduction may need to know about the batch besides the captured value.

    ``attention_mask`` is ``[B, T]`` (1 for real tokens) for token inputs, else None;
    ``prefix_tokens`` counts the tokens before the patch tokens (class, register tokens)
    in the model's token outputs; ``sequence_first`` says token outputs are ``[T, B, D]``.
    """

    attention_mask: torch.Tensor | None = None
    prefix_tokens: int = 0
    sequence_first: bool = False


NO_CONTEXT = ReduceContext()


def reduce_tensor(x: torch.Tensor, tap: Tap, context: ReduceContext = NO_CONTEXT) -> torch.Tensor:
    """Apply ``tap.reduce`` to a batch ``x`` of shape ``[B, ...]``; returns ``[B, ...]``.

    ``context`` carries what the batch says beyond ``x`` (see :class:`ReduceContext`);
    the reductions of today use none of it.

    ``avg``/``max`` pool over every dimension after the channel dimension (``[B, C, ...]``
    -> ``[B, C]``); ``adaptive_avg`` pools ``[B, C, H, W]`` to ``[B, C, k, k]``;
    ``flatten`` gives ``[B, prod(...)]``; ``cls`` and ``mean`` take token 0 or the mean
    over tokens of a ``[B, T, D]`` sequence (-> ``[B, D]``).
    """
    how = tap.reduce
    if how == "none":
        return x
    if how == "flatten":
        return x.flatten(1)
    if how in ("avg", "max"):
        _need_dims(x, tap, minimum=3, shape="[B, C, ...spatial]")
        dims = tuple(range(2, x.dim()))
        return x.mean(dim=dims) if how == "avg" else x.amax(dim=dims)
    if how == "adaptive_avg":
        _need_dims(x, tap, minimum=4, maximum=4, shape="[B, C, H, W]")
        return F.adaptive_avg_pool2d(x, tap.size)
    if how in ("cls", "mean"):
        _need_dims(x, tap, minimum=3, maximum=3, shape="[B, T, D] tokens")
        return x[:, 0] if how == "cls" else x.mean(dim=1)
    raise ConfigError(f"layer {tap.key!r}: unknown reduce {how!r}")


def _need_dims(
    x: torch.Tensor, tap: Tap, minimum: int, shape: str, maximum: int | None = None
) -> None:
    if x.dim() < minimum or (maximum is not None and x.dim() > maximum):
        raise ConfigError(
            f"layer {tap.key!r}: reduce={tap.reduce} needs a {shape} {tap.capture}, got shape "
            f"{list(x.shape)}; choose another reduce (none, flatten, avg, ...)"
        )
