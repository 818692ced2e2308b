"""The registry of model kinds: the questions every kind answers, and which kind a spec names.

A *model kind* is one way of getting a backbone: ``torchvision`` (a model name and its
weights enum) and ``factory`` (a ``package.module:callable``) today; ``timm``, ``hf`` and
``open_clip`` are meant to be further entries, not further branches. Each kind answers
the same questions, as the methods of :class:`ModelKind`:

* :meth:`ModelKind.preprocessing`: the eval preprocessing (transform, decode and crop
  size), given the explicit ``preprocess`` section, which wins over the kind's own;
* :meth:`ModelKind.build`: the ``nn.Module``, the identity of the weights it actually
  read, and (as :class:`BuiltModel` fields with defaults) its tokenizer, the number of
  prefix tokens in its token outputs and whether those are sequence-first. ``inputs``
  says what the data holds: ``"image"`` or ``"text"`` (token ids, for the kinds whose
  models read text: ``hf`` and ``open_clip``; the others refuse it with
  :func:`refuse_text`).

Which kind a :class:`~featcache.config.spec.ModelSpec` names (:func:`kind_for`): ``model.factory``
names the ``factory`` kind; ``model.name`` is ``"<kind>:<reference>"`` or, with no
registered prefix, a ``torchvision`` model name. A local checkpoint is not a kind: it is
a weights-loading step applied on top of any kind (see :mod:`featcache.models.checkpoint`).
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

    ``weights`` is the JSON-able identity of the weights the module holds, as read:
    ``{"source": <where from>, ...}`` (``"torchvision"`` with ``"enum"`` and ``"url"``,
    ``"random"`` with ``"seed"``, ...); :func:`~featcache.models.build_backbone` adds
    ``"model"``. It decides whether a store may be resumed, so it must change exactly when
    the weights do.

    The other fields have the defaults of an image model and are per model, not per kind
    (one kind serves CNNs and ViTs): ``tokenizer`` turns texts into inputs (``None``: the
    model takes images); ``prefix_tokens`` counts the tokens (class, register) before the
    patch tokens of its ``[B, T, D]`` token outputs; ``sequence_first`` says token outputs
    are ``[T, B, D]`` instead.
    """

    module: nn.Module
    weights: dict[str, Any]
    tokenizer: Tokenizer | None = None
    prefix_tokens: int | None = None  # None: the model declares no token layout
    sequence_first: bool = False


class ModelKind(ABC):
    """One way to build a backbone; subclass it and :func:`register` an instance.

    ``ref`` is what the spec names within the kind: ``model.name`` without its
    ``"<kind>:"`` prefix, or ``model.factory``. ``model`` is the whole (checked) spec, for
    ``weights`` and ``kwargs``.
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

        Called before :meth:`build`, and on its own (to show images as the model sees
        them), so it must download nothing and fail on a bad ``ref`` or ``model.weights``
        with one :class:`~featcache.errors.ConfigError` line. An explicit ``preprocess``
        (``preprocess.is_set()``) wins over the model's own preprocessing. The default is
        ``preprocess`` alone (:func:`~featcache.models.preprocess.spec_preprocessing`).
        """
        return spec_preprocessing(preprocess)

    def code_run(self, ref: str, model: ModelSpec) -> str | None:
        """What :meth:`build` would import and run that the config names, in words (None:
        nothing but the kind's own library code).

        Stores record their config, and a store is data: ``verify`` asks this before
        rebuilding a recorded model and refuses unless the user allows it.
        """
        return None

    @abstractmethod
    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        """Construct the module (any mode, any device) and say which weights it read.

        Call ``torch.manual_seed(seed)`` right before constructing it, so that randomly
        initialised parameters are the same for the same seed. With ``inputs="text"`` the
        module takes ``input_ids`` and ``attention_mask`` (int64 ``[B, T]``, right padded)
        as keyword arguments and :attr:`BuiltModel.tokenizer` is set; a kind whose models
        read images only raises :func:`refuse_text`'s error. A kind written without the
        ``inputs`` parameter is called without it, for images only.
        """


_KINDS: dict[str, ModelKind] = {}  # name -> kind, in registration order


def register(kind: ModelKind, *, replace: bool = False) -> ModelKind:
    """Add ``kind`` to the registry under ``kind.name``; returns it.

    Names are lower-case identifiers (they prefix ``model.name``). Registering a taken name
    is an error unless ``replace``.
    """
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
    """The kind that builds ``model``, and the reference it is given.

    ``factory="pkg.mod:fn"`` -> (factory, ``"pkg.mod:fn"``); ``name="timm:vit_b"`` ->
    (timm, ``"vit_b"``); ``name="resnet50"`` -> (torchvision, ``"resnet50"``). A name
    whose prefix is no registered kind, or ``model.kwargs`` with a key the kind refuses
    (:attr:`ModelKind.refused_kwargs`), is one :class:`~featcache.errors.ConfigError`.
    """
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
    api = (
        "; featcache.extract takes any model, with a dataset of tokenised dicts"
        if model.factory is not None
        else ""
    )
    return ConfigError(
        f"model {named} takes images; text data needs a text model: "
        f"hf:<text model or dual encoder> or open_clip:<architecture>{api}"
    )


def _get(name: str, field: str) -> ModelKind:
    kind = _KINDS.get(name)
    if kind is None:  # only when a caller unregistered a built-in kind
        raise ConfigError(f"{field}: no model kind {name!r} is registered")
    return kind
