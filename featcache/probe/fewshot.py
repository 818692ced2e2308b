"""Few-shot evaluation: k rows per class drawn from the fit rows, over several seeded
draws. The linear probe chooses lambda on the validation rows but is not refitted with
them, which would fit more than k rows per class (as in DINOv3 and CLIP_benchmark)."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import numpy as np
import torch

from featcache.errors import ConfigError
from featcache.probe.full import READ_ROWS, fit_sweep, read_layer
from featcache.probe.metrics import Scaling, rank, require_finite, topk_metrics
from featcache.probe.options import ProbeOptions
from featcache.probe.parts import Part, in_order
from featcache.probe.splits import Splits
from featcache.probe.sweep import Grid
from featcache.probe.weighted_knn import knn_in_memory
from featcache.read.dataset import FeatureDataset


def draw_shots(
    labels: np.ndarray, candidates: np.ndarray, shots: int, draw: int, seed: int = 0
) -> np.ndarray:
    """Sorted int64 row numbers: ``shots`` rows of each class among ``candidates``.

    ``labels``: int64 ``[N]`` of every row. Draw ``draw`` shuffles each class's
    candidates with the seed ``[seed, draw]`` and takes the first ``shots``, so a
    smaller ``shots`` takes a subset of a larger one's rows.

    Raises:
        ConfigError: a class has fewer than ``shots`` rows to draw from."""
    rng = np.random.default_rng([seed, draw])
    picked = []
    for label in np.unique(labels[candidates]):
        rows = rng.permutation(candidates[labels[candidates] == label])
        if len(rows) < shots:
            raise ConfigError(
                f"class {label} has {len(rows)} rows to draw {shots} shots from; lower "
                "shots, or hold out fewer validation rows"
            )
        picked.append(rows[:shots])
    return np.sort(np.concatenate(picked))


def summarize(values: list[float]) -> dict[str, float]:
    """Mean, standard deviation (``n - 1``; 0 for one value), min and max."""
    array = np.asarray(values, dtype=np.float64)
    std = float(array.std(ddof=1)) if len(array) > 1 else 0.0
    mean, low, high = float(array.mean()), float(array.min()), float(array.max())
    return {"mean": mean, "std": std, "min": low, "max": high}


class FewShotData:
    """The rows a few-shot run uses, in memory: the train rows that can be drawn (with
    their sample ids), the validation rows and the scored rows, and the stores' sha256."""

    def __init__(self, splits: Splits, layer: str, options: ProbeOptions):
        self.splits = splits
        self.digests: dict[str, str] = {}
        most = max(options.shots or [1])  # the draws of fewer shots take a subset of these
        labels = splits.labels["train"]
        drawn = np.concatenate(
            [
                draw_shots(labels, splits.fit_rows, most, d, options.seed)
                for d in range(options.n_draws)
            ]
        )
        ids = splits.stores["train"].ids
        self.ids = {int(row): ids[row] for row in np.unique(drawn)}
        needed = np.zeros(len(labels), dtype=bool)
        needed[drawn] = True
        if splits.val_rows is not None:
            needed[splits.val_rows] = True
        self.x_train, self.position = self._gather(layer, needed)
        if splits.val_rows is None:
            self.x_val, self.digests["val"] = read_layer(splits.stores["val"], layer)
        else:
            self.x_val = self.rows(splits.val_rows)
        require_finite(self.x_val, f"the validation features of layer {layer}")
        self.y_val = torch.from_numpy(splits.y_val)
        if "test" in splits.stores:
            self.x_scored, self.digests["test"] = read_layer(splits.stores["test"], layer)
            require_finite(self.x_scored, f"the test store's features of layer {layer}")
            self.y_scored = torch.from_numpy(splits.labels["test"])
            self.scored = "test"
        else:
            self.x_scored, self.y_scored, self.scored = self.x_val, self.y_val, "val"

    def _gather(self, layer: str, needed: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """The ``needed`` rows of the train store (one pass, which hashes every row) and
        each row's place among them (-1: not read)."""
        path = self.splits.stores["train"].path
        digest, xs = hashlib.sha256(), []
        with contextlib.closing(FeatureDataset(path, layer, dtype=torch.float32)) as dataset:
            for _, x, _, _, raw in in_order([Part(dataset, needed)], READ_ROWS):
                digest.update(raw.reshape(len(raw), -1).numpy().data)
                xs.append(x)
        self.digests["train"] = digest.hexdigest()
        x = torch.cat(xs)
        require_finite(x, f"the train store's features of layer {layer}")
        position = np.full(len(needed), -1, dtype=np.int64)
        position[needed] = np.arange(int(needed.sum()))
        return x, position

    def rows(self, rows: np.ndarray) -> torch.Tensor:
        """Float32 ``[n, D]`` train rows by row number (rows that were read)."""
        return self.x_train[torch.from_numpy(self.position[rows])]

    def draw_ids(self, rows: np.ndarray) -> dict[str, list[str]]:
        """The sample ids of drawn train ``rows`` (a draw of :func:`draw_shots`) by class,
        in label order; a class is named by its class name, else by its label."""
        labels, names = self.splits.labels["train"][rows], self.splits.class_names
        return {
            names[label] if names and label < len(names) else str(label): [
                self.ids[int(row)] for row in rows[labels == label]
            ]
            for label in np.unique(labels).tolist()
        }


def few_shot_draw(
    data: FewShotData,
    method: str,
    rows: np.ndarray,
    options: ProbeOptions,
    scaling: Scaling,
    device: torch.device,
    desc: str,
) -> dict[str, Any]:
    """One method fitted on the drawn train ``rows`` and scored: its entry of
    ``FewShotResult.draws`` (without the draw number)."""
    splits = data.splits
    x_fit = scaling.rows(data.rows(rows))
    y_fit = torch.from_numpy(splits.labels["train"][rows])
    if method == "knn":
        ranked = knn_in_memory(
            x_fit, y_fit, data.x_scored, options, scaling, splits.num_classes, device
        )
        per_k = {k: topk_metrics(r, data.y_scored, splits.class_names) for k, r in ranked.items()}
        return {"rows": len(rows), "k": {k: _headline(m) for k, m in per_k.items()}}
    grid = Grid.for_trainer("full", options, rows=len(rows))
    x_val, y_fit, y_val = scaling.rows(data.x_val), y_fit.to(device), data.y_val.to(device)
    lam, _, val, model = fit_sweep(
        x_fit, y_fit, x_val, y_val, splits, grid, options, device, scaling, desc
    )
    scored = topk_metrics(rank(model.logits(data.x_scored)), data.y_scored, splits.class_names)
    return {
        "rows": len(rows),
        "lambda": lam,
        **({grid.penalty: grid.value(lam)} if grid.penalty != "lambda" else {}),
        "val_top1": val["top1"],
        **_headline(scored),
    }


def _headline(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: metrics[key] for key in ("top1", "top5", "mean_per_class") if key in metrics}


def summary_lines(method: str, draws: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``FewShotResult.summary`` of the draws of one method."""
    if method == "linear":
        lines = {"linear": draws}
    else:
        lines = {f"k={k}": [d["k"][k] for d in draws] for k in draws[0]["k"]}
    return {
        line: {
            key: summarize([entry[key] for entry in entries])
            for key in ("top1", "top5")
            if key in entries[0]
        }
        for line, entries in lines.items()
    }
