"""torchrun runs: each rank extracts its block of rows into a shard, rank 0 combines them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from featcache.capture.reduce import token_layout
from featcache.config.spec import LayerSpec
from featcache.errors import FeatcacheError
from featcache.extraction.api import RunOptions, _plan, extract
from featcache.extraction.batches import source_length
from featcache.extraction.distributed import (
    Rank,
    block,
    check_other_world_sizes,
    combine_shards,
    shard_path,
)
from featcache.extraction.grid import shard_starts
from featcache.store import FeatureStore, remove_store, stored_resume_key
from featcache.store.history import run_record
from featcache.store.provenance import StoreKey


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
    arguments: dict[str, Any],
    check_space: bool = True,
    rows: range | None = None,
) -> FeatureStore:
    """This rank's block into its shard; then rank 0 writes the store over all shards.
    With ``check_space`` the rank refuses a shard its filesystem cannot hold. ``rows``
    (a block of source rows, default all) is the store's share of the source."""
    rank.join()
    world = rank.world_size
    overwrite = arguments["overwrite"]
    num_rows, batch_size = len(rows or range(source_length(source))), arguments["batch_size"]
    shard_arguments = dict(
        arguments,
        device=rank.device(arguments["device"]),
        progress=arguments["progress"] and rank.is_main,
    )
    per_call = ("provenance", "dataset_fingerprint", "prefix_tokens", "sequence_first")
    plan_options = {k: v for k, v in shard_arguments.items() if k not in per_call}
    plan = _plan(
        model,
        source,
        layers,
        RunOptions.from_kwargs(**plan_options),
        ids=None,
        class_names=None,
        provenance=arguments.get("provenance"),
        dataset_fingerprint=arguments.get("dataset_fingerprint"),
        rows=None,
        tokens=token_layout(
            model, arguments.get("prefix_tokens"), arguments.get("sequence_first", False)
        ),
    )
    done_key = combined_key(plan.key(), num_rows, world)
    if path.exists() and not overwrite and done_key.matches(stored_resume_key(path)):
        return FeatureStore(path)
    check_other_world_sizes(path, world, overwrite)
    if overwrite and rank.is_main:
        remove_store(path)
    starts = shard_starts(source)  # a sharded source goes to the ranks in whole shards
    blocks = [block(num_rows, batch_size, r, world, starts) for r in range(world)]
    if blocks[rank.rank]:
        extract(
            model,
            source,
            layers,
            shard_path(path, rank.rank, world),
            rows=blocks[rank.rank],
            check_space=check_space,
            **shard_arguments,
        )
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
