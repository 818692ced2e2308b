"""The cost of ``featcache extract --update`` after a dataset grew, against a fresh run.

Real JPEG photos (CIFAR-10's, from ``../shared/data/cifar10-jpeg.tar``: ``--images`` of
the training set, the same number per class) are extracted once with resnet18 (random
weights) resized to ``--size`` px, storing ``avgpool``; then the folder grows by
``--grow`` (10%: new photos of every class). Timed, interleaved, ``--repeats`` times:

* a fresh extraction of the grown folder (``--overwrite``), the baseline;
* ``--update`` of a copy of the store made before the folder grew: only the new photos
  run through the model, the rest is copied from the store.

Both run through :func:`featcache.extract_from_config` in this process, wall clock from
the call to the complete store, model building and the folder's listing included.
Prints the medians and their ratio (the target is at most 0.2x), and checks that the
updated store holds the fresh one's ids and labels.

    python scripts/bench_update.py                      # 2,000 photos, 112 px, 3 repeats
    python scripts/bench_update.py --images 1000 --repeats 1
    python scripts/bench_update.py --content-hash       # samples known by their bytes too
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import featcache  # first: makes torchvision importable beside this torch build
from featcache.store import FeatureStore

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10-jpeg.tar"


def unpack_photos(target: Path, per_class: int, extra: int) -> tuple[Path, list[Path]]:
    """The first ``per_class`` training photos of each class into ``target/train``, and
    the next ``extra`` of each into a held-back folder; returns the root and the held back
    files (as their paths under the root once added)."""
    root, held = target / "photos", target / "held"
    wanted: dict[str, int] = {}
    later: list[Path] = []
    with tarfile.open(DATA) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) != 4 or parts[1] != "train":
                continue
            count = wanted.get(parts[2], 0)
            if count >= per_class + extra:
                continue
            wanted[parts[2]] = count + 1
            folder = root if count < per_class else held
            destination = folder / "train" / parts[2] / parts[3]
            destination.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            destination.write_bytes(source.read())
            if folder is held:
                later.append(destination)
    return root, later


def config(root: Path, out: Path, size: int, content_hash: bool, **output: bool) -> dict:
    return {
        "model": {"name": "resnet18"},
        "preprocess": {"resize": size, "mean": [0.485, 0.456, 0.406]},
        "layers": [{"name": "avgpool"}],
        "data": {
            "source": "imagefolder",
            "root": str(root),
            "splits": ["train"],
            "content_hash": content_hash,
        },
        "loader": {"batch_size": 64},
        "output": {"dir": str(out), **output},
        "runtime": {"progress": False},
    }


def timed(cfg: dict, **options: bool) -> tuple[float, FeatureStore]:
    start = time.perf_counter()
    store = featcache.extract_from_config(cfg, **options)["train"]
    return time.perf_counter() - start, store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000, help="photos before growing")
    parser.add_argument("--grow", type=float, default=0.10, help="share of new photos")
    parser.add_argument("--size", type=int, default=112, help="resize to this many px")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--content-hash", action="store_true")
    args = parser.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} is not present; this benchmark needs the CIFAR-10 JPEGs")
    per_class = args.images // 10
    extra = max(1, round(per_class * args.grow))
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        root, later = unpack_photos(work, per_class, extra)
        base = config(root, work / "base", args.size, args.content_hash)
        seconds, store = timed(base)  # before the folder grows; also warms up
        original = store.path
        store.close()
        print(f"first extraction of {per_class * 10} photos: {seconds:.1f} s")
        for file in later:  # the folder grows
            target = root / file.relative_to(work / "held")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(file, target)
        fresh_cfg = config(root, work / "fresh", args.size, args.content_hash, overwrite=True)
        update_dir = work / "update"
        update_dir.mkdir()
        fresh_times, update_times = [], []
        for _ in range(args.repeats):
            shutil.copy(original, update_dir / "train.h5")
            update_cfg = config(root, update_dir, args.size, args.content_hash)
            seconds, updated = timed(update_cfg, update=True)
            update_times.append(seconds)
            run = updated.attrs["history"][-1]
            seconds, fresh = timed(fresh_cfg)
            fresh_times.append(seconds)
            assert updated.ids == fresh.ids and (updated.labels == fresh.labels).all()
            updated.close()
            fresh.close()
        fresh_s, update_s = statistics.median(fresh_times), statistics.median(update_times)
        total = per_class * 10 + extra * 10
        print(
            f"resnet18 at {args.size} px, {per_class * 10} -> {total} CIFAR-10 JPEGs, "
            f"content_hash={args.content_hash}, median of {args.repeats}"
        )
        print(f"{'run':<34}{'seconds':>9}{'vs fresh':>10}")
        print(f"{'fresh extraction (--overwrite)':<34}{fresh_s:>9.2f}{1.0:>9.2f}x")
        print(f"{'--update':<34}{update_s:>9.2f}{update_s / fresh_s:>9.2f}x")
        print(
            f"update computed {run['rows_computed']} rows, reused {run['rows_reused']}; "
            f"per repeat: fresh {[round(t, 2) for t in fresh_times]}, "
            f"update {[round(t, 2) for t in update_times]}"
        )


if __name__ == "__main__":
    main()
