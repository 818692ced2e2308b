"""torchrun runs: each rank extracts its block of rows into a shard, rank 0 combines them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from featcache.config.spec import LayerSpec
from featcache.errors import FeatcacheError
from featcache.extraction.api import run_plan
from featcache.extraction.distributed import (
    Rank,
    block,
    check_other_world_sizes,
    combine_shards,
    shard_path,
)
from featcache.extraction.plan import RunOptions, make_plan
from featcache.store import FeatureStore, remove_store
from featcache.store.history import run_record
from featcache.store.lock import writer_lock
from featcache.store.provenance import StoreKey
from featcache.store.state import store_state


def combined_key(shard_key: StoreKey, num_rows: int, world_size: int) -> StoreKey:
    """The key of the store combined from every rank's shard: all rows, the world size,
    and the device type rather than any one rank's device."""
    layout = dict(shard_key.layout)
    layout["device"] = str(layout.get("device", "")).split(":")[0]
    return dataclasses.replace(shard_key, rows=(0, num_rows), world_size=world_size, layout=layout)


def extract_shard(
    model: nn.Module,
    source: Dataset,
    layers: Sequence[LayerSpec],
    path: Path,
    rank: Rank,
    options: RunOptions,
    arguments: dict[str, Any],
    check_space: bool = True,
) -> FeatureStore:
    """This rank's block into its shard; then rank 0 writes the store over all shards.
    ``arguments`` are :func:`~featcache.extraction.plan.make_plan`'s for the whole store.
    With ``check_space`` the rank refuses a shard its filesystem cannot hold."""
    rank.join()
    world = rank.world_size
    runtime = options.runtime
    options = dataclasses.replace(
        options,
        runtime=dataclasses.replace(
            runtime, device=rank.device(runtime.device), progress=runtime.progress and rank.is_main
        ),
    )
    plan = make_plan(model, source, layers, options, **arguments)
    num_rows = len(plan.rows)
    done_key = combined_key(plan.key(), num_rows, world)
    state = store_state(path)
    if state.complete and not options.overwrite and done_key.matches(state.key):
        return FeatureStore(path)
    check_other_world_sizes(path, world, options.overwrite)
    if options.overwrite and rank.is_main:
        remove_store(path)
    batch_size = options.loader.batch_size  # a sharded source goes in whole shards
    blocks = [block(num_rows, batch_size, r, world, plan.shard_starts) for r in range(world)]
    if blocks[rank.rank]:
        shard = shard_path(path, rank.rank, world)
        with writer_lock(shard):
            shard_plan = make_plan(
                model, source, layers, options, rows=blocks[rank.rank], **arguments
            )
            run_plan(shard_plan, shard, check_space=check_space)
    rank.barrier()
    if rank.is_main:
        shards = [shard_path(path, r, world) for r in range(world) if blocks[r]]
        key = done_key.to_json()
        counts = (len(plan.taps), 0)
        computed, resumed = _rows_of_last_runs(shards)  # every shard's rows
        history = [run_record("extract", (computed, 0), counts, key, resumed=resumed)]
        combine_shards(path, shards, {"resume_key": key, "history": history})
    rank.barrier()
    return FeatureStore(path)


def _rows_of_last_runs(shards: Sequence[Path]) -> tuple[int, int]:
    """The rows the last run of each of ``shards`` computed and those it resumed (a
    stopped run's), summed over the shards (one missing or incomplete is left to
    :func:`combine_shards` to name)."""
    computed = resumed = 0
    for shard in shards:
        try:
            with FeatureStore(shard) as store:
                history = store.attrs.get("history") or [{}]
                rows = len(store)
        except FeatcacheError:
            continue
        last = history[-1]
        computed += int(last.get("rows_computed", rows))
        resumed += int(last.get("rows_resumed") or 0)
    return computed, resumed
