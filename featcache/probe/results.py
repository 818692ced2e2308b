"""What a probe produces: the fitted :class:`LinearProbe` and its :class:`ProbeResult`."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from featcache.probe.options import ProbeOptions


@dataclasses.dataclass
class LinearProbe:
    """A fitted probe: ``logits = ((x - mean) / std) @ weight.T + bias``.

    ``mean``, ``std``: float32 ``[D]``; ``weight``: float32 ``[C, D]``; ``bias``:
    float32 ``[C]``. Inputs are rows of the layer, ``[N, *shape]`` in any float dtype.
    """

    mean: torch.Tensor
    std: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 ``[N, C]`` logits of rows ``x`` ``[N, *shape]``."""
        x = x.reshape(len(x), -1).to(self.weight.device, torch.float32)
        return ((x - self.mean) / self.std) @ self.weight.T + self.bias

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Int64 ``[N]`` predicted classes."""
        return self.logits(x).argmax(1)


@dataclasses.dataclass
class ProbeResult:
    """What one probe measured. ``to_dict()`` is the JSON written for it."""

    layer: str
    shape: list[int]
    trainer: str
    num_classes: int
    class_names: list[str] | None
    lam: float  # the chosen L2 strength
    sweep: list[dict[str, Any]]  # [{"lambda", "val_top1", ...}] in increasing lambda
    n_train: int  # rows the sweep models were fitted on
    n_val: int
    n_test: int
    validation: str  # where the validation rows came from
    val: dict[str, Any]  # the sweep model at ``lam`` on the validation rows
    test: dict[str, Any] | None  # the refitted model on the test store, if one was given
    seconds: dict[str, float]
    # Per role (train, val, test): path, rows, the store's config and dataset
    # fingerprints and weights identity (null where the store lacks them) and the sha256
    # of this layer's rows as little-endian float32, in store order.
    stores: dict[str, dict[str, Any]]
    notes: list[str]
    model: LinearProbe | None = dataclasses.field(default=None, repr=False)
    # The options it was fitted with (resolved: lambdas sorted, max_memory in bytes).
    options: ProbeOptions | None = dataclasses.field(default=None, repr=False)

    @property
    def top1(self) -> float:
        """Test top-1 when there is a test split, else validation top-1 (optimistic)."""
        return (self.test or self.val)["top1"]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "shape": self.shape}
        out["dim"] = int(np.prod(self.shape))
        for f in dataclasses.fields(self)[2:]:
            if f.name not in ("model", "options"):
                out["lambda" if f.name == "lam" else f.name] = getattr(self, f.name)
        return out


@dataclasses.dataclass
class Fit:
    """What a trainer returns for one layer; the splits supply the rest of a result.

    ``features_sha256`` maps each role whose store was read to the sha256 of its rows.
    """

    lam: float
    sweep: list[dict[str, Any]]
    val: dict[str, Any]
    test: dict[str, Any] | None
    seconds: dict[str, float]
    features_sha256: dict[str, str]
    model: LinearProbe


class Timings:
    """Seconds per phase, in the order the phases ran (``ProbeResult.seconds``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record how long the ``with`` block takes as ``seconds[name]``."""
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 4)
