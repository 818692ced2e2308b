"""How a probe is fitted: :class:`ProbeOptions`, checked by :mod:`featcache.config.validation`."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, Literal

from featcache.config.validation import build, option
from featcache.errors import ConfigError
from featcache.util.units import parse_bytes

Trainer = Literal["auto", "full", "streaming"]
TRAINERS: tuple[str, ...] = typing.get_args(Trainer)
Method = Literal["linear", "knn"]
METHODS: tuple[str, ...] = typing.get_args(Method)
RecipeName = Literal["dinov3", "clip"]
RECIPES: tuple[str, ...] = typing.get_args(RecipeName)
Normalize = Literal["standardize", "l2", "l2+standardize", "none"]
NORMALIZE: tuple[str, ...] = typing.get_args(Normalize)
UNKNOWN_OPTION = "unknown probe option {key!r}; known: {known}"

DEFAULT_KS = (10, 20, 100, 200)  # the k of DINO's weighted k-NN evaluation
DEFAULT_DRAWS = 5


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


def _counts(example: str) -> Any:
    """A converter: a list of whole numbers >= 1, or the text ``"1,5,10"``, -> their sorted
    unique ints (None stays None)."""

    def convert(value: Any, at: str) -> list[int] | None:
        if value is None:
            return None
        items = value.split(",") if isinstance(value, str) else value
        numbers = []
        for item in items if isinstance(items, (list, tuple)) else [items]:
            text = item.strip() if isinstance(item, str) else item
            if isinstance(text, str) and text.isdigit():
                text = int(text)
            if isinstance(text, bool) or not isinstance(text, int) or text < 1:
                raise ConfigError(f"{at} must be whole numbers >= 1 like {example}, got {value!r}")
            numbers.append(text)
        if not numbers:
            raise ConfigError(f"{at} must be whole numbers >= 1 like {example}, got {value!r}")
        return sorted(set(numbers))

    return convert


def _methods(value: Any, at: str) -> Any:
    """``"linear,knn"`` -> ``["linear", "knn"]`` (a list is checked as given)."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{at} is empty; choose linear, knn or both (linear,knn)")
        return list(dict.fromkeys(value))  # in the order given, each once
    return value


@dataclasses.dataclass
class ProbeOptions:
    """How a probe is fitted. Every field is also a keyword argument of
    [`probe`][featcache.probe.api.probe] and the other entry points of `featcache.probe`."""

    val_fraction: float | None = option(None, gt=0, lt=1)  # share of train held out; None: 0.2
    trainer: Trainer = "auto"  # "auto" (by max_memory), "full" or "streaming"
    # The coarse grid of L2 strengths; None: DEFAULT_LAMBDAS (full), STREAMING_LAMBDAS.
    lambdas: list[float] | None = option(None, convert=_lambdas)
    # Values tried between the best grid value and each neighbour; None: 2 (full), 1.
    refine: int | None = option(None, ge=0)
    max_iter: int = option(500, ge=1)  # L-BFGS iterations per fit (full trainer)
    # Bytes (or "4GiB") of features the full trainer may hold.
    max_memory: int | str = option(4 << 30, ge=1, convert=lambda value, at: parse_bytes(value))
    epochs: int | None = option(None, ge=1)  # streaming; None: 10, or enough for 300 steps
    batch_size: int = option(1024, ge=1)  # streaming
    lr: float = option(0.05, gt=0)  # streaming: Adam's peak learning rate, cosine-decayed
    num_workers: int = option(0, ge=0)  # streaming: DataLoader workers
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", ...
    seed: int = option(0, ge=0)  # the validation split, the batch order, the few-shot draws
    progress: bool = True
    # The evaluations to run: "linear" (logistic regression), "knn" (weighted k-NN).
    methods: list[Method] = option(default_factory=lambda: ["linear"], convert=_methods)
    ks: list[int] = option(default_factory=lambda: list(DEFAULT_KS), convert=_counts("10,20"))
    temperature: float = option(0.07, gt=0)  # k-NN: a neighbour votes exp(similarity / T)
    # Few-shot: rows per class drawn from train, one evaluation per value; None: all rows.
    shots: list[int] | None = option(None, convert=_counts("1,5,10"))
    draws: int | None = option(None, ge=1)  # few-shot draws per value of shots; None: 5
    # A published linear-probe recipe (sweep, validation split, refit); None: featcache's.
    recipe: RecipeName | None = None
    # How rows are prepared; None: the method's default (linear: standardize, or what the
    # recipe publishes; k-NN: l2). k-NN compares rows by cosine similarity after it.
    normalize: Normalize | None = None

    @property
    def max_bytes(self) -> int:
        """``max_memory`` as a number of bytes."""
        return parse_bytes(self.max_memory)

    @property
    def n_draws(self) -> int:
        """Few-shot draws per value of ``shots``."""
        return DEFAULT_DRAWS if self.draws is None else self.draws

    def validate(self, at: str) -> None:
        where = f"{at}." if at else ""
        if self.draws is not None and self.shots is None:
            raise ConfigError(f"{where}draws counts few-shot draws; give shots too (e.g. 1,5,10)")
        if self.recipe is not None and self.lambdas is not None:
            raise ConfigError(
                f"{where}lambdas and recipe {self.recipe} both set the sweep; give one of them"
            )
        if self.recipe is not None and self.trainer == "streaming":
            raise ConfigError(
                f"{where}recipe {self.recipe} fits in memory as published; leave trainer at "
                "auto or full"
            )


def resolve_options(options: ProbeOptions | None, changes: Mapping[str, Any]) -> ProbeOptions:
    """``options`` (default: all defaults) with keyword ``changes``, every field checked;
    ``lambdas`` sorted and unique, ``max_memory`` in bytes.

    Raises:
        ConfigError: an unknown option, or a value of the wrong kind or out of bounds."""
    base = options or ProbeOptions()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return build(ProbeOptions, {**fields, **changes}, unknown=UNKNOWN_OPTION)
