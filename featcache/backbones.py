"""The old import path of :mod:`featcache.models`; import from there instead."""

from __future__ import annotations

from featcache.models import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    Backbone,
    build_backbone,
    build_transform,
    import_factory,
    load_checkpoint,
    resolve_weights,
)
from featcache.models.checkpoint import STATE_DICT_KEYS

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INTERPOLATIONS",
    "STATE_DICT_KEYS",
    "Backbone",
    "build_backbone",
    "build_transform",
    "import_factory",
    "load_checkpoint",
    "resolve_weights",
]
