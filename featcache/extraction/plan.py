"""The plan of an extraction: everything decided before the first batch.

`make_plan` checks a model, a dataset and the layers asked for and returns an
`ExtractionPlan`, which every run of featcache executes (`featcache.extraction.run`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from featcache.capture.reduce import ReduceContext, token_layout
from featcache.capture.runtime import Layout, choose_layout
from featcache.capture.selectors import Tap, resolve_taps, tap_record
from featcache.config.spec import (
    UPDATE_AND_OVERWRITE,
    LayerSpec,
    LoaderSpec,
    RuntimeSpec,
    StoreSpec,
)
from featcache.config.validation import build
from featcache.errors import ConfigError
from featcache.extraction.batches import check_inputs, first_sample, source_length, token_lengths
from featcache.extraction.bucketing import WINDOW_BATCHES
from featcache.extraction.dataset_info import dataset_classes, dataset_ids
from featcache.extraction.grid import GridBatches, shard_starts
from featcache.sources.stamps import change_report, changed_rows
from featcache.store import FeatureStore, ResumePoint, StorePlan, StoreWriter
from featcache.store.provenance import StoreKey, store_attributes
from featcache.util.fingerprints import ids_fingerprint, module_fingerprint

_SECTIONS = {"loader": LoaderSpec, "store": StoreSpec, "runtime": RuntimeSpec}
_RUN_KEYS = ("overwrite", "update")  # options of the run itself, outside the sections
# What a store's rows are, in the plural, for its speed (``row_unit``: "texts/s").
ROW_UNITS = {"img": "images", "text": "texts", "sample": "samples"}


@dataclasses.dataclass
class RunOptions:
    """Options of one extraction, grouped as in the config's sections."""

    loader: LoaderSpec = dataclasses.field(default_factory=LoaderSpec)
    store: StoreSpec = dataclasses.field(default_factory=StoreSpec)
    runtime: RuntimeSpec = dataclasses.field(default_factory=RuntimeSpec)
    overwrite: bool = False
    update: bool = False  # compute only what the complete store lacks (extraction.update)

    def __post_init__(self) -> None:
        if self.overwrite and self.update:
            raise ConfigError(UPDATE_AND_OVERWRITE)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RunOptions:
        """Build from flat keyword arguments named like the config keys (``batch_size=...``)."""
        owner = {f.name: name for name, kind in _SECTIONS.items() for f in dataclasses.fields(kind)}
        unknown = sorted(set(kwargs) - set(owner) - set(_RUN_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown option {unknown[0]!r}; known options: overwrite, update, "
                + ", ".join(sorted(owner))
            )
        raw: dict[str, Any] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            if key in _RUN_KEYS:
                raw[key] = value
            else:
                raw[owner[key]][key] = value
        return build(cls, raw)

    def replaced(self, **changes: Any) -> RunOptions:
        """These options with the config keys ``changes`` (``dtype=...``) set anew, checked
        as `from_kwargs` checks them."""
        return RunOptions.from_kwargs(**{**self.to_kwargs(), **changes})

    def to_kwargs(self) -> dict[str, Any]:
        """The flat keyword arguments `from_kwargs` takes for these options."""
        flat: dict[str, Any] = {"overwrite": self.overwrite, "update": self.update}
        for name in _SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat


@dataclasses.dataclass
class ExtractionPlan:
    """What a run computes, decided before its first batch.

    ``model`` runs over the source positions ``rows`` of ``dataset``; ``ids`` are those
    of every source row, ``key`` makes the store key on first call (the weights may
    still be being fingerprinted), ``tokens`` is the model's token layout for the
    reductions.
    """

    model: nn.Module
    dataset: Dataset
    options: RunOptions
    taps: list[Tap]
    ids: Sequence[str]
    rows: range
    has_labels: bool
    class_names: list[str] | None
    layout: Layout
    key: Callable[[], StoreKey]
    tokens: ReduceContext
    provenance: Mapping[str, Any]
    # [source rows] tokens per row, for per-token rows and bucketing (None: not needed)
    row_tokens: np.ndarray | None = None
    bucket_window: int | None = None  # rows per window of length-bucketed batches
    unit: str = "img"  # what the progress bar counts
    shard_starts: list[int] = dataclasses.field(default_factory=list)  # batches restart there
    # [source rows] each row's change stamp, taken when the run starts (None: none known)
    stamps: np.ndarray | None = dataclasses.field(default=None, compare=False)

    def for_rows(self, rows: range) -> ExtractionPlan:
        """This plan over the source positions ``rows`` instead (a shard's block), its
        store key naming them; nothing of the source is read again."""
        key = self.key
        return dataclasses.replace(
            self, rows=rows, key=lambda: dataclasses.replace(key(), rows=(rows.start, rows.stop))
        )

    @functools.cached_property
    def ids_width(self) -> int:
        """Bytes of the longest sample id in UTF-8 (at least 1): the width of ``/ids``."""
        return max((len(str(i).encode()) for i in self.ids), default=1)

    @property
    def token_capacity(self) -> int | None:
        """The tokens of the store's rows, which per-token layers are sized for."""
        if self.row_tokens is None:
            return None
        return int(self.row_tokens[self.rows.start : self.rows.stop].sum())

    @property
    def hashes_content(self) -> bool:
        """Whether the run's config asks for samples to be known by their bytes too."""
        config = self.provenance.get("config") or {}
        return bool((config.get("data") or {}).get("content_hash"))

    def grid(self, rows: range | None = None) -> GridBatches:
        """The batches of ``rows`` (default: the plan's) on the run's grid, as positions
        into ``rows``: length-bucketed windows when bucketing is on."""
        rows = self.rows if rows is None else rows
        lengths = None
        if self.bucket_window is not None:
            assert self.row_tokens is not None  # counted whenever bucketing is on
            lengths = self.row_tokens[rows.start : rows.stop]
        size = self.options.loader.batch_size
        return GridBatches(rows, size, self.shard_starts, lengths, self.bucket_window)

    def writer(
        self,
        path: Path,
        mark: Mapping[str, Any] | None = None,
        resume: ResumePoint | None = None,
    ) -> Callable[[], StoreWriter]:
        """What opens the writer of the plan's store at ``path``, on the writer thread.
        ``mark`` adds entries to the recorded store key (an update's); ``resume``
        continues a partial store."""

        def open_writer() -> StoreWriter:
            key = self.key()
            attrs = store_attributes(
                key, self.provenance, device=str(self.layout.device), class_names=self.class_names
            )
            if mark:
                attrs["resume_key"] = {**key.to_json(), **mark}
            store = self.options.store
            return StoreWriter(
                StorePlan(
                    path,
                    len(self.rows),
                    ids_width=self.ids_width,
                    dtype=store.dtype,
                    compression=store.compression,
                    chunk_rows=store.chunk_rows,
                    checksum=store.checksum,
                    has_labels=self.has_labels,
                    attrs=attrs,
                    token_capacity=self.token_capacity,
                    stamps=self.stamps,
                ),
                resume,
            )

        return open_writer

    def changes_since(self, index: np.ndarray, stamps: np.ndarray | None) -> str:
        """The rows (source positions ``index``, recorded with ``stamps``) whose change
        stamp differs from the plan's, named; "" when none does, when either side has no
        stamps, or when content hashes decide instead (``data.content_hash``)."""
        if stamps is None or self.stamps is None or self.hashes_content:
            return ""
        current = self.stamps[index]
        changed = changed_rows(stamps, current)
        if not len(changed):
            return ""
        ids = [str(self.ids[i]) for i in index[changed]]
        return change_report(changed.tolist(), ids, stamps[changed], current[changed])

    def stale_rows(self, path: Path) -> str:
        """The rows of the complete store at ``path`` that `changes_since` names."""
        if self.stamps is None or self.hashes_content:
            return ""
        with FeatureStore(path) as store:
            return self.changes_since(store.index, store.stamps)


def check_unique(ids: Sequence[str]) -> None:
    """Refuse ids that repeat: a row is found, resumed and verified by its id.

    Raises:
        ConfigError: naming the first repeated id and the two rows that have it.
    """
    if len(set(map(str, ids))) == len(ids):
        return
    first_row: dict[str, int] = {}
    for row, sample_id in enumerate(ids):
        earlier = first_row.setdefault(str(sample_id), row)
        if earlier != row:
            raise ConfigError(
                f"id {sample_id!r} is given to rows {earlier} and {row}; every row needs its "
                "own id (list each image once, or pass distinct ids)"
            )


def make_plan(
    model: nn.Module,
    dataset: Dataset,
    layers: Iterable[LayerSpec | str | Mapping[str, Any]] | str,
    options: RunOptions,
    *,
    ids: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    provenance: Mapping[str, Any] | None = None,
    dataset_fingerprint: str | None = None,
    rows: range | None = None,
    prefix_tokens: int | None = None,
    sequence_first: bool = False,
) -> ExtractionPlan:
    """Check the arguments of `featcache.extraction.api.extract` and decide what its
    run will do.

    Raises:
        ConfigError: one line naming the argument that cannot be used, and the fix.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model must be a torch.nn.Module, got {type(model).__name__} {model!r:.40}; to "
            "name a model, use featcache.extract_from_config with model.name"
        )
    tokens = token_layout(model, prefix_tokens, sequence_first)
    taps = resolve_taps(model, layers)  # type: ignore[arg-type]
    num_rows = source_length(dataset)
    if num_rows == 0:
        raise ConfigError(
            f"the dataset ({type(dataset).__name__}) has no rows, so there is nothing to "
            "extract; check its files or arguments"
        )
    if ids is None:
        ids = dataset_ids(dataset)
    if ids is None:
        ids = [f"{type(dataset).__name__}:{i}" for i in range(num_rows)]
    if len(ids) != num_rows:
        raise ConfigError(f"{len(ids)} ids given for a dataset of {num_rows} rows")
    check_unique(ids)
    if isinstance(class_names, str):
        raise ConfigError(f"class_names must be a list of names, got the string {class_names!r}")
    rows = range(num_rows) if rows is None else rows
    if not isinstance(rows, range):
        raise ConfigError(f"rows must be a range of source positions, got {type(rows).__name__}")
    if rows.step != 1 or not rows or rows.start < 0 or rows.stop > num_rows:
        raise ConfigError(f"rows must be a non-empty range within the {num_rows} source rows")
    if class_names is None:
        class_names = dataset_classes(dataset)
    has_labels = getattr(dataset, "has_labels", None)
    first = first_sample(dataset, rows)
    row_tokens = bucket_window = None
    tokenised = first is not None and isinstance(first[0], Mapping)
    if first is not None:
        check_inputs(model, first[0])
        if has_labels is None:
            has_labels = first[1] is not None
    if options.loader.bucket_by_length:
        if not tokenised:
            raise ConfigError(
                "loader.bucket_by_length groups token inputs of similar lengths; this "
                "dataset's items are not mappings of token tensors, so turn it off"
            )
        bucket_window = options.loader.batch_size * WINDOW_BATCHES
    if tokenised and (bucket_window or any(tap.reduce == "none" for tap in taps)):
        row_tokens = token_lengths(dataset)
    layout = choose_layout(model, options.runtime)
    weights = (provenance or {}).get("weights")
    key_parts = dict(
        config_fingerprint=(provenance or {}).get("config_fingerprint"),
        dataset_fingerprint=dataset_fingerprint or ids_fingerprint(ids),
        source_rows=num_rows,
        rows=(rows.start, rows.stop),
        taps=tuple(tap_record(tap) for tap in taps),
        store_dtype=options.store.dtype,
        chunk_rows=options.store.chunk_rows,
        compression=options.store.compression,
        batch_size=options.loader.batch_size,
        on_nonfinite=options.store.on_nonfinite,
        layout=layout.describe(),
        tokens=None
        if tokens.prefix_tokens is None and not tokens.sequence_first
        else {"prefix_tokens": tokens.prefix_tokens, "sequence_first": tokens.sequence_first},
        bucket_window=bucket_window,
    )
    made: list[StoreKey] = []

    def key() -> StoreKey:
        # Made from Python, the weights are identified by their values, hashed on first need
        # (on the writer thread, during the first batches, unless a store is checked first).
        if not made:
            identity = weights or {"source": "module", "sha256": module_fingerprint(model)}
            made.append(StoreKey(weights=identity, **key_parts))  # type: ignore[arg-type]
        return made[0]

    return ExtractionPlan(
        model=model,
        dataset=dataset,
        options=options,
        taps=taps,
        ids=ids,
        rows=rows,
        has_labels=True if has_labels is None else bool(has_labels),
        class_names=None if class_names is None else [str(n) for n in class_names],
        layout=layout,
        key=key,
        tokens=tokens,
        provenance=dict(provenance or {}),
        row_tokens=row_tokens,
        bucket_window=bucket_window,
        unit=_unit(first[0] if first is not None else None),
        shard_starts=shard_starts(dataset),
    )


# make_plan's own keyword arguments, among those of extract (the others: run options)
PLAN_ARGUMENTS = (
    "ids", "class_names", "provenance", "dataset_fingerprint", "rows", "prefix_tokens",
    "sequence_first",
)  # fmt: skip


def _unit(value: Any) -> str:
    """What one row is, for the progress bar: an image, a text, or a sample."""
    if isinstance(value, torch.Tensor) and value.dim() == 3:
        return "img"
    return "text" if isinstance(value, Mapping) and "input_ids" in value else "sample"
