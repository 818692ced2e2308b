"""Shuffled token batches: featcache's token view against a Hugging Face `datasets` Arrow dataset.

Activation caches for sparse autoencoders and token probes are read as single tokens,
shuffled. This script makes per-token activations once and times one shuffled epoch of
them through each route:

* the activations: ``encoder.layer.0`` (per-token rows, ``reduce: none``) of a random
  2-layer BERT of width ``--dim`` over synthetic texts of 16 to 256 bytes, byte-tokenised,
  until about ``--tokens`` tokens; extracted with ``featcache.extract`` into one store per
  ``--dtypes`` entry (``store.dtype``; ``int8`` is in the default list only where
  ``featcache.store.codec.DTYPES`` has it). Every store holds the same tokens, each
  rounded to its dtype.
* the same tokens as a ``datasets.Dataset``: one row per token, one column ``x`` of
  ``--dim`` values (``List(Value(dtype), length=dim)``, an Arrow fixed-size list) written
  with ``save_to_disk`` and opened with ``load_from_disk`` (memory-mapped Arrow). Its
  dtype is the store's where Arrow has it (float16, float32); bfloat16 (which Arrow
  lacks) and int8 (codes and per-token scales, which a single Arrow column cannot hold)
  become float32 holding exactly the values featcache serves for that store. A store
  pairs with the Arrow dataset of its Arrow dtype; a float32 Arrow dataset holds the
  values of the first store that maps to float32.

Routes, each over one epoch in batches of ``--batch`` tokens, every batch converted to
float32:

* ``featcache TokenDataset.batches``: ``TokenDataset(path, layer)`` (float32 out, the
  default) and ``batches(batch, shuffle=True, seed=round)``: whole chunks read in a random
  order into a shuffle buffer (by default 64 blocks of about 1 MiB) and batches drawn from
  a permutation of it; each batch also carries each token's row and position.
* ``Arrow shuffle() + iter``: ``load_from_disk(folder).with_format("torch")``, then
  ``shuffle(seed=round)`` (an exact shuffle: it writes an indices mapping, timed as part
  of the route) and ``iter(batch_size=batch)``. This is the baseline of the ratios. The
  torch format gives float32 batches itself, from a float16 column too.
* ``Arrow to_iterable_dataset + shuffle``: the fast route the ``datasets`` documentation
  gives for shuffled reading (``Dataset.shuffle``'s docstring):
  ``to_iterable_dataset(num_shards=128).shuffle(seed=round, buffer_size=--buffer)``
  (shards in a random order, examples through a shuffle buffer), then
  ``iter(batch_size=batch)``. ``--buffer`` is 131,072 tokens by default: featcache's
  buffer of a bfloat16 layer of width 256. Skipped with ``--no-iterable``.

Every round runs each route once in a fresh child process (this script with
``--child``), the routes in reverse order every other round; medians over ``--repeats``
rounds. The files are in the page cache (just written), so the figures measure the
reading machinery, not the disk. Per route: bytes on disk (the store file; the Arrow
folder as saved, before any shuffle's indices file), the seconds to open and to shuffle
before the first batch (both part of the route's time), tokens/s over wall time and
over the child's CPU time (user + system, every thread), the peak RSS growth during the
route (``VmHWM`` reset through ``/proc/self/clear_refs`` just before it, minus ``VmRSS``
then; memory-mapped file pages count in it) and the peak growth of anonymous memory
alone (``RssAnon``, sampled every 10 ms). Then featcache over the exact Arrow route on
its paired dataset: tokens/s (wall and CPU), peak memory and bytes on disk.

``--threads`` sets torch's intra-op threads in the children (1 by default, as in a
DataLoader worker); pyarrow keeps its own thread pool.

    python scripts/bench_tokens.py [--tokens 1000000] [--dim 256]
                                   [--dtypes bfloat16 float16 [int8]] [--batch 4096]
                                   [--repeats 3] [--buffer 131072] [--no-iterable]
                                   [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LAYER = "encoder.layer.0"
FEATCACHE = "featcache TokenDataset.batches"
EXACT = "Arrow shuffle() + iter"
ITERABLE = "Arrow to_iterable_dataset + shuffle"
SHARDS = 128  # to_iterable_dataset's num_shards, as in the datasets docstring
ARROW_DTYPES = {
    "float16": "float16",
    "float32": "float32",
    "bfloat16": "float32",
    "int8": "float32",
}
WORDS = ["feature", "cache", "token", "row", "a", "of", "the", "store", "model", "text"]


@dataclass(frozen=True)
class Route:
    """One way of reading the tokens: ``kind`` (featcache, exact, iterable) over ``path``,
    which holds them as ``stored`` (the store's or the Arrow column's dtype)."""

    kind: str
    path: Path
    stored: str
    pair: str  # the Arrow dtype of the dataset a featcache route is compared with

    @property
    def name(self) -> str:
        return f"{self.kind}, {self.stored}"


def synthetic_texts(tokens: int, seed: int = 0) -> list[str]:
    """Texts of 16 to 256 bytes of words, enough for about ``tokens`` byte tokens (each
    text gives its bytes plus two)."""
    rng = np.random.default_rng(seed)
    texts: list[str] = []
    total = 0
    while total < tokens:
        length = int(rng.integers(16, 257))
        text = ""
        while len(text) < length:
            text += WORDS[int(rng.integers(len(WORDS)))] + " "
        texts.append(text[:length])
        total += length + 2
    return texts


class Bytes:
    """UTF-8 bytes as token ids (byte + 3) between ids 1 and 2: a tokenizer of no cost."""

    name, pad_id, max_length = "bytes", 0, None

    def __call__(self, texts: list[str], max_length: int | None) -> Any:
        from featcache.sources.tokenizer import Tokenized

        ids = [[1, *(b + 3 for b in text.encode()), 2] for text in texts]
        return Tokenized(ids, [False] * len(ids))


def random_bert(dim: int) -> Any:
    """A seeded random 2-layer BERT of width ``dim`` over a byte-sized vocabulary, in eval."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=384,
        hidden_size=dim,
        num_hidden_layers=2,
        num_attention_heads=4 if dim % 4 == 0 else 1,
        intermediate_size=4 * dim,
        max_position_embeddings=512,
    )
    return transformers.BertModel(config).eval()


def extract_stores(folder: Path, texts: list[str], dim: int, dtypes: list[str]) -> dict[str, Path]:
    """One featcache store of ``LAYER``'s per-token rows of ``texts`` per dtype; their
    paths by dtype."""
    import featcache
    from featcache.sources.text import texts_source

    ids = [f"t{i}" for i in range(len(texts))]
    source = texts_source(texts, None, ids, None, Bytes(), None, "synthetic texts")
    model = random_bert(dim)
    stores = {}
    for dtype in dtypes:
        path = folder / f"tokens-{dtype}.h5"
        start = time.perf_counter()
        featcache.extract(
            model, source, LAYER, path, batch_size=64, num_workers=0, progress=False,
            bucket_by_length=True, dtype=dtype,
        ).close()  # fmt: skip
        print(f"extracted {dtype} store in {time.perf_counter() - start:.0f} s", flush=True)
        stores[dtype] = path
    return stores


def store_values(path: Path, dtype: str) -> np.ndarray:
    """Every token of the store at ``path`` in store order, as featcache serves them in
    ``dtype`` (float16 or float32): ``[tokens, dim]``."""
    import torch

    from featcache import TokenDataset

    dataset = TokenDataset(path, LAYER, dtype=getattr(torch, dtype))
    out = np.empty((dataset.num_tokens, *dataset.shapes[LAYER]), dtype=dtype)
    at = 0
    for features, _, _ in dataset.batches(1 << 16, shuffle=False):
        out[at : at + len(features)] = features.numpy()
        at += len(features)
    dataset.close()
    return out


def write_arrow(values: np.ndarray, folder: Path) -> None:
    """``values`` ``[tokens, dim]`` as a ``datasets.Dataset`` of one row per token (column
    ``x``, a fixed-size list of ``dim`` values) saved to ``folder``."""
    import datasets
    import pyarrow as pa

    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    datasets.Dataset(pa.table({"x": column})).save_to_disk(str(folder))


def make_routes(
    folder: Path, stores: dict[str, Path], iterable: bool
) -> tuple[list[Route], dict[str, int]]:
    """The routes over the stores and their Arrow datasets (written here), and the bytes
    on disk of each route's files by route name."""
    arrows: dict[str, Path] = {}
    for dtype, path in stores.items():
        arrow = ARROW_DTYPES[dtype]
        if arrow not in arrows:
            arrows[arrow] = folder / f"arrow-{arrow}"
            write_arrow(store_values(path, arrow), arrows[arrow])
    routes = [Route(FEATCACHE, path, dtype, ARROW_DTYPES[dtype]) for dtype, path in stores.items()]
    for arrow, path in arrows.items():
        routes.append(Route(EXACT, path, arrow, arrow))
        if iterable:
            routes.append(Route(ITERABLE, path, arrow, arrow))
    sizes = {route.name: disk_bytes(route.path) for route in routes}
    return routes, sizes


def disk_bytes(path: Path) -> int:
    """The bytes of a file, or of every file in a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def memory_kib() -> dict[str, int]:
    """``VmHWM``, ``VmRSS`` and ``RssAnon`` of this process, in KiB."""
    fields = ("VmHWM", "VmRSS", "RssAnon")
    status = Path("/proc/self/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(fields)}


class AnonPeak:
    """The largest ``RssAnon`` seen, sampled every 10 ms on a thread while in use."""

    def __init__(self) -> None:
        self.peak = memory_kib()["RssAnon"]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, memory_kib()["RssAnon"])

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, memory_kib()["RssAnon"])


def featcache_epoch(path: Path, batch: int, seed: int, buffer: int) -> Iterator[Any]:
    """Opens the store (then yields None, and None again: its shuffling is part of
    reading), then yields its float32 batches."""
    from featcache import TokenDataset

    dataset = TokenDataset(path, LAYER)  # float32 out
    yield None
    yield None
    for features, _, _ in dataset.batches(batch, shuffle=True, seed=seed):
        yield features.float()
    dataset.close()


def exact_epoch(path: Path, batch: int, seed: int, buffer: int) -> Iterator[Any]:
    """Opens the Arrow dataset (then yields None), shuffles it: an indices mapping (then
    yields None), then yields float32 batches."""
    import datasets

    dataset = datasets.load_from_disk(str(path)).with_format("torch")
    yield None
    shuffled = dataset.shuffle(seed=seed)
    yield None
    for rows in shuffled.iter(batch_size=batch):
        yield rows["x"].float()


def iterable_epoch(path: Path, batch: int, seed: int, buffer: int) -> Iterator[Any]:
    """Opens the Arrow dataset (then yields None), makes it shuffled shards (then yields
    None), then yields float32 batches drawn through a shuffle buffer of ``buffer`` rows."""
    import datasets

    dataset = datasets.load_from_disk(str(path)).with_format("torch")
    yield None
    shuffled = dataset.to_iterable_dataset(num_shards=SHARDS).shuffle(seed=seed, buffer_size=buffer)
    yield None
    for rows in shuffled.iter(batch_size=batch):
        yield rows["x"].float()


EPOCHS: dict[str, Callable[[Path, int, int, int], Iterator[Any]]] = {
    FEATCACHE: featcache_epoch,
    EXACT: exact_epoch,
    ITERABLE: iterable_epoch,
}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(spec: dict[str, Any]) -> dict[str, float]:
    """One epoch of one route, in this (child) process: tokens read, seconds to open and
    to shuffle before the first batch, wall and CPU seconds in all, and the peak growth of
    RSS and of anonymous memory in bytes."""
    import datasets  # noqa: F401  (every child imports the same libraries before timing)
    import torch

    import featcache  # noqa: F401

    torch.set_num_threads(spec["threads"])
    epoch = EPOCHS[spec["kind"]](Path(spec["path"]), spec["batch"], spec["seed"], spec["buffer"])
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    before = memory_kib()
    tokens = 0
    with AnonPeak() as anon:
        cpu, start = cpu_seconds(), time.perf_counter()
        next(epoch)
        opened = time.perf_counter() - start
        next(epoch)
        shuffled = time.perf_counter() - start - opened
        for features in epoch:
            tokens += len(features)
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    after = memory_kib()
    return {
        "tokens": tokens,
        "open": opened,
        "shuffle": shuffled,
        "wall": wall,
        "cpu": cpu,
        "peak_rss": (after["VmHWM"] - before["VmRSS"]) * 1024,
        "peak_anon": (anon.peak - before["RssAnon"]) * 1024,
    }


def in_child(route: Route, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """``run_child`` for ``route`` in a fresh Python process running this script."""
    spec = {
        "kind": route.kind,
        "path": str(route.path),
        "batch": args.batch,
        "seed": seed,
        "buffer": args.buffer,
        "threads": args.threads,
    }
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{route.name} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def rounds(routes: list[Route], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each route's medians over ``args.repeats`` rounds, one fresh child per route and
    round, every other round in reverse order."""
    results: dict[str, list[dict[str, float]]] = {route.name: [] for route in routes}
    for repeat in range(args.repeats):
        for route in routes if repeat % 2 == 0 else routes[::-1]:
            results[route.name].append(in_child(route, args, seed=repeat))
        print(f"round {repeat + 1} of {args.repeats} done", flush=True)
    counts = {name: {int(run["tokens"]) for run in runs} for name, runs in results.items()}
    if len(set().union(*counts.values())) != 1:
        raise SystemExit(f"the routes read different numbers of tokens: {counts}")
    return {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for name, runs in results.items()
    }


def report(
    routes: list[Route],
    sizes: dict[str, int],
    medians: dict[str, dict[str, float]],
    args: argparse.Namespace,
    texts: int,
) -> None:
    """The header, the table of routes and the table of featcache / Arrow ratios."""
    import datasets
    import torch

    tokens = int(next(iter(medians.values()))["tokens"])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n[{tokens:,} tokens, {args.dim}] {LAYER} of a random BERT (2 x {args.dim}) over "
        f"{texts:,} synthetic texts; one shuffled epoch per route, batches of {args.batch}, "
        f"float32 out;\n{args.threads} torch thread(s) in each child, torch {torch.__version__}, "
        f"datasets {datasets.__version__}; median of {args.repeats} rounds, a fresh child "
        f"process per route and round; load average {load} at the end"
    )
    route_table(routes, sizes, medians)
    ratio_table(routes, sizes, medians)


def route_table(
    routes: list[Route], sizes: dict[str, int], medians: dict[str, dict[str, float]]
) -> None:
    """Each route's figures; its time to open and to shuffle are part of its tokens/s."""
    width = max(len(route.name) for route in routes)
    print(
        f"{'route, stored as':<{width}} {'on disk':>9} {'open s':>7} {'shuffle s':>9} "
        f"{'tokens/s wall':>14} {'tokens/s CPU':>13} {'peak RSS':>9} {'peak anon':>10}"
    )
    for route in routes:
        m = medians[route.name]
        shuffle = "-" if route.kind == FEATCACHE else f"{m['shuffle']:.2f}"
        print(
            f"{route.name:<{width}} {mib(sizes[route.name]):>9} {m['open']:>7.2f} {shuffle:>9} "
            f"{m['tokens'] / m['wall']:>14,.0f} {m['tokens'] / m['cpu']:>13,.0f} "
            f"{mib(m['peak_rss']):>9} {mib(m['peak_anon']):>10}"
        )


def ratio_table(
    routes: list[Route], sizes: dict[str, int], medians: dict[str, dict[str, float]]
) -> None:
    """featcache over the exact Arrow route on the Arrow dataset paired with each store."""
    print(f"\nfeatcache / {EXACT} on the paired Arrow dataset (the same tokens)")
    print(
        f"{'featcache store':<16} {'Arrow':<8} {'tokens/s wall':>14} {'tokens/s CPU':>13} "
        f"{'peak RSS':>9} {'peak anon':>10} {'on disk':>8}"
    )
    for route in routes:
        if route.kind != FEATCACHE:
            continue
        ours, arrow = medians[route.name], medians[f"{EXACT}, {route.pair}"]
        disk = sizes[route.name] / sizes[f"{EXACT}, {route.pair}"]
        print(
            f"{route.stored:<16} {route.pair:<8} "
            f"{arrow['wall'] / ours['wall']:>13.2f}x {arrow['cpu'] / ours['cpu']:>12.2f}x "
            f"{ratio(ours['peak_rss'], arrow['peak_rss']):>9} "
            f"{ratio(ours['peak_anon'], arrow['peak_anon']):>10} {disk:>7.2f}x"
        )


def mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):,.0f} MiB"


def ratio(ours: float, theirs: float) -> str:
    """``ours / theirs``, or a dash where the Arrow figure is too small to divide by."""
    return f"{ours / theirs:.2f}x" if theirs >= 1 << 20 else "-"


def default_dtypes() -> list[str]:
    """bfloat16 and float16, and int8 where featcache's store has it (else a note)."""
    from featcache.store import codec

    if "int8" in codec.DTYPES:
        return ["bfloat16", "float16", "int8"]
    print("int8: not a store dtype of this featcache (featcache.store.codec.DTYPES); skipped")
    return ["bfloat16", "float16"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens, about")
    parser.add_argument("--dim", type=int, default=256, help="the layer's width")
    parser.add_argument("--dtypes", nargs="+", default=None, help="featcache store dtypes")
    parser.add_argument("--batch", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--repeats", type=int, default=3, help="rounds")
    parser.add_argument(
        "--buffer", type=int, default=131072, help="shuffle buffer of the iterable Arrow route"
    )
    parser.add_argument(
        "--no-iterable", dest="iterable", action="store_false", help="skip the iterable route"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_child(json.loads(args.child))))
        return

    import datasets

    from featcache.store import codec

    dtypes = args.dtypes or default_dtypes()
    unknown = [d for d in dtypes if d not in codec.DTYPES]
    if unknown:
        parser.error(f"--dtypes: {unknown} not among featcache's {sorted(codec.DTYPES)}")
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="featcache-bench-tokens-") as name:
        folder = Path(name)
        texts = synthetic_texts(args.tokens)
        stores = extract_stores(folder, texts, args.dim, dtypes)
        routes, sizes = make_routes(folder, stores, args.iterable)
        medians = rounds(routes, args)
        report(routes, sizes, medians, args, len(texts))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
