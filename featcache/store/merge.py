"""One file from several: shards combined into a virtual store, stores copied into one file."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from tqdm.auto import tqdm

from featcache.errors import ConfigError, FeatcacheError
from featcache.provenance import FORMAT_VERSION
from featcache.store import codec
from featcache.store.layout import (
    PROGRESS,
    TARGET_CHUNK_BYTES,
    WHOLE_FILE_LIBVER,
    allocate,
    checksums_name,
    chunk_rows_for,
    stored_checksums,
    write_checked,
)
from featcache.store.lock import writer_lock
from featcache.store.metadata import CHUNKS_ATTR, DIGEST_ATTR, seal
from featcache.store.paths import building_beside, partial_path, replace_durably
from featcache.store.reader import FeatureStore
from featcache.store.rows import forget, opened, read_head, rows_of
from featcache.store.skipped import read_skipped, write_skipped


def copy_store(
    source: str | os.PathLike,
    target: str | os.PathLike,
    compression: str | None = None,
    progress: bool = False,
    attrs: Mapping[str, Any] | None = None,
    drop: Sequence[str] = (),
) -> None:
    """Copy a store into one self-contained file of the current format, then move it into
    place.

    Every dataset of rows is read as featcache reads it (each chunk checked; a store
    combined from shards from its shards) and written whole, chunked as in the source
    (as featcache chunks its own for a virtual one), with its chunk checksums;
    ``compression`` applies HDF5's filter to each. ``attrs`` are set last and the file
    attributes named in ``drop`` are left out. A source chunk that fails raises
    :class:`~featcache.errors.CorruptStoreError`; the half-made copy is removed.
    """
    target = Path(target)
    with opened(source) as src:
        objects = [(name, obj) for name, obj in _walk(src) if not name.startswith("checksums")]
        sized = [o for _, o in objects if isinstance(o, h5py.Dataset)]
        total = sum(o.size * o.dtype.itemsize for o in sized)
        if compression is None:  # the copy's size is known: refuse before HDF5 hits a full disk
            _check_space(total, target)
        key = codec.attr(src, "resume_key")
        with (
            building_beside(target, ".copying") as tmp,
            h5py.File(tmp, "w", libver=WHOLE_FILE_LIBVER) as dst,
            tqdm(
                total=total, unit="B", unit_scale=True, desc=target.name, disable=not progress
            ) as bar,
        ):
            codec.copy_attrs(src, dst, skip={*drop, DIGEST_ATTR})
            for name, obj in objects:
                if isinstance(obj, h5py.Group):
                    codec.copy_attrs(obj, dst.create_group(name, track_order=name == "features"))
                else:
                    _copy_dataset(obj, dst, name, compression, bar)
            current: dict[str, Any] = {"featcache_format": FORMAT_VERSION}
            if isinstance(key, dict):
                current["resume_key"] = dict(key, featcache_format=FORMAT_VERSION)
            codec.write_attrs(dst, {**current, **dict(attrs or {})})
            seal(dst)
    replace_durably(tmp, target)


def _check_space(values_bytes: int, target: Path) -> None:
    """Refuse an uncompressed copy of ``values_bytes`` of values that the disk under
    ``target`` cannot hold: HDF5 fails badly on a full disk (h5py can even crash while
    closing the file)."""
    needed = values_bytes + values_bytes // 50 + (1 << 20)  # checksums, HDF5's metadata
    free = shutil.disk_usage(target.parent if target.parent.exists() else ".").free
    if free < needed:
        raise FeatcacheError(
            f"not enough space for {target}: the copy needs about {needed / 2**20:,.1f} MiB "
            f"and {free / 2**20:,.1f} MiB are free; free some space or write it elsewhere"
        )


def _walk(group: h5py.Group, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, object) for everything under ``group``, in creation order where tracked."""
    for key in group:
        obj = group[key]
        yield prefix + key, obj
        if isinstance(obj, h5py.Group):
            yield from _walk(obj, prefix + key + "/")


def _copy_dataset(
    obj: h5py.Dataset, dst: h5py.File, name: str, compression: str | None, bar: tqdm
) -> None:
    if obj.chunks is None and not obj.is_virtual or not len(obj):  # progress, scalars
        out = dst.create_dataset(name, data=obj[()], dtype=obj.dtype)
    else:
        n, shape = len(obj), obj.shape
        rows = obj.chunks[0] if obj.chunks else chunk_rows_for(shape[1:], obj.dtype.itemsize, n)
        rows = min(rows, n)
        if compression is None:  # written whole: its chunks need no index
            out = allocate(dst, name, shape, obj.dtype, rows, resizable=False)
        else:
            chunks = (rows, *shape[1:])
            out = dst.create_dataset(
                name, shape=shape, dtype=obj.dtype, chunks=chunks, compression=compression
            )
        row_bytes = max(obj.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64)), 1)
        step = max(rows, 8 * TARGET_CHUNK_BYTES // row_bytes // rows * rows)  # a few chunks
        reader = rows_of(obj)
        for start in range(0, n, step):
            stop = min(start + step, n)
            if obj.dtype.kind == "O":  # variable-length text of old stores: HDF5 reads it
                block = obj[start:stop]
            else:
                block = np.empty((stop - start, *shape[1:]), dtype=obj.dtype)
                reader.read(start, stop, block)
            out[start:stop] = block
            bar.update(block.nbytes)
        if out.dtype.kind != "O":
            dst.create_dataset(checksums_name(name), data=stored_checksums(out))
    codec.copy_attrs(obj, out, skip=(CHUNKS_ATTR,))


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
    files = [h5py.File(shard, "r") for shard in shards]
    try:
        for shard, f in zip(shards, files, strict=True):
            if not f.attrs.get("complete"):
                raise FeatcacheError(f"shard {shard} is incomplete; rerun to resume it")
        with (
            building_beside(path, ".combining") as tmp,
            h5py.File(tmp, "w", libver=WHOLE_FILE_LIBVER) as out,
        ):
            _combine(out, shards, files, path.parent)
            codec.copy_attrs(files[0], out, skip=("resume_key", DIGEST_ATTR))
            rows = sum(int(f.attrs["num_rows"]) for f in files)
            seconds = max(float(f.attrs.get("seconds", 0.0)) for f in files)
            # The rows each shard's last run computed (fewer than it holds after a resume).
            computed = sum(
                float(f.attrs.get("images_per_second", 0.0)) * float(f.attrs.get("seconds", 0.0))
                for f in files
            )
            codec.write_attrs(
                out,
                {
                    "num_rows": rows,
                    "rows_written": rows,
                    "skipped": sum(int(f.attrs.get("skipped", 0)) for f in files),
                    "world_size": len(shards),
                    "shards": [shard.name for shard in shards],
                    "seconds": seconds,
                    "images_per_second": computed / max(seconds, 1e-9),
                    **dict(attrs or {}),
                },
            )
            out.attrs["complete"] = True
            seal(out)
    finally:
        for f in files:
            forget(f)
            f.close()
    replace_durably(tmp, path)
    return FeatureStore(path)


def _combine(
    out: h5py.File, shards: Sequence[Path], files: Sequence[h5py.File], folder: Path
) -> None:
    """Every dataset of rows of the shards as one virtual dataset (their offsets as one
    real one), and the shards' skip records as one ``/skipped`` group."""
    # In creation order where it is tracked, so that layers keep their capture order.
    names = [
        name
        for name, obj in _walk(files[0])
        if isinstance(obj, h5py.Dataset)
        and name != PROGRESS
        and not name.startswith(("skipped", "checksums"))
    ]
    out.create_group("features", track_order=True)
    checked = "checksums" in files[0]
    for name in names:
        first = files[0][name]
        if name == "offsets":  # per-token rows: each shard counts its tokens from 0
            offsets = combined_offsets([read_head(f[name], len(f[name])) for f in files])
            write_checked(out, name, offsets, first.chunks[0], checked)
            continue
        total = sum(len(f[name]) for f in files)
        layout = h5py.VirtualLayout(shape=(total, *first.shape[1:]), dtype=first.dtype)
        offset = 0
        for shard, f in zip(shards, files, strict=True):
            n = len(f[name])
            # Relative to the store's folder: HDF5 looks for sources beside the store.
            source = os.path.relpath(shard, folder)
            layout[offset : offset + n] = h5py.VirtualSource(source, name, shape=f[name].shape)
            offset += n
        dataset = out.create_virtual_dataset(name, layout)
        codec.copy_attrs(first, dataset, skip=(CHUNKS_ATTR,))
    records = [record for f in files for record in read_skipped(f)]
    if records:
        write_skipped(out, records, files[0]["index"].chunks[0], checked)


def combined_offsets(offsets: Sequence[np.ndarray]) -> np.ndarray:
    """The ``[N + 1]`` row offsets of stores laid end to end, from each one's own."""
    parts, base = [np.zeros(1, dtype=np.int64)], 0
    for part in offsets:
        parts.append(part[1:] + base)
        base += int(part[-1])
    return np.concatenate(parts)


def merge_store(
    path: str | os.PathLike,
    target: str | os.PathLike,
    compression: str | None = None,
    progress: bool = True,
) -> FeatureStore:
    """Copy a (sharded) store into one self-contained file that needs no shard files.

    The new file is a store like any other: it is written under its lock
    (:func:`~featcache.store.lock.writer_lock`), so a second merge or an extraction to
    the same path is refused while this one runs.
    """
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
