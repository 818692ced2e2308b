"""The in-memory trainer: the whole split in memory, L-BFGS warm-started along the path
(or mini-batch AdamW for a recipe that trains so, as CLIP_benchmark trains them)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from featcache.probe.metrics import Moments, Scaling, rank, require_finite, topk_metrics
from featcache.probe.options import ProbeOptions
from featcache.probe.parts import progress
from featcache.probe.recipes import Recipe, recipe
from featcache.probe.results import Fit, LinearProbe, Timings
from featcache.probe.splits import Splits
from featcache.probe.sweep import Grid, run_sweep
from featcache.store import FeatureStore

READ_ROWS = 8192  # rows per read of a store's layer


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
    iterations)``."""
    if init is None:
        init = (x.new_zeros(num_classes, x.shape[1]), x.new_zeros(num_classes))
    weight, bias = (t.detach().clone().requires_grad_() for t in init)
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


def fit_adamw(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    decays: Sequence[float],
    published: Recipe,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear probe per weight decay in ``decays``, trained side by side as
    ``published`` trains them: AdamW (decay on weight and bias) from the same seeded
    ``nn.Linear`` initialisation, over seeded shuffled batches, the learning rate
    cosine-decayed to zero. The models share batches but not parameters or groups, so
    their summed losses train each as if alone.

    ``x``: float32 ``[N, D]``, ``y``: int64 ``[N]``, on one device. Returns float32
    weights ``[K, C, D]`` and biases ``[K, C]``."""
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(x.shape[1])
    weight = (torch.rand(num_classes, x.shape[1], generator=generator) * 2 - 1) * bound
    bias = (torch.rand(num_classes, generator=generator) * 2 - 1) * bound
    params = [
        (weight.clone().to(x.device).requires_grad_(), bias.clone().to(x.device).requires_grad_())
        for _ in decays
    ]
    optimizer = torch.optim.AdamW(
        [
            {"params": list(pair), "weight_decay": decay}
            for pair, decay in zip(params, decays, strict=True)
        ],
        lr=published.lr,
    )
    schedule = cosine_decay(optimizer, published.epochs * math.ceil(len(x) / published.batch_size))
    for _ in range(published.epochs):
        order = torch.randperm(len(x), generator=generator).to(x.device)
        for rows in order.split(published.batch_size):
            xb, yb = x[rows], y[rows]
            loss = sum(F.cross_entropy(F.linear(xb, w, b), yb) for w, b in params)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[union-attr]
            optimizer.step()
            schedule.step()
    weights = torch.stack([w.detach() for w, _ in params])
    return weights, torch.stack([b.detach() for _, b in params])


def cosine_decay(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate decayed from its peak to zero along a cosine over ``steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))
    )


def run_full(
    splits: Splits,
    layer: str,
    grid: Grid,
    options: ProbeOptions,
    device: torch.device,
    scaling: Scaling,
) -> Fit:
    """Probe ``layer`` with every row in memory, prepared by ``scaling``: the sweep fits on
    the fit rows; the chosen model is refitted on fit + validation rows (prepared with
    their statistics, warm-started from the sweep's weights) and scored once on the test
    store."""
    timings = Timings()
    digests = {}
    with timings.phase("load"):
        x_train, digests["train"] = read_layer(splits.stores["train"], layer)
        x_train = scaling.rows(x_train)
        if splits.val_rows is None:
            x_val, digests["val"] = read_layer(splits.stores["val"], layer)
            x_val = scaling.rows(x_val)
        else:
            x_val = x_train[torch.from_numpy(splits.val_rows)]
        whole = len(splits.fit_rows) == len(x_train)  # fit rows are the whole train store
        x_fit = x_train if whole else x_train[torch.from_numpy(splits.fit_rows)]
        del x_train
        y_fit = torch.from_numpy(splits.y_fit).to(device)
        y_val = torch.from_numpy(splits.y_val).to(device)

    with timings.phase("sweep"):
        lam, sweep, val, swept = fit_sweep(
            x_fit, y_fit, x_val, y_val, splits, grid, options, device, scaling, f"probe {layer}"
        )

    with timings.phase("refit"):
        z_all = torch.cat([x_fit, x_val]).to(device)
        del x_fit, x_val
        mean, std = scaling.standardizer(Moments(z_all.shape[1]).update(z_all), device)
        z_all.sub_(mean).div_(std)
        y_all = torch.cat([y_fit, y_val])
        strength = grid.refit_lambda(lam, len(y_all))
        init = (swept.weight, swept.bias)
        w, b, _ = _fit(z_all, y_all, splits.num_classes, [strength], options, init)[0]
        del z_all
    model = LinearProbe(mean, std, w, b, l2=scaling.l2)

    test = None
    if "test" in splits.stores:
        with timings.phase("test"):
            x_test, digests["test"] = read_layer(splits.stores["test"], layer)
            require_finite(x_test, f"the test store's features of layer {layer}")
            y_test = torch.from_numpy(splits.labels["test"])
            test = topk_metrics(rank(model.logits(x_test)), y_test, splits.class_names)
    return Fit(lam, sweep, val, test, timings.seconds, digests, model)


def _fit(
    z: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    lambdas: list[float],
    options: ProbeOptions,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(W, b, iterations or epochs)`` per strength in ``lambdas`` on prepared rows ``z``:
    by L-BFGS, each warm-started from the one before (the first from ``init``), or AdamW."""
    published = recipe(options.recipe)
    if published is not None and published.optimizer == "adamw":
        weights, biases = fit_adamw(z, y, num_classes, lambdas, published, options.seed)
        return [(w, b, published.epochs) for w, b in zip(weights, biases, strict=True)]
    max_iter = published.max_iter if published is not None else options.max_iter
    out = []
    for lam in lambdas:
        out.append(fit_lbfgs(z, y, num_classes, lam, init=init, max_iter=max_iter))
        init = out[-1][:2]
    return out


def fit_sweep(
    x_fit: torch.Tensor,
    y_fit: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    splits: Splits,
    grid: Grid,
    options: ProbeOptions,
    device: torch.device,
    scaling: Scaling,
    desc: str,
) -> tuple[float, list[dict[str, Any]], dict[str, Any], LinearProbe]:
    """The sweep (L-BFGS fits warm-started along it, AdamW fits afresh): the chosen
    lambda, the sweep entries (increasing lambda), the chosen model's validation metrics
    and the chosen model (with the rows' standardisation)."""
    mean, std = scaling.standardizer(Moments(x_fit.shape[1]).update(x_fit), device)
    z_fit = (x_fit.to(device) - mean) / std
    z_val = (x_val.to(device) - mean) / std
    fits: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
    published = recipe(options.recipe)
    unit = "epochs" if published is not None and published.optimizer == "adamw" else "iterations"
    with progress(options, total=len(grid.lambdas) + 2 * grid.refine, desc=desc, unit="fit") as bar:

        def fit(lambdas: list[float], near: float | None) -> list[dict[str, Any]]:
            entries: list[dict[str, Any]] = []
            if near is None:  # the grid: each fit warm-starts from the one before
                fitted = _fit(z_fit, y_fit, splits.num_classes, lambdas, options)
            else:  # the refinement: each fit warm-starts from the best grid fit
                fitted = [
                    _fit(z_fit, y_fit, splits.num_classes, [lam], options, fits[near])[0]
                    for lam in lambdas
                ]
            for lam, (w, b, count) in zip(lambdas, fitted, strict=True):
                fits[lam] = (w, b)
                accuracy = (F.linear(z_val, w, b).argmax(1) == y_val).double().mean().item()
                entry = {"lambda": lam, "val_top1": accuracy, unit: count}
                if grid.penalty != "lambda":
                    entry[grid.penalty] = grid.value(lam)
                entries.append(entry)
                bar.update()
            return entries

        lam, sweep = run_sweep(grid, fit)
        bar.total = len(sweep)
        bar.refresh()
    w, b = fits[lam]
    val = topk_metrics(rank(F.linear(z_val, w, b)), y_val, splits.class_names)
    return lam, sweep, val, LinearProbe(mean, std, w, b, l2=scaling.l2)


def read_layer(store: FeatureStore, layer: str) -> tuple[torch.Tensor, str]:
    """All rows of ``layer`` as float32 ``[N, D]`` and the sha256 of those bytes."""
    n, dim = len(store), int(np.prod(store.shape(layer)))
    out = torch.empty(n, dim, dtype=torch.float32)
    digest = hashlib.sha256()
    for start in range(0, n, READ_ROWS):
        rows = store.read(layer, slice(start, start + READ_ROWS)).reshape(-1, dim)
        out[start : start + len(rows)] = rows
        digest.update(out[start : start + len(rows)].numpy().data)
    return out, digest.hexdigest()
