"""The stores of a probe run, checked against each other, and the rows each role uses."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import ConfigError
from featcache.store import FeatureStore

Source = str | os.PathLike | FeatureStore


@dataclasses.dataclass
class Splits:
    """The stores of one probe run, checked, with the rows each role uses."""

    stores: dict[str, FeatureStore]  # "train", optionally "val" and "test"
    labels: dict[str, np.ndarray]  # int64 [N] per role
    fit_rows: np.ndarray  # rows of the train store the sweep fits on
    val_rows: np.ndarray | None  # rows of the train store held out; None with a val store
    num_classes: int
    class_names: list[str] | None
    validation: str  # where the validation rows come from, in words

    @classmethod
    def open(
        cls,
        train: Source,
        val: Source | None,
        test: Source | None,
        val_fraction: float | None,
        seed: int,
    ) -> Splits:
        """Open and check the stores; without ``val``, hold out a stratified
        ``val_fraction`` (default 0.2) of ``train``, seeded by ``seed``.

        Raises:
            ConfigError: a val store and a val fraction both, one file in two roles, rows
                without labels, different class names, a single class, sparse labels, or
                a fraction that holds out no rows."""
        if val is not None and val_fraction is not None:
            raise ConfigError("give either a val store or a val fraction, not both")
        given = {"train": train, "val": val, "test": test}
        stores = {role: open_store(source) for role, source in given.items() if source is not None}
        paths: dict[Path, str] = {}
        for role, store in stores.items():
            first = paths.setdefault(store.path.resolve(), role)
            if first != role:
                raise ConfigError(
                    f"the {first} and {role} stores are the same file {store.path}; "
                    "each split must hold its own rows"
                )
        labels = {}
        for role, store in stores.items():
            values = store.labels
            if values is None:
                raise ConfigError(
                    f"the {role} store {store.path} has no labels; a probe needs labelled "
                    "stores (extract from a source with labels)"
                )
            unlabelled = np.flatnonzero(values < 0)
            if len(unlabelled):
                which = (
                    "every row labelled -1 (no label)"
                    if len(unlabelled) == len(values)
                    else f"{len(unlabelled)} of its {len(values)} rows labelled -1 (no label), "
                    f"row {unlabelled[0]} first"
                )
                raise ConfigError(
                    f"the {role} store {store.path} has {which}; a probe needs every row "
                    "labelled: extract the labelled rows alone, or give another store"
                )
            labels[role] = values
        names = stores["train"].class_names
        for role, store in stores.items():
            if store.class_names != names:
                raise ConfigError(
                    f"the train and {role} stores have different class names "
                    f"({_short(names)} vs {_short(store.class_names)}); their labels do not "
                    "mean the same classes"
                )
        present = np.unique(labels["train"])
        if len(present) < 2:
            raise ConfigError(
                f"the train store {stores['train'].path} has only one class ({present[0]}); "
                "a probe needs at least two"
            )
        # The classes the probe can predict come from the fitted splits (and the class
        # names), never from the test labels.
        fitted = np.unique(np.concatenate([labels[r] for r in ("train", "val") if r in labels]))
        num_classes = max(int(fitted[-1]) + 1, len(names or []))
        if num_classes > SPARSE_CLASSES and num_classes > 10 * len(fitted):
            raise ConfigError(
                f"the labels run up to {num_classes - 1} over {len(fitted)} classes, so the "
                f"probe would fit {num_classes} outputs, most of them for classes with no "
                "row; number the classes 0 .. C-1 when extracting"
            )
        val_rows: np.ndarray | None
        if val is None:
            fraction = 0.2 if val_fraction is None else val_fraction
            fit_rows, val_rows = stratified_split(labels["train"], fraction, seed)
            if not len(val_rows):
                raise ConfigError(
                    f"val fraction {fraction} holds out no rows of the {len(fit_rows)}; "
                    "raise it or give a val store"
                )
            validation = f"{fraction:g} of train, stratified (seed {seed})"
        else:
            fit_rows, val_rows = np.arange(len(labels["train"])), None
            validation = f"val store {stores['val'].path}"
        return cls(stores, labels, fit_rows, val_rows, num_classes, names, validation)

    @property
    def y_fit(self) -> np.ndarray:
        """Int64 labels of the rows the sweep fits on."""
        return self.labels["train"][self.fit_rows]

    @property
    def y_val(self) -> np.ndarray:
        """Int64 labels of the validation rows."""
        if self.val_rows is None:
            return self.labels["val"]
        return self.labels["train"][self.val_rows]

    def store_info(self, digests: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Path, rows, fingerprints and weights of every store (null where absent), with
        its ``digests`` entry: the sha256 of the layer's rows."""
        out = {}
        for role, store in self.stores.items():
            attrs = store.attrs
            out[role] = {
                "path": str(store.path),
                "rows": len(store),
                "config_fingerprint": attrs.get("config_fingerprint"),
                "dataset_fingerprint": attrs.get("dataset_fingerprint"),
                "weights": attrs.get("weights"),
            }
            if role in digests:
                out[role]["features_sha256"] = digests[role]
        return out

    def layers(self, layers: str | Sequence[str]) -> list[str]:
        """The layer names ``layers`` means (see :func:`requested_layers`), each checked to
        be in every store with one shape.

        Raises:
            ConfigError: no layer, stores with different layers (for ``"all"``), a layer
                missing from a store, or shapes that differ between stores."""
        stores = self.stores
        names = requested_layers(stores["train"], layers)
        if not names:
            raise ConfigError("no layer given; name one, a comma-separated list, or all")
        if _listed(layers) == ["all"]:
            for role, store in stores.items():
                if set(store.layers) != set(names):
                    raise ConfigError(
                        f"the train and {role} stores have different layers "
                        f"({', '.join(names)} vs {', '.join(store.layers)}); "
                        "probe the layers they share with --layer a,b"
                    )
        for name in names:
            for role, store in stores.items():
                if name not in store.layers:
                    raise ConfigError(
                        f"layer {name!r} is not in the {role} store {store.path}; "
                        f"it holds: {', '.join(store.layers)}"
                    )
            shape = stores["train"].shape(name)
            for role, store in stores.items():
                if store.shape(name) != shape:
                    raise ConfigError(
                        f"layer {name!r} has shape {list(shape)} in the train store but "
                        f"{list(store.shape(name))} in the {role} store {store.path}; the "
                        "stores come from different models or reductions"
                    )
        return names


# Beyond this many outputs, labels must use a tenth of their range at least.
SPARSE_CLASSES = 10_000


def requested_layers(train: Source, layers: str | Sequence[str]) -> list[str]:
    """The layer names ``layers`` means, unchecked: ``"all"`` (the train store's layers),
    a name, a comma-separated list or a sequence of names."""
    names = _listed(layers)
    return open_store(train).layers if names == ["all"] else names


def _listed(layers: str | Sequence[str]) -> list[str]:
    if isinstance(layers, str):
        return [part.strip() for part in layers.split(",") if part.strip()]
    return list(layers)


def open_store(source: Source) -> FeatureStore:
    """``source`` itself when it is a :class:`FeatureStore`, else the store at that path."""
    return source if isinstance(source, FeatureStore) else FeatureStore(source)


def stratified_split(
    labels: np.ndarray, fraction: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of rows into sorted int64 (fit, held-out) row numbers, keeping each
    class's proportion; a class of two rows or more keeps one on each side at least."""
    rng = np.random.default_rng(seed)
    fit, held = [], []
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        take = 0 if len(rows) < 2 else min(max(round(fraction * len(rows)), 1), len(rows) - 1)
        held.append(rows[:take])
        fit.append(rows[take:])
    return np.sort(np.concatenate(fit)), np.sort(np.concatenate(held))


def _short(names: Sequence[str] | None) -> str:
    if names is None:
        return "none"
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
