"""The factory model kind: ``"package.module:callable"`` imported and called with ``model.kwargs``.

**A config that names a factory executes code.** Weights identity: random's, seeded right
before the call, even for a factory that loads weights itself (featcache cannot see that;
``model.checkpoint`` records them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from featcache.config.spec import ModelSpec
from featcache.errors import ConfigError, did_you_mean, first_line
from featcache.models.registry import BuiltModel, Inputs, ModelKind, random_weights, refuse_text


class FactoryKind(ModelKind):
    """``model.factory`` called with ``**model.kwargs``; it must return an ``nn.Module``."""

    name = "factory"

    def code_run(self, ref: str, model: ModelSpec) -> str | None:
        module_name = ref.partition(":")[0]
        arguments = ", ".join(f"{k}={v!r}" for k, v in model.kwargs.items())
        return f"import {module_name} and call {ref}({arguments}) (model.factory)"

    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        if inputs != "image":
            raise refuse_text(model)
        factory = import_factory(ref)
        torch.manual_seed(seed)
        try:
            module = factory(**model.kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"model.factory {ref!r} failed with model.kwargs {model.kwargs}: "
                f"{first_line(exc)}; make model.kwargs match its parameters"
            ) from exc
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"model.factory {ref!r} returned a {type(module).__name__}, not a "
                "torch.nn.Module; name a callable that builds the model"
            )
        return BuiltModel(module, random_weights(seed))


def import_factory(target: str) -> Callable[..., nn.Module]:
    """Import ``"package.module:callable"`` (dotted attributes after the colon allowed)."""
    module_name, colon, attr_path = target.partition(":")
    if not colon or not module_name or not attr_path:
        raise ConfigError(f"model.factory {target!r} must look like 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model.factory {target!r}: cannot import {module_name} ({first_line(exc)}); "
            "install it or put its folder on PYTHONPATH"
        ) from exc
    for depth, attr in enumerate(attr_path.split(".")):
        if not hasattr(obj, attr):
            where = ".".join([module_name, *attr_path.split(".")[:depth]])
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = did_you_mean(attr, names)
            raise ConfigError(f"model.factory {target!r}: {where} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ConfigError(
            f"model.factory {target!r} is a {type(obj).__name__}, not callable; "
            "name a function or class that returns an nn.Module"
        )
    return obj
