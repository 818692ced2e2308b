"""Three backbones over one pass of the photos against three runs of one backbone each.

Real JPEG photos (``../shared/data/hymenoptera.tar``: 397 photos of a few hundred pixels
a side, ``--copies`` times over) are decoded and resized to ``--size`` px for three small
torchvision models (random weights): resnet18 (``avgpool``), mobilenet_v3_small
(``avgpool``) and shufflenet_v2_x0_5 (``conv5``, averaged). Decoding a full photo costs
more than these models' forward at that size, the case a shared pass is for. Timed,
interleaved, ``--repeats`` times:

* three runs of :func:`featcache.extract_from_config`, one config per model: every
  photo decoded three times (the baseline);
* one run of a config listing the three under ``models:``: every photo decoded once.

Wall clock and the process's CPU time (its own and its DataLoader workers') from the
first call to the last complete store, model building and the folder's listing included.
Prints the medians and the speed-up (the target is at least 1.3x), and checks that every
store of the shared pass equals its single run's.

    python scripts/bench_many.py                        # 397 photos x 2, 64 px, 3 repeats
    python scripts/bench_many.py --copies 1 --repeats 1 --workers 0
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import featcache  # first: makes torchvision importable beside this torch build

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "hymenoptera.tar"
MODELS = [
    ("resnet18", [{"name": "avgpool"}]),
    ("mobilenet_v3_small", [{"name": "avgpool"}]),
    ("shufflenet_v2_x0_5", [{"name": "conv5", "reduce": "avg"}]),
]


def unpack_photos(target: Path, copies: int) -> Path:
    """The JPEG photos of the archive, ``copies`` times over, in one class folder each
    of ants and bees under ``target/photos/train``."""
    root = target / "photos"
    with tarfile.open(DATA) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if not member.isfile() or not member.name.lower().endswith(".jpg"):
                continue
            source = tar.extractfile(member)
            assert source is not None
            data = source.read()
            for copy in range(copies):
                destination = root / "train" / parts[-2] / f"{copy}-{parts[-3]}-{parts[-1]}"
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(data)
    return root


def shared_sections(root: Path, out: Path, workers: int) -> dict[str, Any]:
    """The sections every config of the benchmark has: data, loader, output, runtime."""
    return {
        "data": {"source": "imagefolder", "root": str(root), "splits": ["train"]},
        "loader": {"batch_size": 32, "num_workers": workers},
        "output": {"dir": str(out), "overwrite": True},
        "runtime": {"progress": False},
    }


def model_entries(size: int) -> list[dict[str, Any]]:
    preprocess = {"resize": size, "crop": size}
    return [
        {"key": name, "model": {"name": name}, "layers": layers, "preprocess": preprocess}
        for name, layers in MODELS
    ]


def single_configs(root: Path, out: Path, size: int, workers: int) -> list[dict[str, Any]]:
    """One config per model, its stores in ``out/<model>/``."""
    return [
        {**shared_sections(root, out / entry.pop("key"), workers), **entry}
        for entry in model_entries(size)
    ]


def shared_config(root: Path, out: Path, size: int, workers: int) -> dict[str, Any]:
    """One config listing the three models, its stores in ``out/<model>/``."""
    return {**shared_sections(root, out, workers), "models": model_entries(size)}


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (loader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(configs: list[dict[str, Any]]) -> tuple[float, float, dict[str, Any]]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    stores = {}
    for config in configs:
        stores.update(featcache.extract_from_config(config))
    return time.perf_counter() - wall, cpu_seconds() - cpu, stores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=2, help="times each photo is listed")
    parser.add_argument("--size", type=int, default=64, help="model input side, px")
    parser.add_argument("--workers", type=int, default=2, help="loader.num_workers")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not DATA.is_file():
        sys.exit(f"bench_many: {DATA} is missing; it holds the photos this benchmark decodes")
    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="bench-many-"))
    try:
        root = unpack_photos(work, args.copies)
        photos = sum(1 for _ in root.rglob("*.jpg"))
        singles = single_configs(root, work / "alone", args.size, args.workers)
        shared = [shared_config(root, work / "shared", args.size, args.workers)]
        timed(shared)  # warm-up: imports, first model builds, the page cache
        runs: dict[str, list[tuple[float, float]]] = {"three runs": [], "one shared pass": []}
        for _ in range(args.repeats):
            wall, cpu, _ = timed(singles)
            runs["three runs"].append((wall, cpu))
            wall, cpu, together = timed(shared)
            runs["one shared pass"].append((wall, cpu))
            for name, _layers in MODELS:
                single = featcache.FeatureStore(work / "alone" / name / "train.h5")
                pooled = together[f"{name}/train"]
                for layer in single.layers:
                    if not torch.equal(single.read(layer), pooled.read(layer)):
                        sys.exit(f"bench_many: {name} {layer} differs between the two ways")
        print(
            f"{len(MODELS)} models ({', '.join(n for n, _ in MODELS)}) at {args.size} px over "
            f"{photos} JPEG photos, num_workers {args.workers}, median of {args.repeats}"
        )
        print(f"{'run':<20} {'wall s':>8} {'CPU s':>8}")
        medians = {}
        for name, times in runs.items():
            wall = statistics.median(t[0] for t in times)
            cpu = statistics.median(t[1] for t in times)
            medians[name] = (wall, cpu)
            print(f"{name:<20} {wall:>8.2f} {cpu:>8.2f}")
        (three_wall, three_cpu), (one_wall, one_cpu) = medians.values()
        print(
            f"speed-up of the shared pass: {three_wall / one_wall:.2f}x wall, "
            f"{three_cpu / one_cpu:.2f}x CPU; per repeat (wall): "
            + ", ".join(
                f"{a[0]:.1f}/{b[0]:.1f}"
                for a, b in zip(runs["three runs"], runs["one shared pass"], strict=True)
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
