"""What probes produce: the fitted :class:`LinearProbe` and the evaluations' results."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from featcache.probe.options import ProbeOptions
from featcache.probe.recipes import recipe


@dataclasses.dataclass
class LinearProbe:
    """A fitted probe: ``logits = ((x - mean) / std) @ weight.T + bias``, with each row
    ``x`` first scaled to unit L2 norm when ``l2``.

    ``mean``, ``std``: float32 ``[D]``; ``weight``: float32 ``[C, D]``; ``bias``:
    float32 ``[C]``. Inputs are rows of the layer, ``[N, *shape]`` in any float dtype."""

    mean: torch.Tensor
    std: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    l2: bool = False

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 ``[N, C]`` logits of rows ``x`` ``[N, *shape]``."""
        x = x.reshape(len(x), -1).to(self.weight.device, torch.float32)
        if self.l2:
            x = torch.nn.functional.normalize(x, dim=1)
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
    # Per role: path, rows, config and dataset fingerprints, weights (null where absent)
    # and the sha256 of this layer's rows as little-endian float32, in store order.
    stores: dict[str, dict[str, Any]]
    notes: list[str]
    model: LinearProbe | None = dataclasses.field(default=None, repr=False)
    # The options it was fitted with (resolved: lambdas sorted, max_memory in bytes).
    options: ProbeOptions | None = dataclasses.field(default=None, repr=False)
    recipe: str | None = None  # the published recipe it followed (None: featcache's own)
    normalize: str = "standardize"  # how rows were prepared (ProbeOptions.normalize)

    method = "linear"

    @property
    def top1(self) -> float:
        """Test top-1 when there is a test split, else validation top-1 (optimistic)."""
        return (self.test or self.val)["top1"]

    def scores(self) -> list[Score]:
        """Its line of the methods table: the test metrics (validation without a test)."""
        shown = self.test or self.val
        label = "linear" if self.recipe is None else f"linear ({self.recipe})"
        return [Score(label, shown["top1"], shown.get("top5"), shown["chance_top1"])]

    def to_dict(self) -> dict[str, Any]:
        skip = ("model", "options", "recipe")
        return {**_fields(self, skip), "recipe": recipe_record(self.recipe)}


@dataclasses.dataclass(frozen=True)
class Score:
    """One line of the methods table and one point of a layer curve: a method's top-1
    and top-5 on the scored rows, with their standard deviation over few-shot draws."""

    method: str  # "linear", "linear (dinov3)", "k-NN k=20", "linear 5-shot", ...
    top1: float
    top5: float | None
    chance_top1: float
    top1_std: float | None = None
    top5_std: float | None = None


@dataclasses.dataclass
class KnnResult:
    """What one weighted k-NN classification measured. ``to_dict()`` is its JSON."""

    layer: str
    shape: list[int]
    num_classes: int
    class_names: list[str] | None
    temperature: float
    normalize: str  # how rows were prepared before the cosine similarity
    n_train: int  # the neighbour rows
    n_test: int  # the rows classified
    scored: str  # "test", or "val" without a test store
    validation: str  # where validation rows came from (the scored rows for "val")
    metrics: dict[int, dict[str, Any]]  # top-k metrics of each k
    seconds: dict[str, float]
    stores: dict[str, dict[str, Any]]  # as ProbeResult.stores
    notes: list[str]
    options: ProbeOptions | None = dataclasses.field(default=None, repr=False)

    method = "knn"

    @property
    def ks(self) -> list[int]:
        return sorted(self.metrics)

    @property
    def k(self) -> int:
        """The headline ``k``: 20 (DINO's), else the smallest one run."""
        return 20 if 20 in self.metrics else self.ks[0]

    @property
    def top1(self) -> float:
        """Top-1 at the headline ``k``."""
        return self.metrics[self.k]["top1"]

    def scores(self) -> list[Score]:
        """One line per ``k``."""
        return [
            Score(f"k-NN k={k}", m["top1"], m.get("top5"), m["chance_top1"])
            for k, m in sorted(self.metrics.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        metrics = {str(k): m for k, m in sorted(self.metrics.items())}
        return {**_fields(self, ("options",)), "metrics": metrics}


@dataclasses.dataclass
class FewShotResult:
    """One method's few-shot evaluation of one layer at one number of shots, over
    several draws. ``to_dict()`` is its JSON."""

    layer: str
    shape: list[int]
    method: str  # "linear" or "knn"
    shots: int  # rows drawn per class
    num_classes: int
    class_names: list[str] | None
    n_val: int  # validation rows that chose lambda (linear)
    n_test: int  # the rows classified
    scored: str  # "test", or "val" without a test store
    validation: str
    chance_top1: float  # of the scored rows
    # Per draw: {"draw", "seed", "rows", "top1", "top5", ..., "ids"}; linear adds "lambda"
    # and "val_top1", k-NN gives "k": {k: {"top1", "top5"}}. "seed" is the draw's
    # generator seed [seed, draw], "ids" the train rows drawn: {class: [sample ids]}.
    draws: list[dict[str, Any]]
    # Mean, standard deviation (n - 1), min and max over the draws of top-1 and top-5,
    # per line: {"linear": {...}} or {"k=10": {...}, "k=20": {...}, ...}.
    summary: dict[str, dict[str, dict[str, float]]]
    seconds: dict[str, float]
    stores: dict[str, dict[str, Any]]
    notes: list[str]
    recipe: str | None = None
    normalize: str = "standardize"
    options: ProbeOptions | None = dataclasses.field(default=None, repr=False)

    @property
    def top1(self) -> float:
        """Mean top-1 over the draws (k-NN: at k = 20, else the smallest k)."""
        return self.summary[self.headline]["top1"]["mean"]

    @property
    def headline(self) -> str:
        """The headline summary line: "linear", or k-NN's "k=20" (else the smallest k)."""
        if self.method == "linear":
            return "linear"
        return "k=20" if "k=20" in self.summary else next(iter(self.summary))

    def scores(self) -> list[Score]:
        """One line per summary entry (k-NN: per ``k``)."""
        out = []
        for line, stats in self.summary.items():
            name = "linear" if line == "linear" else f"k-NN {line}"
            if line == "linear" and self.recipe is not None:
                name = f"linear ({self.recipe})"
            label, top1, top5 = f"{name} {self.shots}-shot", stats["top1"], stats.get("top5") or {}
            top5_mean, top5_std = top5.get("mean"), top5.get("std")
            out.append(
                Score(label, top1["mean"], top5_mean, self.chance_top1, top1["std"], top5_std)
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**_fields(self, ("options", "recipe")), "recipe": recipe_record(self.recipe)}


Result = ProbeResult | KnnResult | FewShotResult


def _fields(result: Result, skip: tuple[str, ...]) -> dict[str, Any]:
    """A result's JSON entry: layer, shape, dim, method, then its fields but ``skip``
    (``lam`` as ``"lambda"``)."""
    out: dict[str, Any] = {"layer": result.layer, "shape": result.shape}
    out["dim"] = int(np.prod(result.shape))
    out["method"] = result.method
    for f in dataclasses.fields(result)[2:]:
        if f.name not in skip:
            out["lambda" if f.name == "lam" else f.name] = getattr(result, f.name)
    return out


def recipe_record(name: str | None) -> dict[str, str] | None:
    """What a result records of its recipe: its name and source (None: featcache's)."""
    published = recipe(name)
    return None if published is None else {"name": published.name, "source": published.source}


@dataclasses.dataclass
class Fit:
    """What a trainer returns for one layer; ``features_sha256``: of each store read."""

    lam: float
    sweep: list[dict[str, Any]]
    val: dict[str, Any]
    test: dict[str, Any] | None
    seconds: dict[str, float]
    features_sha256: dict[str, str]
    model: LinearProbe


@dataclasses.dataclass
class KnnFit:
    """What a k-NN run returns for one layer, as :class:`Fit` for a trainer."""

    metrics: dict[int, dict[str, Any]]
    n_neighbours: int
    n_queries: int
    seconds: dict[str, float]
    features_sha256: dict[str, str]


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
