"""The published linear-probe recipes (:data:`PUBLISHED`): what each fixes, and its source
(compared in docs/guides/evaluation.md). ``dinov3``'s scikit-learn objective
``C * sum(cross-entropy) + ||W||^2 / 2`` is featcache's with ``lambda = 1 / (C * N)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

Scores = Callable[[list[int]], list[float]]  # validation top-1 of grid positions

DINOV3_SOURCE = (
    "DINOv3 (Simeoni et al. 2025), facebookresearch/dinov3 dinov3/eval/log_regression.py "
    "at 6876159a11b4"
)
CLIP_SOURCE = (
    "CLIP_benchmark, LAION-AI/CLIP_benchmark clip_benchmark/metrics/linear_probe.py and the "
    "README's train/val/test command, at 48de38c1689f"
)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a linear-probe protocol fixes.

    ``penalty`` names the swept strength (``"lambda"``: featcache's L2 on the mean loss;
    ``"C"``: scikit-learn's inverse strength on the summed loss; ``"weight_decay"``:
    AdamW's decoupled decay) and ``values`` its grid in increasing order."""

    name: str
    source: str
    penalty: str
    values: tuple[float, ...]
    search: str  # "grid": every value; "bisect": CLIP_benchmark's coarse-to-fine search
    val_fraction: float  # share of each class of train held out to choose on
    few_shot_val_fraction: float
    normalize: str  # how rows are prepared (see ProbeOptions.normalize)
    optimizer: str  # "lbfgs" (full batch) or "adamw" (mini-batch)
    refit: bool = True  # refit the chosen model on train + validation (never for few-shot)
    max_iter: int = 1000  # L-BFGS iterations per fit
    lr: float = 0.1  # AdamW
    epochs: int = 20  # AdamW
    batch_size: int = 512  # AdamW

    def describe(self) -> str:
        """One line for reports: the name and the source."""
        return f"{self.name}: {self.source}"


PUBLISHED = {
    "dinov3": Recipe(
        name="dinov3",
        source=DINOV3_SOURCE,
        penalty="C",
        values=tuple(np.logspace(-6, 5, 45).tolist()),
        search="grid",
        val_fraction=0.1,
        few_shot_val_fraction=0.01,
        normalize="none",
        optimizer="lbfgs",
    ),
    "clip": Recipe(
        name="clip",
        source=CLIP_SOURCE,
        penalty="weight_decay",
        values=tuple(np.logspace(-6, 2, 97).tolist()),
        search="bisect",
        val_fraction=0.1,
        few_shot_val_fraction=0.1,
        normalize="l2",
        optimizer="adamw",
    ),
}


def recipe(name: str | None) -> Recipe | None:
    """The recipe called ``name`` (None: featcache's own protocol)."""
    return None if name is None else PUBLISHED[name]


def bisect_search(
    count: int, evaluate: Scores, first: int = 7, steps: tuple[int, ...] = (8, 4, 2, 1)
) -> int:
    """CLIP_benchmark's search over grid positions ``0 .. count - 1``.

    ``evaluate(positions)`` returns the validation top-1 of each position (it may be asked
    for a position again; a cache makes that free). Every ``(count - 1) / (first - 1)``-th
    position is tried first; then, for each step, the best so far and the positions
    ``step`` places to either side (clipped to the grid). The first of the best wins, in
    the order tried (left, centre, right): a tie goes to the weaker decay on the left.
    Returns the chosen position."""
    stride = (count - 1) // (first - 1)
    best = _first_best(list(range(0, count, stride)), evaluate)
    for step in steps:
        best = _first_best([max(best - step, 0), best, min(best + step, count - 1)], evaluate)
    return best


def _first_best(positions: list[int], evaluate: Scores) -> int:
    scores = evaluate(positions)
    return positions[scores.index(max(scores))]
