"""Evaluations of cached features: linear probes, weighted k-NN and few-shot probes.

The protocols are in docs/guides/probes.md and docs/guides/evaluation.md. :mod:`.api`
holds the entry points; :mod:`.full` (in memory) and :mod:`.streaming` (stores larger
than memory) fit linear probes through the one sweep of :mod:`.sweep`. Everything is
seeded: the same stores and options give the same numbers (on the same machine and number
of threads; float sums depend on their order)."""

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
