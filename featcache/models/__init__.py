"""Model kinds and the backbones they build: :func:`build_backbone` -> :class:`Backbone`."""

from __future__ import annotations

from featcache.models.backbone import Backbone, backbone_layers, build_backbone, build_preprocessing
from featcache.models.checkpoint import load_checkpoint
from featcache.models.factory import FactoryKind, import_factory
from featcache.models.hf import HFKind
from featcache.models.open_clip import OpenClipKind
from featcache.models.preprocess import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    Preprocessing,
    build_transform,
)
from featcache.models.registry import (
    BuiltModel,
    ModelKind,
    Tokenizer,
    code_named,
    kind_for,
    refuse_recorded_code,
    register,
    registered,
    unregister,
)
from featcache.models.timm import TimmKind
from featcache.models.torchvision import TorchvisionKind, resolve_weights

for _kind in (TorchvisionKind, FactoryKind, TimmKind, HFKind, OpenClipKind):
    register(_kind())

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INTERPOLATIONS",
    "Backbone",
    "BuiltModel",
    "FactoryKind",
    "HFKind",
    "ModelKind",
    "OpenClipKind",
    "Preprocessing",
    "TimmKind",
    "Tokenizer",
    "TorchvisionKind",
    "backbone_layers",
    "build_backbone",
    "build_preprocessing",
    "build_transform",
    "code_named",
    "import_factory",
    "kind_for",
    "load_checkpoint",
    "refuse_recorded_code",
    "register",
    "registered",
    "resolve_weights",
    "unregister",
]
