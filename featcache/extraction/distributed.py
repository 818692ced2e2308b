"""Runs of several processes: which rows each computes, and when they meet.

Under torchrun the ranks of a group split the rows no shard holds yet, in whole batches,
each writing its rows as shards beside the output; rank 0 then combines the store. With
``--shard I/N`` the processes never meet: the one that finds every row held combines
it. See docs/guides/torchrun.md. Shard names, combining and merging live in
:mod:`featcache.store` and are importable from here too.
"""

from __future__ import annotations

import datetime
import itertools
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from featcache.errors import ConfigError
from featcache.store.merge import combine_shards, merge_store
from featcache.store.paths import shard_path

__all__ = [
    "Rank",
    "block",
    "combine_shards",
    "current_rank",
    "launch_words",
    "merge_store",
    "parse_shard",
    "shard_path",
    "share_rows",
]


# How long a rank that is done waits for the others at a barrier: ranks can finish hours
# apart, and torch's default of 30 minutes would fail such a run.
RANKS_WAIT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Rank:
    """This process's place in a run of several: a torchrun rank (``group``: the ranks
    meet), or shard ``rank`` of ``world_size`` independent processes (``--shard I/N``)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None  # processes on this machine (None: all of them)
    group: bool = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, setting: str) -> str:
        """``auto`` means this rank's own GPU when there are GPUs, else the CPU."""
        if setting == "auto":
            return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        return setting

    def join(self) -> None:
        """Join the ranks' group (once per process; it waits for every rank). Joined
        before any work, while the launcher is alive: ranks that outlive it still finish."""
        if self.group and not dist.is_initialized():
            store, rank, world_size = next(dist.rendezvous("env://", timeout=RANKS_WAIT))
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # The elastic agent's store outlives a restart, with the keys the group of
                # the attempt before left (pytorch/pytorch#135712): each attempt's group
                # gets keys of its own.
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                store = dist.PrefixStore(f"featcache/attempt-{attempt}", store)
            # gloo works whatever device the model runs on: the group only synchronises.
            dist.init_process_group(
                backend="gloo", store=store, rank=rank, world_size=world_size, timeout=RANKS_WAIT
            )

    def barrier(self) -> None:
        """Wait until every rank gets here (at once for processes that do not meet)."""
        if self.group:
            self.join()
            dist.barrier()

    def launch_id(self) -> str:
        """An id shared by the processes of this launch (and elastic restart), which the
        shards' history records group by."""
        ids = [uuid.uuid4().hex[:12] if self.rank == 0 or not self.group else None]
        if self.group:
            self.join()
            dist.broadcast_object_list(ids, src=0)
        return str(ids[0])


def parse_shard(text: str) -> Rank:
    """``"I/N"`` (``0 <= I < N``) as shard I of N independent processes.

    Raises:
        ConfigError: ``text`` is not of that form.
    """
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ConfigError(
            f"--shard {text!r}: give I/N with 0 <= I < N, such as --shard 0/4 for the "
            "first of four jobs (a Slurm array's $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)"
        )
    return Rank(int(index), int(count), 0, 1, group=False)


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
    """The start of a command line that runs ``featcache`` as this process was run: alone,
    or under torchrun with as many processes and machines as ``rank`` says (the user adds
    the rendezvous options)."""
    if rank is None or not rank.group:
        return ["featcache"]
    per_machine = min(rank.local_world_size or rank.world_size, rank.world_size)
    if per_machine == rank.world_size:
        nodes = ["--standalone"]
    else:
        nodes = ["--nnodes", str(-(-rank.world_size // per_machine))]
    return ["torchrun", *nodes, "--nproc-per-node", str(per_machine), "-m", "featcache"]


def share_rows(
    missing: Sequence[range], world_size: int, step: int, shard_starts: Sequence[int] = ()
) -> list[list[range]]:
    """The rows of ``missing`` (sorted, disjoint blocks of source rows) each of
    ``world_size`` processes computes: contiguous runs of whole batches of ``step`` rows
    on the grid from row 0, as even as they go (rank 0 first). A sharded source is split
    at its ``shard_starts`` instead (with fewer shards than processes, some get none).
    """
    units: list[range] = []
    for part in missing:
        if shard_starts:
            inner = [s for s in shard_starts if part.start < s < part.stop]
        else:
            inner = list(range(-(-part.start // step) * step, part.stop, step))
        cuts = sorted({part.start, *inner, part.stop})
        units += [range(a, b) for a, b in itertools.pairwise(cuts)]
    ends = [0, *itertools.accumulate(map(len, units))]

    def cut(r: int) -> int:
        if not shard_starts:
            return len(units) * r // world_size
        target = ends[-1] * r / world_size  # the unit edge nearest r / world_size of the rows
        return min(range(len(ends)), key=lambda i: (abs(ends[i] - target), i))

    return [_joined(units[cut(r) : cut(r + 1)]) for r in range(world_size)]


def _joined(units: Sequence[range]) -> list[range]:
    """``units`` (in order) with each run of adjacent ones as one range."""
    joined: list[range] = []
    for unit in units:
        if joined and joined[-1].stop == unit.start:
            joined[-1] = range(joined[-1].start, unit.stop)
        else:
            joined.append(unit)
    return joined


def block(
    num_rows: int, batch_size: int, rank: int, world_size: int, shard_starts: Sequence[int] = ()
) -> range:
    """Rank ``rank``'s contiguous rows of all ``num_rows`` (see :func:`share_rows`)."""
    mine = share_rows([range(num_rows)], world_size, batch_size, shard_starts)[rank]
    return mine[0] if mine else range(0)
