"""Reading a shuffle buffer's blocks, shared between the reader thread and the consumer.

A consumer that has run out of batches (always for the first buffer) would only wait,
so it takes blocks from the reader's counter too. Reads through a memory map release the
GIL and run on two cores; HDF5's would only take turns, so those are left to the reader."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait


class SharedRead:
    """The reads ``tasks`` (each one block of one layer), started on ``reader`` when given.
    :meth:`result` also reads here unless ``shared`` is false, and raises the first error
    of either thread; :meth:`stop` keeps both from taking more blocks."""

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
