"""The streaming trainer: mini-batch Adam over chunk-shuffled batches; it holds no layer
in memory, so it probes stores larger than memory."""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from featcache.probe.full import cosine_decay
from featcache.probe.metrics import Moments, Scaling, rank, require_finite, topk_metrics
from featcache.probe.options import ProbeOptions
from featcache.probe.parts import Part, fit_and_val, in_order, open_datasets, progress, unpack
from featcache.probe.results import Fit, LinearProbe, Timings
from featcache.probe.splits import Splits
from featcache.probe.sweep import Grid, run_sweep
from featcache.read.dataset import ShuffledBatches

Rows = tuple[torch.Tensor, torch.Tensor]  # float32 features [b, D], int64 labels [b]


def run_streaming(
    splits: Splits,
    layer: str,
    grid: Grid,
    options: ProbeOptions,
    device: torch.device,
    scaling: Scaling,
) -> Fit:
    """Probe ``layer`` without holding its rows, prepared by ``scaling`` as they are read:
    one in-order pass for the statistics and hashes, then each sweep phase's models
    trained side by side (:func:`_train_many`), the refit on fit + validation rows and
    the test store scored once."""
    timings = Timings()
    l2 = scaling.l2
    dim = int(np.prod(splits.stores["train"].shape(layer)))
    train = functools.partial(
        _train_many, num_classes=splits.num_classes, options=options, device=device
    )
    predict = functools.partial(_predict, options=options, device=device)
    with open_datasets(splits, layer) as datasets:
        fit_part, val_part = fit_and_val(splits, datasets, l2)
        all_parts = [Part(data, l2=l2) for role, data in datasets.items() if role != "test"]
        with timings.phase("statistics"):
            fit_moments, val_moments, digests = _statistics(fit_part, val_part, dim, options)

        with timings.phase("sweep"):
            mean, std = scaling.standardizer(fit_moments, device)
            epochs = _epochs(len(fit_part), options)
            ranks: dict[float, Rows] = {}  # ranked predictions and labels of held-out rows

            def fit(lambdas: list[float], near: float | None) -> list[dict[str, Any]]:
                desc = f"probe {layer} {'sweep' if near is None else 'refine'}"
                weights, biases = train([fit_part], mean, std, lambdas, epochs, desc)
                ranked, labels, _ = predict([val_part], mean, std, weights, biases)
                entries = []
                for k, lam in enumerate(lambdas):
                    top1 = (ranked[k, :, 0] == labels).double().mean().item()
                    entries.append({"lambda": lam, "val_top1": top1, "epochs": epochs})
                    ranks[lam] = (ranked[k], labels)
                return entries

            lam, sweep = run_sweep(grid, fit)
            val = topk_metrics(*ranks[lam], splits.class_names)

        with timings.phase("refit"):
            moments = Moments(dim).merge(fit_moments).merge(val_moments)
            mean, std = scaling.standardizer(moments, device)
            epochs = _epochs(sum(map(len, all_parts)), options)
            weights, biases = train(all_parts, mean, std, [lam], epochs, f"probe {layer} refit")
            model = LinearProbe(mean, std, weights[0], biases[0], l2=l2)

        test = None
        if "test" in datasets:
            with timings.phase("test"):
                test_part = Part(datasets["test"], l2=l2)
                check = f"the test store's features of layer {layer}"
                ranked, labels, digests["test"] = predict(
                    [test_part], mean, std, weights, biases, check
                )
                test = topk_metrics(ranked[0], labels, splits.class_names)
    return Fit(lam, sweep, val, test, timings.seconds, digests, model)


def _shuffled(
    parts: Sequence[Part], epochs: int, options: ProbeOptions, device: torch.device
) -> Iterator[Rows]:
    """``epochs`` passes over the kept rows in seeded random order: each store's
    :class:`ShuffledBatches` (``num_workers`` loader processes), the stores' batches
    interleaved in a seeded random order."""
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
        order = np.random.default_rng([options.seed, epoch]).permutation(turns)
        in_turn = ((i, next(iterators[i], None)) for i in order)
        # then what a source has left (a worker's last small batch)
        left = ((i, batch) for i, iterator in enumerate(iterators) for batch in iterator)
        for i, batch in itertools.chain(in_turn, left):
            if batch is not None:
                x, y, _ = parts[i].kept(batch)
                if len(x):  # not held-out rows only
                    yield x, y


def _statistics(
    fit: Part, held_out: Part, dim: int, options: ProbeOptions
) -> tuple[Moments, Moments, dict[str, str]]:
    """One in-order pass over the train (and val) store: the moments of the fitted and
    of the held-out rows, and the sha256 of each store's layer as float32 rows."""
    moments = {id(fit): Moments(dim), id(held_out): Moments(dim)}
    stores = {"train": fit.dataset}
    if held_out.dataset is not fit.dataset:
        stores["val"] = held_out.dataset
    digests = {}
    for role, dataset in stores.items():
        digest = hashlib.sha256()
        batches = dataset.batches(options.batch_size, shuffle=False, with_index=True)
        total = math.ceil(len(dataset) / options.batch_size)
        desc = f"statistics {role}"
        for batch in progress(options, batches, total=total, desc=desc, unit="batch", leave=False):
            raw = unpack(batch)[0]
            digest.update(raw.reshape(len(raw), -1).numpy().data)
            for part in (fit, held_out):
                if part.dataset is dataset:
                    moments[id(part)].update(part.kept(batch)[0])
        digests[role] = digest.hexdigest()
    return moments[id(fit)], moments[id(held_out)], digests


def _epochs(rows: int, options: ProbeOptions) -> int:
    """``options.epochs``, else 10, or more to make at least 300 optimiser steps."""
    if options.epochs is not None:
        return int(options.epochs)
    per_epoch = math.ceil(rows / options.batch_size)
    return max(10, math.ceil(300 / per_epoch))


def _train_many(
    parts: Sequence[Part],
    mean: torch.Tensor,
    std: torch.Tensor,
    lams: Sequence[float],
    epochs: int,
    desc: str,
    *,
    num_classes: int,
    options: ProbeOptions,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit one probe per lambda side by side, reading each batch once; the summed losses
    and Adam's elementwise update train each as if alone. Returns float32 weights
    ``[K, C, D]`` and biases ``[K, C]``."""
    k = len(lams)
    weight = torch.zeros(k, num_classes, len(mean), device=device, requires_grad=True)
    bias = torch.zeros(k, num_classes, device=device, requires_grad=True)
    strength = torch.tensor(list(lams), dtype=torch.float32, device=device)
    steps = epochs * sum(math.ceil(len(part.dataset) / options.batch_size) for part in parts)
    optimizer = torch.optim.Adam([weight, bias], lr=options.lr)
    schedule = cosine_decay(optimizer, steps)
    batches = _shuffled(parts, epochs, options, device)
    for x, y in progress(options, batches, total=steps, desc=desc, unit="batch"):
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
    parts: Sequence[Part],
    mean: torch.Tensor,
    std: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    check: str | None = None,
    *,
    options: ProbeOptions,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Ranked predictions of K models over the kept rows, in store order: int64
    ``[K, N, min(5, C)]``, their labels int64 ``[N]``, and the sha256 of every row read
    as float32. With ``check`` (what the rows are), NaN or Inf is refused."""
    ranked, labels, digest = [], [], hashlib.sha256()
    for _, x, y, _, raw in in_order(parts, options.batch_size):
        if check is not None:
            require_finite(x, check)
        digest.update(raw.reshape(len(raw), -1).numpy().data)
        z = (x.to(device, non_blocking=True) - mean) / std
        ranked.append(rank(_many_logits(z, weight, bias)).cpu())
        labels.append(y)
    return torch.cat(ranked).transpose(0, 1), torch.cat(labels), digest.hexdigest()


def _many_logits(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, K, C]`` of K linear models (``weight [K, C, D]``, ``bias [K, C]``)
    on rows ``z [B, D]``, as one matrix product."""
    return F.linear(z, weight.flatten(0, 1), bias.flatten()).view(len(z), *bias.shape)
