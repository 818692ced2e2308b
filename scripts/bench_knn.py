"""Weighted k-NN from a store against a plain ``torch.cdist`` + ``topk`` loop in memory.

Writes a train store of ``--rows`` rows and a test store of ``--queries`` rows, ``--dim``
float16 features each, drawn around 100 seeded class means, with ``featcache.extract``
into a temporary folder (so the files are in the page cache: the figures measure the
search, not the disk). Then times, for k = 10, 20, 100, 200 at once:

* ``cdist + topk, in memory`` (the baseline, 1.00x): both stores read whole into float32
  tensors, rows scaled to unit norm, then for each batch of ``--batch`` test rows
  ``torch.cdist`` against every train row and ``topk(200, largest=False)``; the
  neighbours vote ``exp(cosine / 0.07)`` (cosine is ``1 - d^2 / 2`` on unit rows). The
  reading of the stores is not timed.
* ``featcache knn, streamed``: ``featcache.probe.knn(..., trainer="streaming")`` end to
  end: both stores read from the file, the train rows in blocks with a running top-k per
  test row, hashed, voted and scored.
* ``featcache knn, in memory`` (with ``--in-memory``): the same with the train rows loaded
  whole (``trainer="full"``).

Each run is a fresh process (``--threads`` torch threads): the table gives the peak
resident memory during the run (Linux's ``VmHWM``, reset at its start) above what the
process held before it, and the median seconds over ``--rounds`` rounds (the cases
interleaved, every other round in reverse order), with each case's speed over the
baseline's in the same round. The top-1 at each k must agree between the cases (same
neighbours, same votes).
``--flat ROWS,...`` repeats the memory measurement (one run per case) on train stores of
other sizes, to show which peaks grow with the store and which stay flat.

    python scripts/bench_knn.py [--rows 50000] [--queries 10000] [--dim 512] [--rounds 3]
                                [--batch 1000] [--threads 2] [--flat 100000] [--in-memory]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import featcache
from featcache import FeatureStore
from featcache.probe import knn

KS = (10, 20, 100, 200)
T = 0.07
BASELINE = "cdist + topk, in memory"
CASES = {BASELINE: "baseline", "featcache knn, streamed": "streaming"}
IN_MEMORY = {"featcache knn, in memory": "full"}  # with --in-memory


class _Rows(nn.Module):
    """Hands its input rows out as the output of its one layer ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Identity()

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.x(rows)


def write_store(path: Path, rows: int, dim: int, seed: int) -> None:
    """``rows`` float16 rows around 100 class means (the same means for every store)."""
    means = np.random.default_rng(0).standard_normal((100, dim)).astype(np.float32)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 100, rows)
    x = means[labels] + 2.0 * rng.standard_normal((rows, dim), dtype=np.float32)
    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(labels))
    featcache.extract(
        _Rows(), dataset, ["x"], path, dtype="float16", batch_size=4096, progress=False
    )


def baseline(train: Path, test: Path, batch: int) -> tuple[dict[int, float], float]:
    """Top-1 per k of the cdist + topk loop, and its seconds (after the reads)."""
    with FeatureStore(train) as store:
        x = torch.nn.functional.normalize(store.read("x").float(), dim=1)
        labels = torch.from_numpy(store.labels)
    with FeatureStore(test) as store:
        q = torch.nn.functional.normalize(store.read("x").float(), dim=1)
        truth = torch.from_numpy(store.labels)
    start = time.perf_counter()
    hits = dict.fromkeys(KS, 0)
    for first in range(0, len(q), batch):
        distance = torch.cdist(q[first : first + batch], x)
        nearest, index = distance.topk(max(KS), dim=1, largest=False)
        weights = ((1 - nearest.square() / 2) / T).exp()
        for k in KS:
            votes = torch.zeros(len(index), 100).scatter_add_(
                1, labels[index[:, :k]], weights[:, :k]
            )
            hits[k] += int((votes.argmax(1) == truth[first : first + batch]).sum())
    return {k: hits[k] / len(q) for k in KS}, time.perf_counter() - start


def run_case(case: str, train: Path, test: Path, batch: int) -> dict[str, object]:
    """One timed run in this process: seconds, peak RSS above the start, top-1 per k."""
    before = _rss()
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from now
        f.write("5")
    if case == "baseline":
        top1, seconds = baseline(train, test, batch)
    else:
        start = time.perf_counter()
        result = knn(train, "x", test=test, ks=list(KS), trainer=case, progress=False)
        seconds = time.perf_counter() - start
        top1 = {k: m["top1"] for k, m in result.metrics.items()}
    return {"seconds": seconds, "peak_mib": (_rss("VmHWM") - before) / 2**20, "top1": top1}


def _rss(field: str = "VmRSS") -> int:
    """This process's resident memory now (``VmRSS``) or its peak (``VmHWM``), in bytes
    (Linux)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def spawn(case: str, train: Path, test: Path, args: argparse.Namespace) -> dict[str, object]:
    """``run_case`` in a fresh process."""
    command = [sys.executable, __file__, "--run", case, str(train), str(test)]
    command += ["--batch", str(args.batch), "--threads", str(args.threads)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50000)
    parser.add_argument("--queries", type=int, default=10000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1000, help="baseline test rows per cdist")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--flat", default="", help="other train sizes for the memory check")
    parser.add_argument("--in-memory", action="store_true", help="also time trainer='full'")
    parser.add_argument("--run", nargs=3, metavar=("CASE", "TRAIN", "TEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.run:
        case, train, test = args.run
        print(json.dumps(run_case(case, Path(train), Path(test), args.batch)))
        return

    with tempfile.TemporaryDirectory(prefix="featcache-bench-knn-") as folder:
        root = Path(folder)
        write_store(root / "train.h5", args.rows, args.dim, seed=1)
        write_store(root / "test.h5", args.queries, args.dim, seed=2)
        print(
            f"k-NN (k = {', '.join(map(str, KS))}, T {T}) of {args.queries} test rows against "
            f"{args.rows} train rows, [{args.dim}] float16; {args.threads} torch threads, "
            f"baseline batches of {args.batch}; {platform.machine()}, torch {torch.__version__}"
        )
        cases = {**CASES, **(IN_MEMORY if args.in_memory else {})}
        runs: dict[str, list[dict[str, object]]] = {name: [] for name in cases}
        for round_ in range(args.rounds):
            order = list(cases) if round_ % 2 == 0 else list(cases)[::-1]
            for name in order:
                runs[name].append(spawn(cases[name], root / "train.h5", root / "test.h5", args))
        base = [float(run["seconds"]) for run in runs[BASELINE]]  # type: ignore[arg-type]
        print(f"{'case':<26} {'seconds':>8} {'vs baseline':>22} {'peak RSS':>10}  top-1 k=20")
        for name, results in runs.items():
            seconds = [float(r["seconds"]) for r in results]  # type: ignore[arg-type]
            ratios = [b / s for b, s in zip(base, seconds, strict=True)]
            per_round = " ".join(f"{r:.2f}" for r in ratios)
            peak = max(float(r["peak_mib"]) for r in results)  # type: ignore[arg-type]
            top1 = results[0]["top1"]["20"]  # type: ignore[index]
            print(
                f"{name:<26} {statistics.median(seconds):>8.2f} "
                f"{statistics.median(ratios):>6.2f}x ({per_round:>13}) {peak:>7.0f} MiB  "
                f"{100 * float(top1):.2f}%"
            )
        agree = {json.dumps(r["top1"], sort_keys=True) for rs in runs.values() for r in rs}
        print(f"top-1 at every k identical across cases and rounds: {len(agree) == 1}")

        for rows in [int(r) for r in args.flat.split(",") if r.strip()]:
            write_store(root / f"train-{rows}.h5", rows, args.dim, seed=1)
            peaks = {
                name: spawn(case, root / f"train-{rows}.h5", root / "test.h5", args)["peak_mib"]
                for name, case in cases.items()
            }
            shown = ", ".join(f"{name} {float(p):.0f} MiB" for name, p in peaks.items())  # type: ignore[arg-type]
            print(f"peak RSS with {rows} train rows: {shown}")


if __name__ == "__main__":
    main()
