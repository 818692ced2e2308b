"""WebDataset shards read from a local S3 server against the same shards read from local files.

Packs ``--images`` CIFAR-10 JPEGs (../shared/data/cifar10-jpeg.tar; random JPEGs when it
is absent) into ``--shards`` tar shards in a temporary folder, uploads them to moto's S3
in server mode on 127.0.0.1, and times, per round, each case from the local folder and
from ``s3://``, the two interleaved (every other round in reverse order), medians over
``--rounds`` rounds reported with the ratio s3 / local:

* ``extract``: ``featcache.extract_from_config`` end to end, a first run each time (an
  empty shard-index cache, so the remote case pays for indexing every shard: one
  sequential read each), resnet18 at ``--size`` px capturing ``avgpool``, batch
  ``--batch``, ``--workers`` DataLoader workers.
* ``read``: the source alone: built (index cache empty), then every batch fetched
  (``prefetch``) and every image decoded, no model; the reading machinery's own speed.

The target is ``extract`` at >= 0.8x: extraction from an object store as fast as from a
local copy. moto answers each request in tens of milliseconds on a busy machine, far
slower than a real S3 endpoint, so ``read`` is the harder of the two.

Flags: ``--images``, ``--shards``, ``--rounds``, ``--size``, ``--batch``, ``--workers``.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import featcache  # noqa: E402  (before torchvision, see featcache._compat)
from featcache.config.spec import DataSpec  # noqa: E402
from featcache.sources import build_source  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg.tar"


def jpegs(count: int) -> list[tuple[str, int, bytes]]:
    """``(key, label, jpeg bytes)`` of ``count`` CIFAR-10 train images, or random ones."""
    rows: list[tuple[str, int, bytes]] = []
    if SHARED.exists():
        classes: dict[str, int] = {}
        with tarfile.open(SHARED) as tar:
            for member in tar:
                parts = member.name.split("/")
                if len(parts) == 4 and parts[1] == "train" and member.isfile():
                    label = classes.setdefault(parts[2], len(classes))
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    rows.append((f"{parts[2]}/{parts[3].rsplit('.', 1)[0]}", label, data))
                    if len(rows) == count:
                        break
        return rows
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
        rows.append((f"img{i:06d}", i % 10, buffer.getvalue()))
    return rows


def write_shards(rows: list[tuple[str, int, bytes]], folder: Path, shards: int) -> str:
    """The shards ``train-{000000..}.tar`` of consecutive blocks of ``rows``; their
    brace pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // shards)
    for s in range(shards):
        with tarfile.open(folder / f"train-{s:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for key, label, data in rows[s * per : (s + 1) * per]:
                for name, payload in ((f"{key}.jpg", data), (f"{key}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return f"train-{{000000..{shards - 1:06d}}}.tar"


def extract_seconds(data: dict, out: Path, args: argparse.Namespace, cache: Path) -> float:
    os.environ["FEATCACHE_CACHE_DIR"] = str(cache)
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "avgpool", "reduce": "flatten"}],
        "preprocess": {"resize": args.size, "crop": args.size},
        "data": data,
        "loader": {"batch_size": args.batch, "num_workers": args.workers},
        "runtime": {"device": "cpu", "progress": False},
        "output": {"dir": str(out), "overwrite": True},
    }
    start = time.perf_counter()
    featcache.extract_from_config(config)
    return time.perf_counter() - start


def read_seconds(data: dict, args: argparse.Namespace, cache: Path) -> float:
    os.environ["FEATCACHE_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    source = build_source(DataSpec(**data), "train", None)
    edges = [0, *source.shard_starts, len(source)]
    for first, stop in zip(edges[:-1], edges[1:], strict=True):
        for at in range(first, stop, args.batch):
            rows = list(range(at, min(at + args.batch, stop)))
            source.prefetch(rows)
            for i in rows:
                source[i]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    from tests.object_servers import moto_s3, upload

    with tempfile.TemporaryDirectory() as tmp, moto_s3() as endpoint:
        folder = Path(tmp) / "data"
        rows = jpegs(args.images)
        pattern = write_shards(rows, folder / "shards", args.shards)
        url = upload(endpoint, folder, "bench")
        size = sum(p.stat().st_size for p in (folder / "shards").iterdir())
        print(
            f"{len(rows)} JPEGs in {args.shards} shards ({size / 2**20:.1f} MiB), "
            f"moto S3 at {endpoint}; resnet18 at {args.size}px, batch {args.batch}, "
            f"{args.workers} workers, {args.rounds} rounds, medians"
        )
        local = {
            "source": "webdataset",
            "root": str(folder),
            "splits": {"train": f"shards/{pattern}"},
        }
        remote = {**local, "root": url, "storage_options": {"endpoint_url": f"http://{endpoint}"}}
        cases = {"extract": extract_seconds, "read": read_seconds}
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = [("local", local), ("s3", remote)]
            for case, run in cases.items():
                for where, data in order if r % 2 == 0 else order[::-1]:
                    cache = Path(tmp) / f"cache-{case}-{where}-{r}"  # a first run each time
                    if case == "extract":
                        seconds = run(data, Path(tmp) / "out", args, cache)
                    else:
                        seconds = run(data, args, cache)
                    times.setdefault((case, where), []).append(seconds)
        print(f"{'case':<10} {'local img/s':>12} {'s3 img/s':>10} {'s3 / local':>11}  per round")
        for case in cases:
            here = [len(rows) / s for s in times[(case, "local")]]
            there = [len(rows) / s for s in times[(case, "s3")]]
            ratios = " ".join(f"{b / a:.2f}" for a, b in zip(here, there, strict=True))
            med_here, med_there = statistics.median(here), statistics.median(there)
            print(
                f"{case:<10} {med_here:>12.0f} {med_there:>10.0f} "
                f"{med_there / med_here:>10.2f}x  {ratios}"
            )


if __name__ == "__main__":
    main()
