"""The registry of model kinds (:class:`ModelKind` subclasses: torchvision, factory, timm, hf,
open_clip) and which kind a spec names."""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import nn

from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError, did_you_mean
from featcache.models.preprocess import Preprocessing, spec_preprocessing
from featcache.sources.tokenizer import Tokenizer

DEFAULT_KIND = "torchvision"  # the kind of a model.name without a "<kind>:" prefix
FACTORY_KIND = "factory"  # the kind model.factory names; never a model.name prefix


Inputs = Literal["image", "text"]  # what a model is built to read
INPUTS: tuple[Inputs, ...] = ("image", "text")

_KIND_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass
class BuiltModel:
    """What :meth:`ModelKind.build` returns: the module, its weights and its forward's
    layout (per model, not per kind; the defaults are an image model's)."""

    module: nn.Module
    # The JSON-able identity of the weights as read, {"source": <where from>, ...}. It
    # decides whether a store may be resumed, so it must change exactly when they do.
    weights: dict[str, Any]
    tokenizer: Tokenizer | None = None  # turns texts into inputs; None: the model takes images
    # Class and register tokens before the patch tokens of [B, T, D] outputs; None: unknown.
    prefix_tokens: int | None = None
    sequence_first: bool = False  # token outputs are [T, B, D]


class ModelKind(ABC):
    """One way to build a backbone; subclass it and :func:`register` an instance. ``ref`` is
    ``model.name`` without its ``"<kind>:"`` prefix, or ``model.factory``."""

    name: ClassVar[str]  # the registry key and the model.name prefix: "timm" in "timm:vit_b"
    # model.kwargs keys the kind refuses, each with what to do instead: builder options that
    # run code, unpickle objects or load unrecorded weights, which no config may switch on.
    refused_kwargs: ClassVar[dict[str, str]] = {}

    def preprocessing(
        self, ref: str, model: ModelSpec, preprocess: PreprocessSpec
    ) -> Preprocessing:
        """The eval preprocessing (PIL RGB -> float32 [3, H, W]) of the model ``ref``, a set
        ``preprocess`` winning. Runs before :meth:`build`: downloads nothing, and fails first
        on a bad ``ref`` or ``model.weights``."""
        return spec_preprocessing(preprocess)

    def code_run(self, ref: str, model: ModelSpec) -> str | None:
        """What :meth:`build` would import and run that the config names, in words (None: only
        the kind's own library); ``verify`` refuses it from a store unless allowed."""
        return None

    @abstractmethod
    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        """Construct the module (any mode, device) right after ``torch.manual_seed(seed)``, and
        its weights' identity. With ``inputs="text"`` it takes int64 ``[B, T]`` ``input_ids``
        and ``attention_mask`` keywords and has a tokenizer (image-only kinds raise
        :func:`refuse_text`'s error; a kind without ``inputs`` gets images only)."""


_KINDS: dict[str, ModelKind] = {}  # name -> kind, in registration order


def register(kind: ModelKind, *, replace: bool = False) -> ModelKind:
    """Add ``kind`` to the registry under ``kind.name`` (a lower-case identifier: it prefixes
    ``model.name``); returns it. Registering a taken name is an error unless ``replace``."""
    name = getattr(kind, "name", None)
    if not isinstance(name, str) or not _KIND_NAME.fullmatch(name):
        raise ValueError(f"a model kind's name must be a lower-case identifier, not {name!r}")
    if name in _KINDS and not replace:
        raise ValueError(f"model kind {name!r} is already registered; pass replace=True")
    _KINDS[name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove the kind called ``name`` (no error if there is none)."""
    _KINDS.pop(name, None)


def registered() -> list[str]:
    """The names of the registered kinds, in registration order."""
    return list(_KINDS)


def kind_for(model: ModelSpec) -> tuple[ModelKind, str]:
    """The kind that builds ``model`` and its reference (``"timm:vit_b"`` -> (timm,
    ``"vit_b"``), ``"resnet50"`` -> (torchvision, ``"resnet50"``)); an unknown prefix or a
    refused kwarg is a :class:`~featcache.errors.ConfigError`."""
    kind, ref = _named_kind(model)
    for key in model.kwargs:
        if key in kind.refused_kwargs:
            raise ConfigError(
                f"model.kwargs.{key} is refused for {kind.name} models: {kind.refused_kwargs[key]}"
            )
    return kind, ref


def code_named(model: ModelSpec) -> str | None:
    """:meth:`ModelKind.code_run` of ``model``'s kind."""
    kind, ref = kind_for(model)
    return kind.code_run(ref, model)


def refuse_recorded_code(
    model: ModelSpec, store: str | os.PathLike, command: str, trusted: bool, other_fix: str = ""
) -> None:
    """Refuse, unless ``trusted`` (``--trust-factory``), a ``command`` that would build
    ``model`` recorded in ``store`` and run code its config names; ``other_fix`` (", or
    ...") offers another way out."""
    code = code_named(model)
    if code is not None and not trusted:
        raise ConfigError(
            f"{store} records a config that would {code}; {command} runs no code named in "
            f"a store: pass --trust-factory to run it{other_fix}"
        )


def _named_kind(model: ModelSpec) -> tuple[ModelKind, str]:
    if model.factory is not None:
        return _get(FACTORY_KIND, "model.factory"), model.factory
    if model.name is None:
        raise ConfigError("model: set exactly one of model.name (torchvision) and model.factory")
    prefix, colon, ref = model.name.partition(":")
    if not colon:
        return _get(DEFAULT_KIND, "model.name"), model.name
    kinds = [name for name in _KINDS if name != FACTORY_KIND]
    if prefix not in kinds:
        hint = did_you_mean(prefix, kinds, parenthesised=True)
        factory = "; a factory goes in model.factory" if prefix == FACTORY_KIND else ""
        raise ConfigError(
            f"unknown model kind {prefix!r} in model.name {model.name!r}{hint}; "
            f"model.name is a torchvision name or '<kind>:<name>' with kind one of: "
            f"{', '.join(kinds)}{factory}"
        )
    return _KINDS[prefix], ref


def random_weights(seed: int) -> dict[str, Any]:
    return {"source": "random", "seed": seed}


def refuse_text(model: ModelSpec) -> ConfigError:
    """The error of an image-only kind given text data."""
    named = model.name or model.factory
    api = ""
    if model.factory is not None:
        api = "; featcache.extract takes any model, with a dataset of tokenised dicts"
    return ConfigError(
        f"model {named} takes images; text data needs a text model: "
        f"hf:<text model or dual encoder> or open_clip:<architecture>{api}"
    )


def _get(name: str, field: str) -> ModelKind:
    kind = _KINDS.get(name)
    if kind is None:  # only when a caller unregistered a built-in kind
        raise ConfigError(f"{field}: no model kind {name!r} is registered")
    return kind
