"""Reading a shuffle buffer's blocks, shared between the reader thread and the consumer.

:meth:`FeatureDataset.batches` reads the next buffer on a thread while batches are
drawn from the current one. When the batches run out first (always for the first
buffer), the thread drawing them has nothing to do but wait, so it reads blocks too:
both threads take the next block to read from one counter. Reads that release the GIL
(featcache's reads through a memory map, :mod:`featcache.store.rows`) then run on two cores;
HDF5's reads would only take turns, so a buffer that HDF5 reads is left to the reader."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait


class SharedRead:
    """The reads ``tasks`` (each one block of one layer), started on ``reader`` when given.

    :meth:`result` reads whatever no thread has taken yet (only the reader takes any when
    ``shared`` is false), then waits for the reader's block in flight; the first error
    of either thread is raised there. :meth:`stop` keeps both from taking more blocks (an
    epoch left early, or a read that failed)."""

    def __init__(
        self,
        tasks: Sequence[Callable[[], None]],
        reader: ThreadPoolExecutor | None,
        shared: bool = True,
    ):
        self.tasks = tasks
        self.shared = shared or reader is None
        self.taken = itertools.count()  # next() is atomic: each task runs exactly once
        self.stopped = False
        self.future = reader.submit(self._work) if reader is not None else None

    def _work(self) -> None:
        for i in self.taken:
            if i >= len(self.tasks) or self.stopped:
                return
            try:
                self.tasks[i]()
            except BaseException:
                self.stopped = True
                raise

    def result(self) -> None:
        """Return once every block is read (reading some here); raise the first error."""
        try:
            if self.shared:
                self._work()
        except BaseException:
            if self.future is not None:
                wait([self.future])  # the reader stops after its block; its error is moot
            raise
        if self.future is not None:
            self.future.result()

    def stop(self) -> None:
        """Take no more blocks; a block being read is finished."""
        self.stopped = True
