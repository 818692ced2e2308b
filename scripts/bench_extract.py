"""Extraction speed and memory: featcache against the common ways of doing the job.

Everything runs in this one process (peak-RSS cases in child processes of it), with a
warm-up first, repeats interleaved so that drift hits every case alike, and medians.
Each timed case starts after ``os.sync()``, so that none pays for writing back the files
an earlier case left in the page cache.
The process starts in the malloc state that a featcache run leaves behind
(``featcache.capture.memory.settle_thresholds``), so no case runs in a state that depends on
which case ran before it.
Ratios are images/s against baselines measured in the same run: ``vs bare`` against the
bare eager forward, ``vs best`` against the fastest bare loop at the same depth:

* throughput, per model (resnet18 and resnet50 at 112 px, ``weights=None``, random
  images held in memory so decoding costs nothing) and per target layer (``avgpool``:
  full depth; ``layer2``: early stop): the bare eager forward in the default layout
  (full network), the bare forward in the best eager layout (channels_last), the bare
  forward truncated after the target layer (best layout), the same with freed memory
  kept for reuse as featcache keeps it on the CPU (``featcache.capture.memory``), forward hooks
  appending to lists then saved with h5py, torchvision's ``create_feature_extractor``,
  and ``featcache.extract`` (with its default XXH3 chunk checksums; ``--checksum-cost``
  adds ``featcache.extract, checksum off``, prints the images/s ratio of the two, and
  times creating a 2 GB store of ``layer2`` rows with and without checksums, with the
  disk space it takes before any row is written); and featcache's own work in such a run
  without the forward (hashing the weights, encoding the layer's values to float16,
  writing them with checksums), timed alone, with the ratio to the best bare forward
  that featcache would reach if none of that work overlapped it; when torch's threads
  take every core, also that work's CPU time spread over the cores, the ratio featcache
  would reach if the forward kept every core busy (then the work cannot hide: each CPU
  second it takes is one the forward's threads lose). Below the table,
  ``featcache.extract`` over the best bare loop at its depth (the one with the best
  median) round by round: the median and the range of the per-round ratios, which shows
  how far the machine's drift moves one run (the table's ratios are of medians);
* throughput of a timm ViT by featcache reference (``--models timm:vit_small_patch16_224``,
  random weights, ``img_size`` the ``--size``): the bare forward, the bare forward cut after
  a middle and the last block, and ``featcache.extract`` storing those blocks' patch-token
  mean (its early stop against the cut);
* peak RSS growth from 1,024 to 8,192 images capturing unpooled ``layer3`` of resnet18;
* a JPEG pipeline over real photos (``../shared/data/hymenoptera.tar``, resize 256, crop
  224, resnet18): torchvision ImageFolder + DataLoader + a hook saving to lists, against
  ``featcache.extract`` over featcache's imagefolder source with the same settings, and
  over its webdataset source reading the same photos packed into 4 tar shards (printed
  also as a ratio to the imagefolder source);
* text (``--parts text``): a random 4-layer BERT (width 256) over ``--texts`` synthetic
  texts of 16 to 256 bytes, byte-tokenised, in batches of ``--batch``: the bare forward
  over the same padded batches (built beforehand, in source order) against
  ``featcache.extract`` storing the last block's masked mean, the same plus the block's
  per-token rows, and the masked mean with ``bucket_by_length``.

    python scripts/bench_extract.py                      # everything (about 10 minutes)
    python scripts/bench_extract.py --parts throughput --models resnet18 --images 256
    python scripts/bench_extract.py --parts throughput --models resnet18 --checksum-cost
    python scripts/bench_extract.py --parts throughput --models resnet18 --threads 1
    python scripts/bench_extract.py --parts throughput --models timm:vit_small_patch16_224
    python scripts/bench_extract.py --parts text --texts 2048 --batch 32
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import featcache  # first: makes torchvision importable beside a mismatched torch
from featcache.capture.memory import freed_memory_kept, settle_thresholds
from featcache.store import StorePlan, StoreWriter, codec, remove_store
from featcache.util.fingerprints import module_fingerprint

# isort: split
import torchvision
from torchvision import transforms as T
from torchvision.models.feature_extraction import create_feature_extractor

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
RSS_SIZES = (1024, 8192)


class RandomImages(Dataset):
    """``n`` random images made on demand (so the input itself takes no memory)."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, self.size, self.size, generator=g), 0


def scratch(prefix: str) -> Path:
    """A temporary folder for a part's files, removed when the script exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def truncated(model: nn.Module, layer: str) -> nn.Module:
    """A torchvision ResNet cut right after ``layer``: what an early stop can at best do."""
    parts = []
    for name, child in model.named_children():
        if name == "fc":
            parts.append(nn.Flatten(1))
        parts.append(child)
        if name == layer:
            break
    return nn.Sequential(*parts).eval()


def bare(
    model: nn.Module, data: torch.Tensor, batch: int, channels_last: bool, kept: bool = False
) -> None:
    """The plain loop; with ``kept``, inside :func:`featcache.capture.memory.freed_memory_kept`."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model.to(memory_format=fmt)
    with freed_memory_kept("cpu") if kept else contextlib.nullcontext(), torch.inference_mode():
        for start in range(0, len(data), batch):
            model(data[start : start + batch].contiguous(memory_format=fmt))
    model.to(memory_format=torch.contiguous_format)


def hooks_to_lists(model: nn.Module, batches, layer: str, path: Path) -> None:
    """The common hand-written approach: a hook appends to a list, saved at the end."""
    kept: list[torch.Tensor] = []
    module = dict(model.named_modules())[layer]
    handle = module.register_forward_hook(lambda m, a, out: kept.append(out.detach().clone()))
    try:
        with torch.inference_mode():
            for images, _ in batches:
                model(images)
    finally:
        handle.remove()
    with h5py.File(path, "w") as f:
        f["features"] = torch.cat(kept).flatten(1).numpy().astype(np.float16)


def fx_extractor(model: nn.Module, data: torch.Tensor, batch: int, layer: str, path: Path):
    extractor = create_feature_extractor(model, return_nodes=[layer]).eval()
    kept = []
    with torch.inference_mode():
        for start in range(0, len(data), batch):
            kept.append(extractor(data[start : start + batch])[layer].flatten(1))
    with h5py.File(path, "w") as f:
        f["features"] = torch.cat(kept).numpy().astype(np.float16)


def featcache_run(
    model: nn.Module, dataset: Dataset, layer: str, path: Path, batch: int, checksum: bool = True
):
    reduce = "flatten" if layer == "avgpool" else "none"
    featcache.extract(
        model,
        dataset,
        [{"name": layer, "reduce": reduce}],
        path,
        batch_size=batch,
        num_workers=0,
        progress=False,
        overwrite=True,
        checksum=checksum,
    )


def own_work(model: nn.Module, cut: nn.Module, data: torch.Tensor, batch: int, layer: str):
    """featcache's own work in a run, without the forward: a callable that hashes the
    weights, encodes the layer's values (computed here, beforehand) to float16 and
    writes them with checksums, as ``featcache.extract`` does, one step after another."""
    with torch.inference_mode():
        outputs = [
            cut(data[start : start + batch].contiguous(memory_format=torch.channels_last))
            for start in range(0, len(data), batch)
        ]
    outputs = [o.flatten(1) if layer == "avgpool" else o for o in outputs]
    ids = [str(i) for i in range(len(data))]

    def run(path: Path) -> None:
        module_fingerprint(model)
        writer = StoreWriter(StorePlan(path, len(data), ids_width=4))
        for i, value in enumerate(outputs):
            rows = np.arange(i * batch, i * batch + len(value))
            encoded = codec.as_array(codec.encode(value, "float16"))
            writer.append(rows, [ids[r] for r in rows], np.zeros(len(rows)), {layer: encoded})
        writer.close(complete=True)
        remove_store(path)

    return run


def cpu_timed(run: Callable[[], None], seconds: list[float]) -> None:
    """Run ``run`` and append the process CPU time it took (every thread's) to ``seconds``."""
    start = time.process_time()
    run()
    seconds.append(time.process_time() - start)


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def timed_rounds(cases: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each case in each round; a round runs every case once, in order."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            os.sync()  # no case pays for writing back what an earlier one left dirty
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def timed(cases: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Each case's median seconds over ``repeats`` rounds."""
    return {name: statistics.median(v) for name, v in timed_rounds(cases, repeats).items()}


def throughput(
    model_name: str, images: int, size: int, batch: int, repeats: int, checksum_cost: bool = False
) -> None:
    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, weights=None).eval()
    data = torch.randn(images, 3, size, size)
    dataset = TensorDataset(data, torch.zeros(images, dtype=torch.long))
    folder = scratch("featcache-bench-")
    cases: dict[str, Callable[[], None]] = {
        "bare eager forward, default layout": lambda: bare(model, data, batch, False),
        "bare forward, channels_last": lambda: bare(model, data, batch, True),
    }
    for layer in ("avgpool", "layer2"):
        cut = truncated(model, layer)
        cases[f"[{layer}] bare truncated, channels_last"] = lambda c=cut: bare(c, data, batch, True)
        cases[f"[{layer}] bare truncated, freed memory kept"] = lambda c=cut: bare(
            c, data, batch, True, kept=True
        )
        cases[f"[{layer}] hooks -> lists -> h5py"] = lambda layer=layer: hooks_to_lists(
            model, DataLoader(dataset, batch_size=batch), layer, folder / "lists.h5"
        )
        cases[f"[{layer}] create_feature_extractor"] = lambda layer=layer: fx_extractor(
            model, data, batch, layer, folder / "fx.h5"
        )
        cases[f"[{layer}] featcache.extract"] = lambda layer=layer: featcache_run(
            model, dataset, layer, folder / "fc.h5", batch
        )
        if checksum_cost:
            off = f"[{layer}] featcache.extract, checksum off"
            cases[off] = lambda layer=layer: featcache_run(
                model, dataset, layer, folder / "fc.h5", batch, checksum=False
            )
    own_cpu: dict[str, list[float]] = {"avgpool": [], "layer2": []}  # process CPU seconds
    for layer in ("avgpool", "layer2"):
        work = own_work(model, truncated(model, layer), data, batch, layer)
        cases[f"({layer}) own work"] = lambda w=work, c=own_cpu[layer]: cpu_timed(
            lambda: w(folder / "own.h5"), c
        )
    timed(cases, 1)  # warm-up: every case once
    for seconds in own_cpu.values():
        seconds.clear()
    rounds = timed_rounds(cases, repeats)
    medians = {name: statistics.median(seconds) for name, seconds in rounds.items()}
    own = {layer: medians.pop(f"({layer}) own work") for layer in ("avgpool", "layer2")}
    base = medians["bare eager forward, default layout"]
    print(
        f"\n{model_name} at {size}px, {images} images, batch {batch}, "
        f"{torch.get_num_threads()} threads, median of {repeats}"
    )
    print(f"{'case':<44} {'images/s':>9} {'vs bare':>8} {'vs best':>8}")
    for name, seconds in medians.items():
        # "vs best": against the fastest bare loop that computes as much (seconds: min).
        depth = next((f"[{layer}] " for layer in ("avgpool", "layer2") if f"[{layer}]" in name), "")
        best = min(v for k, v in medians.items() if k.startswith(f"{depth}bare"))
        print(
            f"{name:<44} {images / seconds:>9.1f} {base / seconds:>7.2f}x {best / seconds:>7.2f}x"
        )
    print("featcache.extract over the best bare loop at its depth, round by round:")
    for layer in ("avgpool", "layer2"):
        bare_names = [k for k in medians if k.startswith(f"[{layer}] bare")]
        best_name = min(bare_names, key=medians.__getitem__)
        ours = rounds[f"[{layer}] featcache.extract"]
        paired = sorted(best / s for best, s in zip(rounds[best_name], ours, strict=True))
        print(
            f"  {layer:<8} median {statistics.median(paired):.2f}x, {paired[0]:.2f}x to "
            f"{paired[-1]:.2f}x over {repeats} rounds (against {best_name[len(layer) + 3 :]})"
        )
    print(
        "featcache's own work, without the forward (weights hash, float16 encoding, "
        "checksummed writes), run alone:"
    )
    cores = usable_cores()
    for layer, seconds in own.items():
        best = min(v for k, v in medians.items() if k.startswith(f"[{layer}] bare"))
        print(
            f"  {layer:<8} {seconds:6.3f} s, {100 * seconds / best:4.1f}% of the best bare "
            f"forward: {best / (best + seconds):.3f}x if none of it overlapped the forward"
        )
    threads = torch.get_num_threads()
    if threads >= cores:
        print(
            f"the same work in CPU time, against the best bare forward keeping all {cores} "
            f"cores busy ({threads} torch threads): featcache at about this ratio at best"
        )
        for layer in own:
            best = min(v for k, v in medians.items() if k.startswith(f"[{layer}] bare"))
            cpu = statistics.median(own_cpu[layer])
            print(f"  {layer:<8} {cpu:6.3f} s of CPU time: {best / (best + cpu / cores):.3f}x")
    if checksum_cost:
        ratios = []
        for layer in ("avgpool", "layer2"):
            with_sum = medians[f"[{layer}] featcache.extract"]
            without = medians[f"[{layer}] featcache.extract, checksum off"]
            ratios.append(f"{layer} {without / with_sum:.2f}x")  # seconds: inverse of images/s
        print(f"checksum cost, images/s with checksums over without: {', '.join(ratios)}")
        creation_cost(folder)


def creation_cost(folder: Path, rows: int = 40_000) -> None:
    """Seconds to create a store of ``rows`` float16 ``[128, 14, 14]`` rows (resnet18's
    ``layer2`` at 112 px, 50 KB each) with and without checksums, and its disk usage
    then: the part of a run spent before the first rows can be written."""
    features = {"layer2": np.ones((1, 128, 14, 14), np.float16)}
    size = rows * features["layer2"][0].nbytes
    print(f"creating a store of {rows} rows ({size / 1e9:.1f} GB), median of 3:")
    for checksum in (True, False):
        seconds, used = [], 0
        for _ in range(3):
            path = folder / "created.h5"
            writer = StoreWriter(StorePlan(path, rows, ids_width=8, checksum=checksum))
            start = time.perf_counter()
            writer.append(np.arange(1), ["0"], np.zeros(1), features)  # creates the file
            seconds.append(time.perf_counter() - start)
            used = writer.partial.stat().st_blocks * 512
            writer.close()
            remove_store(path)
        print(
            f"  checksum {'on ' if checksum else 'off'}  {statistics.median(seconds):7.3f} s"
            f"  {used / 1e6:9.1f} MB on disk"
        )


RSS_CHILD = """
import json, shutil, sys, tempfile
from pathlib import Path
sys.path.insert(0, {scripts!r})
import torch
from bench_extract import RandomImages, hooks_to_lists, featcache_run
import torchvision
from torch.utils.data import DataLoader
approach, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torchvision.models.resnet18(weights=None).eval()
folder = Path(tempfile.mkdtemp())
warm = RandomImages(64, size)
with torch.inference_mode():
    model(torch.stack([warm[i][0] for i in range(32)]))
def status_kb(field):  # VmHWM is this process's own peak (ru_maxrss survives exec on Linux)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
base = status_kb("VmRSS")
data = RandomImages(n, size)
if approach == "featcache":
    featcache_run(model, data, "layer3", folder / "s.h5", 64)
else:
    hooks_to_lists(model, DataLoader(data, batch_size=64), "layer3", folder / "s.h5")
peak = status_kb("VmHWM")
shutil.rmtree(folder)
print(json.dumps({{"extra_mb": (peak - base) / 1024}}))
"""


def peak_rss(size: int) -> None:
    print(
        f"\npeak RSS above the loaded model, resnet18 unpooled layer3 at {size}px (child processes)"
    )
    print(f"{'approach':<28} " + " ".join(f"{n:>8}" for n in RSS_SIZES) + f" {'growth':>8}")
    code = RSS_CHILD.format(scripts=str(Path(__file__).resolve().parent))
    for approach in ("hooks -> lists -> h5py", "featcache"):
        key = "featcache" if approach == "featcache" else "lists"
        values = []
        for n in RSS_SIZES:
            out = subprocess.run(
                [sys.executable, "-c", code, key, str(n), str(size)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            values.append(json.loads(out.strip().splitlines()[-1])["extra_mb"])
        cells = " ".join(f"{v:>6.0f}MB" for v in values)
        print(f"{approach:<28} {cells} {values[-1] - values[0]:>6.0f}MB")


def jpeg_pipeline(repeats: int, batch: int) -> None:
    archive = SHARED / "hymenoptera.tar"
    if not archive.exists():
        print(f"\nJPEG pipeline skipped: {archive} not found")
        return
    from featcache.config.spec import DataSpec, PreprocessSpec
    from featcache.models import build_transform
    from featcache.sources import build_source

    folder = scratch("featcache-jpeg-")
    with tarfile.open(archive) as tar:  # the data filter where this Python has it (3.12)
        tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    root = folder / "photos" / "all"  # train and val photos together, by class
    for photo in sorted((folder / "hymenoptera_data").glob("*/*/*")):
        (root / photo.parent.name).mkdir(parents=True, exist_ok=True)
        (root / photo.parent.name / f"{photo.parent.parent.name}-{photo.name}").symlink_to(photo)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    standard = torchvision.datasets.ImageFolder(
        str(root), T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])
    )
    preprocess = PreprocessSpec(resize=256, crop=224)
    source = build_source(
        DataSpec(source="imagefolder", root=str(folder / "photos"), splits={"all": "all"}),
        "all",
        build_transform(preprocess),
        decode_size=preprocess.resize,
    )
    shards = pack_shards(source.paths, source.ids, folder / "shards", 4)
    packed = build_source(
        DataSpec(source="webdataset", root=str(folder), splits={"all": shards}),
        "all",
        build_transform(preprocess),
    )
    packed.decode_size = preprocess.resize  # draft-mode JPEG decoding, as for the files
    assert len(packed) == len(source)
    workers = 2
    cases = {
        "ImageFolder + DataLoader + hooks -> h5py": lambda: hooks_to_lists(
            model,
            DataLoader(standard, batch_size=batch, num_workers=workers),
            "avgpool",
            folder / "lists.h5",
        ),
        "featcache.extract (its own imagefolder source)": lambda: featcache.extract(
            model,
            source,
            [{"name": "avgpool", "reduce": "flatten"}],
            folder / "fc.h5",
            batch_size=batch,
            num_workers=workers,
            progress=False,
            overwrite=True,
        ),
        "featcache.extract (its webdataset source, 4 shards)": lambda: featcache.extract(
            model,
            packed,
            [{"name": "avgpool", "reduce": "flatten"}],
            folder / "wds.h5",
            batch_size=batch,
            num_workers=workers,
            progress=False,
            overwrite=True,
        ),
    }
    timed(cases, 1)  # warm-up: page cache, worker start-up
    medians = timed(cases, repeats)
    base = medians["ImageFolder + DataLoader + hooks -> h5py"]
    n = len(standard)
    print(
        f"\nJPEG pipeline: {n} hymenoptera photos, resize 256 crop 224, resnet18, "
        f"batch {batch}, {workers} loader workers, median of {repeats}"
    )
    print(f"{'case':<52} {'images/s':>9} {'vs standard':>12}")
    for name, seconds in medians.items():
        print(f"{name:<52} {n / seconds:>9.1f} {base / seconds:>11.2f}x")
    files = medians["featcache.extract (its own imagefolder source)"]
    tars = medians["featcache.extract (its webdataset source, 4 shards)"]
    print(f"featcache webdataset over its imagefolder source, images/s: {files / tars:.2f}x")


def pack_shards(paths: list[str], ids: list[str], folder: Path, count: int) -> str:
    """The files ``paths`` packed in order into ``count`` uncompressed tar shards (one
    ``<key>.<ext>`` member per sample, keys from ``ids``); the brace pattern naming them,
    relative to ``folder``'s parent."""
    folder.mkdir(parents=True, exist_ok=True)
    for s, block in enumerate(np.array_split(np.arange(len(paths)), count)):
        with tarfile.open(folder / f"photos-{s:02d}.tar", "w", dereference=True) as tar:
            for i in block:
                stem, ext = ids[i].rsplit(".", 1)
                tar.add(paths[i], arcname=f"{stem.replace('.', '_')}.{ext.lower()}")
    return f"{folder.name}/photos-{{00..{count - 1:02d}}}.tar"


def vit_truncated(model: nn.Module, block: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A timm ViT's forward cut right after ``blocks[block]``: what an early stop can at
    best do."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        for layer in model.blocks[: block + 1]:
            x = layer(x)
        return x

    return forward


def timed_forward(forward: Callable[[torch.Tensor], torch.Tensor], data, batch: int) -> None:
    with torch.inference_mode():
        for start in range(0, len(data), batch):
            forward(data[start : start + batch])


def timm_throughput(reference: str, images: int, size: int, batch: int, repeats: int) -> None:
    """A timm ViT by featcache reference (random weights, ``img_size=size``): the bare
    forward, the bare forward cut after a middle and the last block, and featcache storing
    the patch-token mean of those blocks."""
    from featcache.config.spec import ModelSpec, PreprocessSpec
    from featcache.models import build_backbone

    spec = ModelSpec(name=reference, kwargs={"img_size": size})
    model = build_backbone(spec, PreprocessSpec()).model.eval()
    data = torch.randn(images, 3, size, size)
    dataset = TensorDataset(data, torch.zeros(images, dtype=torch.long))
    folder = scratch("featcache-bench-")
    depth = len(model.blocks)
    cases: dict[str, Callable[[], None]] = {
        "bare forward": lambda: timed_forward(model, data, batch),
    }
    for block in (depth // 2 - 1, depth - 1):
        name = f"blocks.{block}"
        cases[f"[{name}] bare truncated"] = lambda b=block: timed_forward(
            vit_truncated(model, b), data, batch
        )
        cases[f"[{name}] featcache.extract"] = lambda name=name: featcache.extract(
            model, dataset, [{"name": name, "reduce": "mean"}], folder / "vit.h5",
            batch_size=batch, num_workers=0, progress=False, overwrite=True,
        )  # fmt: skip
    timed(cases, 1)
    medians = timed(cases, repeats)
    print(
        f"\n{reference} at {size}px (random weights), {images} images, batch {batch}, "
        f"{torch.get_num_threads()} threads, median of {repeats}"
    )
    print(f"{'case':<44} {'images/s':>9} {'vs truncated':>13}")
    for name, seconds in medians.items():
        best = seconds
        if name.startswith("["):
            best = medians[name.split("]")[0] + "] bare truncated"]
        print(f"{name:<44} {images / seconds:>9.1f} {best / seconds:>12.2f}x")


class Bytes:
    """UTF-8 bytes as token ids (byte + 3) between ids 1 and 2: a tokenizer of no cost."""

    name, pad_id, max_length = "bytes", 0, None

    def __call__(self, texts, max_length):
        from featcache.sources.tokenizer import Tokenized

        ids = [[1, *(b + 3 for b in text.encode()), 2] for text in texts]
        return Tokenized(ids, [False] * len(ids))


def text_throughput(count: int, batch: int, repeats: int) -> None:
    """A random BERT over synthetic texts: the bare forward over the same padded batches
    against featcache storing the masked mean (and per-token rows, and bucketed)."""
    import transformers

    from featcache.extraction.batches import Collate, SourceRows
    from featcache.sources.text import texts_source

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=384,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=512,
    )
    model = transformers.BertModel(config).eval()
    rng = np.random.default_rng(0)
    words = ["feature", "cache", "token", "row", "a", "of", "the", "store", "model", "text"]
    texts = []
    for _ in range(count):
        length = int(rng.integers(16, 257))
        text = ""
        while len(text) < length:
            text += words[int(rng.integers(len(words)))] + " "
        texts.append(text[:length])
    source = texts_source(texts, None, [f"t{i}" for i in range(count)], None, Bytes(), None, "b")
    rows = SourceRows(source, range(count))
    collate = Collate(rows.pad_values)
    padded = [
        collate([rows[j] for j in range(start, min(start + batch, count))]).inputs
        for start in range(0, count, batch)
    ]
    tokens = int(source.token_lengths.sum())
    real = tokens / sum(int(b["input_ids"].numel()) for b in padded)

    def bare() -> None:
        with torch.inference_mode():
            for inputs in padded:
                model(**inputs)

    folder = scratch("featcache-bench-")
    last = f"encoder.layer.{config.num_hidden_layers - 1}"
    mean = {"name": last, "reduce": "mean", "key": "mean"}

    def run(layers, **options) -> Callable[[], None]:
        return lambda: featcache.extract(
            model, source, layers, folder / "text.h5", batch_size=batch, num_workers=0,
            progress=False, overwrite=True, **options,
        )  # fmt: skip

    cases: dict[str, Callable[[], None]] = {
        "bare forward, same padded batches": bare,
        "featcache.extract, masked mean": run([mean]),
        "featcache.extract, mean + per-token rows": run([mean, last]),
        "featcache.extract, mean, bucket_by_length": run([mean], bucket_by_length=True),
    }
    timed(cases, 1)
    medians = timed(cases, repeats)
    baseline = medians["bare forward, same padded batches"]
    print(
        f"\ntext: random BERT (4 x 256) over {count} texts ({tokens} tokens, {real:.0%} of "
        f"padded positions real), batch {batch}, {torch.get_num_threads()} threads, "
        f"median of {repeats}"
    )
    print(f"{'case':<44} {'texts/s':>9} {'vs bare forward':>16}")
    for name, seconds in medians.items():
        print(f"{name:<44} {count / seconds:>9.1f} {baseline / seconds:>15.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["throughput", "rss", "jpeg", "text"],
        choices=["throughput", "rss", "jpeg", "text"],
    )
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--texts", type=int, default=2048, help="text: synthetic texts")
    parser.add_argument(
        "--checksum-cost",
        action="store_true",
        help="throughput: also time featcache.extract with store.checksum off",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settle_thresholds()
    print(
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"featcache {featcache.__version__}, {time.strftime('%Y-%m-%d')}"
    )
    if "throughput" in args.parts:
        for name in args.models:
            if name.startswith("timm:"):
                timm_throughput(name, args.images, args.size, args.batch, args.repeats)
            else:
                throughput(
                    name, args.images, args.size, args.batch, args.repeats, args.checksum_cost
                )
    if "rss" in args.parts:
        peak_rss(args.size)
    if "jpeg" in args.parts:
        jpeg_pipeline(args.repeats, 32)
    if "text" in args.parts:
        text_throughput(args.texts, args.batch, args.repeats)


if __name__ == "__main__":
    main()
