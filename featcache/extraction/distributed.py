"""Sharded extraction under torchrun: which rows each rank owns, and when ranks meet.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every rank takes a contiguous
block of source rows, cut on the batch grid so that every batch holds the same samples as
in a single-process run, runs on its own device (``cuda:LOCAL_RANK``, or the CPU) and
writes ``<store>.shard-RRRRR-of-WWWWW.h5`` next to the output, resumable like any store.
When every rank is done, rank 0 writes the store itself: HDF5 virtual datasets over the
shards, which ``FeatureStore``, ``FeatureDataset`` and plain h5py read like one file.
``featcache merge`` copies such a store into one self-contained file.

Shard file names, combining and merging live in the store package
(:mod:`featcache.store.paths`, :mod:`featcache.store.merge`); they are importable from
here too.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from featcache.errors import ConfigError
from featcache.store.merge import combine_shards, merge_store
from featcache.store.paths import OVERWRITE, shard_path
from featcache.store.state import store_state

__all__ = [
    "Rank",
    "block",
    "check_other_world_sizes",
    "combine_shards",
    "current_rank",
    "launch_words",
    "merge_store",
    "shard_path",
]


# How long a rank that is done waits for the others at a barrier. Ranks can finish hours
# apart (a rank with no rows, or one whose shard was complete before a resume), and
# torch's default of 30 minutes, which bounds both joining the group and each barrier,
# would fail such a run.
RANKS_WAIT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Rank:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None  # processes on this machine (None: all of them)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, setting: str) -> str:
        """``auto`` means this rank's own GPU when there are GPUs, else the CPU."""
        if setting == "auto":
            return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        return setting

    def join(self) -> None:
        """Join the ranks' group (once per process; it waits for every rank).

        Joined before any work, while the launcher is alive: from then on the ranks talk
        directly, so ranks left running after their launcher died still finish and
        combine the store rather than wait for a launcher that is gone.
        """
        if not dist.is_initialized():
            # gloo works whatever device the model runs on: the group only synchronises.
            dist.init_process_group(backend="gloo", timeout=RANKS_WAIT)

    def barrier(self) -> None:
        """Wait until every rank gets here, for up to :data:`RANKS_WAIT`."""
        self.join()
        dist.barrier()


def current_rank() -> Rank | None:
    """The torchrun rank of this process, or None when it runs alone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")
    return Rank(
        int(os.environ["RANK"]),
        world_size,
        int(os.environ.get("LOCAL_RANK", "0")),
        None if local_world_size is None else int(local_world_size),
    )


def launch_words(rank: Rank | None) -> list[str]:
    """The start of a command line that runs ``featcache`` as this process was run:
    ``["featcache"]`` alone, or torchrun with as many processes (and machines) as ``rank``
    says. On several machines the user adds the rendezvous options they launched with."""
    if rank is None:
        return ["featcache"]
    per_machine = min(rank.local_world_size or rank.world_size, rank.world_size)
    if per_machine == rank.world_size:
        nodes = ["--standalone"]
    else:
        nodes = ["--nnodes", str(-(-rank.world_size // per_machine))]
    return ["torchrun", *nodes, "--nproc-per-node", str(per_machine), "-m", "featcache"]


def block(
    num_rows: int, batch_size: int, rank: int, world_size: int, shard_starts: Sequence[int] = ()
) -> range:
    """Rank ``rank``'s contiguous rows: whole batches, spread as evenly as they go.

    A sharded source (``shard_starts``: the first row of each shard after the first) is
    split into whole shards instead, each rank taking a contiguous run of them with about
    ``num_rows / world_size`` rows; with fewer shards than ranks, some ranks get none.
    """
    if shard_starts:
        edges = [0, *sorted(s for s in shard_starts if 0 < s < num_rows), num_rows]

        def cut(r: int) -> int:  # the shard edge nearest r / world_size of the rows
            target = num_rows * r / world_size
            return min(edges, key=lambda edge: (abs(edge - target), edge))

        return range(cut(rank), cut(rank + 1))
    batches = -(-num_rows // batch_size)
    first = batches * rank // world_size
    last = batches * (rank + 1) // world_size
    return range(min(first * batch_size, num_rows), min(last * batch_size, num_rows))


def check_other_world_sizes(
    path: str | os.PathLike, world_size: int, overwrite: bool, delete: bool = True
) -> list[Path]:
    """Refuse shards left by a run with another number of processes beside the store at
    ``path``; with ``overwrite``, delete them (or, without ``delete``, leave that to the
    caller) and return them."""
    stale = store_state(path).other_world_sizes(world_size)
    if stale and overwrite:
        for candidate in stale if delete else ():
            candidate.unlink(missing_ok=True)
        return list(stale)
    if stale:
        first = next(iter(stale))
        raise ConfigError(
            f"{path} has shards of a run with {', '.join(map(str, sorted(set(stale.values()))))} "
            f"processes ({first.name}, ...); rerun with that many processes to resume it "
            f"(`featcache info {first}` prints the command), or pass {OVERWRITE} to start over"
        )
    return []
