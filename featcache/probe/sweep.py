"""The regularisation sweep both trainers run: the grid, its refinement, the choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from featcache.probe.options import ProbeOptions

DEFAULT_LAMBDAS = tuple(10.0**k for k in range(-6, 3))  # 1e-6 ... 1e2, one per decade
STREAMING_LAMBDAS = tuple(10.0**k for k in range(-6, 3, 2))  # 1e-6 ... 1e2, every 2 decades

# fit(lambdas, near) fits one model per lambda and returns one sweep entry per lambda,
# each at least {"lambda", "val_top1"}. ``near`` is None for the grid, which comes from
# strong to weak regularisation so that warm starts follow the path, and the best grid
# value for the refinement values around it.
FitMany = Callable[[list[float], float | None], list[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Grid:
    """The sweep of one trainer: the coarse ``lambdas`` (increasing) and how many values
    to try between the best of them and each neighbour (``refine``)."""

    lambdas: tuple[float, ...]
    refine: int

    @classmethod
    def for_trainer(cls, trainer: str, options: ProbeOptions) -> Grid:
        """The grid of ``options``, or the default of ``trainer`` ("full" or "streaming")."""
        full = trainer == "full"
        lambdas = options.lambdas or (DEFAULT_LAMBDAS if full else STREAMING_LAMBDAS)
        refine = (2 if full else 1) if options.refine is None else options.refine
        return cls(tuple(sorted(lambdas)), refine)

    def at_edge(self, lam: float) -> bool:
        """Whether ``lam`` is the smallest or largest grid value."""
        return lam in (self.lambdas[0], self.lambdas[-1])


def run_sweep(grid: Grid, fit: FitMany) -> tuple[float, list[dict[str, Any]]]:
    """Fit the grid, then ``grid.refine`` values between its best and each neighbour.

    Returns the chosen lambda (best validation top-1 of every fit, see :func:`choose`)
    and all sweep entries in increasing lambda.
    """
    entries = list(fit(sorted(grid.lambdas, reverse=True), None))
    best = choose(entries)
    extra = refine_lambdas(grid.lambdas, best, grid.refine)
    if extra:
        entries += fit(extra, best)
    return choose(entries), sorted(entries, key=lambda entry: entry["lambda"])


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
