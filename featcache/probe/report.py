"""Evaluation results for people and files: the terminal reports, the tables, the JSON."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from featcache.probe.options import ProbeOptions
from featcache.probe.recipes import PUBLISHED, recipe
from featcache.probe.results import FewShotResult, KnnResult, ProbeResult, Result
from featcache.probe.splits import Source
from featcache.store import FeatureStore
from featcache.util.files import building_beside, output_file

PROBE_FORMAT = 1


def save_results(
    results: Sequence[Result],
    path: str | os.PathLike,
    *,
    options: ProbeOptions | None = None,
) -> Path:
    """Write the results JSON: one entry per layer and evaluation (each with the stores
    it used), the protocols, the options and the library versions. Returns the path.

    The options recorded are ``options`` when given, else those the results were fitted
    with; a result fitted with other options carries its own in its entry."""
    from featcache.store.provenance import library_versions

    options = options or next((r.options for r in results if r.options), ProbeOptions())
    entries = []
    for result in results:
        entry = result.to_dict()
        if result.options is not None and result.options != options:
            entry["options"] = dataclasses.asdict(result.options)
        entries.append(entry)
    document = {
        "featcache_probe": PROBE_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "protocol": protocol(results),
        "options": dataclasses.asdict(options),
        "versions": library_versions(),
        "results": entries,
    }
    path = output_file(path, (".json",), "results file")
    with building_beside(path, ".writing") as building:  # a failed write keeps the old file
        building.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(building, path)
    return path


def default_output(train: Source, layers: Sequence[str]) -> Path:
    """``probe-<layer>.json`` (``probe-layers.json`` for several) beside the train store."""
    folder = (train.path if isinstance(train, FeatureStore) else Path(train)).parent
    name = layers[0] if len(layers) == 1 else "layers"
    return folder / f"probe-{re.sub(r'[^A-Za-z0-9._@+-]', '_', name)}.json"


LINEAR_PROTOCOL = (
    "standardise with training statistics; L2 multinomial logistic regression; "
    "lambda chosen on validation top-1 (ties: larger); refit on train+val; test once"
)
KNN_PROTOCOL = (
    "k-NN: cosine similarity to every training row; the k nearest vote exp(similarity / T) "
    "for their class (DINO); top-1 and top-5 of the votes"
)
FEW_SHOT_PROTOCOL = (
    "few-shot: k rows per class drawn from the fit rows per seeded draw; each method fitted "
    "on them alone (lambda chosen on validation, no refit); mean and spread over the draws"
)


SHORT_NAMES = {"weight_decay": "decay"}  # a swept strength's name in the report's first column


def protocol(results: Sequence[Result]) -> str:
    """What the results followed, in words: featcache's linear protocol, each recipe
    (with its source), k-NN, few-shot; the linear protocol alone for plain probes."""
    recipes = [r.recipe for r in results if not isinstance(r, KnnResult) and r.method == "linear"]
    parts = [LINEAR_PROTOCOL] if not results or None in recipes else []
    named = sorted({name for name in recipes if name is not None})
    parts += [f"linear recipe {PUBLISHED[name].describe()}" for name in named]
    if any(r.method == "knn" for r in results):
        parts.append(KNN_PROTOCOL)
    if any(isinstance(r, FewShotResult) for r in results):
        parts.append(FEW_SHOT_PROTOCOL)
    return " | ".join(parts)


def format_result(result: Result) -> str:
    """A short report of one evaluation, for the terminal."""
    if isinstance(result, KnnResult):
        return _format_knn(result)
    if isinstance(result, FewShotResult):
        return _format_few_shot(result)
    published = recipe(result.recipe)
    penalty = "lambda" if published is None else published.penalty
    short = SHORT_NAMES.get(penalty, penalty)
    chosen = [e[penalty] for e in result.sweep if e["lambda"] == result.lam]
    value = result.lam if published is None else chosen[0]
    lines = [
        f"probe {result.layer} {result.shape} ({result.trainer} trainer): "
        f"{result.n_train} train, {result.n_val} val ({result.validation}), "
        f"{result.n_test} test rows; {result.num_classes} classes",
    ]
    if published is not None:
        lines.append(f"recipe     {published.describe()}")
    if result.normalize != "standardize":
        lines.append(f"normalize  {result.normalize}")
    sweep = sorted(result.sweep, key=lambda e: e[penalty])
    lines += [
        f"{'sweep' if published is None else 'sweep ' + short:<10} "
        + "  ".join(f"{e[penalty]:.1e}:{100 * e['val_top1']:.1f}" for e in sweep),
        f"{short:<10} {value:.2e} (val top-1 {_pct(result.val['top1'])})",
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
    return "\n".join(lines + _per_class(shown, "") + _tail(result))


def _per_class(metrics: Mapping[str, Any], where: str) -> list[str]:
    """The line of per-class accuracies (after ``where``), for at most 20 classes."""
    per_class = metrics["per_class"]
    if len(per_class) > 20:
        return []
    return [f"per class  {where}" + ", ".join(f"{n} {100 * a:.1f}" for n, a in per_class.items())]


def _tail(result: Result) -> list[str]:
    """The seconds per phase and the notes."""
    seconds = ", ".join(f"{key} {value:.1f}" for key, value in result.seconds.items())
    return [f"seconds    {seconds}", *(f"note       {note}" for note in result.notes)]


def format_table(results: Sequence[Result], val: str = "val", test: str = "test") -> str:
    """The layer-wise table: layer, dim, lambda, val and test top-1, seconds; with k-NN,
    few-shot or recipe results, one line per method (:func:`format_methods`). ``val``
    and ``test`` name the two splits in the column headings (``"20% of train.h5"``)."""
    plain = [r for r in results if isinstance(r, ProbeResult) and r.recipe is None]
    if len(plain) < len(results):
        return format_methods(results)
    width = max(5, *(len(r.layer) for r in plain))
    has_test = any(r.test is not None for r in plain)
    columns = [f"{val} top-1", *([f"{test} top-1", f"{test} top-5"] if has_test else [])]
    widths = [max(7, len(column)) for column in columns]
    header = f"{'layer':<{width}}  {'dim':>7}  {'lambda':>8}"
    header += "".join(f"  {column:>{w}}" for column, w in zip(columns, widths, strict=True))
    lines = [header + f"  {'seconds':>7}"]
    for r in plain:
        dim = int(np.prod(r.shape))
        cells = [_pct(r.val["top1"])]
        if has_test:
            scored = r.test or {}
            cells.append(_pct(scored["top1"]) if scored else "-")
            cells.append(_pct(scored["top5"]) if "top5" in scored else "-")
        line = f"{r.layer:<{width}}  {dim:>7}  {r.lam:>8.1e}"
        line += "".join(f"  {cell:>{w}}" for cell, w in zip(cells, widths, strict=True))
        lines.append(line + f"  {r.seconds['total']:>7.1f}")
    reference = plain[0].test or plain[0].val
    lines.append(f"chance (most frequent class): {_pct(reference['chance_top1'])}")
    if not has_test:
        lines.append(
            f"{val} top-1 is on the split that chose lambda, so optimistic; pass a test store "
            "(--test) for a held-out accuracy"
        )
    return "\n".join(lines)


def _scores(metrics: Mapping[str, Any]) -> str:
    text = f"top-1 {_pct(metrics['top1'])} (chance {_pct(metrics['chance_top1'])})"
    if "top5" in metrics:
        text += f"  top-5 {_pct(metrics['top5'])} (chance {_pct(metrics['chance_top5'])})"
    return text + f"  mean per class {_pct(metrics['mean_per_class'])}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def format_methods(results: Sequence[Result]) -> str:
    """One line per layer and method (k-NN: per k): top-1 and top-5 on the scored rows
    (mean +- standard deviation over few-shot draws), and seconds."""
    lines = [(r, score) for r in results for score in r.scores()]
    width = max(5, *(len(r.layer) for r, _ in lines))
    method_width = max(6, *(len(score.method) for _, score in lines))
    header = f"{'layer':<{width}}  {'dim':>7}  {'method':<{method_width}}  "
    header += f"{'top-1':>13}  {'top-5':>13}  {'seconds':>7}"
    out = [header]
    for r, score in lines:
        top5 = _pct_spread(score.top5, score.top5_std) if score.top5 is not None else "-"
        out.append(
            f"{r.layer:<{width}}  {int(np.prod(r.shape)):>7}  {score.method:<{method_width}}  "
            f"{_pct_spread(score.top1, score.top1_std):>13}  {top5:>13}  "
            f"{r.seconds['total']:>7.1f}"
        )
    scored = {_scored(r) for r in results}
    where = "the test store" if scored == {"test"} else "validation rows where no test store"
    out.append(
        f"top-1 and top-5 on {where}; chance (most frequent class): {_pct(lines[0][1].chance_top1)}"
    )
    return "\n".join(out)


def _scored(result: Result) -> str:
    if isinstance(result, ProbeResult):
        return "test" if result.test is not None else "val"
    return result.scored


def _pct_spread(value: float, std: float | None) -> str:
    return _pct(value) if std is None else f"{100 * value:.1f} ± {100 * std:.1f}%"


def _format_knn(result: KnnResult) -> str:
    """The report of one k-NN run: top-1 and top-5 per k."""
    rows = "test" if result.scored == "test" else f"val ({result.validation})"
    lines = [
        f"k-NN {result.layer} {result.shape}: {result.n_train} train rows (the neighbours), "
        f"{result.n_test} {rows} rows; {result.num_classes} classes",
        f"vote       the k most similar rows by cosine (rows prepared: {result.normalize}), "
        f"each with weight exp(similarity / {result.temperature:g})",
    ]
    for k, metrics in sorted(result.metrics.items()):
        lines.append(f"k={k:<9}{_scores(metrics)}")
    lines += _per_class(result.metrics[result.k], f"(k={result.k}) ")
    return "\n".join(lines + _tail(result))


def _format_few_shot(result: FewShotResult) -> str:
    """The report of one few-shot evaluation: mean and spread over the draws."""
    published = recipe(result.recipe)
    name = "linear" if result.method == "linear" else "k-NN"
    lines = [
        f"{name} {result.shots}-shot {result.layer} {result.shape}: {len(result.draws)} draws "
        f"of {result.shots} train rows per class; {result.n_test} {result.scored} rows; "
        f"{result.num_classes} classes",
    ]
    if result.method == "linear":
        lines.append(
            f"validation {result.n_val} rows ({result.validation}) choose lambda; no refit"
        )
    if published is not None:
        lines.append(f"recipe     {published.describe()}")
    lines.append(f"normalize  {result.normalize}")
    for score in result.scores():
        top5 = "" if score.top5 is None else f"  top-5 {_pct_spread(score.top5, score.top5_std)}"
        lines.append(
            f"{score.method:<22} top-1 {_pct_spread(score.top1, score.top1_std)}{top5}"
            f"  (chance {_pct(score.chance_top1)})"
        )
    for line, stats in result.summary.items():
        lines.append(
            f"draws      {line}: top-1 from {_pct(stats['top1']['min'])} to "
            f"{_pct(stats['top1']['max'])}"
        )
    lines.append(f"seconds    {result.seconds['total']:.1f}")
    lines += [f"note       {note}" for note in result.notes]
    return "\n".join(lines)
