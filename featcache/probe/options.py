"""How a probe is fitted: :class:`ProbeOptions`, checked by :mod:`featcache.validation`."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, Literal

from featcache.errors import ConfigError
from featcache.units import parse_bytes
from featcache.validation import build, option

Trainer = Literal["auto", "full", "streaming"]
TRAINERS: tuple[str, ...] = typing.get_args(Trainer)
UNKNOWN_OPTION = "unknown probe option {key!r}; known: {known}"


def _lambdas(value: Any, at: str) -> list[float] | None:
    """Any collection of positive finite numbers -> their sorted unique floats."""
    if value is None:
        return None
    try:
        lambdas = sorted({float(v) for v in value})
    except (TypeError, ValueError):
        lambdas = []
    if not lambdas or lambdas[0] <= 0 or not all(map(math.isfinite, lambdas)):
        raise ConfigError(f"{at} must be a non-empty list of positive numbers, e.g. 1e-4,1e-2")
    return lambdas


def _bytes(value: Any, at: str) -> int:
    return parse_bytes(value)


@dataclasses.dataclass
class ProbeOptions:
    """How a probe is fitted. Every field is also a keyword argument of :func:`probe`."""

    val_fraction: float | None = option(None, gt=0, lt=1)  # share of train held out; None: 0.2
    trainer: Trainer = "auto"  # "auto" (by max_memory), "full" or "streaming"
    # The coarse grid of L2 strengths; None: DEFAULT_LAMBDAS (full), STREAMING_LAMBDAS.
    lambdas: list[float] | None = option(None, convert=_lambdas)
    # Values tried between the best grid value and each neighbour; None: 2 (full), 1.
    refine: int | None = option(None, ge=0)
    max_iter: int = option(500, ge=1)  # L-BFGS iterations per fit (full trainer)
    # Bytes (or "4GiB") of features the full trainer may hold.
    max_memory: int | str = option(4 << 30, ge=1, convert=_bytes)
    epochs: int | None = option(None, ge=1)  # streaming; None: 10, or enough for 300 steps
    batch_size: int = option(1024, ge=1)  # streaming
    lr: float = option(0.05, gt=0)  # streaming: Adam's peak learning rate, cosine-decayed
    num_workers: int = option(0, ge=0)  # streaming: DataLoader workers
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", ...
    seed: int = option(0, ge=0)  # the validation split and the streaming batch order
    progress: bool = True

    @property
    def max_bytes(self) -> int:
        """``max_memory`` as a number of bytes."""
        return parse_bytes(self.max_memory)


def resolve_options(options: ProbeOptions | None, changes: Mapping[str, Any]) -> ProbeOptions:
    """``options`` (default: all defaults) with keyword ``changes``, every field checked.

    The result has ``lambdas`` sorted and unique and ``max_memory`` in bytes.

    Raises:
        ConfigError: an unknown option, or a value of the wrong kind or out of bounds.
    """
    base = options or ProbeOptions()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return build(ProbeOptions, {**fields, **changes}, unknown=UNKNOWN_OPTION)
