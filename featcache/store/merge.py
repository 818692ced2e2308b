"""One file from several: shards combined into a virtual store, stores copied into one file."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from tqdm.auto import tqdm

from featcache.errors import ConfigError, FeatcacheError
from featcache.store import codec, layout
from featcache.store.history import run_record
from featcache.store.lock import StoreBusyError, writer_lock
from featcache.store.metadata import DIGEST_ATTR, seal
from featcache.store.paths import open_readonly, partial_path
from featcache.store.provenance import FORMAT_VERSION
from featcache.store.reader import FeatureStore
from featcache.store.rows import read_head, rows_of
from featcache.store.shards import missing_rows, read_shards
from featcache.store.skipped import read_skipped, write_skipped
from featcache.util.compression import filter_options, load_plugins
from featcache.util.files import building_beside, replace_durably, require_space


def copy_store(
    source: str | os.PathLike,
    target: str | os.PathLike,
    compression: str | None = None,
    progress: bool = False,
    attrs: Mapping[str, Any] | None = None,
    drop: Sequence[str] = (),
) -> None:
    """Copy a store into one self-contained file of the current format, then move it into
    place: each dataset read and checked as featcache reads it, written whole with chunk
    checksums, filtered by ``compression`` (a ``store.compression`` value); ``attrs`` set
    last, the file attributes in ``drop`` left out.

    Raises:
        CorruptStoreError: a source chunk fails (the half-made copy is removed).
        ConfigError: a malformed ``compression``, before anything is written.
    """
    target = Path(target)
    filters = filter_options(compression)
    with open_readonly(source) as src:
        objects = [(name, obj) for name, obj in walk(src) if not name.startswith("checksums")]
        total = sum(o.size * o.dtype.itemsize for _, o in objects if isinstance(o, h5py.Dataset))
        if compression is None:  # refused before HDF5 fails badly on a full disk
            require_space(total + total // 50 + (1 << 20), [target], "the copy")
        key = codec.attr(src, "resume_key")
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=target.name, disable=not progress)
        with bar, _written_whole(target, ".copying") as dst:
            codec.copy_attrs(src, dst, skip={*drop, DIGEST_ATTR})
            for name, obj in objects:
                if isinstance(obj, h5py.Group):
                    codec.copy_attrs(obj, dst.create_group(name, track_order=name == "features"))
                else:
                    _copy_dataset(obj, dst, name, filters, bar)
            current: dict[str, Any] = {"featcache_format": FORMAT_VERSION}
            if isinstance(key, dict):
                current["resume_key"] = dict(key, featcache_format=FORMAT_VERSION)
            codec.write_attrs(dst, {**current, **dict(attrs or {})})


@contextlib.contextmanager
def _written_whole(target: Path, suffix: str) -> Iterator[h5py.File]:
    """A new store file written whole beside ``target``, sealed and moved into place last."""
    with building_beside(target, suffix) as tmp:
        with h5py.File(tmp, "w", libver=layout.WHOLE_FILE_LIBVER) as out:
            yield out
            seal(out)
        replace_durably(tmp, target)


def walk(group: h5py.Group, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, object) for everything under ``group``, in creation order where tracked."""
    for key in group:
        obj = group[key]
        yield prefix + key, obj
        if isinstance(obj, h5py.Group):
            yield from walk(obj, prefix + key + "/")


def _copy_dataset(
    obj: h5py.Dataset, dst: h5py.File, name: str, filters: Mapping[str, Any], bar: tqdm
) -> None:
    if obj.chunks is None and not obj.is_virtual or not len(obj):  # progress, scalars
        out = dst.create_dataset(name, data=obj[()], dtype=obj.dtype)
        bar.update(obj.size * obj.dtype.itemsize)
    else:
        n, shape, dtype = len(obj), obj.shape, obj.dtype
        rows = obj.chunks[0] if obj.chunks else layout.chunk_rows_for(shape[1:], dtype.itemsize, n)
        rows = min(rows, n)
        if not filters:  # written whole: its chunks need no index
            out = layout.allocate(dst, name, shape, dtype, rows, resizable=False)
        else:
            out = _create_filtered(dst, name, shape, dtype, rows, filters)
        chunk_bytes = rows * dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        step = rows * max(1, 8 * layout.TARGET_CHUNK_BYTES // max(chunk_bytes, 1))  # a few chunks
        reader = rows_of(obj)
        for start in range(0, n, step):
            block = np.empty((min(step, n - start), *shape[1:]), dtype=dtype)
            reader.read(start, start + len(block), block)
            out[start : start + len(block)] = block
            bar.update(block.nbytes)
        dst.create_dataset(layout.checksums_name(name), data=layout.stored_checksums(out))
    codec.copy_attrs(obj, out)


def _create_filtered(
    group: h5py.Group,
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    rows: int,
    filters: Mapping[str, Any],
) -> h5py.Dataset:
    """A dataset of ``shape`` chunked by ``rows`` along its first axis, compressed with
    ``filters`` (:func:`~featcache.util.compression.filter_options`)."""
    return group.create_dataset(
        name, shape=shape, dtype=dtype, chunks=(rows, *shape[1:]), **filters
    )


def compressed_bytes(values: np.ndarray, chunk_rows: int, compression: str) -> int:
    """Bytes ``values`` (``[n, *shape]``, as stored) take in a compressed copy, chunked by
    ``chunk_rows``: written in memory as :func:`copy_store` writes a dataset.

    Raises:
        ConfigError: a malformed ``compression``, or hdf5plugin missing for its codec.
    """
    filters = filter_options(compression)
    rows = max(1, min(chunk_rows, len(values)))
    with h5py.File(io.BytesIO(), "w") as memory:
        dataset = _create_filtered(memory, "values", values.shape, values.dtype, rows, filters)
        if len(values):
            dataset[...] = values
        dataset.id.flush()
        return int(dataset.id.get_storage_size())


def combine_shards(
    path: str | os.PathLike, shards: Sequence[Path], attrs: Mapping[str, Any] | None = None
) -> FeatureStore:
    """Write the store at ``path`` as virtual datasets over the complete ``shards``."""
    path = Path(path)
    for shard in shards:
        if not shard.exists():
            hint = (
                "; it is still being written or its rank failed"
                if partial_path(shard).exists()
                else "; is the output folder on a filesystem that every node shares?"
            )
            raise FeatcacheError(f"shard {shard} is missing{hint}")
    load_plugins()  # a compressed shard's offsets are read through its filter
    with contextlib.ExitStack() as opened:
        files = [opened.enter_context(h5py.File(shard, "r")) for shard in shards]
        for shard, f in zip(shards, files, strict=True):
            if not f.attrs.get("complete"):
                raise FeatcacheError(f"shard {shard} is incomplete; rerun to resume it")
        with _written_whole(path, ".combining") as out:
            _combine(out, shards, files, path.parent)
            codec.copy_attrs(files[0], out, skip=("resume_key", "launch", DIGEST_ATTR))
            rows = sum(int(f.attrs["num_rows"]) for f in files)
            seconds = [float(f.attrs.get("seconds", 0.0)) for f in files]
            # The rows each shard's last run computed (fewer than it holds after a resume).
            speeds = [float(f.attrs.get("images_per_second", 0.0)) for f in files]
            summary = {
                "num_rows": rows,
                "rows_written": rows,
                "skipped": sum(int(f.attrs.get("skipped", 0)) for f in files),
                "world_size": len(shards),
                "shards": [shard.name for shard in shards],
                "seconds": max(seconds),
                "images_per_second": float(np.dot(speeds, seconds)) / max(max(seconds), 1e-9),
            }
            codec.write_attrs(out, {**summary, **dict(attrs or {})})
            out.attrs["complete"] = True
    return FeatureStore(path)


def _combine(
    out: h5py.File, shards: Sequence[Path], files: Sequence[h5py.File], folder: Path
) -> None:
    """Every dataset of rows of the shards as one virtual dataset (their offsets as one
    real one), and the shards' skip records as one ``/skipped`` group."""
    out.create_group("features", track_order=True)  # layers keep their capture order
    checked = "checksums" in files[0]
    for name, first in walk(files[0]):
        row_dataset = isinstance(first, h5py.Dataset) and name != layout.PROGRESS
        if not row_dataset or name.startswith(("skipped", "checksums")):
            continue
        if name == "offsets":  # per-token rows: each shard counts its tokens from 0
            ends = [read_head(f[name], len(f[name])) for f in files]
            bases = np.cumsum([0] + [int(e[-1]) for e in ends[:-1]])
            offsets = np.concatenate([[0], *(e[1:] + b for e, b in zip(ends, bases, strict=True))])
            layout.write_checked(out, name, offsets.astype(np.int64), first.chunks[0], checked)
            continue
        virtual = h5py.VirtualLayout(
            (sum(len(f[name]) for f in files), *first.shape[1:]), first.dtype
        )
        at = 0
        for shard, f in zip(shards, files, strict=True):
            # Relative to the store's folder: HDF5 looks for sources beside the store.
            source = h5py.VirtualSource(os.path.relpath(shard, folder), name, shape=f[name].shape)
            virtual[at : at + len(f[name])] = source
            at += len(f[name])
        codec.copy_attrs(first, out.create_virtual_dataset(name, virtual))
    records = [record for f in files for record in read_skipped(f)]
    if records:
        write_skipped(out, records, files[0]["index"].chunks[0], checked)


def merge_store(
    path: str | os.PathLike,
    target: str | os.PathLike,
    compression: str | None = None,
    progress: bool = True,
) -> FeatureStore:
    """Copy a (sharded) store into one self-contained file that needs no shard files, under
    the target's writer lock; complete shards not combined yet are combined first.

    Raises:
        ConfigError: rows that no complete shard holds remain.
    """
    shards = [] if Path(path).exists() else read_shards(path)
    rows = int(shards[0].key.get("source_rows", 0)) if shards else 0
    if shards and not combine_when_done(path, rows):
        left = sum(map(len, missing_rows([s for s in shards if s.complete], rows)))
        raise ConfigError(
            f"{path} is not combined yet: no complete shard holds {left} of its rows; finish "
            "the extraction (rerun it, with any number of processes), then merge"
        )
    store = FeatureStore(path)  # refuses incomplete stores
    target = Path(target)
    if target.resolve() == store.path.resolve():
        raise ConfigError("merge writes a new file: give an output path other than the store")
    shards = store.attrs.get("shards") or []
    store.close()
    with writer_lock(target):
        if target.exists():
            raise ConfigError(f"{target} already exists; choose another output path")
        copy_store(path, target, compression, progress, {"merged_from": shards}, drop=("shards",))
    return FeatureStore(target)


def combine_when_done(
    path: str | os.PathLike,
    num_rows: int,
    step: int = 1,
    boundaries: Sequence[int] = (),
    world_size: int | None = None,
) -> bool:
    """Combine the store at ``path`` over its shards once complete shards hold all
    ``num_rows`` rows (one process does; another finding it combining leaves it); whether
    the store is there now. ``world_size``: the processes of the run that combines it."""
    path = Path(path)
    shards = read_shards(path, step, boundaries)
    if not shards or missing_rows(shards, num_rows) or not all(s.complete for s in shards):
        return path.is_file()
    with contextlib.suppress(StoreBusyError), writer_lock(path):
        if path.is_file():
            return True
        key = {**shards[0].key, "rows": [0, num_rows]}
        attrs: dict[str, Any] = {"resume_key": key}
        attrs["history"] = launch_records([s.path for s in shards], key)
        if world_size is not None:
            attrs["world_size"] = world_size
        combine_shards(path, [shard.path for shard in shards], attrs)
    return path.is_file()


def launch_records(shards: Sequence[Path], key: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One history record per ``launch`` that computed rows of ``shards``, its computed and
    resumed rows summed over the shards, oldest first."""
    by_launch: dict[Any, dict[str, Any]] = {}
    for shard in shards:
        with open_readonly(shard) as f:
            records = codec.attr(f, "history") or []
            layers = len(f["features"])
        for record in records:
            launch = record.get("launch")
            merged = by_launch.setdefault(
                launch, run_record("extract", (0, 0), (layers, 0), key, record.get("time"))
            )
            merged["launch"] = launch
            merged["time"] = max(merged["time"] or "", record.get("time") or "")
            merged["rows_computed"] += int(record.get("rows_computed") or 0)
            merged["rows_resumed"] += int(record.get("rows_resumed") or 0)
    return sorted(by_launch.values(), key=lambda record: record["time"])
