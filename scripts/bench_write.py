"""Writing speed: featcache.extract with a model that costs nothing, against casting the
same tensors to float16 and writing them with one fsync, in the same process.

The model is an identity layer, so the run is all featcache's own work: the loader
slicing batches out of a tensor in memory, the hooks, the cast to float16, the writer
thread, the chunk checksums, the progress marks and the completed store's move into
place. Its layer's rows are unpooled ``[256, 14, 14]`` (``--rows`` of them, 8,192 by
default: 784 MiB of float16). The baseline casts the same batches of the same tensor to
float16 and writes them to one file, then fsyncs it.

The cases run in rounds (every case once a round, in order, after ``os.sync()``, the
files removed between rounds), ``--repeats`` rounds after a warm-up. Printed: each
case's median wall and CPU seconds (this process, every thread) with their ranges, and
featcache against the baseline: ``wall`` (the baseline's wall time over featcache's: 1.00x
means as fast) and ``CPU/byte`` (the baseline's CPU time per byte written over
featcache's), the medians of the per-round ratios and their ranges. Target: at least
0.90x and 0.75x, checksums on.

``--threads N`` sets torch's intra-op threads (both cases cast with them). Where the
intra-op threads wait for work they spin for a while first (``OMP_WAIT_POLICY``): that
spinning is CPU time, and more of it where a third busy thread (featcache's writer)
shares two cores.

``--checksum-cost`` adds ``featcache.extract, checksum off`` and ``featcache.extract, no
checks`` (checksums off and ``on_nonfinite: keep``: no pass over the bytes but the cast
and the write). ``--hashes`` times the chunk
checksum libraries that are installed (xxhash's XXH3-64, which featcache uses, and
google-crc32c and crc32c if present) on 1 MiB chunks.

``--profile`` times no rounds: it runs each case once to warm up, once for each thread's
CPU seconds (the main thread: loader, hooks, cast, non-finite check, completion;
``featcache-writer``: staging, checksums, ``pwrite``; ``featcache-sync_0``: the progress
marks' ``fdatasync``; threads that run no Python, such as torch's intra-op pool, which
shares the casts, read from ``/proc/self/task`` on Linux), then once under cProfile, one
profiler per Python thread timed by that thread's CPU clock, for each thread's ``--top``
functions by their own CPU time (cProfile adds its own cost to every call it times).

    python scripts/bench_write.py [--rows 8192] [--batch 64] [--repeats 5]
                                  [--checksum-cost] [--hashes] [--profile [--top 12]]
                                  [--threads N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import importlib
import os
import pstats
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import featcache

SHAPE = (256, 14, 14)


class Identity(nn.Module):
    """A model that costs nothing: its one layer, ``layer``, hands back its input."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def cast_write_fsync(data: torch.Tensor, batch: int, path: Path) -> None:
    """The baseline: each batch cast to float16 and written, then one fsync."""
    with open(path, "wb", buffering=0) as out:
        for start in range(0, len(data), batch):
            out.write(data[start : start + batch].to(torch.float16).numpy().data)
        os.fsync(out.fileno())


def extract(
    data: torch.Tensor, batch: int, path: Path, checksum: bool = True, nonfinite: str = "fail"
) -> None:
    featcache.extract(
        Identity(), TensorDataset(data), [{"name": "layer", "reduce": "none"}], path,
        batch_size=batch, num_workers=0, progress=False, overwrite=True, checksum=checksum,
        on_nonfinite=nonfinite,
    )  # fmt: skip


def timed_rounds(
    cases: dict[str, Callable[[Path], None]], folder: Path, repeats: int
) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each case in each round; a warm-up round first."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for round_ in range(repeats + 1):
        for i, (name, run) in enumerate(cases.items()):
            path = folder / f"case{i}.h5"
            os.sync()  # no case pays for writing back what an earlier one left dirty
            wall, cpu = time.perf_counter(), time.process_time()
            run(path)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if round_:
                times[name].append((wall, cpu))
            path.unlink()
    return times


def spread(values: list[float]) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def hashes(size: int = 1 << 20, repeats: int = 200) -> None:
    """GB/s of each installed checksum library on ``size``-byte chunks (best of runs)."""
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    candidates = {
        "xxhash xxh3_64": ("xxhash", lambda m: m.xxh3_64_intdigest(data)),
        "google-crc32c": ("google_crc32c", lambda m: m.value(data.tobytes())),
        "crc32c": ("crc32c", lambda m: m.crc32c(data)),
    }
    print(f"\nchecksum of {size >> 20} MiB chunks            GB/s")
    for name, (module_name, run) in candidates.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            print(f"{name:<32} not installed")
            continue
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run(module)
            best = min(best, time.perf_counter() - start)
        print(f"{name:<32} {size / best / 1e9:6.1f}")


def native_thread_cpu() -> dict[int, float]:
    """CPU seconds so far of each thread of this process, by native id ({} where
    ``/proc/self/task`` is missing)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    threads = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
        threads[int(task.name)] = (int(utime) + int(stime)) / ticks
    return threads


@contextlib.contextmanager
def each_thread(
    started: Callable[[threading.Thread], None], ended: Callable[[threading.Thread], None]
) -> Iterator[None]:
    """Inside the block, ``started`` and ``ended`` run in every Python thread that starts,
    first and last (the main thread is the caller's to handle)."""
    run = threading.Thread.run

    def wrapped(thread: threading.Thread) -> None:
        started(thread)
        try:
            run(thread)
        finally:
            ended(thread)

    setattr(threading.Thread, "run", wrapped)  # noqa: B010  (a method, replaced for a while)
    try:
        yield
    finally:
        setattr(threading.Thread, "run", run)  # noqa: B010


def thread_cpu(run: Callable[[], None]) -> tuple[float, dict[str, float], float]:
    """Run ``run`` once; returns the process's CPU seconds, those of each Python thread
    (the calling one as ``MainThread``), and those of the threads that ran before and run
    no Python (torch's intra-op pool)."""
    threads: dict[str, float] = {}

    def started(thread: threading.Thread) -> None:
        thread.__dict__["_bench_cpu"] = time.thread_time()

    def ended(thread: threading.Thread) -> None:
        threads[thread.name] = time.thread_time() - thread.__dict__["_bench_cpu"]

    before, cpu, main = native_thread_cpu(), time.process_time(), time.thread_time()
    with each_thread(started, ended):
        run()
    main = time.thread_time() - main
    cpu, after = time.process_time() - cpu, native_thread_cpu()
    main_id = threading.main_thread().native_id
    native = sum(after[i] - before[i] for i in after if i in before and i != main_id)
    return cpu, {"MainThread": main, **threads}, native


def profiles(run: Callable[[], None]) -> dict[str, pstats.Stats]:
    """Run ``run`` once with a cProfile profiler on the thread's CPU clock in the calling
    thread and in every Python thread it starts; returns their stats by thread name."""
    profilers: dict[str, cProfile.Profile] = {"MainThread": cProfile.Profile(time.thread_time)}

    def started(thread: threading.Thread) -> None:
        profilers[thread.name] = profiler = cProfile.Profile(time.thread_time)
        profiler.enable()

    def ended(thread: threading.Thread) -> None:
        profilers[thread.name].disable()

    with each_thread(started, ended):
        profilers["MainThread"].enable()
        try:
            run()
        finally:
            profilers["MainThread"].disable()
    return {name: pstats.Stats(profiler) for name, profiler in profilers.items()}


def where(key: tuple[str, int, str]) -> str:
    """A profile entry's function, its file named from the package or library folder."""
    filename, line, name = key
    if filename == "~":
        return name
    for root in ("site-packages/", "/featcache/", "/lib/python"):
        if root in filename:
            filename = filename[filename.rindex(root) + len(root) :]
            break
    return f"{filename}:{line} {name}"


def print_profile(case: str, run: Callable[[Path], None], path: Path, top: int) -> None:
    """``case`` run once (writing ``path``, removed after each run) for each thread's CPU
    seconds, then once under :func:`profiles` for each thread's ``top`` functions by their
    own CPU time."""
    os.sync()
    cpu, threads, native = thread_cpu(functools.partial(run, path))
    path.unlink()
    print(f"\n{case}: {cpu:.3f} s CPU in the process")
    for name, seconds in threads.items():
        print(f"  {name:<44} {seconds:7.3f} s")
    print(f"  {'threads running no Python (torch intra-op)':<44} {native:7.3f} s")
    print(f"  {'not accounted for':<44} {cpu - sum(threads.values()) - native:7.3f} s")
    os.sync()
    stats = profiles(functools.partial(run, path))
    path.unlink()
    for name, thread in stats.items():
        total = thread.total_tt  # type: ignore[attr-defined]
        print(f"\n  {name}, profiled ({total:.3f} s with cProfile's own cost): top {top}")
        print(f"  {'own s':>7} {'cum s':>7} {'calls':>7}")
        entries = thread.stats.items()  # type: ignore[attr-defined]
        for key, (_, calls, own, cumulative, _) in sorted(entries, key=lambda e: -e[1][2])[:top]:
            print(f"  {own:7.3f} {cumulative:7.3f} {calls:7d}  {where(key)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checksum-cost", action="store_true")
    parser.add_argument("--hashes", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile one run of each case")
    parser.add_argument("--top", type=int, default=12, help="functions per thread (--profile)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    data = torch.randn(args.rows, *SHAPE, generator=torch.Generator().manual_seed(0))
    nbytes = args.rows * int(np.prod(SHAPE)) * 2
    cases: dict[str, Callable[[Path], None]] = {
        "cast + write + fsync": lambda p: cast_write_fsync(data, args.batch, p),
        "featcache.extract": lambda p: extract(data, args.batch, p),
    }
    if args.checksum_cost:
        cases["featcache.extract, checksum off"] = lambda p: extract(data, args.batch, p, False)
        no_checks = functools.partial(extract, data, args.batch, checksum=False, nonfinite="keep")
        cases["featcache.extract, no checks"] = no_checks
    if args.profile:
        with tempfile.TemporaryDirectory(prefix="featcache-bench-write-", dir=args.dir) as tmp:
            for name, run in cases.items():
                path = Path(tmp) / "profiled.h5"
                run(path)  # warm-up
                path.unlink()
                print_profile(name, run, path, args.top)
        return
    with tempfile.TemporaryDirectory(prefix="featcache-bench-write-", dir=args.dir) as tmp:
        times = timed_rounds(cases, Path(tmp), args.repeats)
    print(
        f"{args.rows} rows {list(SHAPE)} float16 ({nbytes / 2**20:,.0f} MiB) in batches of "
        f"{args.batch}; {torch.get_num_threads()} torch threads; OMP_WAIT_POLICY "
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; median (range) of {args.repeats} rounds"
    )
    print(f"{'case':<34} {'wall s':>18} {'CPU s':>18} {'wall':>18} {'CPU/byte':>18}")
    base = times["cast + write + fsync"]
    for name, rounds in times.items():
        walls, cpus = [w for w, _ in rounds], [c for _, c in rounds]
        wall_ratio = [b[0] / w for b, w in zip(base, walls, strict=True)]
        cpu_ratio = [b[1] / c for b, c in zip(base, cpus, strict=True)]  # same bytes
        print(
            f"{name:<34} {spread(walls):>18} {spread(cpus):>18} "
            f"{spread(wall_ratio) + 'x':>18} {spread(cpu_ratio) + 'x':>18}"
        )
    if args.hashes:
        hashes()


if __name__ == "__main__":
    main()
