"""Extraction: a model run over a dataset, its chosen layers written into a store.

``extract`` (Python objects), ``extract_from_config`` (a YAML config, one store per
split, torchrun-aware) and ``extract_models`` (several models over one pass of the data)
are the entry points; the modules below hold the run's parts.
"""

from featcache.extraction.api import RunOptions, estimate, extract
from featcache.extraction.estimate import StoreEstimate
from featcache.extraction.from_config import extract_from_config
from featcache.extraction.many import ModelRun, extract_models

__all__ = [
    "ModelRun",
    "RunOptions",
    "StoreEstimate",
    "estimate",
    "extract",
    "extract_from_config",
    "extract_models",
]
