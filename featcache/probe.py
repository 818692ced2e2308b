"""Linear probes on cached features: the standard linear-evaluation protocol.

The protocol of Kornblith et al. (2019) and the SimCLR / CLIP linear evaluations:

1. Features are flattened to ``[N, D]`` float32 and standardised with the mean and
   standard deviation of the rows being fitted (never of the validation or test rows).
2. An L2-regularised multinomial logistic regression, loss
   ``mean cross-entropy + lambda / 2 * ||W||^2`` (bias unregularised), is fitted for
   every ``lambda`` of a log-spaced grid, then for a few values between the best one
   and its neighbours. Validation top-1 picks ``lambda``; ties go to the stronger
   regularisation.
3. The model is refitted on train + validation at the chosen ``lambda`` (standardised
   with their statistics) and evaluated once on the test split, which no choice
   ever looked at.

Two trainers implement it. ``full``: the whole split in memory, full-batch L-BFGS with
a strong-Wolfe line search, fits warm-started along the regularisation path.
``streaming``: for stores larger than memory, mini-batch Adam (cosine-decayed learning
rate) over the chunk-aware shuffled batches of :class:`~featcache.dataset.FeatureDataset`
(:class:`~featcache.dataset.ShuffledBatches` in a ``DataLoader``), with the
standardisation statistics from one in-order pass over the training rows; the models of
a sweep train side by side, so a sweep reads the features as often as one fit does.

Everything is seeded: the same stores and options give the same numbers (on the same
machine and number of threads; float sums depend on their order).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from featcache.dataset import FeatureDataset, ShuffledBatches
from featcache.errors import ConfigError
from featcache.store import FeatureStore
from featcache.units import format_bytes, parse_bytes

PROBE_FORMAT = 1
TRAINERS = ("auto", "full", "streaming")
DEFAULT_LAMBDAS = tuple(10.0**k for k in range(-6, 3))  # 1e-6 ... 1e2, one per decade
STREAMING_LAMBDAS = tuple(10.0**k for k in range(-6, 3, 2))  # 1e-6 ... 1e2, every 2 decades
READ_ROWS = 8192  # rows per read when the full-batch trainer loads a layer
Source = str | os.PathLike | FeatureStore


@dataclasses.dataclass
class ProbeOptions:
    """How a probe is fitted. Every field is also a keyword argument of :func:`probe`."""

    val_fraction: float | None = None  # stratified share of train held out; None: 0.2
    trainer: str = "auto"  # "auto" (by max_memory), "full" or "streaming"
    # The coarse grid of L2 strengths; None: DEFAULT_LAMBDAS (full), STREAMING_LAMBDAS.
    lambdas: Sequence[float] | None = None
    # Values tried between the best grid value and each neighbour; None: 2 (full), 1.
    refine: int | None = None
    max_iter: int = 500  # L-BFGS iterations per fit (full trainer)
    max_memory: int | str = 4 << 30  # bytes (or "4GiB") of features the full trainer may hold
    epochs: int | None = None  # streaming; None: 10, or more to make 300 optimiser steps
    batch_size: int = 1024  # streaming
    lr: float = 0.05  # streaming: Adam's peak learning rate, cosine-decayed to zero
    num_workers: int = 0  # streaming: DataLoader workers
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", ...
    seed: int = 0  # the validation split and the streaming trainer's batch order
    progress: bool = True


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

    @property
    def top1(self) -> float:
        """Test top-1 when there is a test split, else validation top-1 (optimistic)."""
        return (self.test or self.val)["top1"]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "shape": self.shape}
        out["dim"] = int(np.prod(self.shape))
        for f in dataclasses.fields(self)[2:]:
            if f.name != "model":
                out["lambda" if f.name == "lam" else f.name] = getattr(self, f.name)
        return out


def probe(
    train: Source,
    layer: str,
    *,
    val: Source | None = None,
    test: Source | None = None,
    options: ProbeOptions | None = None,
    **kwargs: Any,
) -> ProbeResult:
    """Fit and evaluate a linear probe on one stored ``layer``.

    ``train``, ``val`` and ``test`` are store paths (or :class:`FeatureStore`). Without
    ``val``, a stratified ``val_fraction`` (default 0.2) of ``train`` is held out for
    choosing the regularisation. Without ``test``, the result reports only the
    validation accuracy, which chose the model and so is optimistic. ``kwargs`` are
    fields of :class:`ProbeOptions`.

    Raises:
        ConfigError: a layer missing from a store, stores whose layers, shapes or class
            names differ, a store without labels, a single class, bad options.
    """
    (result,) = probe_layers(train, [layer], val=val, test=test, options=options, **kwargs)
    return result


def probe_layers(
    train: Source,
    layers: str | Sequence[str] = "all",
    *,
    val: Source | None = None,
    test: Source | None = None,
    options: ProbeOptions | None = None,
    **kwargs: Any,
) -> list[ProbeResult]:
    """One probe per layer: ``"all"`` (every stored layer), a name, a comma-separated
    list or a sequence of names. The results, in that order, form the layer-wise
    transfer curve. Arguments as in :func:`probe`."""
    options = _resolve_options(options, kwargs)
    splits = _Splits.open(train, val, test, options)
    names = _resolve_layers(splits, layers)
    return [_probe_layer(splits, name, options) for name in names]


# ----------------------------------------------------------------------------- checks


def _resolve_options(options: ProbeOptions | None, kwargs: Mapping[str, Any]) -> ProbeOptions:
    options = dataclasses.replace(options or ProbeOptions())
    known = {f.name for f in dataclasses.fields(ProbeOptions)}
    for key, value in kwargs.items():
        if key not in known:
            raise ConfigError(f"unknown probe option {key!r}; known: {', '.join(sorted(known))}")
        setattr(options, key, value)
    if options.trainer not in TRAINERS:
        raise ConfigError(
            f"unknown trainer {options.trainer!r}; choose one of: {', '.join(TRAINERS)}"
        )
    if options.val_fraction is not None and not 0 < options.val_fraction < 1:
        raise ConfigError(
            f"val fraction must be between 0 and 1 (exclusive), got {options.val_fraction}; "
            "0.2 holds out a fifth of the training rows"
        )
    if options.lambdas is not None:
        lambdas = [float(v) for v in options.lambdas]
        if not lambdas or min(lambdas) <= 0 or not all(map(math.isfinite, lambdas)):
            raise ConfigError(
                "lambdas must be a non-empty list of positive numbers, e.g. 1e-4,1e-2"
            )
        options.lambdas = tuple(sorted(set(lambdas)))
    options.max_memory = parse_bytes(options.max_memory)
    for name in ("refine", "max_iter", "batch_size", "num_workers", "max_memory", "epochs"):
        value = getattr(options, name)
        least = 0 if name in ("refine", "num_workers") else 1
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < least
        ):
            raise ConfigError(
                f"probe option {name} must be a whole number >= {least}, got {value!r}"
            )
    if not (isinstance(options.lr, (int, float)) and options.lr > 0):
        raise ConfigError(f"probe option lr must be a positive number, got {options.lr!r}")
    return options


@dataclasses.dataclass
class _Splits:
    """The stores of one probe run, checked, with the rows each role uses."""

    stores: dict[str, FeatureStore]  # "train", optionally "val" and "test"
    labels: dict[str, np.ndarray]
    fit_rows: np.ndarray  # rows of the train store the sweep fits on
    val_rows: np.ndarray | None  # rows of the train store held out; None with a val store
    num_classes: int
    class_names: list[str] | None
    validation: str

    @classmethod
    def open(
        cls, train: Source, val: Source | None, test: Source | None, options: ProbeOptions
    ) -> _Splits:
        if val is not None and options.val_fraction is not None:
            raise ConfigError("give either a val store or a val fraction, not both")
        stores = {"train": _open(train)}
        if val is not None:
            stores["val"] = _open(val)
        if test is not None:
            stores["test"] = _open(test)
        paths: dict[Path, str] = {}
        for role, store in stores.items():
            where = store.path.resolve()
            if where in paths:
                raise ConfigError(
                    f"the {paths[where]} and {role} stores are the same file {store.path}; "
                    "each split must hold its own rows"
                )
            paths[where] = role
        labels = {}
        for role, store in stores.items():
            if not store.has_labels:
                raise ConfigError(
                    f"the {role} store {store.path} has no labels; a probe needs labelled "
                    "stores (extract from a source with labels)"
                )
            labels[role] = store.labels
        names = stores["train"].class_names
        for role, store in stores.items():
            if store.class_names != names:
                raise ConfigError(
                    f"the train and {role} stores have different class names "
                    f"({_short(names)} vs {_short(store.class_names)}); their labels do not "
                    "mean the same classes"
                )
        present = np.unique(labels["train"])
        if len(present) < 2:
            raise ConfigError(
                f"the train store {stores['train'].path} has only one class ({present[0]}); "
                "a probe needs at least two"
            )
        # The classes the probe can predict come from the fitted splits (and the class
        # names), never from the test labels.
        num_classes = max(
            int(labels[role].max()) + 1 for role in ("train", "val") if role in labels
        )
        if names:
            num_classes = max(num_classes, len(names))
        if val is None:
            fraction = 0.2 if options.val_fraction is None else options.val_fraction
            fit_rows, val_rows = stratified_split(labels["train"], fraction, options.seed)
            if not len(val_rows):
                raise ConfigError(
                    f"val fraction {fraction} holds out no rows of the {len(fit_rows)}; "
                    "raise it or give a val store"
                )
            validation = f"{fraction:g} of train, stratified (seed {options.seed})"
        else:
            fit_rows, val_rows = np.arange(len(labels["train"])), None
            validation = f"val store {stores['val'].path}"
        return cls(stores, labels, fit_rows, val_rows, num_classes, names, validation)

    @property
    def y_fit(self) -> np.ndarray:
        return self.labels["train"][self.fit_rows]

    @property
    def y_val(self) -> np.ndarray:
        if self.val_rows is None:
            return self.labels["val"]
        return self.labels["train"][self.val_rows]

    def store_info(self) -> dict[str, Any]:
        """Path, rows, fingerprints and weights of every store (null where absent)."""
        out = {}
        for role, store in self.stores.items():
            attrs = store.attrs
            out[role] = {
                "path": str(store.path),
                "rows": len(store),
                "config_fingerprint": attrs.get("config_fingerprint"),
                "dataset_fingerprint": attrs.get("dataset_fingerprint"),
                "weights": attrs.get("weights"),
            }
        return out


def _open(source: Source) -> FeatureStore:
    return source if isinstance(source, FeatureStore) else FeatureStore(source)


def _short(names: Sequence[str] | None) -> str:
    if names is None:
        return "none"
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


def _resolve_layers(splits: _Splits, layers: str | Sequence[str]) -> list[str]:
    stores = splits.stores
    if isinstance(layers, str):
        layers = [part.strip() for part in layers.split(",") if part.strip()]
    names = list(layers)
    if not names:
        raise ConfigError("no layer given; name one, a comma-separated list, or all")
    if names == ["all"]:
        names = stores["train"].layers
        for role, store in stores.items():
            if set(store.layers) != set(names):
                raise ConfigError(
                    f"the train and {role} stores have different layers "
                    f"({', '.join(names)} vs {', '.join(store.layers)}); "
                    "probe the layers they share with --layer a,b"
                )
    for name in names:
        for role, store in stores.items():
            if name not in store.layers:
                raise ConfigError(
                    f"layer {name!r} is not in the {role} store {store.path}; "
                    f"it holds: {', '.join(store.layers)}"
                )
        shape = stores["train"].shape(name)
        for role, store in stores.items():
            if store.shape(name) != shape:
                raise ConfigError(
                    f"layer {name!r} has shape {list(shape)} in the train store but "
                    f"{list(store.shape(name))} in the {role} store {store.path}; the stores "
                    "come from different models or reductions"
                )
    return names


def stratified_split(
    labels: np.ndarray, fraction: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of rows into (fit, held-out), keeping each class's proportion.

    Every class with at least two rows keeps at least one on each side. Returns two
    sorted int64 arrays of row numbers.
    """
    rng = np.random.default_rng(seed)
    fit, held = [], []
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        take = 0 if len(rows) < 2 else min(max(round(fraction * len(rows)), 1), len(rows) - 1)
        held.append(rows[:take])
        fit.append(rows[take:])
    return np.sort(np.concatenate(fit)), np.sort(np.concatenate(held))


# ------------------------------------------------------------------------- the protocol


def refine_lambdas(grid: Sequence[float], best: float, per_side: int) -> list[float]:
    """``per_side`` log-spaced values strictly between ``best`` and each grid neighbour."""
    grid = sorted(grid)
    i = grid.index(best)
    out = []
    for j in (i - 1, i + 1):
        if 0 <= j < len(grid):
            ratio = grid[j] / best
            out += [best * ratio ** (k / (per_side + 1)) for k in range(1, per_side + 1)]
    return sorted(out)


def choose(sweep: Sequence[Mapping[str, Any]]) -> float:
    """The lambda with the best validation top-1; ties go to the larger lambda."""
    best = max(sweep, key=lambda entry: (entry["val_top1"], entry["lambda"]))
    return best["lambda"]


def topk_metrics(
    ranked: torch.Tensor, labels: torch.Tensor, class_names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Accuracy from ranked predictions.

    ``ranked``: int64 ``[N, k]``, the k highest-scoring classes per row, best first;
    ``labels``: int64 ``[N]``. Gives top-1, top-5 (when ``k >= 5``), the accuracy of each
    class present (by name when ``class_names`` is given) and its mean, and the chance
    level: the accuracy of always guessing the most frequent class(es).
    """
    ranked, labels = ranked.cpu(), labels.cpu()
    hit1 = ranked[:, 0] == labels
    counts = torch.bincount(labels)
    per_class = {}
    for label in torch.nonzero(counts).flatten().tolist():
        mask = labels == label
        name = class_names[label] if class_names and label < len(class_names) else str(label)
        per_class[name] = hit1[mask].double().mean().item()
    frequencies = counts.double().sort(descending=True).values / len(labels)
    out: dict[str, Any] = {"n": len(labels), "top1": hit1.double().mean().item()}
    out["chance_top1"] = frequencies[0].item()
    if ranked.shape[1] >= 5:
        out["top5"] = (ranked[:, :5] == labels[:, None]).any(1).double().mean().item()
        out["chance_top5"] = frequencies[:5].sum().item()
    out["mean_per_class"] = float(np.mean(list(per_class.values())))
    out["per_class"] = per_class
    return out


def _rank(logits: torch.Tensor) -> torch.Tensor:
    return logits.topk(min(5, logits.shape[-1]), dim=-1).indices


class Moments:
    """Running mean and variance per feature (Chan et al.'s parallel update, float64)."""

    def __init__(self, dim: int):
        self.n = 0
        self.mean = torch.zeros(dim, dtype=torch.float64)
        self.m2 = torch.zeros(dim, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> Moments:
        """Add rows ``x`` ``[B, D]`` (any device and float dtype; read in slices, so a
        large array is never copied whole to float64)."""
        for part in x.split(READ_ROWS):
            part = part.to("cpu", torch.float64)
            mean = part.mean(0)
            self._add(len(part), mean, ((part - mean) ** 2).sum(0))
        return self

    def merge(self, other: Moments) -> Moments:
        """Add the rows another :class:`Moments` has seen, in place."""
        self._add(other.n, other.mean, other.m2)
        return self

    def _add(self, n: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        if n:
            total = self.n + n
            delta = mean - self.mean
            self.mean = self.mean + delta * (n / total)
            self.m2 = self.m2 + m2 + delta**2 * (self.n * n / total)
            self.n = total

    def standardizer(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``(mean, std)`` on ``device``; constant features get std 1."""
        std = (self.m2 / max(self.n, 1)).sqrt()
        std = torch.where(std > 1e-6, std, torch.ones_like(std))
        return self.mean.float().to(device), std.float().to(device)


def fit_lbfgs(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    lam: float,
    *,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_iter: int = 500,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Multinomial logistic regression by full-batch L-BFGS (strong-Wolfe line search).

    Minimises ``mean cross-entropy + lam / 2 * ||W||^2`` with the bias unregularised.
    ``x``: float32 ``[N, D]`` (standardised), ``y``: int64 ``[N]``, on one device;
    ``init``: a starting ``(W [C, D], b [C])``, zeros by default. Returns ``(W, b,
    iterations)``.
    """
    if init is None:
        weight = x.new_zeros(num_classes, x.shape[1])
        bias = x.new_zeros(num_classes)
    else:
        weight, bias = (t.detach().clone() for t in init)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        tolerance_grad=1e-6,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(F.linear(x, weight, bias), y) + 0.5 * lam * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    iterations = optimizer.state[optimizer.param_groups[0]["params"][0]].get("n_iter", 0)
    return weight.detach(), bias.detach(), int(iterations)


def _probe_layer(splits: _Splits, layer: str, options: ProbeOptions) -> ProbeResult:
    from featcache.runtime import resolve_device

    device = resolve_device(options.device)
    shape = list(splits.stores["train"].shape(layer))
    dim = int(np.prod(shape))
    rows = sum(len(store) for store in splits.stores.values())
    needed = 8 * dim * rows  # float32 rows plus their standardised copy
    trainer, notes = options.trainer, []
    if trainer == "auto":
        trainer = "full" if needed <= options.max_memory else "streaming"
        if trainer == "streaming":
            notes.append(
                f"streaming trainer: the features need about {format_bytes(needed)}, more than "
                f"max_memory {format_bytes(options.max_memory)}"
            )
    options = dataclasses.replace(
        options,
        lambdas=options.lambdas or (DEFAULT_LAMBDAS if trainer == "full" else STREAMING_LAMBDAS),
        refine=(2 if trainer == "full" else 1) if options.refine is None else options.refine,
    )
    run = _run_full if trainer == "full" else _run_streaming
    start = time.perf_counter()
    parts = run(splits, layer, options, device)
    lam = parts["lam"]
    if lam in (min(options.lambdas), max(options.lambdas)):
        notes.append(
            f"the chosen lambda {lam:.0e} is at the edge of the grid; widen it (lambdas) "
            "if accuracy matters at this end"
        )
    parts["seconds"]["total"] = round(time.perf_counter() - start, 4)
    stores = splits.store_info()
    for role, digest in parts.pop("features_sha256").items():
        stores[role]["features_sha256"] = digest
    return ProbeResult(
        layer=layer,
        shape=shape,
        trainer=trainer,
        num_classes=splits.num_classes,
        class_names=splits.class_names,
        n_train=len(splits.fit_rows),
        n_val=len(splits.y_val),
        n_test=len(splits.labels["test"]) if "test" in splits.labels else 0,
        validation=splits.validation,
        stores=stores,
        notes=notes,
        **parts,
    )


def _sweep_order(options: ProbeOptions) -> list[float]:
    return sorted(options.lambdas, reverse=True)  # strong to weak: warm starts follow the path


# ----------------------------------------------------------------------- full batch


def _run_full(
    splits: _Splits, layer: str, options: ProbeOptions, device: torch.device
) -> dict[str, Any]:
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    digests = {}
    x_train, digests["train"] = _read_layer(splits.stores["train"], layer)
    if splits.val_rows is None:
        x_fit = x_train
        x_val, digests["val"] = _read_layer(splits.stores["val"], layer)
    else:
        x_fit = x_train[torch.from_numpy(splits.fit_rows)]
        x_val = x_train[torch.from_numpy(splits.val_rows)]
    del x_train
    y_fit = torch.from_numpy(splits.y_fit).to(device)
    y_val = torch.from_numpy(splits.y_val).to(device)
    seconds["load"] = _lap(clock)

    clock = time.perf_counter()
    sweep, lam, (w, b), val = _sweep_full(
        x_fit, y_fit, x_val, y_val, splits, options, device, f"probe {layer}"
    )
    seconds["sweep"] = _lap(clock)

    clock = time.perf_counter()
    z_all = torch.cat([x_fit, x_val]).to(device)
    del x_fit, x_val
    mean, std = Moments(z_all.shape[1]).update(z_all).standardizer(device)
    z_all.sub_(mean).div_(std)
    y_all = torch.cat([y_fit, y_val])
    w, b, _ = fit_lbfgs(
        z_all, y_all, splits.num_classes, lam, init=(w, b), max_iter=options.max_iter
    )
    del z_all
    model = LinearProbe(mean, std, w, b)
    seconds["refit"] = _lap(clock)

    test = None
    if "test" in splits.stores:
        clock = time.perf_counter()
        x_test, digests["test"] = _read_layer(splits.stores["test"], layer)
        y_test = torch.from_numpy(splits.labels["test"])
        test = topk_metrics(_rank(model.logits(x_test)), y_test, splits.class_names)
        seconds["test"] = _lap(clock)
    return {
        "lam": lam,
        "sweep": sweep,
        "val": val,
        "test": test,
        "seconds": seconds,
        "features_sha256": digests,
        "model": model,
    }


def _sweep_full(
    x_fit: torch.Tensor,
    y_fit: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    splits: _Splits,
    options: ProbeOptions,
    device: torch.device,
    desc: str,
) -> tuple[list[dict[str, Any]], float, tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
    """The grid, then the refinement around its best, warm-started along the path.

    Returns the sweep (increasing lambda), the chosen lambda, its ``(W, b)`` and its
    validation metrics.
    """
    mean, std = Moments(x_fit.shape[1]).update(x_fit).standardizer(device)
    z_fit = (x_fit.to(device) - mean) / std
    z_val = (x_val.to(device) - mean) / std
    fits: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
    sweep: list[dict[str, Any]] = []
    grid = _sweep_order(options)
    with tqdm(
        total=len(grid) + 2 * options.refine,
        desc=desc,
        unit="fit",
        disable=not options.progress,
        dynamic_ncols=True,
    ) as bar:

        def fit(lam: float, init: tuple[torch.Tensor, torch.Tensor] | None) -> None:
            w, b, iterations = fit_lbfgs(
                z_fit, y_fit, splits.num_classes, lam, init=init, max_iter=options.max_iter
            )
            fits[lam] = (w, b)
            accuracy = (F.linear(z_val, w, b).argmax(1) == y_val).double().mean().item()
            sweep.append({"lambda": lam, "val_top1": accuracy, "iterations": iterations})
            bar.update()

        for lam in grid:
            fit(lam, fits[sweep[-1]["lambda"]] if sweep else None)
        best = choose(sweep)
        for lam in refine_lambdas(options.lambdas, best, options.refine):
            fit(lam, fits[best])
        bar.total = len(sweep)
        bar.refresh()
    lam = choose(sweep)
    w, b = fits[lam]
    val = topk_metrics(_rank(F.linear(z_val, w, b)), y_val, splits.class_names)
    return sorted(sweep, key=lambda entry: entry["lambda"]), lam, (w, b), val


def _read_layer(store: FeatureStore, layer: str) -> tuple[torch.Tensor, str]:
    """All rows of ``layer`` as float32 ``[N, D]`` and the sha256 of those bytes."""
    n, dim = len(store), int(np.prod(store.shape(layer)))
    out = torch.empty(n, dim, dtype=torch.float32)
    digest = hashlib.sha256()
    for start in range(0, n, READ_ROWS):
        rows = store.read(layer, slice(start, start + READ_ROWS)).reshape(-1, dim)
        out[start : start + len(rows)] = rows
        digest.update(out[start : start + len(rows)].numpy())
    return out, digest.hexdigest()


def _lap(start: float) -> float:
    return round(time.perf_counter() - start, 4)


# ------------------------------------------------------------------------ streaming


@dataclasses.dataclass
class _Part:
    """The rows of one store that a pass uses: all, or those where ``keep`` is true."""

    dataset: FeatureDataset
    keep: np.ndarray | None = None  # bool [N]

    def __len__(self) -> int:
        return len(self.dataset) if self.keep is None else int(self.keep.sum())

    def kept(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features, labels, rows)`` of a batch -> kept ``(float32 [b, D], int64 [b])``."""
        x, y, rows = batch
        if self.keep is not None:
            mask = torch.from_numpy(self.keep[rows.numpy()])
            x, y = x[mask], y[mask]
        return x.reshape(len(x), -1), y


def _in_order(parts: Sequence[_Part], batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The kept rows of each part in store order, read chunk by chunk:
    ``(float32 [b, D], int64 [b], raw)``, where ``raw`` is every row of the batch (for
    hashing the store)."""
    for part in parts:
        for batch in part.dataset.batches(batch_size, shuffle=False, with_index=True):
            x, y = part.kept(batch)
            yield x, y, batch[0]


def _shuffled(
    parts: Sequence[_Part], epochs: int, options: ProbeOptions, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``epochs`` passes over the kept rows in seeded random order.

    Each store is read with chunk-aware shuffling (:class:`ShuffledBatches`, whole chunks
    into a shuffled buffer, ``num_workers`` loader processes); the batches of several
    stores are interleaved in a seeded random order.
    """
    sources = [
        ShuffledBatches(part.dataset, options.batch_size, seed=options.seed, with_index=True)
        for part in parts
    ]
    loaders = [
        DataLoader(
            source,
            batch_size=None,
            num_workers=options.num_workers,
            persistent_workers=options.num_workers > 0,
            pin_memory=device.type == "cuda",
        )
        for source in sources
    ]
    counts = [math.ceil(len(part.dataset) / options.batch_size) for part in parts]
    for epoch in range(epochs):
        for source in sources:
            source.set_epoch(epoch)
        iterators = [iter(loader) for loader in loaders]
        turns = np.repeat(np.arange(len(parts)), counts)
        for i in np.random.default_rng([options.seed, epoch]).permutation(turns):
            batch = next(iterators[i], None)
            if batch is not None:
                yield from _nonempty(parts[i].kept(batch))
        for part, iterator in zip(parts, iterators, strict=True):
            for batch in iterator:  # what a source has left (a worker's last small batch)
                yield from _nonempty(part.kept(batch))


def _nonempty(batch: tuple[torch.Tensor, torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
    if len(batch[0]):  # a batch of held-out rows only is empty once they are dropped
        yield batch


def _run_streaming(
    splits: _Splits, layer: str, options: ProbeOptions, device: torch.device
) -> dict[str, Any]:
    seconds: dict[str, float] = {}
    datasets = {
        role: FeatureDataset(store.path, layer, dtype=torch.float32)
        for role, store in splits.stores.items()
    }
    if splits.val_rows is None:
        fit_parts = [_Part(datasets["train"])]
        val_parts = [_Part(datasets["val"])]
    else:
        held = np.zeros(len(datasets["train"]), dtype=bool)
        held[splits.val_rows] = True
        fit_parts = [_Part(datasets["train"], ~held)]
        val_parts = [_Part(datasets["train"], held)]
    all_parts = [_Part(dataset) for role, dataset in datasets.items() if role != "test"]
    dim = int(np.prod(splits.stores["train"].shape(layer)))
    try:
        clock = time.perf_counter()
        fit_moments, val_moments, digests = _statistics(fit_parts[0], val_parts[0], dim, options)
        seconds["statistics"] = _lap(clock)

        clock = time.perf_counter()
        mean, std = fit_moments.standardizer(device)
        epochs = _epochs(sum(map(len, fit_parts)), options)
        ranks: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}  # on the held-out rows
        sweep: list[dict[str, Any]] = []

        def fit(lams: list[float], phase: str) -> None:
            weights, biases = _train_many(
                fit_parts, mean, std, lams, splits.num_classes, epochs, options, device, phase
            )
            ranked, labels, _ = _predict(val_parts, mean, std, weights, biases, options, device)
            for k, lam in enumerate(lams):
                top1 = (ranked[k, :, 0] == labels).double().mean().item()
                sweep.append({"lambda": lam, "val_top1": top1, "epochs": epochs})
                ranks[lam] = (ranked[k], labels)

        fit(_sweep_order(options), f"probe {layer} sweep")
        extra = refine_lambdas(options.lambdas, choose(sweep), options.refine)
        if extra:
            fit(extra, f"probe {layer} refine")
        lam = choose(sweep)
        val = topk_metrics(*ranks[lam], splits.class_names)
        seconds["sweep"] = _lap(clock)

        clock = time.perf_counter()
        mean, std = Moments(dim).merge(fit_moments).merge(val_moments).standardizer(device)
        weights, biases = _train_many(
            all_parts,
            mean,
            std,
            [lam],
            splits.num_classes,
            _epochs(sum(map(len, all_parts)), options),
            options,
            device,
            f"probe {layer} refit",
        )
        model = LinearProbe(mean, std, weights[0], biases[0])
        seconds["refit"] = _lap(clock)

        test = None
        if "test" in datasets:
            clock = time.perf_counter()
            ranked, labels, digests["test"] = _predict(
                [_Part(datasets["test"])], mean, std, weights, biases, options, device
            )
            test = topk_metrics(ranked[0], labels, splits.class_names)
            seconds["test"] = _lap(clock)
    finally:
        for dataset in datasets.values():
            dataset.close()
    return {
        "lam": lam,
        "sweep": sorted(sweep, key=lambda entry: entry["lambda"]),
        "val": val,
        "test": test,
        "seconds": seconds,
        "features_sha256": digests,
        "model": model,
    }


def _statistics(
    fit: _Part, held_out: _Part, dim: int, options: ProbeOptions
) -> tuple[Moments, Moments, dict[str, str]]:
    """One in-order pass over the train store (and the val store, when the held-out rows
    are one): the moments of the fitted and of the held-out rows, and the sha256 of each
    store's layer as float32 rows."""
    moments = {id(fit): Moments(dim), id(held_out): Moments(dim)}
    stores = {"train": fit.dataset}
    if held_out.dataset is not fit.dataset:
        stores["val"] = held_out.dataset
    digests = {}
    for role, dataset in stores.items():
        digest = hashlib.sha256()
        for batch in tqdm(
            dataset.batches(options.batch_size, shuffle=False, with_index=True),
            total=math.ceil(len(dataset) / options.batch_size),
            desc=f"statistics {role}",
            unit="batch",
            disable=not options.progress,
            dynamic_ncols=True,
            leave=False,
        ):
            digest.update(batch[0].reshape(len(batch[0]), -1).numpy())
            for part in (fit, held_out):
                if part.dataset is dataset:
                    moments[id(part)].update(part.kept(batch)[0])
        digests[role] = digest.hexdigest()
    return moments[id(fit)], moments[id(held_out)], digests


def _epochs(rows: int, options: ProbeOptions) -> int:
    if options.epochs is not None:
        return int(options.epochs)
    per_epoch = math.ceil(rows / options.batch_size)
    return max(10, math.ceil(300 / per_epoch))


def _train_many(
    parts: Sequence[_Part],
    mean: torch.Tensor,
    std: torch.Tensor,
    lams: Sequence[float],
    num_classes: int,
    epochs: int,
    options: ProbeOptions,
    device: torch.device,
    desc: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit one probe per lambda side by side, reading each batch once.

    The losses are summed, and Adam's update is elementwise, so the models train as if
    alone. Returns float32 weights ``[K, C, D]`` and biases ``[K, C]``.
    """
    k = len(lams)
    weight = torch.zeros(k, num_classes, len(mean), device=device, requires_grad=True)
    bias = torch.zeros(k, num_classes, device=device, requires_grad=True)
    strength = torch.tensor(list(lams), dtype=torch.float32, device=device)
    steps = epochs * sum(math.ceil(len(part.dataset) / options.batch_size) for part in parts)
    optimizer = torch.optim.Adam([weight, bias], lr=options.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))
    )
    for x, y in tqdm(
        _shuffled(parts, epochs, options, device),
        total=steps,
        desc=desc,
        unit="batch",
        disable=not options.progress,
        dynamic_ncols=True,
    ):
        z = (x.to(device, non_blocking=True) - mean) / std
        y = y.to(device, non_blocking=True)
        logits = _many_logits(z, weight, bias)  # [B, K, C]
        loss = F.cross_entropy(logits.transpose(1, 2), y[:, None].expand(-1, k), reduction="none")
        loss = loss.mean(0).sum() + 0.5 * (strength * weight.square().sum((1, 2))).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return weight.detach(), bias.detach()


@torch.inference_mode()
def _predict(
    parts: Sequence[_Part],
    mean: torch.Tensor,
    std: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    options: ProbeOptions,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Ranked predictions of K models over the kept rows, in store order: int64
    ``[K, N, min(5, C)]``, their labels int64 ``[N]``, and the sha256 of every row read
    (as float32; the store's hash when the parts are whole stores)."""
    ranked, labels, digest = [], [], hashlib.sha256()
    for x, y, raw in _in_order(parts, options.batch_size):
        digest.update(raw.reshape(len(raw), -1).numpy())
        z = (x.to(device, non_blocking=True) - mean) / std
        ranked.append(_rank(_many_logits(z, weight, bias)).cpu())
        labels.append(y)
    return torch.cat(ranked).transpose(0, 1), torch.cat(labels), digest.hexdigest()


def _many_logits(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, K, C]`` of K linear models (``weight [K, C, D]``, ``bias [K, C]``)
    on rows ``z [B, D]``, as one matrix product."""
    return F.linear(z, weight.flatten(0, 1), bias.flatten()).view(len(z), *bias.shape)


# -------------------------------------------------------------------------- reports


def save_results(
    results: Sequence[ProbeResult],
    path: str | os.PathLike,
    *,
    options: ProbeOptions | None = None,
) -> Path:
    """Write the results JSON: one entry per layer (each with the stores it used), the
    options and the library versions. Returns the path."""
    from featcache.provenance import library_versions

    options = options or ProbeOptions()
    document = {
        "featcache_probe": PROBE_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "protocol": (
            "standardise with training statistics; L2 multinomial logistic regression; "
            "lambda chosen on validation top-1 (ties: larger); refit on train+val; test once"
        ),
        "options": dataclasses.asdict(options),
        "versions": library_versions(),
        "results": [result.to_dict() for result in results],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def default_output(train: Source, layers: Sequence[str]) -> Path:
    """``probe-<layer>.json`` (``probe-layers.json`` for several) beside the train store."""
    folder = (train.path if isinstance(train, FeatureStore) else Path(train)).parent
    name = layers[0] if len(layers) == 1 else "layers"
    return folder / f"probe-{re.sub(r'[^A-Za-z0-9._@+-]', '_', name)}.json"


def format_result(result: ProbeResult) -> str:
    """A short report of one probe, for the terminal."""
    lines = [
        f"probe {result.layer} {result.shape} ({result.trainer} trainer): "
        f"{result.n_train} train, {result.n_val} val ({result.validation}), "
        f"{result.n_test} test rows; {result.num_classes} classes",
        "sweep      "
        + "  ".join(f"{e['lambda']:.1e}:{100 * e['val_top1']:.1f}" for e in result.sweep),
        f"lambda     {result.lam:.2e} (val top-1 {_pct(result.val['top1'])})",
    ]
    if result.test is None:
        lines.append(
            f"val        {_scores(result.val)}  <- no test store; the split that chose "
            "lambda, so optimistic"
        )
        shown = result.val
    else:
        lines.append(f"test       {_scores(result.test)}")
        shown = result.test
    per_class = ", ".join(f"{name} {100 * acc:.1f}" for name, acc in shown["per_class"].items())
    if len(shown["per_class"]) <= 20:
        lines.append(f"per class  {per_class}")
    seconds = ", ".join(f"{key} {value:.1f}" for key, value in result.seconds.items())
    lines.append(f"seconds    {seconds}")
    lines += [f"note       {note}" for note in result.notes]
    return "\n".join(lines)


def _scores(metrics: Mapping[str, Any]) -> str:
    text = f"top-1 {_pct(metrics['top1'])} (chance {_pct(metrics['chance_top1'])})"
    if "top5" in metrics:
        text += f"  top-5 {_pct(metrics['top5'])} (chance {_pct(metrics['chance_top5'])})"
    return text + f"  mean per class {_pct(metrics['mean_per_class'])}"


def format_table(results: Sequence[ProbeResult]) -> str:
    """The layer-wise table: layer, dim, lambda, val and test top-1, seconds."""
    width = max(5, *(len(r.layer) for r in results))
    has_test = any(r.test is not None for r in results)
    header = f"{'layer':<{width}}  {'dim':>7}  {'lambda':>8}  {'val top-1':>9}"
    header += f"  {'test top-1':>10}  {'test top-5':>10}" if has_test else ""
    lines = [header + f"  {'seconds':>7}"]
    for r in results:
        dim = int(np.prod(r.shape))
        line = f"{r.layer:<{width}}  {dim:>7}  {r.lam:>8.1e}  {_pct(r.val['top1']):>9}"
        if has_test:
            test = r.test or {}
            top5 = _pct(test["top5"]) if "top5" in test else "-"
            top1 = _pct(test["top1"]) if test else "-"
            line += f"  {top1:>10}  {top5:>10}"
        lines.append(line + f"  {r.seconds['total']:>7.1f}")
    reference = results[0].test or results[0].val
    lines.append(f"chance (most frequent class): {_pct(reference['chance_top1'])}")
    return "\n".join(lines)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


# ----------------------------------------------------------------------------- plot

_COLOURS = {"test": (214, 96, 39), "val": (45, 110, 180), "chance": (140, 140, 140)}


def plot_layers(
    results: Sequence[ProbeResult], path: str | os.PathLike, *, size: tuple[int, int] = (720, 420)
) -> Path:
    """Draw the layer-wise transfer curve (top-1 per layer, 0-100%) as a PNG at ``path``.

    One line for validation top-1, one for test top-1 when there is a test split, and
    the chance level dashed. Returns the path.
    """
    from PIL import Image, ImageDraw, ImageFont

    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    left, right, top, bottom = 56, 20, 36, 64
    plot_w, plot_h = width - left - right, height - top - bottom

    def y_of(value: float) -> float:
        return top + plot_h * (1 - value)

    def x_of(i: int) -> float:
        return left + plot_w * ((i + 0.5) / len(results))

    for tick in range(0, 101, 10):
        y = y_of(tick / 100)
        draw.line([(left, y), (left + plot_w, y)], fill=(225, 225, 225) if tick else "black")
        if tick % 20 == 0:
            draw.text((left - 8, y), f"{tick}%", fill="black", font=font, anchor="rm")
    draw.line([(left, top), (left, top + plot_h)], fill="black")
    slot = plot_w / len(results)
    for i, result in enumerate(results):
        label = _fit_text(draw, result.layer, font, slot - 4)
        draw.text((x_of(i), top + plot_h + 8), label, fill="black", font=font, anchor="mt")
    chance = (results[0].test or results[0].val)["chance_top1"]
    for x in range(left, left + plot_w, 12):
        draw.line([(x, y_of(chance)), (x + 6, y_of(chance))], fill=_COLOURS["chance"], width=2)
    series = [("val", [r.val["top1"] for r in results])]
    if all(r.test is not None for r in results):
        series.append(("test", [r.test["top1"] for r in results]))  # type: ignore[index]
    for name, values in series:
        points = [(x_of(i), y_of(v)) for i, v in enumerate(values)]
        if len(points) > 1:
            draw.line(points, fill=_COLOURS[name], width=3)
        for x, y in points:
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=_COLOURS[name])
    draw.text((left, 12), "linear probe top-1 by layer", fill="black", font=font)
    legend = [(f"{name} top-1", name) for name, _ in series] + [("chance", "chance")]
    x = width - right
    for text, name in reversed(legend):
        x -= draw.textlength(text, font=font) + 30
        draw.rectangle([x, 14, x + 14, 22], fill=_COLOURS[name])
        draw.text((x + 18, 18), text, fill="black", font=font, anchor="lm")
    draw.text((left + plot_w / 2, height - 14), "layer", fill="black", font=font, anchor="mm")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path


def _fit_text(draw: Any, text: str, font: Any, width: float) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..." if text else ""
