"""Sharded extraction under torchrun: each rank writes one shard, one store presents them.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every rank takes a contiguous
block of source rows, cut on the batch grid so that every batch holds the same samples as
in a single-process run, runs on its own device (``cuda:LOCAL_RANK``, or the CPU) and
writes ``<store>.shard-RRRRR-of-WWWWW.h5`` next to the output, resumable like any store.
When every rank is done, rank 0 writes the store itself: HDF5 virtual datasets over the
shards, which ``FeatureStore``, ``FeatureDataset`` and plain h5py read like one file.
``featcache merge`` copies such a store into one self-contained file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import torch
import torch.distributed as dist

from featcache.errors import ConfigError, FeatcacheError
from featcache.store import (
    FeatureStore,
    copy_store,
    partial_path,
    write_attrs,
    write_skipped,
)

SHARD_PATTERN = re.compile(r"\.shard-(\d{5})-of-(\d{5})\.h5(\.partial)?$")


@dataclass(frozen=True)
class Rank:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, setting: str) -> str:
        """``auto`` means this rank's own GPU when there are GPUs, else the CPU."""
        if setting == "auto":
            return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        return setting

    def barrier(self) -> None:
        if not dist.is_initialized():
            # gloo works whatever device the model runs on: the group only synchronises.
            dist.init_process_group(backend="gloo")
        dist.barrier()


def current_rank() -> Rank | None:
    """The torchrun rank of this process, or None when it runs alone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    return Rank(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))


def block(num_rows: int, batch_size: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous rows: whole batches, spread as evenly as they go."""
    batches = -(-num_rows // batch_size)
    first = batches * rank // world_size
    last = batches * (rank + 1) // world_size
    return range(min(first * batch_size, num_rows), min(last * batch_size, num_rows))


def shard_path(path: str | os.PathLike, rank: int, world_size: int) -> Path:
    path = Path(path)
    return path.with_name(f"{path.stem}.shard-{rank:05d}-of-{world_size:05d}{path.suffix}")


def check_other_world_sizes(path: str | os.PathLike, world_size: int, overwrite: bool) -> None:
    """Refuse shards left by a run with another number of processes (or delete them)."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    stale = []
    for candidate in path.parent.glob(f"{path.stem}.shard-*"):
        match = SHARD_PATTERN.search(candidate.name)
        if match and int(match.group(2)) != world_size:
            stale.append(candidate)
    if stale and overwrite:
        for candidate in stale:
            candidate.unlink(missing_ok=True)
    elif stale:
        sizes = sorted({int(SHARD_PATTERN.search(c.name).group(2)) for c in stale})
        raise ConfigError(
            f"{path} has shards of a run with {', '.join(map(str, sizes))} processes "
            f"({stale[0].name}, ...); rerun with that many processes to resume it, or pass "
            "--overwrite to start over"
        )


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
    opened = [h5py.File(shard, "r") for shard in shards]
    try:
        for shard, f in zip(shards, opened, strict=True):
            if not f.attrs.get("complete"):
                raise FeatcacheError(f"shard {shard} is incomplete; rerun to resume it")
        tmp = path.with_name(path.name + ".combining")
        with h5py.File(tmp, "w") as out:
            _combine(out, shards, opened, path.parent)
            first = opened[0].attrs
            for key, value in first.items():
                if key not in ("resume_key",):
                    out.attrs[key] = value
            rows = sum(int(f.attrs["num_rows"]) for f in opened)
            seconds = max(float(f.attrs.get("seconds", 0.0)) for f in opened)
            write_attrs(
                out,
                {
                    "num_rows": rows,
                    "rows_written": rows,
                    "skipped": sum(int(f.attrs.get("skipped", 0)) for f in opened),
                    "world_size": len(shards),
                    "shards": [shard.name for shard in shards],
                    "seconds": seconds,
                    "images_per_second": rows / max(seconds, 1e-9),
                    **dict(attrs or {}),
                },
            )
            out.attrs["complete"] = True
    finally:
        for f in opened:
            f.close()
    os.replace(tmp, path)
    return FeatureStore(path)


def _combine(out: h5py.File, shards: Sequence[Path], opened: Sequence[h5py.File], folder: Path):
    names: list[str] = []
    opened[0].visititems(
        lambda name, obj: (
            names.append(name)
            if isinstance(obj, h5py.Dataset)
            and name != "progress"
            and not name.startswith("skipped")
            else None
        )
    )
    features = out.create_group("features", track_order=True)
    del features  # created first so that layers keep their capture order
    for name in names:
        first = opened[0][name]
        total = sum(len(f[name]) for f in opened)
        layout = h5py.VirtualLayout(shape=(total, *first.shape[1:]), dtype=first.dtype)
        offset = 0
        for shard, f in zip(shards, opened, strict=True):
            n = len(f[name])
            # Relative to the store's folder: HDF5 looks for sources beside the store.
            source = os.path.relpath(shard, folder)
            layout[offset : offset + n] = h5py.VirtualSource(source, name, shape=f[name].shape)
            offset += n
        dataset = out.create_virtual_dataset(name, layout)
        for key, value in first.attrs.items():
            dataset.attrs[key] = value
    records = [
        {"index": int(i), "id": sample_id, "reason": reason}
        for f in opened
        if "skipped" in f
        for i, sample_id, reason in zip(
            f["skipped/index"][:],
            f["skipped/ids"].asstr()[:],
            f["skipped/reasons"].asstr()[:],
            strict=True,
        )
    ]
    if records:
        write_skipped(out, records)


def merge_store(
    path: str | os.PathLike,
    target: str | os.PathLike,
    compression: str | None = None,
    progress: bool = True,
) -> FeatureStore:
    """Copy a (sharded) store into one self-contained file that needs no shard files."""
    store = FeatureStore(path)  # refuses incomplete stores
    target = Path(target)
    if target.exists():
        raise ConfigError(f"{target} already exists; choose another output path")
    if target.resolve() == store.path.resolve():
        raise ConfigError("merge writes a new file: give an output path other than the store")
    attrs = store.attrs
    shards = attrs.get("shards") or []
    store.close()
    copy_store(path, target, compression, progress, {"merged_from": shards}, drop=("shards",))
    return FeatureStore(target)
