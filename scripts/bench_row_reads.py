"""CPU time of small reads: one row through ``FeatureStore.read``, a shuffled batch through
``FeatureDataset.__getitems__``.

Writes a ``[--rows, --dim]`` float16 store with featcache's writer in a temporary folder,
then times ``--reads`` one-row reads at random rows through one open ``FeatureStore`` and
``--batches`` batches of ``--batch`` shuffled rows (sorted, as a DataLoader batch sampler
gives them to ``__getitems__``) through one ``FeatureDataset``. It reports the process CPU
time per call, the lowest and every one of ``--repeats`` repeats. CPU time, not wall
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

from featcache.dataset import FeatureDataset
from featcache.store import FeatureStore, StorePlan, StoreWriter


def write_store(path: Path, rows: int, dim: int) -> None:
    """A one-layer store ``a`` of standard normal float16 rows."""
    rng = np.random.default_rng(0)
    writer = StoreWriter(StorePlan(path, rows, ids_width=8))
    for start in range(0, rows, 500):
        index = np.arange(start, min(start + 500, rows))
        values = rng.standard_normal((len(index), dim)).astype(np.float16)
        writer.append(index, [str(i) for i in index], np.zeros(len(index), np.int64), {"a": values})
    writer.close(complete=True)


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
    with tempfile.TemporaryDirectory(prefix="featcache-bench-rows-") as folder:
        path = Path(folder) / "rows.h5"
        write_store(path, args.rows, args.dim)
        store = FeatureStore(path)
        dataset = FeatureDataset(path, "a", dtype=None)
        label = f"FeatureDataset.__getitems__, {args.batch} rows"
        micros: dict[str, list[float]] = {"FeatureStore.read, one row": [], label: []}
        for _ in range(args.repeats):
            start = time.process_time()
            for row in rows:
                store.read("a", [row])
            micros["FeatureStore.read, one row"].append(
                (time.process_time() - start) / len(rows) * 1e6
            )
            start = time.process_time()
            for batch in batches:
                dataset.__getitems__(batch)
            micros[label].append((time.process_time() - start) / len(batches) * 1e6)
        store.close()
        dataset.close()
    print(f"[{args.rows}, {args.dim}] float16 store, CPU time per call, {args.repeats} repeats")
    for name, values in micros.items():
        every = ", ".join(f"{value:.0f}" for value in values)
        print(f"{name:<40} {min(values):>8.0f} us (lowest; all: {every})")


if __name__ == "__main__":
    main()
