"""Compact stores: bytes, write and read speed, and probe accuracy of each store dtype
(float32, float16, bfloat16, int8) and lossless codec, on real features, in one process.

Data: the pretrained CIFAR-10 ResNet-20 (``../shared/data/weights/resnet20-12fca82f.th``)
over the CIFAR-10 JPEGs (``../shared/data/cifar10-jpeg.tar``, unpacked into a temporary
folder: 10,000 train and 10,000 test images, 32 px, the ImageNet mean and std), two layers:
``pooled`` (``layer3``, ``reduce: avg``, ``[64]``) and ``unpooled`` (``layer3``,
``[64, 8, 8]``); and ``tokens``, the per-token rows of ``encoder.layer.1`` of a random
2-layer BERT (hidden size ``--text-dim``, saved with ``save_pretrained`` beside a ByT5
tokenizer) over ``--texts`` synthetic labelled texts (one split), for bytes and speed only.

For each store dtype:

* write: ``featcache.extract_from_config`` of both CIFAR splits (``loader.num_workers: 0``,
  so the process CPU time holds decoding too) and of the texts, uncompressed, in
  ``--write-repeats`` rounds (the dtypes in a rotated order each round; a 256-image
  float32 warm-up run first; the first round's stores are the ones measured below): wall
  clock from the call to the complete stores, rows/s and process CPU seconds, medians and
  ranges, against float32. The whole extraction is timed: the forward and the JPEG
  decoding take most of it.
* bytes: each codec of ``CODECS`` that featcache accepts makes a compressed copy of the
  train store (and of the text store) with ``featcache.store.copy_store(src, dst,
  compression)``, timed (input MB/s). Per layer: ``dataset.id.get_storage_size()`` of
  ``/features/<layer>`` (plus ``/scales/<layer>`` for int8) over the rows (the tokens,
  for ``tokens``), and the file size. Every copy is read back and compared with its
  source, value for value.
* read: shuffled epochs of ``FeatureDataset(path, layer).batches(--batch)`` (float32,
  the default ``dtype``; ``TokenDataset`` for ``tokens``), as many whole epochs as fill
  ``--seconds`` (a pooled epoch takes milliseconds), each from a fresh handle ("fresh":
  new buffers, every chunk checked again), and from one handle that read an untimed
  epoch first ("kept": a training loop's later epochs); rows/s and process CPU seconds
  per epoch, the cases interleaved over ``--repeats`` repeats (every other one in reverse
  order) after a warm-up epoch each, medians; ratios against float16 uncompressed of the
  same layer. Pooled and tokens uncompressed; unpooled with every codec. Reads run with
  ``--read-threads`` torch threads (1, as in a DataLoader worker: with 2 on a busy 2-core
  machine the float16 and int8 conversions to float32 stalled erratically, up to 70x);
  the rest with ``--threads`` (default: torch's).
* accuracy: the linear probe (``featcache.probe.probe`` defaults: 20% of train held out
  to choose the L2 strength, refitted, scored on test) and the weighted 20-NN top-1
  (``featcache.probe.knn``, ``ks=[20]``) of ``pooled`` and ``unpooled``, uncompressed,
  beside float32's (through ``featcache.probe.evaluate``, ``methods="linear,knn"``); and
  the same for the int8 stores compressed with ``CHECKED_CODEC``: lossless, so the
  numbers should be identical.
* float8: the float32 rows scaled per row so that the largest magnitude maps to 448 (the
  largest ``torch.float8_e4m3fn``), cast to float8_e4m3fn and back, times the scale:
  written as float32 stores through ``featcache.extract`` (an identity model) and
  probed like the others. Reconstruction error (of every dtype, on the test rows, against
  the float32 store): the largest ``|x' - x|`` over the row's largest ``|x|``, and its
  mean over all values; int8's is that of the int8 store's own dequantized values.

Targets: int8 bytes over float16 bytes at most 0.53 for rows of 256 values or more,
int8's probe and 20-NN top-1 within 0.2 points of float32's, int8 reads at least 0.9x
float16's rows/s. Nothing is asserted on timings; the script stops only if a compressed
copy differs from its source.

    python scripts/bench_compact.py [--quick] [--repeats 3] [--write-repeats 3]
                                    [--seconds 0.5] [--batch 256] [--read-threads 1]
                                    [--threads N] [--texts 4000] [--text-dim 256] [--dir DIR]

``--quick``: 1,000 images per split (``data.limit``), 500 texts, one round and one
repeat: a smoke run. Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import h5py
import numpy as np
import torch
from torch.utils.data import TensorDataset

import featcache  # first: makes torchvision importable beside this torch build
from featcache.errors import ConfigError
from featcache.probe import evaluate
from featcache.probe.results import KnnResult, ProbeResult
from featcache.read.token_view import TokenDataset
from featcache.store import FeatureStore, codec, copy_store
from featcache.util.compression import check_compression

sys.path.insert(0, str(Path(__file__).parent))
from bench_write import Identity  # noqa: E402  (the model of stored rows)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
ARCHIVE = SHARED / "cifar10-jpeg.tar"
WEIGHTS = SHARED / "weights" / "resnet20-12fca82f.th"
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]

DTYPES = ("float32", "float16", "bfloat16", "int8")
CODECS = (None, "gzip", "zstd", "blosc2-lz4", "blosc2-zstd-bitshuffle")
CHECKED_CODEC = "blosc2-zstd-bitshuffle"  # the int8 copies probed again: identical numbers
POOLED, UNPOOLED, TOKENS = "pooled", "unpooled", "tokens"
IMAGE_LAYERS = (POOLED, UNPOOLED)
FLOAT8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
K = 20
FLOAT8 = "float8 (simulated)"
WORDS = [
    "calm", "quiet", "soft", "still", "gentle", "slow", "warm", "mild", "loud", "noisy",
    "harsh", "shrill", "bright", "sharp", "fast", "cold", "river", "stone", "cloud", "field",
    "market", "engine", "letter", "garden", "window", "signal", "paper", "music",
]  # fmt: skip

T = TypeVar("T")
START = time.perf_counter()


def log(message: str) -> None:
    """A progress line on stderr, with the seconds since the start."""
    print(f"[{time.perf_counter() - START:7.1f} s] {message}", file=sys.stderr, flush=True)


def timed(run: Callable[[], T]) -> tuple[T, float, float]:
    """``run()``'s result, wall seconds and process CPU seconds (every thread)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def codec_name(compression: str | None) -> str:
    return compression or "none"


# ---------------------------------------------------------------------------- the data


def unpack_cifar(folder: Path) -> Path:
    """The CIFAR-10 JPEGs in ImageFolder layout under ``folder``; returns their root."""
    with tarfile.open(ARCHIVE) as tar:
        if hasattr(tarfile, "data_filter"):  # the data filter where this Python has it
            tar.extractall(folder, filter="data")
        else:
            tar.extractall(folder)
    return folder / "cifar10-jpeg"


def cifar_config(root: Path, out: Path, dtype: str, limit: int | None) -> dict[str, Any]:
    """The config of tests/test_probe_real.py's CIFAR stores, with both layer3 layers."""
    data: dict[str, Any] = {"source": "imagefolder", "root": str(root), "splits": ["train", "test"]}
    if limit is not None:
        data["limit"] = limit
    return {
        "model": {
            "factory": "tests.cifar_resnet:resnet20",
            "checkpoint": str(WEIGHTS),
            "strip_prefix": "module.",
        },
        "layers": [
            {"name": "layer3", "reduce": "avg", "key": POOLED},
            {"name": "layer3", "reduce": "none", "key": UNPOOLED},
        ],
        "data": data,
        "preprocess": {"mean": MEAN, "std": STD},  # the images are 32x32 already
        "loader": {"batch_size": 256, "num_workers": 0},
        "store": {"dtype": dtype},
        "output": {"dir": str(out)},
        "runtime": {"progress": False},
    }


def write_texts(folder: Path, count: int, dim: int) -> Path:
    """A random 2-layer BERT of hidden size ``dim`` saved with a ByT5 tokenizer, and
    ``count`` synthetic labelled texts of 2 to 14 words in ``train.jsonl``; returns
    ``folder``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=384,
        hidden_size=dim,
        num_hidden_layers=2,
        num_attention_heads=max(1, dim // 64),
        intermediate_size=2 * dim,
        max_position_embeddings=256,
    )
    transformers.utils.logging.disable_progress_bar()
    transformers.BertModel(config).eval().save_pretrained(folder / "bert")
    transformers.ByT5Tokenizer().save_pretrained(folder / "bert")
    rng = random.Random(0)
    with open(folder / "train.jsonl", "w") as f:
        for i in range(count):
            words = rng.choices(WORDS, k=rng.randrange(2, 15))
            row = {"id": f"t{i:06d}", "text": " ".join(words), "label": i % 2}
            f.write(json.dumps(row) + "\n")
    return folder


def text_config(folder: Path, out: Path, dtype: str) -> dict[str, Any]:
    """Per-token rows of the BERT's last layer over ``train.jsonl`` (tokens cut at 96)."""
    return {
        "model": {"name": f"hf:{folder / 'bert'}"},
        "layers": [{"name": "encoder.layer.1", "key": TOKENS}],
        "data": {
            "source": "text",
            "root": str(folder),
            "splits": {"train": "train.jsonl"},
            "max_length": 96,
        },
        "loader": {"batch_size": 64, "num_workers": 0},
        "store": {"dtype": dtype},
        "output": {"dir": str(out)},
        "runtime": {"progress": False},
    }


# ---------------------------------------------------------------------------- writing


Write = dict[tuple[str, str], list[tuple[int, int, float, float]]]


def extract_stores(
    args: argparse.Namespace, work: Path
) -> tuple[dict[str, dict[str, Path]], Write]:
    """Every dtype's CIFAR and text stores, each extraction timed in ``--write-repeats``
    rounds (the dtypes in a rotated order each round); the first round's stores are kept.

    Returns ``{dtype: {"train", "test", "text": path}}`` and ``{(set, dtype): [(rows,
    tokens, wall s, CPU s)] per round}`` (set: ``"cifar"``, ``"text"``)."""
    root = unpack_cifar(work / "jpeg")
    text_folder = write_texts(_mkdir(work / "texts"), args.texts, args.text_dim)
    log("warm-up extraction")
    featcache.extract_from_config(cifar_config(root, work / "warm", "float32", 256))
    paths: dict[str, dict[str, Path]] = {}
    write: Write = {(kind, dtype): [] for kind in ("cifar", "text") for dtype in DTYPES}
    for round_ in range(args.write_repeats):
        out = work / ("stores" if round_ == 0 else f"round{round_}")
        for dtype in DTYPES[round_ % len(DTYPES) :] + DTYPES[: round_ % len(DTYPES)]:
            log(f"write round {round_ + 1} of {args.write_repeats}: {dtype}")
            config = cifar_config(root, out / "cifar" / dtype, dtype, args.limit)
            stores, wall, cpu = timed(partial(featcache.extract_from_config, config))
            write[("cifar", dtype)].append((sum(map(len, stores.values())), 0, wall, cpu))
            config = text_config(text_folder, out / "text" / dtype, dtype)
            texts, wall, cpu = timed(partial(featcache.extract_from_config, config))
            offsets = texts["train"].offsets
            assert offsets is not None
            write[("text", dtype)].append((len(texts["train"]), int(offsets[-1]), wall, cpu))
            for store in (*stores.values(), *texts.values()):
                store.close()
            if round_ == 0:
                paths[dtype] = {
                    "train": stores["train"].path,
                    "test": stores["test"].path,
                    "text": texts["train"].path,
                }
        if round_:
            shutil.rmtree(out)
    return paths, write


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------- bytes


def accepted_codecs() -> tuple[list[str | None], list[str]]:
    """The codecs of ``CODECS`` featcache accepts here, and a line for each it refuses."""
    accepted: list[str | None] = []
    refused = []
    for compression in CODECS:
        try:
            check_compression(compression)
            accepted.append(compression)
        except ConfigError as exc:
            refused.append(f"{compression}: {exc}")
    return accepted, refused


def layer_bytes(path: Path, layer: str) -> int:
    """Stored bytes of ``/features/<layer>``, plus ``/scales/<layer>`` where present."""
    with h5py.File(path, "r") as f:
        total = int(f["features"][layer].id.get_storage_size())
        scales = codec.scales_name(layer)
        if scales in f:
            total += int(f[scales].id.get_storage_size())
    return total


def same_values(a: Path, b: Path) -> bool:
    """Whether every layer of the stores at ``a`` and ``b`` reads back the same."""
    with FeatureStore(a) as x, FeatureStore(b) as y:
        for layer in x.layers:
            if x.is_per_token(layer):
                if not torch.equal(x.read_tokens(layer)[0], y.read_tokens(layer)[0]):
                    return False
            elif not torch.equal(x.read(layer), y.read(layer)):
                return False
    return True


def compressed_copies(
    paths: dict[str, dict[str, Path]], codecs: Sequence[str | None], work: Path
) -> dict[tuple[str, str, str | None], tuple[Path, float, float]]:
    """``{(dtype, store, codec): (path, wall, cpu)}`` for the train and text stores of
    every dtype and codec (the source itself for None, untimed), and the test store of
    int8 with ``CHECKED_CODEC``; each copy checked against its source."""
    copies: dict[tuple[str, str, str | None], tuple[Path, float, float]] = {}
    wanted = [(d, s, c) for d in DTYPES for s in ("train", "text") for c in codecs]
    if CHECKED_CODEC in codecs:
        wanted.append(("int8", "test", CHECKED_CODEC))
    for dtype, store, compression in wanted:
        source = paths[dtype][store]
        if compression is None:
            copies[(dtype, store, None)] = (source, 0.0, 0.0)
            continue
        target = _mkdir(work / "copies" / dtype) / f"{store}-{compression}.h5"
        log(f"copying {dtype} {store} with {compression}")
        _, wall, cpu = timed(partial(copy_store, source, target, compression))
        if not same_values(source, target):
            raise SystemExit(f"{target} reads back other values than {source}")
        copies[(dtype, store, compression)] = (target, wall, cpu)
    return copies


# ---------------------------------------------------------------------------- reading


def read_epoch(dataset: featcache.FeatureDataset, batch: int, epoch: int) -> int:
    """One shuffled epoch of ``dataset``'s float32 batches; the rows (tokens) read."""
    return sum(len(b[0]) for b in dataset.batches(batch, shuffle=True, epoch=epoch))


def read_for(
    path: Path, layer: str, batch: int, seconds: float, first: int, kept: bool
) -> tuple[float, float]:
    """Rows/s and CPU seconds per epoch of whole epochs (``first``, ``first + 1``, ...)
    until ``seconds`` have passed: each from a fresh handle, or with ``kept`` from one
    handle that read an untimed epoch before (its buffers made, its chunks checked)."""
    kind = TokenDataset if layer == TOKENS else featcache.FeatureDataset
    held = kind(path, layer) if kept else None
    if held is not None:
        read_epoch(held, batch, first - 1)
    seen = epochs = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while not epochs or time.perf_counter() - wall < seconds:
        dataset = held or kind(path, layer)
        seen += read_epoch(dataset, batch, first + epochs)
        if held is None:
            dataset.close()
        epochs += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if held is not None:
        held.close()
    return seen / wall, cpu / epochs


Speed = dict[tuple[str, str, str | None, bool], tuple[float, float]]


def time_reads(
    cases: dict[tuple[str, str, str | None], Path], batch: int, repeats: int, seconds: float
) -> Speed:
    """``{(layer, dtype, codec, kept): (rows/s, CPU s per epoch)}``: medians over
    ``repeats`` interleaved runs of :func:`read_for` (every other repeat in reverse order),
    after one warm-up epoch of each case."""
    for (layer, _, _), path in cases.items():
        read_for(path, layer, batch, 0.0, 0, kept=False)
    keys = [(*key, kept) for key in cases for kept in (False, True)]
    runs: dict[tuple[str, str, str | None, bool], list[tuple[float, float]]] = {k: [] for k in keys}
    for repeat in range(repeats):
        log(f"read repeat {repeat + 1} of {repeats}")
        for key in keys if repeat % 2 == 0 else reversed(keys):
            path = cases[key[:3]]
            runs[key].append(read_for(path, key[0], batch, seconds, 1000 * repeat + 2, key[3]))
    return {
        key: (statistics.median(r for r, _ in got), statistics.median(c for _, c in got))
        for key, got in runs.items()
    }


# ---------------------------------------------------------------------------- accuracy


def accuracy(train: Path, test: Path, layers: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``{layer: (linear probe test top-1, 20-NN test top-1)}``, in percent."""
    results = evaluate(train, list(layers), test=test, methods="linear,knn", ks=[K], progress=False)
    found: dict[str, dict[str, float]] = {layer: {} for layer in layers}
    for result in results:
        if isinstance(result, ProbeResult):
            assert result.test is not None
            found[result.layer]["linear"] = 100 * result.test["top1"]
        else:
            assert isinstance(result, KnnResult)
            found[result.layer]["knn"] = 100 * result.metrics[K]["top1"]
    return {layer: (values["linear"], values["knn"]) for layer, values in found.items()}


def float8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` ``[n, ...]`` (float32) stored as float8_e4m3fn with one float32 scale per
    row (the row's largest magnitude over 448) and read back as float32."""
    flat = x.flatten(1)
    scales = flat.abs().amax(dim=1) / FLOAT8_MAX
    step = torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    back = (flat / step).to(torch.float8_e4m3fn).float() * step
    return back.view(x.shape)


def write_rows(path: Path, values: torch.Tensor, like: FeatureStore, key: str) -> Path:
    """A float32 store of ``values`` as layer ``key``, with ``like``'s labels, ids and
    classes."""
    labels = torch.from_numpy(np.asarray(like.labels, dtype=np.int64))
    featcache.extract(
        Identity(), TensorDataset(values, labels), [{"name": "layer", "key": key}], path,
        ids=like.ids, class_names=like.class_names, dtype="float32", batch_size=512,
        num_workers=0, progress=False,
    )  # fmt: skip
    return path


def float8_stores(paths: dict[str, Path], work: Path) -> dict[str, dict[str, Path]]:
    """``{layer: {split: path}}``: float32 stores of the float8 round trip of each
    float32 CIFAR store's layer (one store per layer and split)."""
    out: dict[str, dict[str, Path]] = {layer: {} for layer in IMAGE_LAYERS}
    for split in ("train", "test"):
        with FeatureStore(paths[split]) as store:
            for layer in IMAGE_LAYERS:
                values = float8_round_trip(store.read(layer))
                target = _mkdir(work / "float8" / layer) / f"{split}.h5"
                out[layer][split] = write_rows(target, values, store, layer)
    return out


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest and the mean ``|got - want|`` over the row's largest ``|want|``, in %."""
    got, want = got.flatten(1).double(), want.flatten(1).double()
    row_max = want.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    relative = (got - want).abs() / row_max
    return 100 * float(relative.max()), 100 * float(relative.mean())


def reconstruction(
    paths: dict[str, dict[str, Path]],
) -> tuple[dict[tuple[str, str], tuple[float, float]], dict[str, bool]]:
    """``{(layer, dtype): (max %, mean %)}`` of every dtype and ``"float8 (simulated)"``
    on the test rows against the float32 store, and per layer whether the int8 store
    equals ``codec.quantize`` of the float32 store's rows, code for code."""
    found: dict[tuple[str, str], tuple[float, float]] = {}
    exact: dict[str, bool] = {}
    with FeatureStore(paths["float32"]["test"]) as reference:
        for layer in IMAGE_LAYERS:
            want = reference.read(layer)
            for dtype in DTYPES[1:]:
                with FeatureStore(paths[dtype]["test"]) as store:
                    found[(layer, dtype)] = errors(store.read(layer), want)
            found[(layer, FLOAT8)] = errors(float8_round_trip(want), want)
            with h5py.File(paths["int8"]["test"], "r") as f:
                codes = torch.from_numpy(f["features"][layer][()])
            exact[layer] = torch.equal(codec.quantize(want)[0], codes)
    return found, exact


# ---------------------------------------------------------------------------- tables


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain-text table: the first column left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for row in cells:
        first = row[0].ljust(widths[0])
        print("  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]))


def machine_facts() -> None:
    import hdf5plugin

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(
        f"machine: {platform.machine()} {platform.processor() or platform.system()}, "
        f"{os.cpu_count()} CPUs ({affinity} usable), load average "
        f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}; torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, h5py {h5py.__version__} (HDF5 "
        f"{h5py.version.hdf5_version}), hdf5plugin {hdf5plugin.version}; "
        f"python {platform.python_version()}"
    )


def spread(values: Sequence[float], form: str) -> str:
    """``median (min-max)`` in ``form``; the median alone for one value."""
    middle = format(statistics.median(values), form)
    if len(values) == 1:
        return middle
    return f"{middle} ({format(min(values), form)}-{format(max(values), form)})"


def print_write(write: Write) -> None:
    rows = []
    for (kind, dtype), rounds in write.items():
        count, tokens = rounds[0][:2]
        walls, cpus = [r[2] for r in rounds], [r[3] for r in rounds]
        base = statistics.median(r[2] for r in write[(kind, "float32")])
        what = "CIFAR-10 train+test" if kind == "cifar" else f"texts ({tokens:,} tokens)"
        rows.append(
            [f"{what}, {dtype}", f"{count:,}", spread(walls, ".1f"),
             f"{count / statistics.median(walls):,.0f}", spread(cpus, ".1f"),
             f"{base / statistics.median(walls):.2f}x"]
        )  # fmt: skip
    repeats = len(next(iter(write.values())))
    table(
        "write: extract_from_config, uncompressed, wall from the call to the complete stores; "
        f"median (range) of {repeats} rounds",
        ["stores", "rows", "wall s", "rows/s", "CPU s", "speed vs float32"],
        rows,
    )


def print_bytes(
    copies: dict[tuple[str, str, str | None], tuple[Path, float, float]],
    codecs: Sequence[str | None],
    units: dict[str, int],
) -> None:
    """Bytes per row of each layer and dtype under each codec, the file sizes, and the
    copies' speed."""
    header = ["layer, dtype", *(codec_name(c) for c in codecs), "none vs float16"]
    rows = []
    for layer in (*IMAGE_LAYERS, TOKENS):
        store = "text" if layer == TOKENS else "train"
        base = layer_bytes(copies[("float16", store, None)][0], layer)
        for dtype in DTYPES:
            sizes = [layer_bytes(copies[(dtype, store, c)][0], layer) for c in codecs]
            rows.append(
                [f"{layer}, {dtype}", *(f"{s / units[store]:,.1f}" for s in sizes),
                 f"{sizes[0] / base:.3f}"]
            )  # fmt: skip
    table(
        "bytes per row (tokens: per token) of each layer: storage of /features/<layer> "
        "(+ /scales/<layer>) over rows",
        header,
        rows,
    )
    rows = []
    for store in ("train", "text"):
        for dtype in DTYPES:
            sizes = [copies[(dtype, store, c)][0].stat().st_size for c in codecs]
            rows.append([f"{store}, {dtype}", *(f"{s / 2**20:,.2f}" for s in sizes)])
    table("file size, MiB", ["store, dtype", *(codec_name(c) for c in codecs)], rows)
    rows = []
    for (dtype, store, compression), (path, wall, cpu) in copies.items():
        if compression is None or store == "test":
            continue
        raw = copies[(dtype, store, None)][0].stat().st_size
        rows.append(
            [f"{store}, {dtype}, {compression}", f"{wall:.2f}", f"{cpu:.2f}",
             f"{raw / wall / 1e6:,.0f}", f"{raw / path.stat().st_size:.2f}x"]
        )  # fmt: skip
    table(
        "copy_store(src, dst, compression): every copy read back equal to its source",
        ["store, dtype, codec", "wall s", "CPU s", "MB/s in", "smaller"],
        rows,
    )


def print_reads(speed: Speed, args: argparse.Namespace) -> None:
    rows = []
    for layer, dtype, compression, kept in speed:
        if kept:
            continue
        cells = [f"{layer}, {dtype}, {codec_name(compression)}"]
        for held in (False, True):
            rate, cpu = speed[(layer, dtype, compression, held)]
            base_rate, base_cpu = speed[(layer, "float16", None, held)]
            cells += [f"{rate:,.0f}", f"{cpu:.3f}", f"{rate / base_rate:.2f}x"]
        rows.append(cells)
    table(
        f"read: shuffled epochs of batches({args.batch}) as float32, each from a fresh handle "
        f"(fresh) or from one handle after an epoch (kept); {args.read_threads} torch "
        f"thread(s); median of {args.repeats}; tokens: TokenDataset, tokens/s; CPU s per epoch",
        ["layer, dtype, codec", "fresh rows/s", "CPU s", "vs float16",
         "kept rows/s", "CPU s", "vs float16"],
        rows,
    )  # fmt: skip


def print_accuracy(acc: dict[str, dict[str, tuple[float, float]]], test_rows: int) -> None:
    rows = []
    for layer in IMAGE_LAYERS:
        base = acc["float32"][layer]
        for name, by_layer in acc.items():
            linear, knn = by_layer[layer]
            rows.append(
                [f"{layer}, {name}", f"{linear:.2f}", f"{linear - base[0]:+.2f}",
                 f"{knn:.2f}", f"{knn - base[1]:+.2f}"]
            )  # fmt: skip
    table(
        f"accuracy on the {test_rows:,} test rows (top-1 %; difference from float32 in points)",
        ["layer, storage", "linear", "vs f32", f"{K}-NN", "vs f32"],
        rows,
    )


def print_errors(found: dict[tuple[str, str], tuple[float, float]], exact: dict[str, bool]) -> None:
    rows = [
        [f"{layer}, {name}", f"{worst:.4f}", f"{mean:.5f}"]
        for (layer, name), (worst, mean) in found.items()
    ]
    table(
        "reconstruction error on the test rows against float32: |x' - x| over the row's "
        "largest |x|, in %",
        ["layer, storage", "max %", "mean %"],
        rows,
    )
    for layer, same in exact.items():
        print(f"int8 store of {layer} equals codec.quantize(float32 store), code for code: {same}")


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 images per split, 500 texts")
    parser.add_argument("--repeats", type=int, default=None, help="read repeats (default 3)")
    parser.add_argument("--batch", type=int, default=256, help="rows per read batch")
    parser.add_argument("--texts", type=int, default=None, help="texts (default 4,000)")
    parser.add_argument(
        "--seconds", type=float, default=0.5, help="least time of a read measurement"
    )
    parser.add_argument("--read-threads", type=int, default=1, help="torch threads of reads")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the rest (default: torch's)"
    )
    parser.add_argument(
        "--write-repeats", type=int, default=None, help="extraction rounds (default 3)"
    )
    parser.add_argument("--text-dim", type=int, default=256, help="the BERT's hidden size")
    parser.add_argument("--dir", type=Path, default=None, help="where to work (default: tmp)")
    args = parser.parse_args()
    args.limit = 1000 if args.quick else None
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.write_repeats = args.write_repeats or (1 if args.quick else 3)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.texts = args.texts or (500 if args.quick else 4000)
    sys.path.insert(0, str(REPO))  # the model factory tests.cifar_resnet:resnet20
    for needed in (ARCHIVE, WEIGHTS):
        if not needed.exists():
            raise SystemExit(f"{needed} is missing: it lives in ../shared/data beside the repo")
    machine_facts()
    with tempfile.TemporaryDirectory(prefix="featcache-bench-compact-", dir=args.dir) as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, work: Path) -> None:
    codecs, refused = accepted_codecs()
    paths, write = extract_stores(args, work)
    copies = compressed_copies(paths, codecs, work)
    units = store_units(paths["float32"])

    reads: dict[tuple[str, str, str | None], Path] = {}
    for dtype in DTYPES:
        reads[(POOLED, dtype, None)] = paths[dtype]["train"]
        for compression in codecs:
            reads[(UNPOOLED, dtype, compression)] = copies[(dtype, "train", compression)][0]
        reads[(TOKENS, dtype, None)] = paths[dtype]["text"]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.read_threads)  # as in a DataLoader worker; see --read-threads
    speed = time_reads(reads, args.batch, args.repeats, args.seconds)
    torch.set_num_threads(threads)

    acc: dict[str, dict[str, tuple[float, float]]] = {}
    for dtype in DTYPES:
        log(f"probing {dtype}")
        acc[dtype] = accuracy(paths[dtype]["train"], paths[dtype]["test"], IMAGE_LAYERS)
    if CHECKED_CODEC in codecs:
        log(f"probing int8, {CHECKED_CODEC}")
        acc[f"int8, {CHECKED_CODEC}"] = accuracy(
            copies[("int8", "train", CHECKED_CODEC)][0],
            copies[("int8", "test", CHECKED_CODEC)][0],
            IMAGE_LAYERS,
        )
    log("float8 round trip")
    simulated = float8_stores(paths["float32"], work)
    acc[FLOAT8] = {
        layer: accuracy(simulated[layer]["train"], simulated[layer]["test"], [layer])[layer]
        for layer in IMAGE_LAYERS
    }
    found, exact = reconstruction(paths)

    print(
        f"\nCIFAR-10 JPEGs through the pretrained ResNet-20: {units['train']:,} train and "
        f"{units['test']:,} test rows; layers {POOLED} (layer3, avg, [64]) and {UNPOOLED} "
        f"(layer3, [64, 8, 8]). {TOKENS}: per-token rows [{args.text_dim}] of a random "
        f"BERT over {args.texts:,} texts ({units['text']:,} tokens)."
    )
    if refused:
        print("codecs featcache refused here: " + "; ".join(refused))
    print_write(write)
    print_bytes(copies, codecs, units)
    print_reads(speed, args)
    print_accuracy(acc, units["test"])
    print_errors(found, exact)
    summary(copies, speed, acc)
    machine_facts()


def store_units(paths: dict[str, Path]) -> dict[str, int]:
    """The rows of the train and test stores and the tokens of the text store."""
    units = {}
    for split in ("train", "test"):
        with FeatureStore(paths[split]) as store:
            units[split] = len(store)
    with FeatureStore(paths["text"]) as store:
        assert store.offsets is not None
        units["text"] = int(store.offsets[-1])
    return units


def summary(
    copies: dict[tuple[str, str, str | None], tuple[Path, float, float]],
    speed: Speed,
    acc: dict[str, dict[str, tuple[float, float]]],
) -> None:
    """The three targets, from the numbers above."""
    print("\ntargets")
    sizes = ((UNPOOLED, "train", "4096"), (TOKENS, "text", "256"), (POOLED, "train", "64"))
    for layer, store, values in sizes:
        int8 = layer_bytes(copies[("int8", store, None)][0], layer)
        half = layer_bytes(copies[("float16", store, None)][0], layer)
        print(
            f"  int8 / float16 bytes, {layer} ({values} values a row): {int8 / half:.3f} "
            "(target <= 0.53 for 256+ values)"
        )
    for layer in IMAGE_LAYERS:
        linear = acc["int8"][layer][0] - acc["float32"][layer][0]
        knn = acc["int8"][layer][1] - acc["float32"][layer][1]
        print(
            f"  int8 - float32 top-1, {layer}: linear {linear:+.2f}, {K}-NN {knn:+.2f} points "
            "(target within 0.2)"
        )
    for layer in (POOLED, UNPOOLED, TOKENS):
        fresh, kept = (
            speed[(layer, "int8", None, held)][0] / speed[(layer, "float16", None, held)][0]
            for held in (False, True)
        )
        print(
            f"  int8 / float16 read rows/s, {layer}: fresh handle {fresh:.2f}x, kept handle "
            f"{kept:.2f}x (target >= 0.9x)"
        )


if __name__ == "__main__":
    main()
