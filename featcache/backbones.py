"""Build the backbone ``nn.Module`` and its image preprocessing from a :class:`ModelSpec`.

A model comes from one of two places, optionally followed by a local checkpoint:

* ``model.name``: a torchvision model, built with ``torchvision.models.get_model``, with
  ``model.weights`` naming one of its weights enums (torchvision downloads those into the
  torch hub cache the first time, as usual).
* ``model.factory``: ``"package.module:callable"``, imported and called with ``model.kwargs``.
  **This is the only way a config executes code**: featcache imports the named module and
  calls the named callable, so only use configs whose factory you trust.
* ``model.checkpoint``: a state dict file, loaded with ``torch.load(weights_only=True)``,
  which reads tensors and plain containers only and never unpickles arbitrary objects.

:attr:`Backbone.weights` is a JSON-able record of which weights the model holds. It always
has ``"model"`` (the torchvision name or the factory string) and ``"source"``:

* ``"torchvision"``: ``"enum"`` (``"ResNet18_Weights.IMAGENET1K_V1"``) and ``"url"``.
* ``"checkpoint"``: ``"path"`` and ``"sha256"`` of the file; when the checkpoint was loaded
  on top of torchvision weights, also their ``"enum"`` and ``"url"``.
* ``"random"``: ``"seed"``, the seed set right before the model was constructed. A factory
  that loads weights by itself is recorded as ``"random"`` too: featcache cannot see that.
"""

from __future__ import annotations

import difflib
import importlib
import os
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision import transforms as T

from featcache.errors import ConfigError, FeatcacheError
from featcache.fingerprints import file_sha256
from featcache.spec import ModelSpec, PreprocessSpec
from featcache.validation import check

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INTERPOLATIONS = {
    "bilinear": T.InterpolationMode.BILINEAR,
    "bicubic": T.InterpolationMode.BICUBIC,
    "nearest": T.InterpolationMode.NEAREST,
}

# Keys under which training scripts commonly nest the state dict in a checkpoint.
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model")


@dataclass
class Backbone:
    """A model ready for feature extraction, with the preprocessing its weights expect."""

    model: nn.Module  # in eval() mode, on CPU
    transform: Callable[[Image.Image], torch.Tensor]  # PIL RGB -> float32 [3, H, W]
    weights: dict[str, Any]  # JSON-able identity of the weights (see the module docstring)
    decode_size: int | None = None  # shorter side ``transform`` resizes to first, if any


def build_backbone(model: ModelSpec, preprocess: PreprocessSpec, seed: int = 0) -> Backbone:
    """Build the model described by ``model`` and the transform described by ``preprocess``.

    ``torch.manual_seed(seed)`` is called right before the model is constructed, so a
    randomly initialised model is the same for the same seed. With no explicit
    ``preprocess`` and torchvision weights, the transform is the weights' own
    ``transforms()``; otherwise it is :func:`build_transform`.
    """
    check(model, "model")
    enum = resolve_weights(model.name, model.weights) if model.name is not None else None
    # Built before the model so that a bad option fails before any download.
    if enum is not None and not preprocess.is_set():
        transform = enum.transforms()
        decode_size = _first(getattr(transform, "resize_size", None))
    else:
        transform = build_transform(preprocess)
        decode_size = preprocess.resize

    if model.name is not None:
        net = _build_torchvision(model.name, enum, model.kwargs, seed)
    else:
        assert model.factory is not None
        net = _call_factory(model.factory, import_factory(model.factory), model.kwargs, seed)

    identity: dict[str, Any] = {"model": model.name or model.factory}
    if model.checkpoint is not None:
        sha256 = load_checkpoint(net, model.checkpoint, model.strip_prefix)
        identity.update(source="checkpoint", path=str(model.checkpoint), sha256=sha256)
        if enum is not None:
            identity.update(enum=_enum_id(enum), url=enum.url)
    elif enum is not None:
        identity.update(source="torchvision", enum=_enum_id(enum), url=enum.url)
    else:
        identity.update(source="random", seed=seed)
    return Backbone(net.cpu().eval(), transform, identity, decode_size)


def resolve_weights(name: str, weights: str | None) -> torchvision.models.WeightsEnum | None:
    """The weights enum member of torchvision model ``name`` called ``weights``.

    ``weights`` is a member name (``"IMAGENET1K_V2"``, ``"DEFAULT"``) or the full form
    (``"ResNet50_Weights.IMAGENET1K_V2"``); ``None`` gives ``None``. Resolving downloads
    nothing.
    """
    _check_model_name(name)
    if weights is None:
        return None
    enum_cls = torchvision.models.get_model_weights(name)
    cls_name, dot, member = weights.rpartition(".")
    if dot and cls_name != enum_cls.__name__:
        raise ConfigError(
            f"model.weights {weights!r} are not weights of {name}; "
            f"its weights are {enum_cls.__name__}.<name>"
        )
    available = list(enum_cls.__members__)
    if member not in available:
        close = difflib.get_close_matches(member, available, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            f"unknown weights {weights!r} for {name}{hint}; available: {', '.join(available)}"
        )
    return enum_cls[member]


def build_transform(preprocess: PreprocessSpec) -> Callable[[Image.Image], torch.Tensor]:
    """Resize (shorter side) -> CenterCrop -> float32 in [0, 1] -> Normalize, as configured.

    Resize and crop are skipped when null; mean/std default to ImageNet's. The result maps
    a PIL RGB image to a float32 tensor [3, H, W] and is picklable (for DataLoader workers).
    """
    interpolation = INTERPOLATIONS.get(preprocess.interpolation)
    if interpolation is None:
        raise ConfigError(
            f"preprocess.interpolation is {preprocess.interpolation!r}; "
            f"choose one of: {', '.join(INTERPOLATIONS)}"
        )
    steps: list[Callable[..., Any]] = []
    if preprocess.resize is not None:
        steps.append(T.Resize(preprocess.resize, interpolation=interpolation, antialias=True))
    if preprocess.crop is not None:
        steps.append(T.CenterCrop(preprocess.crop))
    mean = preprocess.mean if preprocess.mean is not None else IMAGENET_MEAN
    std = preprocess.std if preprocess.std is not None else IMAGENET_STD
    steps += [T.ToTensor(), T.Normalize(list(mean), list(std))]
    return T.Compose(steps)


def load_checkpoint(
    module: nn.Module, path: str | os.PathLike, strip_prefix: str | None = None
) -> str:
    """Load the state dict in file ``path`` into ``module`` (strictly); return its sha256.

    The file holds a state dict, or a dict with one under ``"state_dict"``,
    ``"model_state_dict"`` or ``"model"``. ``strip_prefix`` is removed from the start of
    every key that has it (``"module."`` for checkpoints saved from ``DataParallel``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint not found: {path}; set model.checkpoint to a local file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        what = f"it contains a pickled {found.group(1)}" if found else "it is not a tensor file"
        raise ConfigError(
            f"checkpoint {path} cannot be loaded with torch.load(weights_only=True): {what}. "
            "featcache loads only tensors (weights_only=True) and never unpickles arbitrary "
            "objects; re-save it with torch.save(model.state_dict(), path)"
        ) from exc
    except (EOFError, RuntimeError, OSError) as exc:
        raise ConfigError(f"checkpoint {path} is not a readable torch file: {exc}") from exc

    state = _find_state_dict(obj, path)
    stored_keys = list(state)
    if strip_prefix:
        state = {k.removeprefix(strip_prefix): v for k, v in state.items()}
    own = module.state_dict()
    # strict=False plus our own check of what it reports is exactly strict=True, with a
    # one-line message instead of torch's multi-line one.
    wrong: list[str] = []
    try:
        result = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # tensors of the wrong shape; load the rest to list the keys
        wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
        if not wrong:
            raise ConfigError(f"checkpoint {path} does not load into the model: {exc}") from exc
        result = module.load_state_dict({k: state[k] for k in state if k not in wrong}, False)
    missing = [k for k in result.missing_keys if k not in wrong]
    problems = [
        _some_keys(keys, what)
        for keys, what in (
            (
                [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in wrong],
                "tensors of the wrong shape",
            ),
            (missing, "missing keys"),
            (result.unexpected_keys, "unexpected keys"),
        )
        if keys
    ]
    if problems:
        hint = "; check model.kwargs (e.g. num_classes) and the architecture" if wrong else ""
        raise ConfigError(
            f"checkpoint {path} does not match the model: {', '.join(problems)}"
            f"{_prefix_hint(stored_keys, own, strip_prefix)}{hint}"
        )
    return file_sha256(path)


def import_factory(target: str) -> Callable[..., nn.Module]:
    """Import ``"package.module:callable"`` (dotted attributes after the colon allowed)."""
    module_name, colon, attr_path = target.partition(":")
    if not colon or not module_name or not attr_path:
        raise ConfigError(f"model.factory {target!r} must look like 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model.factory {target!r}: cannot import {module_name} ({exc}); "
            "install it or put its folder on PYTHONPATH"
        ) from exc
    for depth, attr in enumerate(attr_path.split(".")):
        if not hasattr(obj, attr):
            where = ".".join([module_name, *attr_path.split(".")[:depth]])
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(attr, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"model.factory {target!r}: {where} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ConfigError(
            f"model.factory {target!r} is a {type(obj).__name__}, not callable; "
            "name a function or class that returns an nn.Module"
        )
    return obj


def _first(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if len(value) == 1 else None
    return int(value) if isinstance(value, int) else None


def _check_model_name(name: str) -> None:
    names = torchvision.models.list_models()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown torchvision model {name!r}{hint} "
            "(torchvision.models.list_models() lists them all)"
        )


def _build_torchvision(
    name: str, enum: torchvision.models.WeightsEnum | None, kwargs: dict[str, Any], seed: int
) -> nn.Module:
    torch.manual_seed(seed)
    try:
        return torchvision.models.get_model(name, weights=enum, **kwargs)
    except (TypeError, ValueError) as exc:  # torchvision rejects kwargs with either
        raise ConfigError(f"model.kwargs {kwargs} rejected by torchvision's {name}: {exc}") from exc
    except OSError as exc:  # urllib's URLError is an OSError
        raise FeatcacheError(
            f"could not download {_enum_id(enum)} from {getattr(enum, 'url', '?')} ({exc}); "
            f"check the network, or put the file in {torch.hub.get_dir()}/checkpoints"
        ) from exc


def _call_factory(
    target: str, factory: Callable[..., Any], kwargs: dict[str, Any], seed: int
) -> nn.Module:
    torch.manual_seed(seed)
    try:
        net = factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"model.factory {target!r} failed with model.kwargs {kwargs}: {exc}; "
            "make model.kwargs match its parameters"
        ) from exc
    if not isinstance(net, nn.Module):
        raise ConfigError(
            f"model.factory {target!r} returned a {type(net).__name__}, not a torch.nn.Module; "
            "name a callable that builds the model"
        )
    return net


def _enum_id(enum: Any) -> str:
    return f"{type(enum).__name__}.{enum.name}"


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def _find_state_dict(obj: Any, path: Path) -> Mapping[str, torch.Tensor]:
    if _is_state_dict(obj) and obj:
        return obj
    if isinstance(obj, Mapping):
        for key in STATE_DICT_KEYS:
            if _is_state_dict(obj.get(key)):
                return obj[key]
        keys = ", ".join(map(str, list(obj)[:8]))
        raise ConfigError(
            f"checkpoint {path} holds no state dict: expected a mapping of names to tensors, "
            f"or one under {', '.join(STATE_DICT_KEYS)}; its keys are: {keys}"
        )
    raise ConfigError(
        f"checkpoint {path} holds a {type(obj).__name__}, not a state dict; "
        "save it with torch.save(model.state_dict(), path)"
    )


def _some_keys(keys: list[str], what: str, shown: int = 3) -> str:
    more = ", ..." if len(keys) > shown else ""
    return f"{len(keys)} {what} ({', '.join(keys[:shown])}{more})"


def _prefix_hint(keys: list[str], own: Mapping[str, Any], strip_prefix: str | None) -> str:
    """Suggest strip_prefix when every checkpoint key starts with the same ``name.``.

    ``keys`` are the checkpoint's keys as stored, before any prefix was stripped.
    """
    if strip_prefix and not any(k.startswith(strip_prefix) for k in keys):
        note = f"; model.strip_prefix {strip_prefix!r} matched no checkpoint key"
        strip_prefix = None
    else:
        note = ""
    keys = [k.removeprefix(strip_prefix) for k in keys] if strip_prefix else keys
    first = keys[0].split(".", 1)[0] + "." if keys and "." in keys[0] else ""
    shared = first and all(k.startswith(first) for k in keys)
    if shared and {k.removeprefix(first) for k in keys} & set(own):
        prefix = (strip_prefix or "") + first
        note += f"; all its keys start with {first!r}: set model.strip_prefix: {prefix!r}"
    return note
