"""Extraction: a model run over a dataset, its chosen layers written into a store.

``extract`` (Python objects) and ``extract_from_config`` (a YAML config, one store per
split, torchrun-aware) are the two entry points; the modules below hold the run's parts.
"""

from featcache.extraction.api import RunOptions, estimate, extract
from featcache.extraction.estimate import StoreEstimate
from featcache.extraction.from_config import extract_from_config

__all__ = ["RunOptions", "StoreEstimate", "estimate", "extract", "extract_from_config"]
