"""CPU time of small reads: one row through ``FeatureStore.read``, a shuffled batch through
``FeatureDataset.__getitems__``, of one store file and of a store combined from two
torchrun shards.

Writes a ``[--rows, --dim]`` float16 store with featcache's writer in a temporary folder,
and the same rows as two shards combined into one store (as a torchrun run leaves them),
then times, for each, ``--reads`` one-row reads at random rows through one open
``FeatureStore`` and ``--batches`` batches of ``--batch`` shuffled rows (sorted, as a
DataLoader batch sampler gives them to ``__getitems__``) through one ``FeatureDataset``.
It reports the process CPU time per call, the lowest and every one of ``--repeats``
repeats. CPU time, not wall
clock: on a shared machine it is the steadier figure for costs of a few hundred
microseconds. Run it with the code before and after a change (``PYTHONPATH=<checkout>``).

    python scripts/bench_row_reads.py [--rows 20000] [--dim 64] [--reads 10000]
                                      [--batches 2000] [--batch 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from featcache.read.dataset import FeatureDataset
from featcache.store import FeatureStore, StorePlan, StoreWriter, combine_shards


def write_store(path: Path, rows: range, dim: int) -> Path:
    """A one-layer store ``a`` of the standard normal float16 ``rows`` (row ``i`` seeded by
    ``i // 500``, so that shards hold the rows of one store)."""
    writer = StoreWriter(StorePlan(path, len(rows), ids_width=8))
    for start in range(rows.start, rows.stop, 500):
        index = np.arange(start, min(start + 500, rows.stop))
        values = np.random.default_rng(start // 500).standard_normal((len(index), dim))
        features = {"a": values.astype(np.float16)}
        writer.append(index, [str(i) for i in index], np.zeros(len(index), np.int64), features)
    writer.close(complete=True)
    return path


def time_reads(
    path: Path, rows: list[int], batches: list[list[int]], repeats: int, label: str
) -> dict[str, list[float]]:
    """CPU microseconds per one-row read and per batch read of the store at ``path``."""
    store = FeatureStore(path)
    dataset = FeatureDataset(path, "a", dtype=None)
    one, many = (
        f"FeatureStore.read, one row, {label}",
        f"__getitems__, {len(batches[0])} rows, {label}",
    )
    micros: dict[str, list[float]] = {one: [], many: []}
    for _ in range(repeats):
        start = time.process_time()
        for row in rows:
            store.read("a", [row])
        micros[one].append((time.process_time() - start) / len(rows) * 1e6)
        start = time.process_time()
        for batch in batches:
            dataset.__getitems__(batch)
        micros[many].append((time.process_time() - start) / len(batches) * 1e6)
    store.close()
    dataset.close()
    return micros


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reads", type=int, default=10000)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    rows = rng.integers(0, args.rows, args.reads).tolist()
    batches = [
        np.sort(rng.choice(args.rows, args.batch, replace=False)).tolist()
        for _ in range(args.batches)
    ]
    with tempfile.TemporaryDirectory(prefix="featcache-bench-rows-") as name:
        folder = Path(name)
        one = write_store(folder / "rows.h5", range(args.rows), args.dim)
        half = args.rows // 1000 * 500  # shards split on the seeding blocks
        shards = [
            write_store(folder / "s0.h5", range(half), args.dim),
            write_store(folder / "s1.h5", range(half, args.rows), args.dim),
        ]
        combine_shards(folder / "combined.h5", shards).close()
        micros = time_reads(one, rows, batches, args.repeats, "one file")
        micros |= time_reads(folder / "combined.h5", rows, batches, args.repeats, "2 shards")
    print(f"[{args.rows}, {args.dim}] float16 store, CPU time per call, {args.repeats} repeats")
    for name, values in micros.items():
        every = ", ".join(f"{value:.0f}" for value in values)
        print(f"{name:<46} {min(values):>8.0f} us (lowest; all: {every})")


if __name__ == "__main__":
    main()
