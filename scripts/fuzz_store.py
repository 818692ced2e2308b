"""Damage stores on purpose and check that featcache never returns a wrong row.

Every trial runs in a forked child process (a crash there counts as a failure), on a
store written by featcache from a small seeded model: 64 rows of a conv layer
([4, 6, 6] float16) and a linear head ([5]), 4 rows per chunk, labels and ids.

* ``flip``: one byte changed (xor a random mask) at a random place inside a stored chunk
  of the layers, ``/labels``, ``/index`` or ``/ids``, of a complete store (``--target
  store``), of one shard of a store combined from two torchrun shards (``shard``), or
  of an incomplete store (``partial``: its durable chunks and those past its mark).
  Then every read path reads everything: ``FeatureStore.read`` of each layer, the
  labels, index and ids, ``FeatureDataset.batches`` (shuffled, through the shuffle
  buffer), ``FeatureDataset.__getitems__`` of scattered rows, and ``scan_chunks`` (what
  ``verify --quick`` runs). Each read must give the true rows, or raise one line naming
  the store, the dataset and rows that include the changed byte's row; the scan must
  name the changed chunk (when the byte lies in rows the store holds).
* ``torn``: the ``.partial`` file of a run stopped part way is cut short at a random
  length, or a random range of it is zero-filled (a torn or lost write); then its
  readers read it, and the same extraction is run again. The readers must give the true
  durable rows or one line; the rerun must end with exactly the store an uninterrupted
  run writes, or refuse in one line (``--overwrite`` then starts over).

Prints a table of outcomes per part and exits non-zero if any trial failed.

    python scripts/fuzz_store.py [--flips 1000] [--torn 200] [--seed 0]
                                 [--targets store,shard,partial]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import pickle
import random
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch

import featcache
from featcache import FeatureDataset, FeatureStore
from featcache.errors import FeatcacheError
from featcache.store import combine_shards, partial_path, scan_chunks
from featcache.store.paths import shard_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_format2_fixtures import ConvNet  # noqa: E402  (the same seeded model)

ROWS = 64
DATASETS = ("features/conv", "features/head", "labels", "index", "ids")
OPTIONS = {"batch_size": 8, "chunk_rows": 4, "num_workers": 0, "progress": False}
LAYERS = [{"name": "conv"}, {"name": "head"}]


class Images(torch.utils.data.Dataset):
    """``ROWS`` seeded inputs with labels ``i % 3``; reading row ``stop`` raises."""

    def __init__(self, stop: int | None = None) -> None:
        self.x = torch.randn(ROWS, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        self.ids = [f"img/{i:03d}.png" for i in range(ROWS)]
        self.stop = stop

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int):
        if i == self.stop:
            raise RuntimeError("stopped on purpose")
        return self.x[i], i % 3


def extract(path: Path, stop: int | None = None, **options) -> None:
    featcache.extract(ConvNet(), Images(stop), LAYERS, path, **(OPTIONS | options))


def truth(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of rows of the store at ``path``, read by plain h5py."""
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in DATASETS}


# -- reading everything, and judging what came back --------------------------------------


def read_everything(path: Path, allow_incomplete: bool) -> dict[str, object]:
    """What each read path gives for the store at ``path``: an array of every row it
    reads, or the error it raised."""
    results: dict[str, object] = {}

    def attempt(name: str, read: Callable[[], object]) -> None:
        try:
            results[name] = read()
        except FeatcacheError as exc:
            results[name] = exc

    try:
        store = FeatureStore(path, allow_incomplete=allow_incomplete)
    except FeatcacheError as exc:
        return {"open": exc}
    with store:
        for layer in ("conv", "head"):
            attempt(f"read features/{layer}", lambda layer=layer: store.read(layer).numpy())
        attempt("read labels", lambda: store.labels)
        attempt("read index", lambda: store.index)
        attempt("read ids", lambda: np.array(store.ids, dtype="S"))

    def batches() -> dict[str, np.ndarray]:
        dataset = FeatureDataset(path, ["conv", "head"], dtype=None, allow_incomplete=True)
        got: dict[str, list] = {"conv": [], "head": [], "labels": [], "rows": []}
        for features, labels, rows in dataset.batches(5, seed=3, with_index=True):
            for layer in ("conv", "head"):
                got[layer].append(features[layer].numpy())
            got["labels"].append(labels.numpy())
            got["rows"].append(rows.numpy())
        dataset.close()
        if not got["rows"]:  # a partial store with no durable row yet
            return {"rows": np.empty(0, dtype=np.int64)}
        order = np.argsort(np.concatenate(got["rows"]))
        return {key: np.concatenate(value)[order] for key, value in got.items()}

    def scattered() -> dict[str, np.ndarray]:
        dataset = FeatureDataset(path, ["conv", "head"], dtype=None, allow_incomplete=True)
        if not len(dataset):
            dataset.close()
            return {"rows": np.empty(0, dtype=np.int64)}
        rows = np.random.default_rng(4).permutation(len(dataset))[: max(len(dataset) // 3, 1)]
        items = dataset.__getitems__(rows.tolist())
        dataset.close()
        return {
            "rows": rows,
            **{
                layer: np.stack([item[0][layer].numpy() for item in items])
                for layer in ("conv", "head")
            },
        }

    attempt("batches", batches)
    attempt("getitems", scattered)
    attempt("scan", lambda: scan_chunks(path))
    return results


def judge(results: dict[str, object], expected: dict[str, np.ndarray], rows: int,
          damaged: tuple[str, int] | None) -> str:  # fmt: skip
    """``"true rows"``, ``"refused"`` or a ``"FAIL: ..."`` line, for the reads of a store
    whose first ``rows`` rows are those of ``expected``. ``damaged`` is the dataset and
    row of a changed byte (None: unknown, any refusal must only be one line)."""
    outcome = "true rows"
    for name, got in results.items():
        if isinstance(got, FeatcacheError):
            text = str(got)
            if "\n" in text:
                return f"FAIL: {name} raised more than one line: {text!r:.200}"
            if damaged is not None and name != "open" and not names(text, *damaged):
                return f"FAIL: {name} refused without naming {damaged}: {text}"
            outcome = "refused"
            continue
        if name == "scan":
            if damaged is not None and damaged[1] < rows and damaged[0] not in {b.key for b in got}:
                return f"FAIL: scan missed the changed chunk of {damaged[0]}: {got}"
            if got:
                outcome = "refused"
            continue
        if name in ("batches", "getitems"):
            picked = got["rows"]
            wanted = {"conv": "features/conv", "head": "features/head", "labels": "labels"}
            for key, source in wanted.items():
                if key in got and not np.array_equal(got[key], expected[source][:rows][picked]):
                    return f"FAIL: {name} gave wrong {key} rows"
            continue
        source = name.removeprefix("read ")
        if not np.array_equal(got, expected[source][:rows]):
            return f"FAIL: {name} gave wrong rows"
    return outcome


def names(message: str, dataset: str, row: int) -> bool:
    """Whether a refusal names ``dataset`` and a row span holding ``row``."""
    words = (
        f"layer {dataset[len('features/') :]}"
        if dataset.startswith("features/")
        else f"dataset {dataset}"
    )
    if words not in message:
        return False
    span = message.split(words, 1)[1].split()
    try:
        first, _, last = span[1].partition("-")
        return int(first) <= row <= int(last or first)
    except (IndexError, ValueError):
        return False


# -- the trials -----------------------------------------------------------------------


def in_child(trial: Callable[[], str]) -> str:
    """Run ``trial`` in a forked child; its outcome, or a FAIL line when it crashed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        torch.set_num_threads(1)  # the parent's thread pool does not survive the fork
        try:
            outcome = trial()
        except BaseException:  # noqa: BLE001 (reported to the parent)
            outcome = "FAIL: " + traceback.format_exc().replace("\n", " | ")
        os.write(write, pickle.dumps(outcome))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    return pickle.loads(data) if data else f"FAIL: the child died (status {status})"


def chunk_places(path: Path, name: str, limit: int | None = None) -> list[tuple[int, int, int]]:
    """``(file offset, stored bytes, first row)`` of each chunk of dataset ``name``,
    those starting before row ``limit`` when given."""
    with h5py.File(path, "r", locking=False) as f:
        dataset = f[name]
        rows = dataset.chunks[0]
        places = []
        dataset.id.chunk_iter(lambda i: places.append((i.byte_offset, i.size, i.chunk_offset[0])))
    return [
        p for p in sorted(places, key=lambda p: p[2]) if limit is None or p[2] < limit or rows == 0
    ]


def flip_trial(
    path: Path,
    shown: Path,
    name: str,
    place: tuple[int, int, int],
    rng: random.Random,
    expected: dict[str, np.ndarray],
    rows: int,
    first: int,
    incomplete: bool,
) -> str:
    """Change one byte of the chunk at ``place`` of dataset ``name`` of file ``path``, read
    the store ``shown`` (whose rows start at ``first`` in this file), and judge."""
    offset, size, chunk_row = place
    at = offset + rng.randrange(size)
    mask = rng.randrange(1, 256)
    with h5py.File(path, "r", locking=False) as f:
        dataset = f[name]
        row_bytes = dataset.dtype.itemsize * int(np.prod(dataset.shape[1:]))
    row = first + chunk_row + (at - offset) // row_bytes
    with open(path, "r+b") as raw:
        raw.seek(at)
        byte = raw.read(1)[0]
        raw.seek(at)
        raw.write(bytes([byte ^ mask]))
    try:
        results = read_everything(shown, allow_incomplete=incomplete)
        return judge(results, expected, rows, (name, row))
    finally:
        with open(path, "r+b") as raw:
            raw.seek(at)
            raw.write(bytes([byte]))


def flips(folder: Path, target: str, count: int, rng: random.Random) -> collections.Counter:
    """``count`` single-byte changes of the stored chunks of a ``target`` store."""
    reference = folder / "reference.h5"
    expected = truth(reference)
    if target == "store":
        path = reference
        cases = [(path, path, 0, ROWS, False)]
    elif target == "shard":
        shards = [shard_path(folder / "t.h5", first) for first in (0, 24)]
        if not (folder / "t.h5").exists():
            for shard, rows in zip(shards, (range(0, 24), range(24, ROWS)), strict=True):
                extract(shard, rows=rows)
            combine_shards(folder / "t.h5", shards).close()
        cases = [
            (shards[0], folder / "t.h5", 0, ROWS, False),
            (shards[1], folder / "t.h5", 24, ROWS, False),
        ]
    else:
        path = folder / "p.h5"
        if not partial_path(path).exists():
            try:
                extract(path, stop=45)
            except FeatcacheError:
                pass
        with h5py.File(partial_path(path), "r", locking=False) as f:
            durable = int(f["progress"][0])
        cases = [(partial_path(path), partial_path(path), 0, durable, True)]
    outcomes: collections.Counter = collections.Counter()
    for trial in range(count):
        file, shown, first, rows, incomplete = cases[trial % len(cases)]
        name = rng.choice(DATASETS)
        place = rng.choice(chunk_places(file, name))
        seed = rng.randrange(1 << 30)
        flip = functools.partial(flip_trial, file, shown, name, place, random.Random(seed))
        outcome = in_child(functools.partial(flip, expected, rows, first, incomplete))
        outcomes[outcome] += 1
        if outcome.startswith("FAIL"):
            print(f"flip {target} {name} chunk {place}: {outcome}", file=sys.stderr)
    return outcomes


def torn_trial(
    folder: Path, partial: Path, expected: dict[str, np.ndarray], rng: random.Random
) -> str:
    """Cut or zero-fill a copy of ``partial``, read it, rerun its extraction, judge."""
    path = folder / "s.h5"
    damaged = partial_path(path)
    shutil.copy(partial, damaged)
    size = damaged.stat().st_size
    with open(damaged, "r+b") as raw:
        if rng.random() < 0.5:
            raw.truncate(rng.randrange(size))
        else:
            start = rng.randrange(size)
            raw.seek(start)
            raw.write(bytes(min(rng.choice((1, 16, 512, 4096, 65536)), size - start)))
    with h5py.File(partial, "r", locking=False) as f:
        durable = int(f["progress"][0])
    # A torn progress record may count fewer rows (zeros: none), never more.
    claimed = durable
    with contextlib.suppress(Exception):  # unreadable: every read must refuse
        with h5py.File(damaged, "r", locking=False) as f:
            claimed = int(f["progress"][0])
    if claimed > durable:
        return f"FAIL: the torn file counts {claimed} durable rows, {durable} were written"
    outcome = judge(read_everything(damaged, allow_incomplete=True), expected, claimed, None)
    if outcome.startswith("FAIL"):
        return outcome
    try:
        extract(path)
    except FeatcacheError as exc:
        if "\n" in str(exc):
            return f"FAIL: the rerun raised more than one line: {exc!r:.200}"
        if os.environ.get("FUZZ_VERBOSE"):
            print(f"refused: {exc}", file=sys.stderr)
        return "rerun refused"
    got = truth(path)
    for name in DATASETS:
        if not np.array_equal(got[name], expected[name]):
            return f"FAIL: the rerun wrote wrong {name} rows"
    if judge(read_everything(path, allow_incomplete=False), expected, ROWS, None) != "true rows":
        return "FAIL: featcache reads the rerun's store otherwise than h5py"
    return "rerun equals uninterrupted"


def torn(folder: Path, count: int, rng: random.Random) -> collections.Counter:
    """``count`` cut or zero-filled copies of partial stores, each read and resumed."""
    expected = truth(folder / "reference.h5")
    partials = []
    for stop in (13, 29, 45, 61):  # runs stopped at different rows
        path = folder / f"stopped-{stop}.h5"
        try:
            extract(path, stop=stop)
        except FeatcacheError:
            pass
        partials.append(partial_path(path))
    outcomes: collections.Counter = collections.Counter()
    for trial in range(count):
        partial = partials[trial % len(partials)]
        work = folder / f"torn-{trial}"
        work.mkdir()
        seed = rng.randrange(1 << 30)
        outcome = in_child(
            functools.partial(torn_trial, work, partial, expected, random.Random(seed))
        )
        outcomes[outcome] += 1
        if outcome.startswith("FAIL"):
            print(f"torn {partial.name} seed {seed}: {outcome}", file=sys.stderr)
        shutil.rmtree(work)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flips", type=int, default=1000, help="byte changes per target")
    parser.add_argument("--torn", type=int, default=200, help="cut or zero-filled partials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default="store,shard,partial")
    args = parser.parse_args()
    torch.set_num_threads(1)  # forked children run the model: no thread pool across fork
    rng = random.Random(args.seed)
    failed = False
    with tempfile.TemporaryDirectory(prefix="featcache-fuzz-") as tmp:
        folder = Path(tmp)
        extract(folder / "reference.h5")
        parts = [
            (f"flip {t}", lambda t=t: flips(folder, t, args.flips, rng))
            for t in args.targets.split(",")
            if args.flips
        ]
        if args.torn:
            parts.append(("torn partial", lambda: torn(folder, args.torn, rng)))
        print(f"{'part':<16} {'trials':>6}  outcomes")
        for label, run in parts:
            outcomes = run()
            failed |= any(key.startswith("FAIL") for key in outcomes)
            shown = ", ".join(f"{n} {key[:60]}" for key, n in outcomes.most_common())
            print(f"{label:<16} {sum(outcomes.values()):>6}  {shown}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
