"""The regularisation sweep every trainer runs: the grid, its search, the choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from featcache.probe.options import ProbeOptions
from featcache.probe.recipes import bisect_search, recipe

DEFAULT_LAMBDAS = tuple(10.0**k for k in range(-6, 3))  # 1e-6 ... 1e2, one per decade
STREAMING_LAMBDAS = tuple(10.0**k for k in range(-6, 3, 2))  # 1e-6 ... 1e2, every 2 decades

# fit(lambdas, near): one sweep entry ({"lambda", "val_top1", ...}) per lambda fitted.
# ``near`` is None for the grid (strong to weak, so warm starts follow the path), else
# the best grid value, which the refinement values lie around.
FitMany = Callable[[list[float], float | None], list[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Grid:
    """The sweep of one probe: the coarse ``lambdas`` (increasing; the L2 strength on the
    mean loss, or AdamW's weight decay) and how many values to try between the best of
    them and each neighbour (``refine``), or CLIP_benchmark's search (``bisect``).
    ``penalty`` names what a recipe sweeps; for ``"C"``, ``C = 1 / (lambda * rows)``."""

    lambdas: tuple[float, ...]
    refine: int
    bisect: bool = False
    penalty: str = "lambda"
    rows: int = 0

    @classmethod
    def for_trainer(cls, trainer: str, options: ProbeOptions, rows: int = 0) -> Grid:
        """The grid of ``options``: the recipe's (for ``rows`` fitted rows), else the
        ``lambdas`` given, else the default of ``trainer`` ("full" or "streaming")."""
        published = recipe(options.recipe)
        if published is not None:
            if published.penalty == "C":
                from_c = tuple(sorted(1.0 / (c * rows) for c in published.values))
                return cls(from_c, 0, penalty="C", rows=rows)
            bisect = published.search == "bisect"
            return cls(published.values, 0, bisect=bisect, penalty="weight_decay")
        full = trainer == "full"
        lambdas = options.lambdas or (DEFAULT_LAMBDAS if full else STREAMING_LAMBDAS)
        refine = (2 if full else 1) if options.refine is None else options.refine
        return cls(tuple(sorted(lambdas)), refine)

    def value(self, lam: float) -> float:
        """The recipe's own value of the fitted ``lam`` (C, weight decay or lambda)."""
        return 1.0 / (lam * self.rows) if self.penalty == "C" else lam

    def refit_lambda(self, lam: float, rows: int) -> float:
        """The strength to refit with on ``rows`` rows: the same C means a smaller lambda
        on more rows; a lambda or weight decay stays."""
        return lam * self.rows / rows if self.penalty == "C" else lam

    def at_edge(self, lam: float) -> bool:
        """Whether ``lam`` is the smallest or largest grid value."""
        return lam in (self.lambdas[0], self.lambdas[-1])


def run_sweep(grid: Grid, fit: FitMany) -> tuple[float, list[dict[str, Any]]]:
    """Fit the grid, then ``grid.refine`` values between its best and each neighbour (or
    CLIP_benchmark's search with ``grid.bisect``). Returns the chosen lambda
    (:func:`choose`, or CLIP_benchmark's rule) and the entries in increasing lambda."""
    if grid.bisect:
        return _bisect(grid, fit)
    entries = list(fit(sorted(grid.lambdas, reverse=True), None))
    best = choose(entries)
    extra = refine_lambdas(grid.lambdas, best, grid.refine)
    if extra:
        entries += fit(extra, best)
    return choose(entries), sorted(entries, key=lambda entry: entry["lambda"])


def _bisect(grid: Grid, fit: FitMany) -> tuple[float, list[dict[str, Any]]]:
    fitted: dict[float, dict[str, Any]] = {}

    def evaluate(positions: list[int]) -> list[float]:
        new = [grid.lambdas[i] for i in dict.fromkeys(positions) if grid.lambdas[i] not in fitted]
        if new:
            for entry in fit(new, None):
                fitted[entry["lambda"]] = entry
        return [fitted[grid.lambdas[i]]["val_top1"] for i in positions]

    chosen = grid.lambdas[bisect_search(len(grid.lambdas), evaluate)]
    return chosen, sorted(fitted.values(), key=lambda entry: entry["lambda"])


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
