"""Local state-dict checkpoints, loaded strictly on top of any model kind's module, only with
``torch.load(weights_only=True)`` (which never unpickles arbitrary objects)."""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcache.errors import ConfigError, first_line
from featcache.util.fingerprints import file_sha256

# Keys under which training scripts commonly nest the state dict in a checkpoint.
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model")


def apply_checkpoint(
    module: nn.Module,
    path: str | os.PathLike,
    strip_prefix: str | None,
    underneath: Mapping[str, Any],
) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``module``; return ``{"source": "checkpoint", "path",
    "sha256"}`` and the other entries of ``underneath``, the kind's identity, unless random
    (a strict load replaced every random weight)."""
    sha256 = load_checkpoint(module, path, strip_prefix)
    identity: dict[str, Any] = {"source": "checkpoint", "path": str(path), "sha256": sha256}
    if underneath.get("source") != "random":
        identity.update((k, v) for k, v in underneath.items() if k not in identity)
    return identity


def load_checkpoint(
    module: nn.Module, path: str | os.PathLike, strip_prefix: str | None = None
) -> str:
    """Load the state dict in file ``path`` (or under one of :data:`STATE_DICT_KEYS`) into
    ``module`` strictly, ``strip_prefix`` (``"module."``) removed from its keys; return the
    file's sha256. Any mismatch is one :class:`ConfigError` line listing a few keys."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint not found: {path}; set model.checkpoint to a local file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise pickled_objects_error(path, exc) from exc
    except (EOFError, RuntimeError, OSError) as exc:
        raise ConfigError(
            f"checkpoint {path} is not a readable torch file: {first_line(exc)}"
        ) from exc

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
            raise ConfigError(
                f"checkpoint {path} does not load into the model: {first_line(exc)}"
            ) from exc
        result = module.load_state_dict({k: state[k] for k in state if k not in wrong}, False)
    found = {
        "tensors of the wrong shape": [
            f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in wrong
        ],
        "missing keys": [k for k in result.missing_keys if k not in wrong],
        "unexpected keys": result.unexpected_keys,
    }
    problems = [_some_keys(keys, what) for what, keys in found.items() if keys]
    if problems:
        hint = "; check model.kwargs (e.g. num_classes) and the architecture" if wrong else ""
        raise ConfigError(
            f"checkpoint {path} does not match the model: {', '.join(problems)}"
            f"{_prefix_hint(stored_keys, own, strip_prefix)}{hint}"
        )
    return file_sha256(path)


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
    """Suggest strip_prefix when every stored key starts with the same ``name.``."""
    note = ""
    if strip_prefix and not any(k.startswith(strip_prefix) for k in keys):
        note = f"; model.strip_prefix {strip_prefix!r} matched no checkpoint key"
        strip_prefix = None
    keys = [k.removeprefix(strip_prefix) for k in keys] if strip_prefix else keys
    first = keys[0].split(".", 1)[0] + "." if keys and "." in keys[0] else ""
    shared = first and all(k.startswith(first) for k in keys)
    if shared and {k.removeprefix(first) for k in keys} & set(own):
        prefix = (strip_prefix or "") + first
        note += f"; all its keys start with {first!r}: set model.strip_prefix: {prefix!r}"
    return note


def pickled_objects_error(path: str | os.PathLike, exc: pickle.UnpicklingError) -> ConfigError:
    """The error of a file ``torch.load(weights_only=True)`` refused: what it holds, and the fix."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    what = f"it contains a pickled {found.group(1)}" if found else "it is not a tensor file"
    return ConfigError(
        f"checkpoint {path} cannot be loaded with torch.load(weights_only=True): {what}. "
        "featcache loads only tensors (weights_only=True) and never unpickles arbitrary "
        "objects; re-save it with torch.save(model.state_dict(), path)"
    )
