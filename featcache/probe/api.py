"""The entry points: linear probes, k-NN and few-shot evaluations of stored layers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from featcache.capture.runtime import resolve_device
from featcache.errors import ConfigError
from featcache.probe.fewshot import FewShotData, draw_shots, few_shot_draw, summary_lines
from featcache.probe.full import run_full
from featcache.probe.metrics import scaling_for
from featcache.probe.options import ProbeOptions, resolve_options
from featcache.probe.recipes import recipe
from featcache.probe.results import FewShotResult, KnnResult, ProbeResult, Result
from featcache.probe.splits import Source, Splits
from featcache.probe.streaming import run_streaming
from featcache.probe.sweep import Grid
from featcache.probe.weighted_knn import run_knn
from featcache.util.units import format_bytes


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

    ``train``, ``val`` and ``test`` are store paths (or
    [`FeatureStore`][featcache.store.reader.FeatureStore]). Without
    ``val``, a stratified ``val_fraction`` (default 0.2, or the recipe's) of ``train`` is
    held out for choosing the regularisation. Without ``test``, the result reports only
    the validation accuracy, which chose the model and so is optimistic. ``kwargs`` are
    fields of [`ProbeOptions`][featcache.probe.options.ProbeOptions].

    Raises:
        ConfigError: a layer missing from a store, stores whose layers, shapes or class
            names differ, a store without labels, a single class, bad options."""
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
    """One linear probe per layer: ``"all"`` (every stored layer), a name, a
    comma-separated list or a sequence of names. The results, in that order, form the
    layer-wise transfer curve. Arguments as in [`probe`][featcache.probe.api.probe];
    [`evaluate`][featcache.probe.api.evaluate] runs k-NN and few-shot evaluations."""
    options = resolve_options(options, kwargs)
    if options.methods != ["linear"] or options.shots is not None:
        raise ConfigError(
            "probe_layers fits linear probes on every row; featcache.probe.evaluate runs "
            "the methods and shots given"
        )
    splits = _open(train, val, test, options)
    return [_probe_layer(splits, name, options) for name in splits.layers(layers)]


def knn(
    train: Source,
    layer: str,
    *,
    val: Source | None = None,
    test: Source | None = None,
    options: ProbeOptions | None = None,
    **kwargs: Any,
) -> KnnResult:
    """Weighted k-NN classification of one stored ``layer``: the ``test`` rows (else the
    validation rows) against the training rows, for each ``k`` of ``ks`` (default 10, 20,
    100, 200) with ``temperature`` (default 0.07); the search and the vote are
    [`nearest`][featcache.probe.weighted_knn.nearest] and
    [`vote`][featcache.probe.weighted_knn.vote]. Arguments as in
    [`probe`][featcache.probe.api.probe]."""
    (result,) = evaluate(
        train, [layer], val=val, test=test, options=options, **{**kwargs, "methods": ["knn"]}
    )
    assert isinstance(result, KnnResult)
    return result


def evaluate(
    train: Source,
    layers: str | Sequence[str] = "all",
    *,
    val: Source | None = None,
    test: Source | None = None,
    options: ProbeOptions | None = None,
    **kwargs: Any,
) -> list[Result]:
    """Every evaluation the options ask for, layer by layer: for each of ``methods``
    ("linear", "knn") a `ProbeResult` or `KnnResult` on all rows, or with ``shots``, a
    `FewShotResult` per method and number of shots (``featcache.probe.results``). Arguments
    as in [`probe_layers`][featcache.probe.api.probe_layers]."""
    options = resolve_options(options, kwargs)
    splits = _open(train, val, test, options)
    results: list[Result] = []
    for name in splits.layers(layers):
        if options.shots is not None:
            results += _few_shot_layer(splits, name, options)
            continue
        for method in options.methods:
            run = _probe_layer if method == "linear" else _knn_layer
            results.append(run(splits, name, options))
    return results


def _open(train: Source, val: Source | None, test: Source | None, options: ProbeOptions) -> Splits:
    """The stores, checked, with the validation rows the options ask for: the recipe
    holds out its own share of train unless a share or a val store is given."""
    fraction = options.val_fraction
    published = recipe(options.recipe)
    if fraction is None and val is None and published is not None:
        few = options.shots is not None
        fraction = published.few_shot_val_fraction if few else published.val_fraction
    return Splits.open(train, val, test, fraction, options.seed)


def _layer_bytes(splits: Splits, layer: str) -> int:
    """The bytes of every store's rows of ``layer`` as float32."""
    dim = int(np.prod(splits.stores["train"].shape(layer)))
    return 4 * dim * sum(len(store) for store in splits.stores.values())


def _probe_layer(splits: Splits, layer: str, options: ProbeOptions) -> ProbeResult:
    device = resolve_device(options.device)
    needed = 2 * _layer_bytes(splits, layer)  # float32 rows plus their standardised copy
    trainer, notes = options.trainer, []
    published = recipe(options.recipe)
    if published is not None and needed > options.max_bytes and trainer != "full":
        raise ConfigError(
            f"recipe {published.name} fits in memory as published, and layer {layer} needs "
            f"about {format_bytes(needed)}, more than max_memory "
            f"{format_bytes(options.max_bytes)}; raise max_memory (--max-memory)"
        )
    if trainer == "auto":
        trainer = "full" if needed <= options.max_bytes or published else "streaming"
        if trainer == "streaming":
            notes.append(
                f"streaming trainer: the features need about {format_bytes(needed)}, more than "
                f"max_memory {format_bytes(options.max_bytes)}"
            )
    scaling = scaling_for("linear", options)
    grid = Grid.for_trainer(trainer, options, rows=len(splits.fit_rows))
    start = time.perf_counter()
    run = run_full if trainer == "full" else run_streaming
    fit = run(splits, layer, grid, options, device, scaling)
    if grid.at_edge(fit.lam):
        if published is None:
            notes.append(
                f"the chosen lambda {fit.lam:.0e} is at the edge of the grid; widen it "
                "(lambdas) if accuracy matters at this end"
            )
        else:
            notes.append(
                f"the chosen {grid.penalty} {grid.value(fit.lam):.0e} is at the edge of the "
                f"{published.name} recipe's grid"
            )
    fit.seconds["total"] = round(time.perf_counter() - start, 4)
    return ProbeResult(
        **_common(splits, layer, fit.features_sha256, notes, options),
        trainer=trainer,
        lam=fit.lam,
        sweep=fit.sweep,
        n_train=len(splits.fit_rows),
        n_val=len(splits.y_val),
        n_test=len(splits.labels["test"]) if "test" in splits.labels else 0,
        validation=splits.validation,
        val=fit.val,
        test=fit.test,
        seconds=fit.seconds,
        model=fit.model,
        recipe=options.recipe,
        normalize=scaling.name,
    )


def _knn_layer(splits: Splits, layer: str, options: ProbeOptions) -> KnnResult:
    device = resolve_device(options.device)
    size = _layer_bytes(splits, layer)
    streamed, notes = options.trainer == "streaming", []
    if options.trainer == "auto" and size > options.max_bytes:
        streamed = True
        notes.append(
            f"neighbours read in blocks: the features need about {format_bytes(size)}, more "
            f"than max_memory {format_bytes(options.max_bytes)}"
        )
    scaling = scaling_for("knn", options)
    start = time.perf_counter()
    fit = run_knn(splits, layer, options, device, scaling, streamed)
    fit.seconds["total"] = round(time.perf_counter() - start, 4)
    if max(options.ks) > fit.n_neighbours:
        notes.append(f"k is at most the {fit.n_neighbours} neighbour rows")
    scored = "test" if "test" in splits.stores else "val"
    return KnnResult(
        **_common(splits, layer, fit.features_sha256, notes, options),
        temperature=options.temperature,
        normalize=scaling.name,
        n_train=fit.n_neighbours,
        n_test=fit.n_queries,
        scored=scored,
        validation=splits.validation if scored == "val" else "",
        metrics=fit.metrics,
        seconds=fit.seconds,
    )


def _few_shot_layer(splits: Splits, layer: str, options: ProbeOptions) -> list[FewShotResult]:
    assert options.shots is not None
    device = resolve_device(options.device)
    data = FewShotData(splits, layer, options)
    results = []
    for method in options.methods:
        scaling = scaling_for(method, options)
        for shots in options.shots:
            start = time.perf_counter()
            draws = []
            for d in range(options.n_draws):
                rows = draw_shots(splits.labels["train"], splits.fit_rows, shots, d, options.seed)
                desc = f"{method} {layer} {shots}-shot draw {d}"
                entry = few_shot_draw(data, method, rows, options, scaling, device, desc)
                seed = [options.seed, d]  # draw_shots's generator: the draw can be redone
                draws.append({"draw": d, "seed": seed, **entry, "ids": data.draw_ids(rows)})
            seconds = round(time.perf_counter() - start, 4)
            results.append(
                FewShotResult(
                    **_common(splits, layer, data.digests, [], options),
                    method=method,
                    shots=shots,
                    n_val=len(splits.y_val),
                    n_test=len(data.y_scored),
                    scored=data.scored,
                    validation=splits.validation,
                    chance_top1=_chance(data.y_scored),
                    draws=draws,
                    summary=summary_lines(method, draws),
                    seconds={"draws": seconds, "total": seconds},
                    recipe=options.recipe if method == "linear" else None,
                    normalize=scaling.name,
                )
            )
    return results


def _chance(labels: torch.Tensor) -> float:
    """Top-1 of always guessing the most frequent class of ``labels``."""
    return (torch.bincount(labels).max() / len(labels)).item()


def _common(
    splits: Splits, layer: str, digests: dict[str, str], notes: list[str], options: ProbeOptions
) -> dict[str, Any]:
    """The fields every result has; ``digests``: the sha256 of each store's rows of ``layer``."""
    return {
        "layer": layer,
        "shape": list(splits.stores["train"].shape(layer)),
        "num_classes": splits.num_classes,
        "class_names": splits.class_names,
        "stores": splits.store_info(digests),
        "notes": notes,
        "options": options,
    }
