"""What decides a store's contents: the config fingerprint, the store key, library versions."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import platform
from collections.abc import Mapping
from typing import Any

from featcache.config.spec import Spec, to_dict

# The store layout's version (the featcache_format attribute, and in the key): 2 added
# Fletcher-32 checksums and attribute digests, 3 unfiltered chunks allocated at creation,
# an XXH3 checksum per chunk (docs/store-format.md). Newer stores are refused.
FORMAT_VERSION = 3

# Config keys that do not change what a store contains (None: the whole section).
CONTENT_FREE_KEYS: dict[str, tuple[str, ...] | None] = {
    "output": None,
    "runtime": ("progress",),
    # Whether a repository's own code may run; the weights identity records what was read.
    "model": ("trust_remote_code",),
    # on_error only decides which rows are left out, and the store lists those; so a run
    # stopped by a bad sample can be resumed with on_error=skip.
    "loader": ("num_workers", "pin_memory", "on_error"),
    # Checksums guard the stored bytes without changing them.
    "store": ("checksum",),
    # How to reach remote data (endpoint, profile); the dataset fingerprint records what
    # was read (the objects' URLs and ETags).
    "data": ("storage_options",),
}


# Keys added after stores were first written, with the value that reproduces the older
# stores, counted only when set otherwise: an older store's fingerprint stays the same.
LATER_KEYS: dict[str, dict[str, Any]] = {
    "data": {
        "image_column": None,
        "text_column": None,
        "label_column": None,
        "id_column": None,
        "max_length": None,
        "class_names": None,
        "limit": None,
        "storage_options": {},
    },
    # Older stores decoded JPEGs at reduced scale whenever the preprocessing resized them.
    "loader": {"bucket_by_length": False, "decode": "fast"},
}
LATER_LAYER_KEYS: dict[str, Any] = {"layout": None}  # the same, for each entry of layers


def config_fingerprint(spec: Spec) -> str:
    """sha256 of the canonical JSON of every config key that decides the stored values."""
    text = json.dumps(content_config(to_dict(spec)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def content_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a config (a :func:`~featcache.config.spec.to_dict`) that decides the
    stored values: what :func:`config_fingerprint` hashes."""
    data = json.loads(json.dumps(config))
    for section, keys in CONTENT_FREE_KEYS.items():
        if keys is None:
            data.pop(section, None)
        else:
            for key in keys:
                data.get(section, {}).pop(key, None)
    for section, defaults in LATER_KEYS.items():
        for key, default in defaults.items():
            if data.get(section, {}).get(key, default) == default:
                data.get(section, {}).pop(key, None)
    if not data.get("models"):  # added later too: a store's config is of one model
        data.pop("models", None)
    for layer in data.get("layers", []):
        for key, default in LATER_LAYER_KEYS.items():
            if isinstance(layer, dict) and layer.get(key, default) == default:
                layer.pop(key, None)
    return data


def recorded_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config as a store recorded it, with the keys it predates (:data:`LATER_KEYS`,
    :data:`LATER_LAYER_KEYS`) set to the values it was made under."""
    data = json.loads(json.dumps(config))
    for section, later in LATER_KEYS.items():
        if isinstance(data.get(section), dict):
            for key, value in later.items():
                data[section].setdefault(key, value)
    return data


def config_differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The dotted keys (``preprocess.resize``, ``layers``) whose values differ between two
    configs, in the part that decides the stored values; sorted."""

    def flat(data: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(data, Mapping):
            return {prefix: data}
        found: dict[str, Any] = {}
        for key, value in data.items():
            found.update(flat(value, f"{prefix}{key}."))
        return found

    mine, theirs = flat(content_config(current)), flat(content_config(stored))
    return sorted(k.rstrip(".") for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def key_difference(
    key: str,
    stored: Mapping[str, Any],
    current: Mapping[str, Any],
    stored_config: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
) -> str:
    """What differs between a stored store key and this run's at ``key``, in words: for
    the config fingerprint, the config keys themselves when both configs are known."""
    keys = []
    if key == "config_fingerprint" and stored_config and config is not None:
        keys = config_differences(stored_config, config)
    if not keys:
        what = f"its {key.replace('_', ' ')} differs from this run's"
        return f"{what} ({short_value(stored.get(key))} vs {short_value(current.get(key))})"
    named = (
        " and ".join(keys) if len(keys) <= 2 else f"{keys[0]}, {keys[1]} and {len(keys) - 2} more"
    )
    before, now = (short_value(value_at(side, keys[0])) for side in (stored_config, config))
    return f"its config differs from this run's at {named} ({before} vs {now})"


def value_at(config: Any, dotted: str) -> Any:
    """The value at a dotted key of a config (None when absent)."""
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, Mapping) else None
    return config


def short_value(value: Any) -> str:
    """``value`` as text (JSON unless a string), its middle cut out past 40 characters."""
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:16] + "..." + text[-8:]


@dataclasses.dataclass(frozen=True)
class StoreKey:
    """The settings that decide a store's bytes (its ``resume_key`` attribute): a run resumes,
    skips, combines or verifies a store by it, as equal keys make equal stores. ``rows`` is
    the block of source positions the file holds."""

    config_fingerprint: str | None
    weights: Any
    dataset_fingerprint: str
    source_rows: int
    rows: tuple[int, int]
    taps: tuple[Mapping[str, Any], ...]
    store_dtype: str
    chunk_rows: int | None
    compression: str | None
    batch_size: int
    on_nonfinite: str
    layout: Mapping[str, Any]
    world_size: int | None = None
    featcache_format: int = FORMAT_VERSION
    # The model's token layout, when it declares one: {"prefix_tokens", "sequence_first"}.
    tokens: Mapping[str, Any] | None = None
    # Rows per window of length-bucketed batches (loader.bucket_by_length), when bucketed.
    bucket_window: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data as stored; ``world_size``, ``tokens``, ``bucket_window`` if set."""
        data = json.loads(json.dumps(dataclasses.asdict(self)))
        for optional in ("world_size", "tokens", "bucket_window"):
            if data[optional] is None:
                data.pop(optional)
        return data

    def differences(self, stored: Mapping[str, Any] | None) -> list[str]:
        """Names of the entries where a stored key differs from this one (all if None)."""
        mine = self.to_json()
        if stored is None:
            return sorted(mine)
        return [k for k in sorted(set(stored) | set(mine)) if stored.get(k) != mine.get(k)]

    def matches(self, stored: Mapping[str, Any] | None) -> bool:
        """Whether a finished store made under ``stored`` holds what this key would write
        (a readable older format counts: only its layout differs)."""
        if stored is None:
            return False
        older = stored.get("featcache_format") in range(1, FORMAT_VERSION)
        return self.differences(stored) in ([], ["featcache_format"] if older else [])


def store_attributes(
    key: StoreKey,
    provenance: Mapping[str, Any],
    *,
    device: str,
    class_names: list[str] | None = None,
) -> dict[str, Any]:
    """The file attributes of a new store: ``provenance``, the key and what it holds,
    library versions, device and time."""
    attrs = {
        **provenance,
        "weights": key.weights,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "versions": library_versions(),
        "device": device,
        "layout": dict(key.layout),
        "dataset_fingerprint": key.dataset_fingerprint,
        "store_dtype": key.store_dtype,
        "taps": [dict(tap) for tap in key.taps],
        "resume_key": key.to_json(),
    }
    if class_names is not None:
        attrs["class_names"] = class_names
    return attrs


def library_versions() -> dict[str, str]:
    """Versions of everything that can change a stored value, for the store's attributes."""
    import h5py
    import numpy as np
    import torch
    import torchvision

    from featcache import __version__

    return {
        "featcache": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
