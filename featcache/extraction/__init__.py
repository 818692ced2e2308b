"""Extraction: a model run over a dataset, its chosen layers written into a store.

``extract`` (Python objects), ``extract_from_config`` (a YAML config, one store per
split, torchrun-aware) and ``extract_models`` (several models over one pass of the data)
are the entry points. Each makes an :class:`ExtractionPlan` (:mod:`.plan`) and executes
it through the one run (:mod:`.run`); the other modules hold the run's parts.
"""

from featcache.extraction.api import estimate, extract, run_plan
from featcache.extraction.estimate import StoreEstimate
from featcache.extraction.from_config import extract_from_config
from featcache.extraction.many import ModelRun, extract_models
from featcache.extraction.plan import ExtractionPlan, RunOptions, make_plan

__all__ = [
    "ExtractionPlan",
    "ModelRun",
    "RunOptions",
    "StoreEstimate",
    "estimate",
    "extract",
    "extract_from_config",
    "extract_models",
    "make_plan",
    "run_plan",
]
