"""Preemption: what a torchrun extraction killed midway costs when rerun with another
number of processes.

Data: the CIFAR-10 JPEGs (``../shared/data/cifar10-jpeg.tar``, its train and test folders
unpacked into one temporary split), ``--rows`` of them (all 20,000 by default; fewer
through ``data.limit``, spread evenly over the classes), resized to ``--size`` px (64) with the
ImageNet mean and std. Model: torchvision's resnet18 with random weights (seed 0: no
pretrained resnet18 is on these machines), two layers: ``avgpool`` (flatten, [512]) and
``layer3`` (avg, [256]); float16, batch ``--batch`` (64), ``loader.num_workers: 0``,
featcache's default chunks (at most 256 rows, so a rank's durable rows grow 256 at a time;
``--chunk-rows`` sets ``store.chunk_rows``).

1. ``torchrun --standalone --nproc-per-node 3 -m featcache extract CONFIG``
   (``--processes-before``). The script polls the durable rows of the ``.partial`` shards
   (``progress[0]`` of each, plus the rows of complete shards) and once their sum reaches
   ``--kill-at`` of the rows, sends SIGKILL to every rank and to the launcher (the ranks
   run in their own sessions: each is found by its command line, which holds the config's
   path). "Durable when killed" is that sum read again once every process is gone.
2. The same command with 2 processes (``--processes-after``), to completion: it seals the
   stopped shards with the rows they keep, shares out the missing rows and combines the
   store. Its record in the store's ``history`` gives ``rows_computed`` and ``rows_resumed``.
3. Unless ``--no-verify``: ``featcache extract`` of the same config in one process, into
   another folder; the two stores' ``features/*``, ``ids``, ``labels`` and ``index`` must be
   the same bytes (read with h5py, the combined store through its virtual datasets).

How rows computed are counted: the model is built by ``model.factory:
bench_preempt:counted_resnet18`` (this module, put on the ranks' ``PYTHONPATH``), a resnet18
whose forward pre-hook appends each call's batch size to a file of its process, written
and flushed before the forward runs, so a process killed mid-batch leaves every call it
started counted. A launch's rows "through the model" are the sum over its processes: the
batches computed for the store, the one-row forward that sizes a store before its first
batch, and in the rerun the batch per stopped shard (the one holding its last durable
row) recomputed to prove that its rows are this computation's before they are kept
(featcache.extraction.continuity). The killed launch
is in no history record, so this count is its only one; for the rerun the count and
``rows_computed`` are printed side by side, their difference being those checks and
sizing forwards.

Target: rows through the model in both launches over the rows in the store at most 1.05
(the same ratio with the rerun's ``rows_computed`` in place of its count is printed too).
Exit code 1 when the ratio misses the target, when the stores differ, or when a launch
fails; the table goes to stdout, progress to stderr.

    python scripts/bench_preempt.py [--rows 10000] [--processes-before 3]
                                    [--processes-after 2] [--kill-at 0.5] [--batch 64]
                                    [--size 64] [--chunk-rows N] [--no-verify] [--quick]
                                    [--timeout 1800] [--dir DIR]

``--quick``: 2,000 rows, a smoke run. The extra rows hardly depend on ``--rows``: per
killed rank, the rows computed but not yet durable when it dies (those past its last
whole chunk, plus up to half a second of rows not yet marked durable and the batches in
flight), and one batch of checks per launch that wrote stopped shards. So the ratio of a
small run is far above that of a large one: 1.023 and 1.029 over the 20,000 rows, 1.046
and 1.077 over 10,000 with the default chunks, 1.039 over 10,000 with ``--chunk-rows 64``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import h5py
import torch
import yaml
from torch import nn

import featcache  # first: makes torchvision importable beside a mismatched torch

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"
ARCHIVE = SHARED / "cifar10-jpeg.tar"
SPLIT_ROWS = 20_000  # JPEGs in the archive: 10,000 train and 10,000 test
COUNTS_ENV = "FEATCACHE_BENCH_FORWARD_COUNTS"  # folder of the per-process forward counts
TARGET = 1.05
LAYERS = [
    {"name": "avgpool", "reduce": "flatten"},
    {"name": "layer3", "reduce": "avg"},
]
COMPARED = ("ids", "labels", "index")  # besides every features/<layer>
START = time.perf_counter()


def log(message: str) -> None:
    """A progress line on stderr, with the seconds since the start."""
    sys.stdout.flush()  # the table's lines so far first, where both go to one terminal
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the model

_counts: IO[str] | None = None


def _count_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Append this call's batch size to this process's count file, flushed at once."""
    global _counts
    folder = os.environ.get(COUNTS_ENV)
    if not folder or not args or not isinstance(args[0], torch.Tensor):
        return
    if _counts is None:
        _counts = open(Path(folder) / f"{os.getpid()}.txt", "a", encoding="utf-8")  # noqa: SIM115
    _counts.write(f"{args[0].shape[0]}\n")
    _counts.flush()


def counted_resnet18() -> nn.Module:
    """torchvision's resnet18 (random weights; featcache seeds before the call) whose every
    forward is counted in the folder named by ``$FEATCACHE_BENCH_FORWARD_COUNTS``."""
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    model.register_forward_pre_hook(_count_forward)
    return model


def counted_rows(folder: Path) -> tuple[int, int]:
    """``(rows, processes)``: the batch sizes the processes of a launch counted, summed."""
    files = sorted(folder.glob("*.txt"))
    rows = sum(int(line) for file in files for line in file.read_text().split())
    return rows, len(files)


# ---------------------------------------------------------------------------- the runs


def unpack_all(folder: Path) -> Path:
    """Every JPEG of the archive (its train and test splits) as one ImageFolder split,
    ``folder/all/<class>/<split>-<name>.jpg``; returns ``folder``."""
    with tarfile.open(ARCHIVE) as tar:
        for member in tar:
            parts = member.name.split("/")  # cifar10-jpeg/<split>/<class>/<name>.jpg
            if len(parts) != 4 or not member.isfile():
                continue
            target = folder / "all" / parts[2] / f"{parts[1]}-{parts[3]}"
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            target.write_bytes(source.read())
    return folder


def write_config(path: Path, root: Path, out: Path, args: argparse.Namespace) -> Path:
    """The config of every run (only ``output.dir`` differs); returns the store's path."""
    data: dict[str, Any] = {"source": "imagefolder", "root": str(root), "splits": ["all"]}
    if args.rows < SPLIT_ROWS:
        data["limit"] = args.rows
    config = {
        "model": {"factory": f"{Path(__file__).stem}:counted_resnet18"},
        "layers": LAYERS,
        "data": data,
        "preprocess": {
            "resize": args.size,
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
        },
        "loader": {"batch_size": args.batch, "num_workers": 0},
        "store": {"dtype": "float16", "chunk_rows": args.chunk_rows},
        "output": {"dir": str(out)},
        "runtime": {"progress": False, "seed": 0},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    folder = out / f"limit-{args.rows}" if args.rows < SPLIT_ROWS else out
    return folder / "all.h5"


def command(processes: int, config: Path) -> list[str]:
    """The command line of a launch: torchrun with ``processes`` ranks, or one process."""
    extract = ["-m", "featcache", "extract", str(config)]
    if processes == 1:
        return [sys.executable, *extract]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(processes), *extract,
    ]  # fmt: skip


def shown(words: list[str]) -> str:
    """``words`` as a shell line, with ``python -m torch.distributed.run`` as torchrun."""
    if words[1:3] == ["-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    else:
        words = ["python", *words[1:]]
    return shlex.join(words)


def start(words: list[str], counts: Path, output: Path) -> subprocess.Popen[bytes]:
    """Start ``words`` with its forwards counted in ``counts`` and its output in ``output``."""
    counts.mkdir(parents=True)
    paths = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), COUNTS_ENV: str(counts)}
    with open(output, "wb") as sink:
        return subprocess.Popen(words, stdout=sink, stderr=subprocess.STDOUT, env=env)


def finish(process: subprocess.Popen[bytes], output: Path, timeout: float) -> None:
    """Wait for ``process``; stop the benchmark with its output's tail if it fails."""
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        code = None
    if code != 0:
        tail = "\n".join(output.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"{shown(list(map(str, process.args)))} failed ({code}):\n{tail}")


def job_pids(config: Path) -> list[int]:
    """The processes (other than this one) whose command line holds ``config``'s path:
    the torchrun launcher and its ranks."""
    wanted, found = str(config).encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if wanted in words:
            found.append(int(entry.name))
    return found


def kill_job(launcher: subprocess.Popen[bytes], config: Path) -> int:
    """SIGKILL every rank, then the launcher; wait until all are gone. Returns the
    number of processes killed."""
    ranks = [pid for pid in job_pids(config) if pid != launcher.pid]
    for pid in [*ranks, launcher.pid]:
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while job_pids(config):
        if time.monotonic() > deadline:
            raise SystemExit(f"processes of {config} still alive 30 s after SIGKILL")
        time.sleep(0.05)
    return len(ranks) + 1


def shard_rows(folder: Path) -> dict[str, tuple[int, bool]]:
    """``{shard file: (durable rows, complete)}`` beside the store in ``folder``: a
    ``.partial`` shard's ``progress[0]``, a complete one's rows."""
    found = {}
    for file in sorted(folder.glob("*.shard-*.h5*")):
        partial = file.name.endswith(".partial")
        try:
            with h5py.File(file, "r", locking=False) as f:
                rows = int(f["progress"][0]) if partial else len(f["index"])
        except (OSError, KeyError):  # renamed on completion, or removed, meanwhile
            continue
        found[file.name] = (rows, not partial)
    return found


def killed_launch(args: argparse.Namespace, config: Path, store: Path, work: Path) -> dict:
    """Step 1: start ``--processes-before`` ranks, kill them at ``--kill-at`` of the rows
    durable. Returns what was measured."""
    words = command(args.processes_before, config)
    log(f"killed launch: {shown(words)}")
    wall = time.perf_counter()
    launcher = start(words, work / "counts" / "killed", work / "killed.log")
    threshold = args.kill_at * args.rows
    deadline = time.monotonic() + args.timeout
    try:
        while sum(rows for rows, _ in shard_rows(store.parent).values()) < threshold:
            if launcher.poll() is not None:
                finish(launcher, work / "killed.log", 0)  # a failure: stop with its output
                raise SystemExit(
                    f"the launch finished before {args.kill_at:.0%} of the rows were durable; "
                    "give more --rows"
                )
            if time.monotonic() > deadline:
                raise SystemExit(f"no kill point within {args.timeout} s")
            time.sleep(0.02)
    finally:
        killed = kill_job(launcher, config)
    wall = time.perf_counter() - wall
    shards = shard_rows(store.parent)
    durable = sum(rows for rows, _ in shards.values())
    log(f"killed {killed} processes; {durable} rows durable in {len(shards)} shards")
    rows, processes = counted_rows(work / "counts" / "killed")
    return {"words": words, "wall": wall, "shards": shards, "durable": durable,
            "forwards": rows, "processes": processes}  # fmt: skip


def completed_launch(
    words: list[str], name: str, work: Path, timeout: float
) -> tuple[float, int, int]:
    """Run ``words`` to completion; ``(wall seconds, rows through the model, processes
    that counted)``."""
    log(f"{name}: {shown(words)}")
    wall = time.perf_counter()
    process = start(words, work / "counts" / name, work / f"{name}.log")
    finish(process, work / f"{name}.log", timeout)
    wall = time.perf_counter() - wall
    rows, processes = counted_rows(work / "counts" / name)
    return wall, rows, processes


def differing(a: Path, b: Path) -> list[str]:
    """The datasets of ``COMPARED`` and ``features/*`` whose bytes differ between the
    stores at ``a`` and ``b`` (or that one of them lacks)."""
    differ = []
    with h5py.File(a, "r") as x, h5py.File(b, "r") as y:
        layers = sorted(set(x["features"]) | set(y["features"]))
        for name in [*COMPARED, *(f"features/{layer}" for layer in layers)]:
            if name not in x or name not in y:
                differ.append(f"{name} (missing)")
                continue
            u, v = x[name][()], y[name][()]
            if u.dtype != v.dtype or u.shape != v.shape or u.tobytes() != v.tobytes():
                differ.append(name)
    return differ


# ---------------------------------------------------------------------------- report


def report(
    args: argparse.Namespace,
    store: Path,
    killed: dict[str, Any],
    rerun: tuple[float, int, int],
    one: tuple[float, int, int, Path] | None,
) -> bool:
    """Print the table and the summary line; whether everything passed."""
    with featcache.FeatureStore(store) as opened:
        rows = len(opened)
        history = opened.attrs["history"]
    rerun_wall, rerun_forwards, rerun_processes = rerun
    computed = sum(int(r.get("rows_computed") or 0) for r in history)
    resumed = sum(int(r.get("rows_resumed") or 0) for r in history)
    print(
        f"\npreemption: resnet18 (random weights, seed 0) at {args.size} px, "
        f"{', '.join(layer['name'] for layer in LAYERS)}, {args.rows} CIFAR-10 JPEGs, "
        f"batch {args.batch}, float16, chunk rows {args.chunk_rows or 'default'}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"featcache {featcache.__version__}, {time.strftime('%Y-%m-%d')}"
    )
    print(f"  killed: {shown(killed['words'])}")
    print(f"  rerun:  {shown(command(args.processes_after, Path(killed['words'][-1])))}")
    print(f"\n{'launch':<34} {'procs':>5} {'wall s':>7} {'through model':>14} "
          f"{'rows_computed':>14} {'rows_resumed':>13}")  # fmt: skip
    stopped = f"killed at {killed['durable'] / args.rows:.0%} durable (SIGKILL)"
    print(
        f"{stopped:<34} "
        f"{killed['processes']:>5} {killed['wall']:>7.1f} {killed['forwards']:>14} "
        f"{'(no record)':>14} {'':>13}"
    )
    print(
        f"{'rerun to completion':<34} {rerun_processes:>5} {rerun_wall:>7.1f} "
        f"{rerun_forwards:>14} {computed:>14} {resumed:>13}"
    )
    if one is not None:
        print(f"{'one process (reference)':<34} {one[2]:>5} {one[0]:>7.1f} {one[1]:>14}")
    print("\nshards when killed (durable rows): " + ", ".join(
        f"{name.split('.shard-')[1]} {count}{'' if done else ' partial'}"
        for name, (count, done) in killed["shards"].items()
    ))  # fmt: skip
    lost = killed["forwards"] - killed["durable"]
    checks = rerun_forwards - computed
    print(f"rows in the store                        {rows}")
    print(f"rows durable when killed                 {killed['durable']}")
    print(f"rows kept by the rerun (rows_resumed)    {resumed}")
    print(f"rows through the model, killed launch    {killed['forwards']} ({lost} not durable)")
    print(f"rows computed by the rerun (history)     {computed}")
    print(f"rows through the model, rerun            {rerun_forwards} ({checks} in checks, sizing)")
    print(f"history records                          {len(history)}")
    total = killed["forwards"] + rerun_forwards
    ratio = total / rows
    by_history = (killed["forwards"] + computed) / rows
    print(f"through the model in all / store rows    {total} / {rows} = {ratio:.3f}")
    print(f"same, rerun by rows_computed             {by_history:.3f}")
    ok = ratio <= TARGET and rows == args.rows
    if rows != args.rows:
        print(f"the store holds {rows} rows, not {args.rows}")
    same = "not checked (--no-verify)"
    if one is not None:
        differ = differing(store, one[3])
        same = "identical" if not differ else "DIFFER: " + ", ".join(differ)
        print(f"against one process ({', '.join(COMPARED)}, features)  {same}")
        ok = ok and not differ
    verdict = "PASS" if ratio <= TARGET else "FAIL"
    print(
        f"\npreempt: ratio {ratio:.3f} (rows through the model in both launches / rows in the "
        f"store; {by_history:.3f} with the rerun's rows_computed), target <= {TARGET}: "
        f"{verdict}; one-process store: {same}"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="images (default 20,000, all)")
    parser.add_argument(
        "--processes-before", type=int, default=3, help="ranks of the killed launch"
    )
    parser.add_argument("--processes-after", type=int, default=2, help="ranks of the rerun")
    parser.add_argument(
        "--kill-at", type=float, default=0.5, help="durable fraction of the rows to kill at"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=64, help="images resized to this")
    parser.add_argument(
        "--chunk-rows", type=int, default=None, help="store.chunk_rows (default: featcache's)"
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the one-process store and comparison"
    )
    parser.add_argument("--quick", action="store_true", help="2,000 rows: a smoke run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--dir", type=Path, default=None, help="where to work (default: tmp)")
    args = parser.parse_args()
    args.rows = args.rows or (2000 if args.quick else SPLIT_ROWS)
    if not 0 < args.rows <= SPLIT_ROWS:
        parser.error(f"--rows must be between 1 and {SPLIT_ROWS}")
    if not 0 < args.kill_at < 1 or args.processes_before < 2 or args.processes_after < 1:
        parser.error("give 0 < --kill-at < 1, --processes-before >= 2, --processes-after >= 1")
    if not ARCHIVE.exists():
        raise SystemExit(f"{ARCHIVE} is missing: it lives in ../shared/data beside the repo")
    with tempfile.TemporaryDirectory(prefix="featcache-bench-preempt-", dir=args.dir) as tmp:
        work = Path(tmp)
        config = work / "preempt.yaml"
        try:
            ok = run(args, work, config)
        finally:
            for pid in job_pids(config):  # left by a failure: this script started them
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    log("done")
    if not ok:
        sys.exit(1)


def run(args: argparse.Namespace, work: Path, config: Path) -> bool:
    log("unpacking the CIFAR-10 JPEGs")
    root = unpack_all(work / "data")
    store = write_config(config, root, work / "out", args)
    killed = killed_launch(args, config, store, work)
    words = command(args.processes_after, config)
    rerun = completed_launch(words, "rerun", work, args.timeout)
    one = None
    if not args.no_verify:
        reference = work / "reference.yaml"
        one_store = write_config(reference, root, work / "one", args)
        one = (*completed_launch(command(1, reference), "one", work, args.timeout), one_store)
    return report(args, store, killed, rerun, one)


if __name__ == "__main__":
    main()
