"""The registry of model kinds: the questions every kind answers, and which kind a spec names.

A *model kind* (torchvision, factory, timm, hf, open_clip) is a :class:`ModelKind` subclass,
registered once, not a branch elsewhere. A local checkpoint is not a kind but a
weights-loading step on top of any kind (:mod:`featcache.models.checkpoint`).
"""

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
    """What :meth:`ModelKind.build` returns: the module and what the forward will look like.

    The fields after ``weights`` are per model, not per kind (one kind serves CNNs and
    ViTs), with the defaults of an image model.
    """

    module: nn.Module
    # The JSON-able identity of the weights as read, {"source": <where from>, ...}. It
    # decides whether a store may be resumed, so it must change exactly when they do.
    weights: dict[str, Any]
    tokenizer: Tokenizer | None = None  # turns texts into inputs; None: the model takes images
    # Tokens (class, register) before the patch tokens of [B, T, D] token outputs; None: the
    # model declares no token layout.
    prefix_tokens: int | None = None
    sequence_first: bool = False  # token outputs are [T, B, D]


class ModelKind(ABC):
    """One way to build a backbone; subclass it and :func:`register` an instance.

    ``ref`` is what the spec names within the kind (``model.name`` without its ``"<kind>:"``
    prefix, or ``model.factory``); ``model`` is the whole checked spec.
    """

    name: ClassVar[str]  # the registry key and the model.name prefix: "timm" in "timm:vit_b"
    # model.kwargs keys the kind refuses, each with what to do instead: options of the
    # zoo's builder that would run code or unpickle objects, which a config (and so a
    # store's recorded config) must not be able to switch on through kwargs.
    refused_kwargs: ClassVar[dict[str, str]] = {}

    def preprocessing(
        self, ref: str, model: ModelSpec, preprocess: PreprocessSpec
    ) -> Preprocessing:
        """The eval preprocessing of the model ``ref``, mapping PIL RGB to float32 [3, H, W].

        Called before :meth:`build`, and on its own, so it must download nothing and fail on a bad
        ``ref`` or ``model.weights`` with one :class:`~featcache.errors.ConfigError` line. An
        explicit ``preprocess`` (``preprocess.is_set()``) wins over the model's own; this default
        uses it alone.
        """
        return spec_preprocessing(preprocess)

    def code_run(self, ref: str, model: ModelSpec) -> str | None:
        """What :meth:`build` would import and run that the config names, in words (None: only
        the kind's own library code). A store is data: ``verify`` asks this before rebuilding a
        recorded model and refuses unless the user allows it."""
        return None

    @abstractmethod
    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        """Construct the module (any mode, any device) and say which weights it read.

        Call ``torch.manual_seed(seed)`` right before constructing it, so that random parameters
        are the same for the same seed. With ``inputs="text"`` the module takes ``input_ids`` and
        ``attention_mask`` (int64 ``[B, T]``, right padded) keyword arguments and
        :attr:`BuiltModel.tokenizer` is set; a kind whose models read images only raises
        :func:`refuse_text`'s error. A kind written without ``inputs`` is called for images only.
        """


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
    """The kind that builds ``model``, and the reference it is given: ``factory="pkg.mod:fn"``
    -> (factory, ``"pkg.mod:fn"``); ``name="timm:vit_b"`` -> (timm, ``"vit_b"``);
    ``name="resnet50"`` -> (torchvision, ``"resnet50"``). An unknown prefix, or a
    ``model.kwargs`` key the kind refuses, is one :class:`~featcache.errors.ConfigError`."""
    kind, ref = _named_kind(model)
    for key in model.kwargs:
        if key in kind.refused_kwargs:
            raise ConfigError(
                f"model.kwargs.{key} is refused for {kind.name} models: {kind.refused_kwargs[key]}"
            )
    return kind, ref


def code_named(model: ModelSpec) -> str | None:
    """What building ``model`` would import and run that its config names, in words (None:
    nothing but the kinds' own libraries)."""
    kind, ref = kind_for(model)
    return kind.code_run(ref, model)


def refuse_recorded_code(
    model: ModelSpec, store: str | os.PathLike, command: str, trusted: bool, other_fix: str = ""
) -> None:
    """Raise one :class:`~featcache.errors.ConfigError` line when ``command`` would build
    ``model``, recorded in the store at ``store``, and that runs code the config names,
    unless ``trusted`` (``--trust-factory``). A store is data: nothing named in one runs
    without the user's say. ``other_fix`` offers another way out (", or ...")."""
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
    """The identity of randomly initialised weights: ``{"source": "random", "seed": seed}``."""
    return {"source": "random", "seed": seed}


def refuse_text(model: ModelSpec) -> ConfigError:
    """The one-line error of a kind whose models read images only, given text data."""
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
