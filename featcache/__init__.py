"""featcache: activation caches from pretrained backbones in chunked HDF5 stores.

The public names load on first use: ``import featcache`` imports no torch, and no
submodule imports the package back while it is being initialised.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from featcache import _moved
from featcache._compat import guard_torchvision_import

guard_torchvision_import()  # before any module imports torchvision
_moved.install()  # old module paths (featcache.dataset, ...) still import, with a warning

__version__ = "0.1.0"

_PUBLIC = {
    "ConfigError": "featcache.errors",
    "FeatcacheError": "featcache.errors",
    "FeatureDataset": "featcache.read.dataset",
    "FeatureStore": "featcache.store",
    "ModelRun": "featcache.extraction",
    "PadTokens": "featcache.read.padding",
    "ShuffledBatches": "featcache.read.dataset",
    "TokenDataset": "featcache.read.token_view",
    "extract": "featcache.extraction",
    "extract_from_config": "featcache.extraction",
    "extract_models": "featcache.extraction",
    "pad_tokens": "featcache.read.padding",
    "plan": "featcache.extraction.planning",
}

# Subpackages reachable as attributes (``featcache.probe.probe(...)``), loaded on first use;
# the old module paths among them warn that they moved.
_SUBMODULES = (
    "capture", "commands", "config", "extraction", "models", "probe", "read", "sources",
    "store", "util", *(old.split(".")[1] for old in _moved.MOVED if old.count(".") == 1),
)  # fmt: skip

__all__ = [
    "ConfigError",
    "FeatcacheError",
    "FeatureDataset",
    "FeatureStore",
    "ModelRun",
    "PadTokens",
    "ShuffledBatches",
    "TokenDataset",
    "extract",
    "extract_from_config",
    "extract_models",
    "pad_tokens",
    "plan",
]

if TYPE_CHECKING:
    from featcache.errors import ConfigError, FeatcacheError
    from featcache.extraction import ModelRun, extract, extract_from_config, extract_models
    from featcache.extraction.planning import plan
    from featcache.read.dataset import FeatureDataset, ShuffledBatches
    from featcache.read.padding import PadTokens, pad_tokens
    from featcache.read.token_view import TokenDataset
    from featcache.store import FeatureStore


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"featcache.{name}")  # the import sets the attribute
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'featcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBMODULES})
