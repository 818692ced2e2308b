"""Shuffled reading: FeatureDataset against in-memory indexing and per-row h5py, in one process.

Writes a ``[rows, dim]`` store with featcache's own writer (one layer, chunks of ~1 MiB or
of ``--chunk-rows`` rows) in a temporary folder, then times one shuffled pass over it in
batches of ``--batch`` rows for each case, warm-up first, the cases interleaved over
``--repeats`` repeats (every other one in reverse order), medians reported. The file is
in the page cache (just written), so the figures measure the reading machinery, not the
disk. Cases:

* in-memory tensor ``x[idx]``: the whole array in memory, indexed with a random batch of
  row numbers; the baseline (1.00x). ``x.index_select(0, idx)``, the fastest torch
  gather, is shown beside it.
* per-row h5py: ``dataset[i]`` for each row of a shuffled order, on ``h5py.File(path)``
  with h5py's default chunk cache (the "vs per-row" reference), and with the chunk cache
  off; and ``FeatureStore.read(layer, [i])`` for the same rows. Only ``--per-row`` rows
  are read.
* ``FeatureDataset`` through ``DataLoader(batch_size, shuffle=True)``: a batch is read in
  increasing row order (``__getitems__``), with the default chunk cache (none for an
  uncompressed layer) and with a 4 MiB one; one whole epoch, or ``--sampled`` rows of it.
* ``FeatureDataset.batches``: chunk-aware shuffling from the file, and from memory
  (``in_memory=True``).
* the same ``DataLoader`` and ``batches`` cases over the same number of rows in a store
  combined from two torchrun shards (HDF5 virtual datasets over the shard files, as
  ``featcache extract`` under torchrun writes it).
* ``ShuffledBatches`` under ``DataLoader(batch_size=None, num_workers=--workers,
  persistent_workers=True)``; skipped with ``--workers 0``.

The store is written as featcache writes by default, with an XXH3 checksum per
chunk (``store.checksum``). ``--checksum-cost`` also writes the same rows without
checksums and times the per-row, ``FeatureDataset`` and ``ShuffledBatches`` cases on it
too (rows ``..., no checksum``, each run right beside its twin with checksums), then
prints each case's speed with checksums over its speed without. featcache checks a
chunk's checksum the first time it is read while its file is open: every case but one
closes its file after each repeat, so each repeat pays for the checks of every chunk it
touches; ``FeatureDataset.batches, later epochs, one handle`` keeps a copy of the store
open from the warm-up on, as a training loop does, and shows what epochs after the first
cost.

``--tokens`` times the token view instead, on a store of per-token rows (as a text model
with ``reduce: none`` writes): ``--rows`` tokens of ``--dim`` values in rows of 1 to 64
tokens. Cases: the same in-memory baseline over the ``[tokens, dim]`` array, and
``TokenDataset.batches`` (shuffled single tokens, with their row and position) from the
file, from memory, and through ``ShuffledBatches`` workers. Target: the shuffled token
view at >= 0.5x in-memory indexing.

Flags: ``--rows``, ``--dim``: the store's shape; ``--dtype``: its dtype (float16,
float32, bfloat16); ``--batch``: rows per batch; ``--repeats``: timed repeats;
``--per-row``: rows read per repeat by the per-row cases (the slow ones); ``--sampled``:
rows read per repeat by the ``FeatureDataset, DataLoader`` cases (default: a whole
epoch; fewer rows make the checksum cost look larger than it is, since a fresh handle
checks every chunk that a random sample touches, nearly all of them, for a fraction of
the rows); ``--workers``: DataLoader workers for ``ShuffledBatches``; ``--float32``:
convert every batch to float32, in the baseline too (by default batches stay in the
stored dtype); ``--threads``: torch intra-op threads, 1 by default, as in a DataLoader
worker (on a busy 2-core machine torch's multi-threaded gathers stall);
``--checksum-cost``: the cases above also on a store without checksums; ``--tokens``: the
token view (see above).

``--read-ahead`` times reading ahead instead: one epoch of ``FeatureDataset.batches``
with ``read_ahead=True`` (a thread reads and checks the next buffer while batches are
drawn from the current one) against ``read_ahead=False``, on the store with checksums
(and, with ``--checksum-cost``, on one without), with nothing done with the batches and
with a linear-probe step on each (``features.float() @ W`` for a ``[dim, 10]`` W).
``--cold`` drops the page cache before every run (Linux, as root), so that the epochs
read from the disk.

    python scripts/bench_read.py [--rows 50000] [--dim 512] [--dtype float16] [--batch 256]
                                 [--repeats 5] [--per-row 5000] [--sampled ROWS]
                                 [--workers 2] [--float32] [--threads 1] [--checksum-cost]
                                 [--tokens | --read-ahead [--cold]]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader

import featcache  # noqa: F401  (before torchvision, which this script does not need)
from featcache.read.dataset import FeatureDataset, ShuffledBatches
from featcache.read.token_view import TokenDataset
from featcache.store import FeatureStore, StorePlan, StoreWriter, combine_shards
from featcache.store.paths import shard_path

BASELINE = "in-memory tensor x[idx]"
PER_ROW = "per-row h5py, default chunk cache"
NO_CHECKSUM = ", no checksum"  # suffix of the cases on the store without checksums
LATER_EPOCHS = "FeatureDataset.batches, later epochs, one handle"


def write_store(
    path: Path,
    rows: int,
    dim: int,
    dtype: str,
    checksum: bool = True,
    chunk_rows: int | None = None,
) -> None:
    """A one-layer store ``x`` of standard normal rows, labels ``row % 10``; chunks of
    ``chunk_rows`` rows (None: featcache's ~1 MiB)."""
    rng = np.random.default_rng(0)
    writer = StoreWriter(
        StorePlan(path, rows, ids_width=8, dtype=dtype, checksum=checksum, chunk_rows=chunk_rows)
    )
    for start in range(0, rows, 4096):
        stop = min(start + 4096, rows)
        index = np.arange(start, stop)
        x = torch.from_numpy(rng.standard_normal((stop - start, dim), dtype=np.float32))
        if dtype == "bfloat16":
            x = x.to(torch.bfloat16).view(torch.int16)
        else:
            x = x.to(getattr(torch, dtype))
        writer.append(index, [f"{i:08d}" for i in index], index % 10, {"x": x.numpy()})
    writer.close(complete=True)


def write_token_store(path: Path, tokens: int, dim: int, dtype: str) -> None:
    """A store whose layer ``x`` holds per-token rows of 1 to 64 standard normal tokens."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=tokens)  # more rows than needed; cut below
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    lengths[-1] -= int(lengths.sum()) - tokens
    rows = len(lengths)
    writer = StoreWriter(StorePlan(path, rows, ids_width=8, dtype=dtype, token_capacity=tokens))
    for start in range(0, rows, 256):
        stop = min(start + 256, rows)
        index = np.arange(start, stop)
        count = int(lengths[start:stop].sum())
        x = torch.from_numpy(rng.standard_normal((count, dim), dtype=np.float32))
        x = (
            x.to(torch.bfloat16).view(torch.int16)
            if dtype == "bfloat16"
            else x.to(getattr(torch, dtype))
        )
        writer.append(
            index,
            [f"{i:08d}" for i in index],
            index % 10,
            {"x": x.numpy()},
            lengths=lengths[start:stop],
            ragged=frozenset({"x"}),
        )
    writer.close(complete=True)


def with_workers(dataset: FeatureDataset, batch: int, workers: int) -> Callable[[], int]:
    """One epoch of ShuffledBatches through persistent DataLoader workers, a new order each."""
    shuffled = ShuffledBatches(dataset, batch)
    loader = DataLoader(shuffled, batch_size=None, num_workers=workers, persistent_workers=True)

    def run() -> int:
        shuffled.set_epoch(shuffled.epoch + 1)
        return sum(len(batch[0]) for batch in loader)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument(
        "--chunk-rows", type=int, default=None, help="rows per chunk (default: about 1 MiB)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--per-row", type=int, default=5000, help="rows read one at a time")
    parser.add_argument(
        "--sampled", type=int, default=None, help="rows read by __getitems__ (default: all)"
    )
    parser.add_argument("--workers", type=int, default=2, help="for ShuffledBatches; 0: skip")
    parser.add_argument("--float32", action="store_true", help="convert every batch to float32")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--checksum-cost", action="store_true", help="also time a store without checksums"
    )
    parser.add_argument("--tokens", action="store_true", help="time the token view")
    parser.add_argument("--read-ahead", action="store_true", help="time reading ahead")
    parser.add_argument("--cold", action="store_true", help="--read-ahead from the disk")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="featcache-bench-read-") as folder:
        if args.read_ahead:
            bench_read_ahead(args, Path(folder))
        elif args.tokens:
            bench_tokens(args, Path(folder) / "tokens.h5")
        else:
            bench(args, Path(folder) / "read.h5")


def bench_tokens(args: argparse.Namespace, path: Path) -> None:
    write_token_store(path, args.rows, args.dim, args.dtype)
    dtype = torch.float32 if args.float32 else None
    batch = args.batch
    with FeatureStore(path) as store:
        memory = store.read_tokens("x")[0]
    in_memory = in_memory_case(memory, batch, args.float32)

    def token_view(dataset: TokenDataset) -> Callable[[], int]:
        epochs = iter(range(1 << 30))

        def run() -> int:
            seen = sum(len(rows) for _, rows, _ in dataset.batches(batch, epoch=next(epochs)))
            dataset.close()
            return seen

        return run

    file_view = TokenDataset(path, "x", dtype=dtype)
    cases: dict[str, Callable[[], int]] = {
        BASELINE: in_memory,
        "TokenDataset.batches, shuffled": token_view(file_view),
        "  same, in_memory=True": token_view(TokenDataset(path, "x", dtype=dtype, in_memory=True)),
    }
    if args.workers:
        cases[f"ShuffledBatches(TokenDataset), {args.workers} workers"] = with_workers(
            file_view, batch, args.workers
        )
    speed = time_cases(cases, args.repeats)
    print(
        f"[{args.rows} tokens, {args.dim}] {args.dtype} per-token store with checksums "
        f"({file_view.num_rows} tokens in {len(file_view.row_offsets) - 1} rows), chunks of "
        f"{file_view.block_rows} tokens, batch {batch}; {torch.get_num_threads()} torch threads; "
        f"median of {args.repeats}"
    )
    width = max(42, *(len(name) for name in speed))
    print(f"{'case':<{width}} {'tokens/s':>11} {'vs in-memory':>13}")
    for name, value in speed.items():
        print(f"{name:<{width}} {value:>11,.0f} {value / speed[BASELINE]:>12.2f}x")


def in_memory_case(memory: torch.Tensor, batch: int, float32: bool) -> Callable[[], int]:
    """The baseline: one shuffled pass over ``memory`` by ``x[idx]`` in batches of ``batch``."""

    def run() -> int:
        order = torch.randperm(len(memory))
        for start in range(0, len(order), batch):
            picked = memory[order[start : start + batch]]
            if float32:
                picked.float()
        return len(order)

    return run


def bench_read_ahead(args: argparse.Namespace, folder: Path) -> None:
    stores = {"checksums": folder / "summed.h5"}
    write_store(stores["checksums"], args.rows, args.dim, args.dtype, chunk_rows=args.chunk_rows)
    if args.checksum_cost:
        stores["no checksum"] = folder / "plain.h5"
        write_store(stores["no checksum"], args.rows, args.dim, args.dtype, False, args.chunk_rows)
    weights = torch.randn(args.dim, 10)

    def epoch(path: Path, read_ahead: bool, step: bool) -> Callable[[], float]:
        def run() -> float:  # seconds for one epoch, from a fresh handle
            if args.cold:
                drop_page_cache()
            start = time.perf_counter()
            dataset = FeatureDataset(path, "x", dtype=None)
            for features, _ in dataset.batches(args.batch, read_ahead=read_ahead):
                if step:
                    (features.float() @ weights).sum()
            dataset.close()
            return time.perf_counter() - start

        return run

    cases = {
        (store, step, ahead): epoch(path, ahead, step)
        for store, path in stores.items()
        for step in (False, True)
        for ahead in (True, False)
    }
    seconds: dict[tuple[str, bool, bool], list[float]] = {key: [] for key in cases}
    for run in cases.values():
        run()  # warm-up
    for _ in range(args.repeats):
        for key, run in cases.items():
            seconds[key].append(run())
    speed = {key: args.rows / statistics.median(times) for key, times in seconds.items()}
    print(
        f"[{args.rows}, {args.dim}] {args.dtype} store, one epoch of FeatureDataset.batches, "
        f"batch {args.batch}, {'page cache dropped' if args.cold else 'page cache warm'}; "
        f"{torch.get_num_threads()} torch threads; median of {args.repeats}"
    )
    print(f"{'case':<44} {'read_ahead':>11} {'rows/s':>11} {'ahead/not':>10}")
    for (store, step, ahead), value in speed.items():
        name = f"{store}, {'probe step' if step else 'nothing done'}"
        ratio = f"{value / speed[(store, step, False)]:>9.2f}x" if ahead else ""
        print(f"{name:<44} {str(ahead):>11} {value:>11,.0f} {ratio:>10}")


def drop_page_cache() -> None:
    """Write back and drop the page cache (Linux, as root), so reads come from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError as exc:
        raise SystemExit(f"--cold drops the page cache, which needs root on Linux: {exc}") from exc


def time_cases(cases: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Items per second of each case: the median of ``repeats`` interleaved timed runs,
    after one warm-up run of each (imports, page cache, worker start)."""
    for run in cases.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    items: dict[str, int] = {}
    names = list(cases)
    for repeat in range(repeats):
        # Interleaved, so that drift hits every case alike, and every other repeat in
        # reverse, so that no case always runs right after the same one.
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            items[name] = cases[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: items[name] / statistics.median(times) for name, times in seconds.items()}


def bench(args: argparse.Namespace, path: Path) -> None:
    write_store(path, args.rows, args.dim, args.dtype, chunk_rows=args.chunk_rows)
    plain = path.with_name("plain.h5")
    if args.checksum_cost:
        write_store(plain, args.rows, args.dim, args.dtype, False, args.chunk_rows)
    dtype = torch.float32 if args.float32 else None
    batch = args.batch
    shuffled_rows = np.random.default_rng(1).permutation(args.rows)[: args.per_row].tolist()

    combined = path.with_name("combined.h5")
    shards = [shard_path(combined, first) for first in (0, args.rows // 2)]
    write_store(shards[0], args.rows // 2, args.dim, args.dtype, chunk_rows=args.chunk_rows)
    write_store(shards[1], args.rows - args.rows // 2, args.dim, args.dtype, True, args.chunk_rows)
    combine_shards(combined, shards).close()
    file_dataset = FeatureDataset(path, "x", dtype=dtype)
    with FeatureStore(path) as store:
        memory = store.read("x")
    convert = (lambda t: t.float()) if args.float32 else (lambda t: t)
    in_memory = in_memory_case(memory, batch, args.float32)

    def in_memory_select() -> int:
        order = torch.randperm(len(memory))
        for start in range(0, len(order), batch):
            convert(memory.index_select(0, order[start : start + batch]))
        return len(order)

    def per_row(cache: dict, path: Path = path) -> Callable[[], int]:
        def run() -> int:
            with h5py.File(path, "r", **cache) as f:
                x = f["features/x"]
                for row in shuffled_rows:
                    x[row]
            return len(shuffled_rows)

        return run

    def store_per_row() -> int:
        with FeatureStore(path) as store:
            for row in shuffled_rows:
                store.read("x", [row])
        return len(shuffled_rows)

    def sampled(chunk_cache: int | None, path: Path = path) -> Callable[[], int]:
        dataset = FeatureDataset(path, "x", dtype=dtype, chunk_cache=chunk_cache)
        loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=0)

        def run() -> int:
            seen = 0
            for features, _ in loader:
                seen += len(features)
                if args.sampled is not None and seen >= args.sampled:
                    break
            dataset.close()  # a fresh handle each repeat: nothing is left in the cache
            return seen

        return run

    def chunk_aware(dataset: FeatureDataset, reopen: bool = True) -> Callable[[], int]:
        epochs = iter(range(1 << 30))

        def run() -> int:
            seen = sum(len(labels) for _, labels in dataset.batches(batch, epoch=next(epochs)))
            if reopen:  # HDF5 shares an open dataset's cache with later opens
                dataset.close()  # and featcache checks each chunk once per open dataset
            return seen

        return run

    cases: dict[str, Callable[[], int]] = {
        BASELINE: in_memory,
        "in-memory tensor x.index_select(0, idx)": in_memory_select,
        PER_ROW: per_row({}),
        "per-row h5py, no chunk cache": per_row({"rdcc_nbytes": 0}),
        "per-row FeatureStore.read": store_per_row,
        "FeatureDataset, DataLoader shuffle=True": sampled(None),
        "  same, 4 MiB chunk cache": sampled(4 << 20),
        "FeatureDataset.batches, shuffled": chunk_aware(file_dataset),
        "  same, in_memory=True": chunk_aware(
            FeatureDataset(path, "x", dtype=dtype, in_memory=True)
        ),
        "2 torchrun shards, DataLoader shuffle=True": sampled(None, combined),
        "2 torchrun shards, FeatureDataset.batches": chunk_aware(
            FeatureDataset(combined, "x", dtype=dtype)
        ),
    }
    if args.workers:
        cases[f"ShuffledBatches, DataLoader {args.workers} workers"] = with_workers(
            file_dataset, batch, args.workers
        )
    if args.checksum_cost:
        plain_dataset = FeatureDataset(plain, "x", dtype=dtype)
        cases[PER_ROW + NO_CHECKSUM] = per_row({}, plain)
        cases["FeatureDataset, DataLoader shuffle=True" + NO_CHECKSUM] = sampled(None, plain)
        cases["FeatureDataset.batches, shuffled" + NO_CHECKSUM] = chunk_aware(plain_dataset)
        # Copies, so that the handles they keep open do not keep the other cases' files open
        # (featcache remembers a chunk as checked for as long as its file is open).
        kept = {path: path.with_name("kept.h5"), plain: plain.with_name("kept-plain.h5")}
        for original, copy in kept.items():
            shutil.copyfile(original, copy)
        cases[LATER_EPOCHS] = chunk_aware(FeatureDataset(kept[path], "x", dtype=dtype), False)
        cases[LATER_EPOCHS + NO_CHECKSUM] = chunk_aware(
            FeatureDataset(kept[plain], "x", dtype=dtype), reopen=False
        )
        if args.workers:
            name = f"ShuffledBatches, DataLoader {args.workers} workers"
            cases[name + NO_CHECKSUM] = with_workers(plain_dataset, batch, args.workers)

    # Each case beside its twin without checksums, so that the two run in the same state.
    order = [name for name in cases if not name.endswith(NO_CHECKSUM)]
    order = [n for name in order for n in (name, name + NO_CHECKSUM) if n in cases]
    speed = time_cases({name: cases[name] for name in order}, args.repeats)
    print(
        f"[{args.rows}, {args.dim}] {args.dtype} store with checksums, chunks of "
        f"{file_dataset.block_rows} rows, batch {batch}, "
        f"{'float32' if args.float32 else 'stored dtype'} out; "
        f"{torch.get_num_threads()} torch threads, {platform.machine()}, "
        f"h5py {h5py.version.version}, HDF5 {h5py.version.hdf5_version}; "
        f"median of {args.repeats}"
    )
    width = max(42, *(len(name) for name in speed))
    print(f"{'case':<{width}} {'rows/s':>11} {'vs in-memory':>13} {'vs per-row':>11}")
    for name, value in speed.items():
        print(
            f"{name:<{width}} {value:>11,.0f} {value / speed[BASELINE]:>12.2f}x "
            f"{value / speed[PER_ROW]:>10.1f}x"
        )
    pairs = [name for name in speed if name + NO_CHECKSUM in speed]
    if pairs:
        print("\nchecksum cost: rows/s with XXH3 checksums over rows/s without")
        column = max(len(name) for name in pairs)
        print(f"{'case':<{column}} {'with':>11} {'without':>11} {'ratio':>7}")
        for name in pairs:
            without = speed[name + NO_CHECKSUM]
            ratio = speed[name] / without
            print(f"{name:<{column}} {speed[name]:>11,.0f} {without:>11,.0f} {ratio:>6.2f}x")


if __name__ == "__main__":
    main()
