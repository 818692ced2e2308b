"""Freed CPU memory kept for reuse while a run lasts: glibc's two malloc thresholds.

glibc's ``malloc`` serves a request above its *mmap threshold* with a fresh mapping that
``free`` unmaps again, and gives free memory at the top of its heap back to the kernel
once it exceeds its *trim threshold*. The mmap threshold follows a rule of its own: it
rises to the size of the largest mapped block freed so far, but never above 32 MiB (on
64-bit systems), and the trim threshold stays at twice it.

A CPU forward allocates and frees activations of tens of MiB every batch (resnet18 at
112 px in batches of 64: 51 MB out of its first convolution alone), so under those
rules the kernel maps, zero-fills and unmaps every page of them again each batch. On a
2-core x86 machine that was 600,000 page faults and 19-21% of the CPU time of a
1,024-image resnet18 forward to ``layer2``; with the thresholds raised as below, 510
page faults and 1.36x the images/s (``scripts/bench_extract.py`` has a bare loop with
freed memory kept).

:func:`freed_memory_kept` raises both thresholds while a CPU run lasts, so that the
blocks a batch frees serve the next batch. When the last run ends it sets them to the
ceilings of glibc's own rule (glibc offers no call that hands the rule back) and trims
the heap, returning what the run kept. Elsewhere (CUDA runs, other C libraries) it does
nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import threading
from collections.abc import Iterator
from typing import Any

import torch

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3

# While a run lasts: blocks up to 256 MiB come from the heap, and up to 512 MiB of free
# heap is kept. Above that, a block is mapped as it would be anyway.
RUN_MMAP_THRESHOLD = 256 << 20
RUN_TRIM_THRESHOLD = 512 << 20

# The ceilings of glibc's own rule: DEFAULT_MMAP_THRESHOLD_MAX (4 MiB per byte of a
# long: 32 MiB on 64-bit systems), and twice it for trimming.
CEILING_MMAP_THRESHOLD = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
CEILING_TRIM_THRESHOLD = 2 * CEILING_MMAP_THRESHOLD

_lock = threading.Lock()
_runs = 0  # runs inside freed_memory_kept now, in any thread


@functools.cache
def glibc() -> Any:
    """The process's C library when it is glibc with ``mallopt`` and ``malloc_trim``,
    else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def settle_thresholds() -> None:
    """Set the thresholds to the ceilings of glibc's rule and trim the heap: the state a
    run leaves the process in. (Benchmarks call it first, so that every case runs in the
    same state whatever ran before it.)"""
    libc = glibc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, CEILING_MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, CEILING_TRIM_THRESHOLD)
    libc.malloc_trim(0)


@contextlib.contextmanager
def freed_memory_kept(device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside the block, freed CPU memory is kept for reuse instead of being returned to
    the kernel and faulted in again (glibc's malloc thresholds raised, so that the blocks
    one batch of a CPU forward frees serve the next); a no-op for devices
    other than the CPU and where the C library is not glibc. Nested and concurrent blocks
    are counted: the thresholds settle when the last one ends."""
    global _runs
    libc = glibc()
    if libc is None or torch.device(device).type != "cpu":
        yield
        return
    with _lock:
        _runs += 1
        if _runs == 1:
            libc.mallopt(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD)
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                settle_thresholds()
