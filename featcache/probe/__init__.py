"""Evaluations of cached features: linear probes, weighted k-NN and few-shot probes.

The linear probe follows the protocol of Kornblith et al. (2019) and the SimCLR / CLIP
linear evaluations:

1. Features are flattened to ``[N, D]`` float32 and standardised with the mean and
   standard deviation of the rows being fitted (never of the validation or test rows).
2. An L2-regularised multinomial logistic regression, loss
   ``mean cross-entropy + lambda / 2 * ||W||^2`` (bias unregularised), is fitted for
   every ``lambda`` of a log-spaced grid, then for a few values between the best one
   and its neighbours. Validation top-1 picks ``lambda``; ties go to the stronger
   regularisation.
3. The model is refitted on train + validation at the chosen ``lambda`` (standardised
   with their statistics) and evaluated once on the test split, which no choice
   ever looked at.

``recipe`` swaps in a published protocol instead (:mod:`.recipes`) and ``normalize`` the
preparation of rows (:mod:`.metrics`). Two trainers fit linear probes, :mod:`.full` (in
memory) and :mod:`.streaming` (for stores larger than memory), both through the one sweep
of :mod:`.sweep`; :mod:`.weighted_knn` is DINO's k-NN classifier and :mod:`.fewshot` fits
each method on k rows per class. :mod:`.api` holds the entry points.

Everything is seeded: the same stores and options give the same numbers (on the same
machine and number of threads; float sums depend on their order)."""

from featcache.probe.api import evaluate, knn, probe, probe_layers
from featcache.probe.fewshot import draw_shots
from featcache.probe.full import fit_lbfgs
from featcache.probe.metrics import Moments, topk_metrics
from featcache.probe.options import METHODS, NORMALIZE, RECIPES, TRAINERS, ProbeOptions
from featcache.probe.plot import plot_layers
from featcache.probe.recipes import Recipe, recipe
from featcache.probe.report import (
    PROBE_FORMAT,
    default_output,
    format_result,
    format_table,
    save_results,
)
from featcache.probe.results import FewShotResult, KnnResult, LinearProbe, ProbeResult, Result
from featcache.probe.splits import Source, requested_layers, stratified_split
from featcache.probe.sweep import DEFAULT_LAMBDAS, STREAMING_LAMBDAS, choose, refine_lambdas
from featcache.probe.weighted_knn import nearest, vote
from featcache.util.units import parse_bytes

__all__ = [
    "DEFAULT_LAMBDAS",
    "METHODS",
    "NORMALIZE",
    "PROBE_FORMAT",
    "RECIPES",
    "STREAMING_LAMBDAS",
    "TRAINERS",
    "FewShotResult",
    "KnnResult",
    "LinearProbe",
    "Moments",
    "ProbeOptions",
    "ProbeResult",
    "Recipe",
    "Result",
    "Source",
    "choose",
    "default_output",
    "draw_shots",
    "evaluate",
    "fit_lbfgs",
    "format_result",
    "format_table",
    "knn",
    "nearest",
    "parse_bytes",
    "plot_layers",
    "probe",
    "probe_layers",
    "recipe",
    "refine_lambdas",
    "save_results",
    "requested_layers",
    "stratified_split",
    "topk_metrics",
    "vote",
]
