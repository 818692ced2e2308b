"""``FeatureDataset``: cached features as a torch Dataset for downstream training.

Two ways to get shuffled batches out of a store:

* a ``DataLoader`` with any sampler: each batch is read in increasing row order, one
  slice per run of consecutive rows (:meth:`FeatureDataset.__getitems__`);
* chunk-aware shuffling (:meth:`FeatureDataset.batches`, :class:`ShuffledBatches`): whole
  blocks of chunks are read in a random order into a buffer and batches are drawn from a
  random permutation of the buffer, so no HDF5 call is made per row and a shuffled epoch
  runs about as fast as indexing an array in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from featcache.errors import ConfigError
from featcache.store import codec
from featcache.store.chunks import chunk_rows_of, row_bytes
from featcache.store.fletcher import checksum_only
from featcache.store.reader import (
    FeatureStore,
    StoreFile,
    read_rows,
    read_runs,
    read_token_rows,
    row_numbers,
)

Features = torch.Tensor | dict[str, torch.Tensor]
Batch = tuple[Features, torch.Tensor] | tuple[Features, torch.Tensor, torch.Tensor]

CACHE_FLOOR_BYTES = 4 << 20  # smallest chunk cache given to a filtered layer
CACHE_CHUNKS = 4  # whole chunks a filtered layer's cache holds, at least
BUFFER_BLOCKS = 64  # default shuffle buffer: this many blocks ...
BUFFER_BYTES = 64 << 20  # ... but no more than this many stored bytes


class FeatureDataset(Dataset):
    """Rows of one or more stored layers with their labels.

    ``dataset[i]`` is ``(features, label)``: ``features`` is a tensor of the layer's row
    shape (a dict ``{layer: tensor}`` when several layers are asked for), converted to
    ``dtype`` (float32 by default; None keeps the stored dtype); ``label`` is an int64
    scalar tensor, -1 when the store has no labels.

    The HDF5 file is opened lazily in each process, so the dataset works with DataLoader
    workers and pickles without its file handle. A DataLoader with automatic batching
    calls :meth:`__getitems__`, which reads a whole batch in increasing row order.
    :meth:`batches` (and :class:`ShuffledBatches` for DataLoader workers) reads whole
    chunks instead and shuffles them in memory: the fast way to run shuffled epochs.
    ``in_memory=True`` loads the layers once and serves both from memory.

    A checksummed layer (the default) is read through
    :class:`~featcache.store.checked.CheckedChunks`: each chunk is checked against its
    Fletcher-32 checksum the first time this process's handle reads it, and from then on
    a row costs a read of that row only. A chunk that fails its checksum raises
    :class:`~featcache.errors.CorruptStoreError` naming the layer and the rows of that
    chunk, from every read path, before any of its values are returned.

    ``chunk_cache`` is the HDF5 chunk cache of each layer, in bytes (0: none). By default
    a layer without filters, or with the checksum alone, gets none, so a random row costs
    a read of that row only, not of its whole chunk; a compressed layer gets ``max(4 MiB,
    4 chunks)``: HDF5 decompresses a chunk whole, and the cache does it once while the
    rows of a sorted batch are taken from it.

    A layer of per-token rows (text models with ``reduce: none``) gives row ``i`` as
    ``[T_i, *shape]``; such rows differ in length, so they are read one batch at a time
    through :meth:`__getitems__` (a DataLoader needs a ``collate_fn`` that pads, or
    ``batch_size=None``), not through :meth:`batches`. :class:`~featcache.TokenDataset`
    serves their single tokens, shuffled by chunk.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layers: str | Sequence[str],
        *,
        in_memory: bool = False,
        dtype: torch.dtype | None = torch.float32,
        allow_incomplete: bool = False,
        chunk_cache: int | None = None,
    ):
        self.path = Path(path)
        store = FeatureStore(self.path, allow_incomplete=allow_incomplete)
        self.single = isinstance(layers, str)
        self.layers = [layers] if isinstance(layers, str) else list(layers)
        if not self.layers:
            raise ConfigError("FeatureDataset needs at least one layer")
        for layer in self.layers:
            store.shape(layer)  # raises a clear error for a missing layer
        self.num_rows = store.rows_written if allow_incomplete else len(store)
        self.per_token = [layer for layer in self.layers if store.is_per_token(layer)]
        self.offsets = store.offsets if self.per_token else None
        labels = store.labels
        self.has_labels = labels is not None
        self.labels = torch.from_numpy(
            labels[: self.num_rows]
            if labels is not None
            else np.full(self.num_rows, -1, dtype=np.int64)
        )
        self.class_names = store.class_names
        self.dtype = dtype
        self._read_layouts(store, chunk_cache)
        self._memory: dict[str, torch.Tensor] | None = None
        if in_memory:
            self._memory = {
                layer: self._convert(
                    store.read_tokens(layer, slice(0, self.num_rows))[0]
                    if layer in self.per_token
                    else store.read(layer, slice(0, self.num_rows))
                )
                for layer in self.layers
            }
        store.close()
        # Opened in each process on first read; an incomplete store is read from its .partial.
        self._handle = StoreFile(self.path)
        self._spare: dict[str, torch.Tensor] | None = None  # shuffle buffers, for reuse

    def _read_layouts(self, store: FeatureStore, chunk_cache: int | None) -> None:
        """Each layer's item shape, stored dtype and chunk cache, and :attr:`block_rows`."""
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._storage: dict[str, torch.dtype] = {}
        self._caches: dict[str, tuple[int, int]] = {}
        chunk_rows = []
        for layer in self.layers:
            features = store.file["features"][layer]
            self.shapes[layer] = tuple(features.shape[1:])
            self._storage[layer] = codec.torch_dtype(features.attrs["dtype"])
            rows = chunk_rows_of(features)
            chunk_rows.append(rows)
            # Chunks with a checksum alone are read by featcache itself, not through the cache.
            filtered = features.id.get_create_plist().get_nfilters() > 0
            filtered = filtered and not checksum_only(features)
            self._caches[layer] = _chunk_cache(rows * row_bytes(features), filtered, chunk_cache)
        # A block is the unit the shuffling reader reads: one chunk of the layer with the
        # most rows per chunk (with the usual ~1 MiB chunks, whole chunks of every layer).
        self.block_rows = max(1, min(max(chunk_rows), self.num_rows))

    def __len__(self) -> int:
        return self.num_rows

    def features(self, layer: str) -> h5py.Dataset:
        """The ``h5py.Dataset`` of ``layer``, opened in this process with its chunk cache."""
        return self._handle.dataset(f"features/{layer}", self._caches[layer])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_spare"] = None  # the handle pickles as its path alone
        return state

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def _rows(self, rows: np.ndarray) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        for layer in self.layers:
            if layer in self.per_token:
                out[layer] = self._token_rows(layer, rows)
            elif self._memory is not None:
                out[layer] = _take(self._memory[layer], rows)
            else:
                out[layer] = self._convert(read_rows(self.features(layer), rows))
        return out

    def _token_rows(self, layer: str, rows: np.ndarray) -> list[torch.Tensor]:
        """Rows of a per-token layer: one ``[T_i, *shape]`` tensor each."""
        assert self.offsets is not None
        if self._memory is not None:
            tokens = self._memory[layer]
            return [tokens[self.offsets[r] : self.offsets[r + 1]].clone() for r in rows]
        values, starts = read_token_rows(self.features(layer), self.offsets, rows)
        values = self._convert(values)
        return [values[starts[j] : starts[j + 1]] for j in range(len(rows))]

    def __getitem__(self, i: int) -> tuple[Features, torch.Tensor]:
        (sample,) = self.__getitems__([i])
        return sample

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Features, torch.Tensor]]:
        """A batch of samples, read in increasing row order: one slice per run of rows."""
        rows = row_numbers(indices, self.num_rows)
        features = self._rows(rows)
        labels = self.labels[torch.from_numpy(rows)]
        if self.single:
            (values,) = features.values()
            return [(values[j], labels[j]) for j in range(len(rows))]
        return [
            ({layer: features[layer][j] for layer in self.layers}, labels[j])
            for j in range(len(rows))
        ]

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        buffer_rows: int | None = None,
        drop_last: bool = False,
        with_index: bool = False,
    ) -> Iterator[Batch]:
        """One epoch of batches, read chunk by chunk: ``(features, labels)`` each.

        ``features`` is ``[b, *shape]`` in ``dtype`` (a dict of such tensors for several
        layers), ``labels`` is int64 ``[b]``, and with ``with_index=True`` a third int64
        ``[b]`` tensor gives each sample's row in the store. Every row comes exactly once;
        only the last batch may be smaller, and it is dropped with ``drop_last=True``.

        With ``shuffle=True``, blocks of :attr:`block_rows` rows (whole HDF5 chunks) are
        read in a random order into a buffer of about ``buffer_rows`` rows (by default 64
        blocks, at most 64 MiB of stored data), and batches are drawn from a random
        permutation of the buffer; rows left over at the end of a buffer join the next
        one. The order depends only on ``seed`` and ``epoch``. With ``shuffle=False`` the
        rows come in store order. Reading from the file, the dataset keeps its buffers for
        the next epoch.
        """
        return self._batches(
            batch_size, shuffle, seed, epoch, buffer_rows, drop_last, with_index, 0, 1
        )

    def shuffled(self, batch_size: int, **options: Any) -> ShuffledBatches:
        """:class:`ShuffledBatches` over this dataset (same options as :meth:`batches`)."""
        return ShuffledBatches(self, batch_size, **options)

    def _batches(
        self,
        batch_size: int,
        shuffle: bool,
        seed: int,
        epoch: int,
        buffer_rows: int | None,
        drop_last: bool,
        with_index: bool,
        shard: int,
        shards: int,
    ) -> Iterator[Batch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if self.per_token:
            raise ConfigError(
                f"layer {self.per_token[0]!r} holds per-token rows of different lengths, "
                "which do not stack into batches; read single tokens with "
                "featcache.TokenDataset, or rows through a DataLoader with a padding collate_fn"
            )
        if buffer_rows is not None and buffer_rows < 1:
            raise ValueError(f"buffer_rows must be at least 1, got {buffer_rows}")
        starts = np.arange(0, self.num_rows, self.block_rows)
        rng = None
        if shuffle:
            # Every shard draws the same block order and takes its own share of it.
            starts = np.random.default_rng([seed, epoch]).permutation(starts)
            rng = np.random.default_rng([seed, epoch, shard, shards])
        starts = starts[shard::shards]
        if buffer_rows is None:
            block_bytes = self.block_rows * sum(
                int(np.prod(self.shapes[layer])) * self._storage[layer].itemsize
                for layer in self.layers
            )
            per_buffer = min(BUFFER_BLOCKS, BUFFER_BYTES // max(block_bytes, 1))
        else:
            per_buffer = buffer_rows // self.block_rows
        return self._read_blocks(starts, max(per_buffer, 1), batch_size, rng, drop_last, with_index)

    def _read_blocks(
        self,
        starts: np.ndarray,
        per_buffer: int,
        batch_size: int,
        rng: np.random.Generator | None,
        drop_last: bool,
        with_index: bool,
    ) -> Iterator[Batch]:
        # In memory, batches are gathered straight from the layers by row number. From the
        # file, the blocks are read into one buffer per layer and batches are gathered
        # from it by position; the buffers are reused for the next buffer's worth of
        # blocks, and kept for the next epoch (fresh pages cost as much as the read).
        buffers = self._memory
        if buffers is None:
            capacity = min(per_buffer * self.block_rows + batch_size, self.num_rows)
            buffers, self._spare = self._spare, None
            if buffers is None or any(len(b) < capacity for b in buffers.values()):
                buffers = {
                    layer: torch.empty((capacity, *self.shapes[layer]), dtype=self._storage[layer])
                    for layer in self.layers
                }
        try:
            yield from self._shuffle_blocks(
                starts, per_buffer, batch_size, rng, drop_last, with_index, buffers
            )
        finally:
            if self._memory is None:
                self._spare = buffers

    def _shuffle_blocks(
        self,
        starts: np.ndarray,
        per_buffer: int,
        batch_size: int,
        rng: np.random.Generator | None,
        drop_last: bool,
        with_index: bool,
        buffers: dict[str, torch.Tensor],
    ) -> Iterator[Batch]:
        rows_left = np.empty(0, dtype=np.int64)
        for first in range(0, len(starts), per_buffer):
            spans = [
                (int(s), min(int(s) + self.block_rows, self.num_rows))
                for s in starts[first : first + per_buffer]
            ]
            rows = np.concatenate([rows_left, *(np.arange(a, b) for a, b in spans)])
            if self._memory is None:
                for layer in self.layers:
                    self._read_spans(layer, spans, buffers[layer], len(rows_left))
            order = rng.permutation(len(rows)) if rng is not None else np.arange(len(rows))
            last = first + per_buffer >= len(starts)
            full = len(rows) if last else len(rows) - len(rows) % batch_size
            for i in range(0, full, batch_size):
                picked = order[i : i + batch_size]
                if drop_last and len(picked) < batch_size:
                    break
                index = rows[picked]
                position = index if self._memory is not None else picked
                features = {
                    layer: self._convert(_take(buffers[layer], position)) for layer in self.layers
                }
                out: Features = features[self.layers[0]] if self.single else features
                extra = (torch.from_numpy(index),) if with_index else ()
                yield (out, *self._targets(index), *extra)
            rest = order[full:]
            rows_left = rows[rest]
            if self._memory is None and len(rest):
                for buffer in buffers.values():  # carried to the front of the next buffer
                    buffer[: len(rest)] = _take(buffer, rest)

    def _targets(self, index: np.ndarray) -> tuple[torch.Tensor, ...]:
        """What comes with the features of the rows ``index`` in a batch: their labels."""
        return (self.labels[torch.from_numpy(index)],)

    def _read_spans(
        self, layer: str, spans: list[tuple[int, int]], buffer: torch.Tensor, start: int
    ) -> None:
        """Read the row ranges ``spans`` of ``layer`` into ``buffer`` from row ``start``."""
        read_runs(self.features(layer), spans, codec.as_array(buffer), start)

    def close(self) -> None:
        """Close this process's file handle; the next read opens it again."""
        self._handle.close()


class ShuffledBatches(IterableDataset):
    """Chunk-aware shuffled batches of a :class:`FeatureDataset`, for a DataLoader.

    Iterating gives one epoch of :meth:`FeatureDataset.batches` (same options); use it as
    ``DataLoader(ShuffledBatches(dataset, 256), batch_size=None, num_workers=k)``. Each
    worker reads a disjoint share of the blocks, so every row still comes exactly once
    per epoch (each worker may end with one smaller batch, unless ``drop_last``).

    Call :meth:`set_epoch` before each epoch for a different order; the order depends
    only on ``seed``, the epoch and the number of workers. The epoch lives in shared
    memory, so it also reaches workers kept alive with ``persistent_workers=True``.
    """

    def __init__(
        self,
        dataset: FeatureDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        buffer_rows: int | None = None,
        drop_last: bool = False,
        with_index: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.buffer_rows = buffer_rows
        self.drop_last = drop_last
        self.with_index = with_index
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next iteration on."""
        self._epoch.fill_(epoch)

    def __iter__(self) -> Iterator[Batch]:
        worker = get_worker_info()
        shard, shards = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        return self.dataset._batches(
            self.batch_size,
            self.shuffle,
            self.seed,
            self.epoch,
            self.buffer_rows,
            self.drop_last,
            self.with_index,
            shard,
            shards,
        )


def _take(tensor: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """``tensor[index]`` along the first dimension, as a new tensor.

    numpy's take is single-threaded and as fast as torch's gather on one thread; torch's
    slows down badly with several intra-op threads on a busy machine.
    """
    return codec.from_array(codec.as_array(tensor).take(index, axis=0), tensor.dtype)


def _chunk_cache(chunk_bytes: int, filtered: bool, nbytes: int | None) -> tuple[int, int]:
    """``(nslots, nbytes)`` of the HDF5 chunk cache for one layer."""
    if nbytes is None:
        # HDF5 reads the selected rows of an unfiltered chunk straight from the file
        # unless the chunk fits in the cache; then it loads the whole chunk for one row.
        # On [50000, 512] float16 in 1 MiB chunks, random rows read 10x and sorted random
        # batches 2x slower with a 4 MiB cache than with none (scripts/bench_read.py).
        # A filtered chunk is always read whole, so there the cache only saves rereads.
        nbytes = max(CACHE_FLOOR_BYTES, CACHE_CHUNKS * chunk_bytes) if filtered else 0
    if nbytes == 0:
        return 0, 0
    # HDF5 suggests a prime number of hash slots, about 100 times the chunks that fit.
    return _next_prime(100 * max(nbytes // max(chunk_bytes, 1), 1)), nbytes


def _next_prime(n: int) -> int:
    while n < 2 or any(n % d == 0 for d in range(2, int(n**0.5) + 1)):
        n += 1
    return n
