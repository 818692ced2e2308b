"""The streaming trainer: mini-batch Adam over chunk-shuffled batches, for big stores.

It holds no layer in memory, so it probes stores larger than memory.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from featcache.probe.metrics import Moments, rank, require_finite, topk_metrics
from featcache.probe.options import ProbeOptions
from featcache.probe.parts import Part, in_order, unpack
from featcache.probe.results import Fit, LinearProbe, Timings
from featcache.probe.scaling import STANDARDIZE, Scaling
from featcache.probe.splits import Splits
from featcache.probe.sweep import Grid, run_sweep
from featcache.read.dataset import FeatureDataset, ShuffledBatches

Rows = tuple[torch.Tensor, torch.Tensor]  # float32 features [b, D], int64 labels [b]


def run_streaming(
    splits: Splits,
    layer: str,
    grid: Grid,
    options: ProbeOptions,
    device: torch.device,
    scaling: Scaling = STANDARDIZE,
) -> Fit:
    """Probe ``layer`` without holding its rows.

    One in-order pass gives the standardisation statistics of the fit and validation rows
    (and the stores' hashes); the models of each sweep phase then train side by side with
    Adam over seeded, chunk-aware shuffled batches (:class:`ShuffledBatches` in a
    ``DataLoader``); the chosen lambda is refitted on fit + validation rows and scored
    once on the test store. Rows are prepared by ``scaling`` as they are read.
    """
    timings = Timings()
    datasets = {
        role: FeatureDataset(store.path, layer, dtype=torch.float32)
        for role, store in splits.stores.items()
    }
    l2 = scaling.l2
    if splits.val_rows is None:
        fit_parts = [Part(datasets["train"], l2=l2)]
        val_parts = [Part(datasets["val"], l2=l2)]
    else:
        held = np.zeros(len(datasets["train"]), dtype=bool)
        held[splits.val_rows] = True
        fit_parts = [Part(datasets["train"], ~held, l2)]
        val_parts = [Part(datasets["train"], held, l2)]
    all_parts = [Part(dataset, l2=l2) for role, dataset in datasets.items() if role != "test"]
    dim = int(np.prod(splits.stores["train"].shape(layer)))
    try:
        with timings.phase("statistics"):
            fit_moments, val_moments, digests = _statistics(
                fit_parts[0], val_parts[0], dim, options
            )

        with timings.phase("sweep"):
            mean, std = scaling.standardizer(fit_moments, device)
            epochs = _epochs(sum(map(len, fit_parts)), options)
            ranks: dict[float, Rows] = {}  # ranked predictions and labels of held-out rows

            def fit(lambdas: list[float], near: float | None) -> list[dict[str, Any]]:
                phase = "sweep" if near is None else "refine"
                weights, biases = _train_many(
                    fit_parts,
                    mean,
                    std,
                    lambdas,
                    splits.num_classes,
                    epochs,
                    options,
                    device,
                    f"probe {layer} {phase}",
                )
                ranked, labels, _ = _predict(val_parts, mean, std, weights, biases, options, device)
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
            model = LinearProbe(mean, std, weights[0], biases[0], l2=l2)

        test = None
        if "test" in datasets:
            with timings.phase("test"):
                ranked, labels, digests["test"] = _predict(
                    [Part(datasets["test"], l2=l2)],
                    mean,
                    std,
                    weights,
                    biases,
                    options,
                    device,
                    check=f"the test store's features of layer {layer}",
                )
                test = topk_metrics(ranked[0], labels, splits.class_names)
    finally:
        for dataset in datasets.values():
            dataset.close()
    return Fit(lam, sweep, val, test, timings.seconds, digests, model)


def _shuffled(
    parts: Sequence[Part], epochs: int, options: ProbeOptions, device: torch.device
) -> Iterator[Rows]:
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


def _nonempty(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Iterator[Rows]:
    """Features and labels of a kept batch, unless it is empty (a batch of held-out
    rows only is, once they are dropped)."""
    if len(batch[0]):
        yield batch[0], batch[1]


def _statistics(
    fit: Part, held_out: Part, dim: int, options: ProbeOptions
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
    parts: Sequence[Part],
    mean: torch.Tensor,
    std: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    options: ProbeOptions,
    device: torch.device,
    check: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Ranked predictions of K models over the kept rows, in store order: int64
    ``[K, N, min(5, C)]``, their labels int64 ``[N]``, and the sha256 of every row read
    (as float32; the store's hash when the parts are whole stores). With ``check`` (what
    the rows are, for the error), rows that hold NaN or Inf are refused."""
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
