"""``FeatureDataset``: cached features as a torch Dataset for downstream training."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from featcache.errors import ConfigError
from featcache.read.buffer_read import SharedRead
from featcache.read.padding import PadTokens
from featcache.read.shuffled_batches import ShuffledBatches
from featcache.store import codec
from featcache.store.reader import FeatureStore, StoreFile
from featcache.store.rows import PartRows, Rows, read_rows, read_token_rows, row_numbers, rows_of

Features = torch.Tensor | dict[str, torch.Tensor]
Batch = tuple[Features, torch.Tensor] | tuple[Features, torch.Tensor, torch.Tensor]

BUFFER_BLOCKS = 64  # default shuffle buffer: this many blocks ...
BUFFER_BYTES = 64 << 20  # ... but no more than this many stored bytes
BLOCK_BYTES = 1 << 20  # a block of the shuffling reader: whole chunks of about this many bytes
CACHE_FLOOR_BYTES = 4 << 20  # smallest chunk cache given to a layer HDF5 reads
CACHE_CHUNKS = 4  # whole chunks such a layer's cache holds, at least


class FeatureDataset(Dataset):
    """Rows of one or more stored layers with their labels.

    ``dataset[i]`` is ``(features, label)``: ``features`` is a tensor of the layer's row
    shape (a dict ``{layer: tensor}`` when several layers are asked for), converted to
    ``dtype`` (float32 by default; None keeps the stored dtype); ``label`` is an int64
    scalar tensor, -1 when the store has no labels.

    The HDF5 file is opened lazily in each process, so the dataset works with DataLoader
    workers and pickles without its file handle. A DataLoader with automatic batching
    calls `__getitems__`, which reads a whole batch in increasing row order.
    [`batches`][featcache.read.dataset.FeatureDataset.batches] (and
    [`ShuffledBatches`][featcache.read.shuffled_batches.ShuffledBatches] for DataLoader workers)
    reads whole chunks instead and shuffles them in memory: the fast way to run shuffled
    epochs.
    ``in_memory=True`` loads the layers once and serves both from memory.

    An uncompressed layer is read straight from the file through a memory map
    (`featcache.store.rows`): each chunk is checked against its checksum the first
    time it is read while the file is open, and from then on a row costs a copy of that
    row only. A chunk that fails its checksum raises
    [`CorruptStoreError`][featcache.errors.CorruptStoreError] naming the layer and the rows of that
    chunk, from every read path, before any of its values are returned.

    ``chunk_cache`` is the HDF5 chunk cache of each layer, in bytes (0: none), for the
    layers HDF5 reads. By default a layer read through the memory map gets none; a
    compressed layer gets ``max(4 MiB, 4 chunks)``: HDF5 decompresses a chunk whole, and
    the cache does it once while the rows of a sorted batch are taken from it.

    A layer of per-token rows (text models with ``reduce: none``) gives row ``i`` as
    ``[T_i, *shape]``; such rows differ in length, so they are read one batch at a time
    through `__getitems__` (a DataLoader takes
    [`pad_tokens`][featcache.read.dataset.FeatureDataset.pad_tokens] as its ``collate_fn``, which
    pads them and gives a mask), not through `batches`.
    [`TokenDataset`][featcache.read.token_view.TokenDataset] serves their single tokens, shuffled
    by chunk."""

    # Whether a shuffled epoch lets each block's mapped pages go once it is in the
    # buffer (see `Rows.release`): off here, where an epoch over pages kept mapped runs
    # about 12% faster; on for the token view, whose stores dwarf memory.
    release_pages = False

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
        name = type(self).__name__
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"{name} takes a store path, got {type(path).__name__}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
        self.path = Path(path)
        self.single = isinstance(layers, str)
        if not self.single and not (
            isinstance(layers, Sequence) and all(isinstance(layer, str) for layer in layers)
        ):
            raise ConfigError(f"layers must be a layer key or a list of them, got {layers!r}")
        self.layers = [layers] if isinstance(layers, str) else list(layers)
        if not self.layers:
            raise ConfigError(f"{name} needs at least one layer")
        store = FeatureStore(self.path, allow_incomplete=allow_incomplete)
        for layer in self.layers:
            store.shape(layer)  # raises a clear error for a missing layer
        self.class_names = store.class_names
        self.dtype = dtype
        self._count_rows(store, allow_incomplete)
        self._read_layouts(store, chunk_cache)
        self._memory: dict[str, torch.Tensor] | None = None
        if in_memory:
            self._memory = {layer: self._convert(self._load(store, layer)) for layer in self.layers}
        store.close()
        # Opened in each process on first read; an incomplete store is read from its .partial.
        self._handle = StoreFile(self.path)
        self._spare: list[dict[str, torch.Tensor]] | None = None  # read buffers, reused

    def _count_rows(self, store: FeatureStore, allow_incomplete: bool) -> None:
        """The rows served (:attr:`num_rows`), their labels and the per-token offsets."""
        self.num_rows = store.rows_written if allow_incomplete else len(store)
        self.per_token = [layer for layer in self.layers if store.is_per_token(layer)]
        self.offsets = store.offsets if self.per_token else None
        labels = store.labels
        self.has_labels = labels is not None
        if labels is None:
            labels = np.full(self.num_rows, -1, dtype=np.int64)
        self.labels = torch.from_numpy(labels[: self.num_rows])

    def _load(self, store: FeatureStore, layer: str) -> torch.Tensor:
        """Every row of ``layer`` in its stored dtype, for ``in_memory``."""
        if layer in self.per_token:
            return store.read_tokens(layer, slice(0, self.num_rows))[0]
        return store.read(layer, slice(0, self.num_rows))

    def _read_layouts(self, store: FeatureStore, chunk_cache: int | None) -> None:
        """Each layer's item shape, stored dtype and chunk cache, and :attr:`block_rows`."""
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._storage: dict[str, torch.dtype] = {}
        self._quantized: set[str] = set()  # layers of int8 codes, with scales beside them
        self._caches: dict[str, tuple[int, int]] = {}
        block_rows = []
        for layer in self.layers:
            features = store.file["features"][layer]
            self.shapes[layer] = tuple(features.shape[1:])
            dtype = codec.attr(features, "dtype")
            self._storage[layer] = codec.torch_dtype(dtype)
            if dtype in codec.QUANTIZED:
                self._quantized.add(layer)
            reader = rows_of(features)
            row_bytes = max(features.dtype.itemsize * int(np.prod(self.shapes[layer])), 1)
            chunk_bytes = reader.chunk_rows * row_bytes
            block_rows.append(reader.chunk_rows * max(1, BLOCK_BYTES // chunk_bytes))
            self._caches[layer] = _chunk_cache(chunk_bytes, not reader.direct, chunk_cache)
        # The layer with the most rows per block sets it (whole chunks of every layer, with
        # featcache's chunk sizes).
        self.block_rows = max(1, min(max(block_rows), self.num_rows))

    def __len__(self) -> int:
        return self.num_rows

    def features(self, layer: str) -> h5py.Dataset:
        """The ``h5py.Dataset`` of ``layer``, opened in this process with its chunk cache."""
        return self._handle.dataset(f"features/{layer}", self._caches[layer])

    def _reader(self, layer: str) -> Rows | PartRows:
        """The reads of ``layer`` in this process (with its chunk cache)."""
        return self._handle.rows(f"features/{layer}", self._caches[layer])

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
                out[layer] = self._convert(self._scaled(layer, read_rows, rows))
        return out

    def _scaled(self, layer: str, read: Callable[..., Any], *where: Any) -> Any:
        """``read(reads of layer, *where)``, int8 codes dequantized with their scales read
        the same way (for per-token rows ``read`` gives ``(values, offsets)``)."""
        values = read(self._reader(layer), *where)
        if layer not in self._quantized:
            return values
        scales = read(self._handle.rows(codec.scales_name(layer)), *where)
        if isinstance(values, tuple):
            return codec.dequantize(values[0], scales[0]), values[1]
        return codec.dequantize(values, scales)

    def _token_rows(self, layer: str, rows: np.ndarray) -> list[torch.Tensor]:
        """Rows of a per-token layer: one ``[T_i, *shape]`` tensor each."""
        assert self.offsets is not None
        if self._memory is not None:
            tokens = self._memory[layer]
            return [tokens[self.offsets[r] : self.offsets[r + 1]].clone() for r in rows]
        values, starts = self._scaled(layer, read_token_rows, self.offsets, rows)
        values = self._convert(values)
        return [values[starts[j] : starts[j + 1]] for j in range(len(rows))]

    def __getitem__(self, i: int) -> tuple[Features, torch.Tensor]:
        (sample,) = self.__getitems__([i])
        return sample

    @property
    def pad_tokens(self) -> PadTokens:
        """The DataLoader ``collate_fn`` for this dataset's per-token rows: batches of
        ``(features [B, T, ...], mask [B, T], labels [B])``, rows padded to the longest
        (see [`PadTokens`][featcache.read.padding.PadTokens])."""
        return PadTokens(self.per_token)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Features, torch.Tensor]]:
        """A batch of samples, read in increasing row order: one slice per run of rows."""
        rows = row_numbers(indices, self.num_rows)
        features = self._rows(rows)
        labels = self.labels[torch.from_numpy(rows)]
        return [(self._item(features, j), labels[j]) for j in range(len(rows))]

    def _item(self, features: dict[str, torch.Tensor | list[torch.Tensor]], j: int) -> Features:
        """Item ``j`` of the rows :meth:`_rows` read: a tensor, or a dict for several layers."""
        if self.single:
            return features[self.layers[0]][j]
        return {layer: features[layer][j] for layer in self.layers}

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
        read_ahead: bool = True,
    ) -> Iterator[Batch]:
        """One epoch of batches, read chunk by chunk: ``(features, labels)`` each.

        ``features`` is ``[b, *shape]`` in ``dtype`` (a dict of such tensors for several
        layers), ``labels`` is int64 ``[b]``, and with ``with_index=True`` a third int64
        ``[b]`` tensor gives each sample's row in the store. Every row comes exactly once;
        only the last batch may be smaller, and it is dropped with ``drop_last=True``.

        With ``shuffle=True``, blocks of ``block_rows`` rows (whole HDF5 chunks) are
        read in a random order into a buffer of about ``buffer_rows`` rows (by default 64
        blocks, at most 64 MiB of stored data), and batches are drawn from a random
        permutation of the buffer; rows left over at the end of a buffer join the next
        one. The order depends only on ``seed`` and ``epoch``. With ``shuffle=False`` the
        rows come in store order. Reading from the file, the buffers are kept for the next
        epoch; with ``read_ahead`` (the default) a thread reads and checks the next
        buffer's blocks while batches are drawn from the current one, which takes a
        second buffer, and a buffer the batches wait for is read on both threads
        (`featcache.read.buffer_read`)."""
        return self._batches(
            batch_size,
            shuffle,
            seed,
            epoch,
            buffer_rows,
            drop_last,
            with_index,
            0,
            1,
            read_ahead=read_ahead,
        )

    def shuffled(self, batch_size: int, **options: Any) -> ShuffledBatches:
        """[`ShuffledBatches`][featcache.read.shuffled_batches.ShuffledBatches] over this dataset
        (same options as [`batches`][featcache.read.dataset.FeatureDataset.batches])."""
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
        *,
        read_ahead: bool = True,
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
        per_buffer = max(per_buffer, 1)
        blocks = functools.partial(
            self._shuffle_blocks, starts, per_buffer, batch_size, rng, drop_last, with_index
        )
        capacity = min(per_buffer * self.block_rows + batch_size, self.num_rows)
        return self._read_blocks(blocks, capacity, read_ahead)

    def _read_blocks(
        self, shuffle: Callable[..., Iterator[Batch]], capacity: int, read_ahead: bool
    ) -> Iterator[Batch]:
        # In memory, batches are gathered straight from the layers by row number. From the
        # file, blocks are read into a buffer (one tensor per layer) and batches gathered
        # from it by position; reading ahead, the next blocks go into a second buffer
        # meanwhile. The buffers are reused, and kept for the next epoch (fresh pages cost
        # as much as the read).
        if self._memory is not None:
            yield from shuffle(None, None)
            return
        kept, self._spare = self._spare, None
        kept = [b for b in kept or [] if all(len(t) >= capacity for t in b.values())]
        while len(kept) < (2 if read_ahead else 1):
            kept.append(self._new_buffers(capacity))
        pair = kept[:2] if read_ahead else [kept[0], kept[0]]
        reading = ThreadPoolExecutor(1, thread_name_prefix="featcache-read") if read_ahead else None
        try:
            with reading or contextlib.nullcontext() as reader:
                yield from shuffle(pair, reader)
        finally:
            self._spare = kept

    def _new_buffers(self, capacity: int) -> dict[str, torch.Tensor]:
        return {
            **{
                layer: torch.empty((capacity, *self.shapes[layer]), dtype=self._storage[layer])
                for layer in self.layers
            },
            **{codec.scales_name(layer): torch.empty(capacity) for layer in self._quantized},
        }

    def _shuffle_blocks(
        self,
        starts: np.ndarray,
        per_buffer: int,
        batch_size: int,
        rng: np.random.Generator | None,
        drop_last: bool,
        with_index: bool,
        pair: list[dict[str, torch.Tensor]] | None,
        reader: ThreadPoolExecutor | None,
    ) -> Iterator[Batch]:
        """Batches from blocks read into ``pair`` (buffer ``t % 2`` holds the ``t``-th group
        of blocks; the same buffer twice without read-ahead), by ``reader`` when given;
        straight from the layers in memory when ``pair`` is None."""
        groups = [starts[i : i + per_buffer] for i in range(0, len(starts), per_buffer)]
        spans = [
            [(int(s), min(int(s) + self.block_rows, self.num_rows)) for s in g] for g in groups
        ]
        pending: SharedRead | None = None
        if pair is not None and spans:
            pending = self._read_into(reader, spans[0], pair[0], 0)
        rows_left = np.empty(0, dtype=np.int64)
        try:
            for t in range(len(spans)):
                rows = np.concatenate([rows_left, *(np.arange(a, b) for a, b in spans[t])])
                last = t + 1 == len(spans)
                full = len(rows) if last else len(rows) - len(rows) % batch_size
                buffers = self._memory
                if pair is not None:
                    if pending is not None:
                        pending.result()  # the buffer is read and checked, or the error raised
                    buffers = pair[t % 2]
                    if reader is not None and not last:  # after the rows left over from this one
                        pending = self._read_into(
                            reader, spans[t + 1], pair[1 - t % 2], len(rows) - full
                        )
                assert buffers is not None
                order = rng.permutation(len(rows)) if rng is not None else np.arange(len(rows))
                for i in range(0, full, batch_size):
                    picked = order[i : i + batch_size]
                    if drop_last and len(picked) < batch_size:
                        break
                    index = rows[picked]
                    position = index if pair is None else picked
                    features = {
                        layer: self._convert(self._gather(buffers, layer, position, pair))
                        for layer in self.layers
                    }
                    out: Features = features[self.layers[0]] if self.single else features
                    extra = (torch.from_numpy(index),) if with_index else ()
                    yield (out, *self._targets(index), *extra)
                rest = order[full:]
                rows_left = rows[rest]
                if pair is None:
                    continue
                following = pair[1 - t % 2]
                for layer, buffer in buffers.items():  # carried to the front of the next buffer
                    following[layer][: len(rest)] = _take(buffer, rest)
                if reader is None and not last:
                    pending = self._read_into(None, spans[t + 1], following, len(rest))
        finally:
            if pending is not None:  # an epoch left early: the reader takes no more blocks
                pending.stop()

    def _gather(
        self,
        buffers: dict[str, torch.Tensor],
        layer: str,
        position: np.ndarray,
        pair: list[dict[str, torch.Tensor]] | None,
    ) -> torch.Tensor:
        """The rows at ``position`` of ``layer`` in ``buffers`` (read blocks, whose int8
        codes are dequantized here; or the layers in memory, already dequantized)."""
        values = _take(buffers[layer], position)
        if pair is None or layer not in self._quantized:
            return values
        return codec.dequantize(values, _take(buffers[codec.scales_name(layer)], position))

    def _read_into(
        self,
        reader: ThreadPoolExecutor | None,
        spans: list[tuple[int, int]],
        buffers: dict[str, torch.Tensor],
        start: int,
    ) -> SharedRead:
        """The read of the row ranges ``spans`` of every layer into ``buffers`` from row
        ``start``: begun on ``reader`` when given, finished by its ``result()``."""
        outs = {name: codec.as_array(buffer) for name, buffer in buffers.items()}
        readers = {layer: self._reader(layer) for layer in self.layers}
        for layer in self._quantized:
            readers[codec.scales_name(layer)] = self._handle.rows(codec.scales_name(layer))

        def advise() -> None:  # the disk gets every block of the buffer at once
            for rows in readers.values():
                for span in spans:
                    rows.advise(*span)

        tasks: list[Callable[[], None]] = [advise]  # taken first, by the reader when ahead
        at = start
        for first, stop in spans:
            for layer, rows in readers.items():
                into = outs[layer][at : at + stop - first]
                read = functools.partial(_read_block, rows, first, stop, into, self.release_pages)
                tasks.append(read)
            at += stop - first
        # Where HDF5 reads a layer, a second thread would only wait for its turn.
        shared = all(rows.direct for rows in readers.values())
        return SharedRead(tasks, reader, shared)

    def _targets(self, index: np.ndarray) -> tuple[torch.Tensor, ...]:
        """What comes with the features of the rows ``index`` in a batch: their labels."""
        return (self.labels[torch.from_numpy(index)],)

    def close(self) -> None:
        """Close this process's file handle; the next read opens it again."""
        self._handle.close()


def _chunk_cache(chunk_bytes: int, by_hdf5: bool, nbytes: int | None) -> tuple[int, int]:
    """``(nslots, nbytes)`` of one layer's HDF5 chunk cache (``chunk_cache`` of
    :class:`FeatureDataset`); ``by_hdf5``: compressed, or a format-2 store."""
    if nbytes is None:
        nbytes = max(CACHE_FLOOR_BYTES, CACHE_CHUNKS * chunk_bytes) if by_hdf5 else 0
    if nbytes == 0:
        return 0, 0
    slots = 100 * max(nbytes // max(chunk_bytes, 1), 1)  # HDF5 suggests ~100 per chunk, prime
    while any(slots % d == 0 for d in range(2, int(slots**0.5) + 1)):
        slots += 1
    return slots, nbytes


def _read_block(
    rows: Rows | PartRows, start: int, stop: int, out: np.ndarray, release: bool
) -> None:
    """Rows ``[start, stop)`` into ``out``; with ``release``, their mapped pages then go
    (see `Rows.release`)."""
    rows.read(start, stop, out)
    if release:
        rows.release(start, stop)


def _take(tensor: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """``tensor[index]`` along the first dimension, as a new tensor.

    numpy's take is single-threaded and as fast as torch's gather on one thread; torch's
    slows down badly with several intra-op threads on a busy machine."""
    return codec.from_array(codec.as_array(tensor).take(index, axis=0), tensor.dtype)
