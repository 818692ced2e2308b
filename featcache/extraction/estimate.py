"""Sizing a store before its run, and the check that the disk has room."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from featcache.errors import FeatcacheError
from featcache.extraction.dry_run import DryRun, LayerSize, dry_run
from featcache.extraction.plan import ExtractionPlan
from featcache.extraction.run import recompute
from featcache.store import codec
from featcache.store.layout import META_BLOCK_BYTES, chunk_rows_for
from featcache.store.merge import compressed_bytes
from featcache.store.paths import partial_path
from featcache.util.files import require_space

SIZING_ROWS = 8  # rows tried, one at a time, until one reads (the others may be skipped)
# Attribute text besides the provenance and the class names: the store key, library
# versions, layout, timings (about 1.5 KiB in the demo stores).
OTHER_ATTRS_BYTES = 1536
# How to run anyway when the check refuses, from the command line and from Python.
GO_AHEAD = "pass --ignore-free-space (check_space=False from Python)"
# HDF5's own bytes in a store, measured on stores written by StoreWriter: the superblock
# and root group, and per chunked dataset its object header (shape, type, featcache's
# attributes) and its chunk index (version-1 B-tree nodes of 64 entries).
FILE_METADATA_BYTES = 2400
DATASET_METADATA_BYTES = 800
BTREE_ENTRIES = 64
CHECKSUM_BYTES = 8  # one XXH3-64 per chunk, in /checksums/<dataset>
# Rows, spread over a run's rows, computed and compressed to predict its compressed store
COMPRESSION_SAMPLE_ROWS = 32


@dataclasses.dataclass(frozen=True)
class StoreEstimate:
    """What one store will take: ``bytes`` on disk once finished (uncompressed), and
    for each layer its shape per row (per token) and the bytes of its values; with
    ``compression``, ``compressed``: the predicted bytes of the compressed store, where
    predicted (`with_compressed_size`)."""

    path: Path
    rows: int
    tokens: int | None  # the tokens of per-token layers (None without any)
    layers: tuple[LayerSize, ...]
    layer_bytes: dict[str, int]
    bytes: int
    compression: str | None
    compressed: int | None = None
    # room left in the writer's whole metadata blocks, counted in ``bytes``: a file written
    # whole (a compressed copy) has none
    metadata_slack: int = 0

    def needed(self, overwrite: bool) -> int:
        """Bytes the run still has to find free: the finished store, less what its
        partial store already holds when the run resumes it (a torchrun rank's store is
        its shard), plus room for the compressed copy (written beside it, at most as
        large) when the store is compressed."""
        written = 0 if overwrite else bytes_on_disk(partial_path(self.path))
        copy = self.bytes if self.compression is not None else 0
        return max(self.bytes - written, 0) + copy


def estimate_store(plan: ExtractionPlan, path: Path) -> StoreEstimate:
    """The size of the store a run of ``plan`` writes at ``path``, from one row through
    the hooked forward; nothing is written."""
    seen = sized_rows(plan)
    store = plan.options.store
    rows = len(plan.rows)
    tokens = plan.token_capacity if any(s.per_token for s in seen.layers.values()) else None
    columns = getattr(plan.dataset, "row_columns", None) or {}
    attrs = json.dumps(dict(plan.provenance), default=str) + json.dumps(plan.class_names)
    layers = tuple(seen.layers.values())
    sized = functools.partial(
        store_bytes,
        rows,
        layers,
        ids_width=plan.ids_width,
        has_labels=plan.has_labels,
        tokens=tokens,
        token_ids=seen.token_ids,
        chunk_rows=store.chunk_rows,
        checksum=store.checksum,
        row_column_bytes=sum(np.asarray(column).dtype.itemsize for column in columns.values()),
        attrs_bytes=len(attrs.encode()) + OTHER_ATTRS_BYTES,
    )
    total = sized()
    per_layer = {}
    for layer in layers:
        length = max(tokens or 0, 1) if layer.per_token else rows
        chunk = layer_chunk_rows(layer, length, store.chunk_rows)
        per_layer[layer.key] = dataset_bytes(length, chunk, layer.item_bytes, checksum=False)
    slack = total - sized(whole_blocks=False)
    return StoreEstimate(
        path, rows, tokens, layers, per_layer, total, store.compression, metadata_slack=slack
    )


def with_compressed_size(plan: ExtractionPlan, estimate: StoreEstimate) -> StoreEstimate:
    """``estimate`` (of ``plan``'s store) with ``compressed`` predicted when the store is
    compressed: each layer's bytes scaled by the ratio a sample of its rows gets, the
    other datasets counted uncompressed (so it errs on the large side). ``estimate`` as
    it is when the store is not compressed or no sample row could be read."""
    if estimate.compression is None:
        return estimate
    ratios = compression_ratios(plan, estimate, estimate.compression)
    if not ratios:
        return estimate
    saved = float(estimate.metadata_slack)
    for layer in estimate.layers:
        compressed = ratios.get(layer.key, 1.0) * _entries(estimate, layer) * layer.item_bytes
        saved += estimate.layer_bytes[layer.key] - compressed
    return dataclasses.replace(estimate, compressed=max(round(estimate.bytes - saved), 0))


def compression_ratios(
    plan: ExtractionPlan, estimate: StoreEstimate, compression: str
) -> dict[str, float]:
    """Compressed over uncompressed bytes of each layer of ``estimate``'s store with the
    filter ``compression``, from up to `COMPRESSION_SAMPLE_ROWS` rows spread over
    ``plan``'s rows, compressed in memory; layers of which no row was read left out."""
    count = min(len(plan.rows), COMPRESSION_SAMPLE_ROWS)
    positions = np.unique(np.linspace(0, len(plan.rows) - 1, count).round().astype(int))
    size = plan.options.loader.batch_size
    batches = [positions[i : i + size].tolist() for i in range(0, len(positions), size)]
    plain = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, channels_last=False))
    captured = recompute(plain, batches)
    ratios = {}
    for layer in estimate.layers:
        parts = [codec.as_array(b.features[layer.key].cpu()) for b in captured]
        values = np.concatenate(parts) if parts else None
        if values is None or not values.size:
            continue
        chunk = layer_chunk_rows(layer, _entries(estimate, layer), plan.options.store.chunk_rows)
        ratios[layer.key] = compressed_bytes(values, chunk, compression) / values.nbytes
    return ratios


def _entries(estimate: StoreEstimate, layer: LayerSize) -> int:
    """Rows of a dense layer, tokens of a per-token one, in ``estimate``'s store."""
    return max(estimate.tokens or 0, 1) if layer.per_token else estimate.rows


def sized_rows(plan: ExtractionPlan) -> DryRun:
    """A dry run of the first of the run's rows that reads: each layer's stored shape.

    Raises:
        FeatcacheError: when none of the first rows gives values (all skipped).
    """
    # The memory layout changes no shape: the default one spares converting the weights.
    plain = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, channels_last=False))
    first = plan.rows.start
    for row in range(first, min(plan.rows.stop, first + SIZING_ROWS)):
        seen = dry_run(plain, range(row, row + 1), 1, workers=False)
        if seen.layers:
            return seen
    raise FeatcacheError(
        f"none of the first {SIZING_ROWS} rows of the dataset could be read, so the size of "
        "the store is unknown; check the data (or pass check_space=False / "
        "--ignore-free-space to run without the check)"
    )


def check_free_space(estimates: Sequence[StoreEstimate], overwrite: bool) -> None:
    """Refuse a run whose stores need more bytes than their filesystem has free.

    Raises:
        FeatcacheError: not enough free space.
    """
    if estimates:
        needed = sum(estimate.needed(overwrite) for estimate in estimates)
        require_space(needed, [e.path for e in estimates], "the run", GO_AHEAD)


def store_bytes(
    rows: int,
    layers: Sequence[LayerSize],
    *,
    ids_width: int,
    has_labels: bool = True,
    tokens: int | None = None,
    token_ids: bool = False,
    chunk_rows: int | None = None,
    checksum: bool = True,
    row_column_bytes: int = 0,
    attrs_bytes: int = 0,
    whole_blocks: bool = True,
) -> int:
    """Bytes on disk of the finished, uncompressed store that
    `featcache.store.StoreWriter` writes for ``rows`` rows of ``layers``.

    Every chunked dataset is allocated whole at creation, in whole chunks (as
    `featcache.store.layout.chunk_rows_for` says, or ``chunk_rows``), with 8 bytes
    of checksum per chunk when ``checksum``: the layers (``[rows, *shape]``, or
    ``[tokens, *shape]`` per token), ``/index``, ``/labels``, ``/ids`` (``ids_width``
    bytes each), and for per-token layers ``/offsets`` and, with ``token_ids``,
    ``/token_ids``. Added: ``row_column_bytes`` per row of the columns a source records
    at completion, ``/progress``, and HDF5's metadata (estimated per file and dataset,
    a B-tree node per 64 chunks, ``attrs_bytes`` of attribute text) in whole
    `featcache.store.layout.META_BLOCK_BYTES` blocks (as they are, without
    ``whole_blocks``: a file written whole). Not counted: skipped rows
    (the store keeps its size), the skip records, compression. Dense layers are exact
    up to the metadata estimate; per-token layers as exact as ``tokens`` is.
    """
    meta_chunk = chunk_rows or chunk_rows_for((), 8, rows)
    token_rows = max(tokens or 0, 1)
    # length, chunk rows, row bytes, rank of each dataset
    datasets = [(rows, meta_chunk, 8, 1), (rows, meta_chunk, max(1, ids_width), 1)]
    datasets += [(rows, meta_chunk, 8, 1)] if has_labels else []
    if any(layer.per_token for layer in layers):
        datasets += [(rows + 1, meta_chunk, 8, 1)] + (
            [(token_rows, meta_chunk, 8, 1)] if token_ids else []
        )
    for layer in layers:
        length = token_rows if layer.per_token else rows
        chunk = layer_chunk_rows(layer, length, chunk_rows)
        datasets.append((length, chunk, layer.item_bytes, 1 + len(layer.shape)))
    data = 8 * (1 + len(datasets)) + rows * row_column_bytes  # /progress, the columns
    metadata = FILE_METADATA_BYTES + attrs_bytes
    for length, chunk, row_bytes, rank in datasets:
        leaves = math.ceil(math.ceil(length / min(chunk, length)) / BTREE_ENTRIES)
        node = 24 + (BTREE_ENTRIES + 1) * (16 + 8 * rank) + 8 * BTREE_ENTRIES  # keyed by offsets
        data += dataset_bytes(length, chunk, row_bytes, checksum)
        metadata += DATASET_METADATA_BYTES * (1 + checksum)  # its header, its checksums'
        metadata += node * (leaves + (leaves > 1))
    if not whole_blocks:
        return data + metadata
    return data + META_BLOCK_BYTES * math.ceil(metadata / META_BLOCK_BYTES)


def layer_chunk_rows(layer: LayerSize, length: int, chunk_rows: int | None = None) -> int:
    """Rows (tokens) per chunk of ``layer``'s dataset of ``length`` rows (tokens)."""
    itemsize = codec.numpy_dtype(layer.dtype).itemsize
    return min(chunk_rows or chunk_rows_for(layer.shape, itemsize, length), length)


def dataset_bytes(length: int, chunk: int, row_bytes: int, checksum: bool = True) -> int:
    """Bytes of a dataset of ``length`` rows of ``row_bytes`` in whole chunks of
    ``chunk`` rows, and of its chunk checksums when ``checksum``."""
    chunk = min(chunk, length)
    return math.ceil(length / chunk) * (chunk * row_bytes + CHECKSUM_BYTES * checksum)


def bytes_on_disk(path: str | os.PathLike) -> int:
    """Bytes the file at ``path`` occupies (its allocated blocks), 0 when there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return 0
    blocks = getattr(stat, "st_blocks", None)
    return stat.st_size if blocks is None else min(stat.st_size, blocks * 512)
