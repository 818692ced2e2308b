"""Freed CPU memory kept for reuse while a run lasts: glibc's two malloc thresholds.

glibc returns freed blocks above its mmap threshold (at most 32 MiB) and free heap above
its trim threshold to the kernel, so a CPU forward faults its largest activations in again
every batch (``docs/benchmarks.md``). glibc cannot restore its own dynamic rule, so a run
ends with the thresholds at that rule's ceilings.
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

# While a run lasts: blocks up to 256 MiB come from the heap, up to 512 MiB free is kept.
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
    """The process's C library if it is glibc (with ``mallopt``, ``malloc_trim``), else None."""
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
    """Set the thresholds to glibc's ceilings and trim the heap, as a run ends."""
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
    one batch of a CPU forward frees serve the next); a no-op for devices other than the
    CPU and where the C library is not glibc. Nested and concurrent blocks are counted:
    the thresholds settle, and the heap is trimmed, when the last one ends."""
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
