"""The entry points: probe one stored layer or several, choosing the trainer by size."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from featcache.probe.full import run_full
from featcache.probe.options import ProbeOptions, resolve_options
from featcache.probe.results import ProbeResult
from featcache.probe.splits import Source, Splits
from featcache.probe.streaming import run_streaming
from featcache.probe.sweep import Grid
from featcache.units import format_bytes


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
    options = resolve_options(options, kwargs)
    splits = Splits.open(train, val, test, options.val_fraction, options.seed)
    return [_probe_layer(splits, name, options) for name in splits.layers(layers)]


def _probe_layer(splits: Splits, layer: str, options: ProbeOptions) -> ProbeResult:
    from featcache.runtime import resolve_device

    device = resolve_device(options.device)
    shape = list(splits.stores["train"].shape(layer))
    dim = int(np.prod(shape))
    rows = sum(len(store) for store in splits.stores.values())
    needed = 8 * dim * rows  # float32 rows plus their standardised copy
    trainer, notes = options.trainer, []
    if trainer == "auto":
        trainer = "full" if needed <= options.max_bytes else "streaming"
        if trainer == "streaming":
            notes.append(
                f"streaming trainer: the features need about {format_bytes(needed)}, more than "
                f"max_memory {format_bytes(options.max_bytes)}"
            )
    grid = Grid.for_trainer(trainer, options)
    run = run_full if trainer == "full" else run_streaming
    start = time.perf_counter()
    fit = run(splits, layer, grid, options, device)
    if grid.at_edge(fit.lam):
        notes.append(
            f"the chosen lambda {fit.lam:.0e} is at the edge of the grid; widen it (lambdas) "
            "if accuracy matters at this end"
        )
    fit.seconds["total"] = round(time.perf_counter() - start, 4)
    stores = splits.store_info()
    for role, digest in fit.features_sha256.items():
        stores[role]["features_sha256"] = digest
    return ProbeResult(
        layer=layer,
        shape=shape,
        trainer=trainer,
        num_classes=splits.num_classes,
        class_names=splits.class_names,
        lam=fit.lam,
        sweep=fit.sweep,
        n_train=len(splits.fit_rows),
        n_val=len(splits.y_val),
        n_test=len(splits.labels["test"]) if "test" in splits.labels else 0,
        validation=splits.validation,
        val=fit.val,
        test=fit.test,
        seconds=fit.seconds,
        stores=stores,
        notes=notes,
        model=fit.model,
        options=options,
    )
