"""Runs of several processes: each computes its share of the rows no shard holds yet.

Every attempt starts from the shards on disk: stopped ones no live process writes are
sealed, the rows no shard holds are shared out on the batch grid, and once every row is
held the store is combined over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from featcache.config.spec import LayerSpec
from featcache.extraction.api import run_plan
from featcache.extraction.distributed import (
    Rank,
    block,
    shard_path,
    share_rows,
)
from featcache.extraction.plan import ExtractionPlan, RunOptions, make_plan
from featcache.store import FeatureStore, remove_store
from featcache.store.lock import StoreBusyError, writer_lock
from featcache.store.merge import combine_when_done, copy_store
from featcache.store.provenance import StoreKey
from featcache.store.shards import Shard, check_same_run, missing_rows, read_shards, uncovered
from featcache.store.state import store_state


def combined_key(shard_key: StoreKey, num_rows: int) -> StoreKey:
    """The key of the store combined from shards: the one-process store's (all rows),
    with the device type rather than any one rank's device."""
    return dataclasses.replace(_device_type(shard_key), rows=(0, num_rows), world_size=None)


def _device_type(key: StoreKey) -> StoreKey:
    device = str(key.layout.get("device", "")).split(":")[0]
    return dataclasses.replace(key, layout={**key.layout, "device": device})


def extract_shard(
    model: nn.Module,
    source: Dataset,
    layers: Sequence[LayerSpec],
    path: Path,
    rank: Rank,
    options: RunOptions,
    arguments: dict[str, Any],
    check_space: bool = True,
) -> FeatureStore | None:
    """This process's share of the store at ``path`` as shards; then, once every row is
    held, the store over all shards (combined by rank 0 of a torchrun group, or by the
    process that finds the last row done). Returns the store, or None while other
    processes' rows remain. ``arguments`` are `make_plan`'s for the whole store."""
    rank.join()
    launch = rank.launch_id()
    runtime = options.runtime
    options = dataclasses.replace(
        options,
        runtime=dataclasses.replace(
            runtime, device=rank.device(runtime.device), progress=runtime.progress and rank.is_main
        ),
    )

    provenance = {**(arguments.get("provenance") or {}), "launch": launch}
    whole = make_plan(model, source, layers, options, **{**arguments, "provenance": provenance})
    # Keyed by its device type (cuda, not cuda:3): any process, on any of its devices,
    # resumes or seals a shard another wrote.
    plan = dataclasses.replace(whole, key=lambda: _device_type(whole.key()))
    num_rows = len(plan.rows)
    done_key = combined_key(plan.key(), num_rows)
    state = store_state(path)
    stored = {k: v for k, v in (state.key or {}).items() if k != "world_size"}
    if state.complete and not options.overwrite and done_key.matches(stored):
        return FeatureStore(path)
    if options.overwrite and rank.is_main:  # torchrun only: --shard jobs refuse it
        for file in state.shards:
            file.unlink(missing_ok=True)
        remove_store(path)
    rank.barrier()
    step = plan.bucket_window or options.loader.batch_size
    grid = (step, plan.shard_starts)
    stopped = [shard for shard in read_shards(path, *grid) if not shard.complete]
    # The shards one launch wrote hold one computation: recomputing a batch of the first
    # proves the others too (a shard of unknown launch is checked on its own).
    launches: set[str] = set()
    checks = []
    for shard in stopped:
        checks.append(0 if shard.launch in launches else 1)
        if shard.launch is not None:
            launches.add(shard.launch)
    rank.barrier()  # every rank has listed the same stopped shards before any is sealed
    mine = range(rank.rank, len(stopped), rank.world_size) if rank.group else range(len(stopped))
    for i in mine:
        _seal(stopped[i], plan, launch, busy_ok=not rank.group, batches=checks[i])
    rank.barrier()
    shards = read_shards(path, *grid)
    check_same_run(shards, plan.key().to_json())
    if rank.group:
        share = share_rows(missing_rows(shards, num_rows), rank.world_size, *grid)[rank.rank]
    else:
        mine = block(num_rows, step, rank.rank, rank.world_size, plan.shard_starts)
        share = uncovered(mine, [shard.held for shard in shards])
    for rows in share:
        shard_file = shard_path(path, rows.start)
        with writer_lock(shard_file):
            run_plan(plan.for_rows(rows), shard_file, check_space=check_space, launch=launch)
    rank.barrier()
    if rank.is_main or not rank.group:
        combine_when_done(path, num_rows, *grid, world_size=rank.world_size)
    rank.barrier()
    return FeatureStore(path) if path.is_file() else None


def _seal(
    shard: Shard,
    plan: ExtractionPlan,
    launch: str,
    busy_ok: bool,
    batches: int,
) -> None:
    """Complete the stopped shard ``shard`` with the rows a resume keeps (delete it when
    it keeps none), after ``batches`` of them are recomputed and compared. A shard a live
    process writes is left to it with ``busy_ok`` (another --shard job's).

    Raises:
        StoreBusyError: a live process writes the shard, and not ``busy_ok``.
    """
    try:
        with writer_lock(shard.path):
            if not shard.file.exists():  # sealed by another process meanwhile
                return
            if not shard.held:
                shard.file.unlink()
                return
            run_plan(
                plan.for_rows(shard.held),
                shard.path,
                check_space=False,
                seal=True,
                launch=launch,
                continuity=batches,
            )
            # Copied, its file no longer keeps room for the rows it was made for.
            copy_store(shard.path, shard.path)
    except StoreBusyError:
        if not busy_ok:
            raise
