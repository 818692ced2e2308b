"""Probe results for people and files: the terminal report, the layer table, the JSON."""

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
from featcache.probe.results import ProbeResult
from featcache.probe.splits import Source
from featcache.store import FeatureStore
from featcache.store.paths import building_beside, output_file

PROBE_FORMAT = 1


def save_results(
    results: Sequence[ProbeResult],
    path: str | os.PathLike,
    *,
    options: ProbeOptions | None = None,
) -> Path:
    """Write the results JSON: one entry per layer (each with the stores it used), the
    options and the library versions. Returns the path.

    The options recorded are ``options`` when given, else those the results were fitted
    with; a result fitted with other options carries its own in its entry.
    """
    from featcache.provenance import library_versions

    fitted = [result.options for result in results if result.options is not None]
    options = options or (fitted[0] if fitted else ProbeOptions())
    entries = []
    for result in results:
        entry = result.to_dict()
        if result.options is not None and result.options != options:
            entry["options"] = dataclasses.asdict(result.options)
        entries.append(entry)
    document = {
        "featcache_probe": PROBE_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "protocol": (
            "standardise with training statistics; L2 multinomial logistic regression; "
            "lambda chosen on validation top-1 (ties: larger); refit on train+val; test once"
        ),
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
    if not has_test:
        lines.append(
            "val top-1 is on the split that chose lambda, so optimistic; pass a test store "
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
