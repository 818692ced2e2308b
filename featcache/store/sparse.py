"""New HDF5 files whose zero-filled chunks are left as holes instead of being written.

HDF5 writes every chunk of a filtered dataset when it allocates it, whatever the fill
time: for a checksummed store that is the store's full size in zeros (each zero chunk's
Fletcher-32 checksum is 0 too), written and synced before the first row, and written
again as the rows arrive. Read back, a hole in a file is zeros as well, so leaving those
bytes unwritten gives the same file: HDF5 and featcache's checked reads accept every
chunk, and the store takes disk space only as rows are written, like a store without
checksums.

:func:`created_sparse` builds a file through h5py's file-object driver over
:class:`SparseWriter`, which skips writes of zeros past everything written so far.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from featcache.store.metadata import LIBVER

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12


class SparseWriter(io.RawIOBase):
    """A new file, as a file object for h5py, that does not write zeros into new space.

    A write of nothing but zero bytes that starts at or after the end of everything
    written so far only moves the position: those bytes are still unwritten, so they
    read as zeros. Any other write goes to the file. :meth:`truncate` sets the file's
    size, so that skipped bytes at the end still belong to it.
    """

    def __init__(self, path: str | os.PathLike):
        self.file = open(path, "w+b", buffering=0)  # noqa: SIM115 (closed by close())
        self.position = 0
        self.size = 0  # the file's size as HDF5 sees it, skipped zeros included
        self.written_end = 0  # no byte at or after this offset has been written
        self.skipped = 0  # bytes left unwritten

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        if self.position >= self.written_end and not np.frombuffer(view, np.uint8).any():
            self.skipped += len(view)
        else:
            self.file.seek(self.position)
            self.file.write(view)
            self.written_end = max(self.written_end, self.position + len(view))
        self.position += len(view)
        self.size = max(self.size, self.position)
        return len(view)

    def readinto(self, buffer: Buffer) -> int:
        """Fill ``buffer`` from the position; skipped zeros past the end of what the
        file holds yet read as zeros, up to the size HDF5 sees."""
        view = memoryview(buffer).cast("B")
        want = min(len(view), max(self.size - self.position, 0))
        self.file.seek(self.position)
        got = self.file.readinto(view[:want]) or 0
        view[got:want] = bytes(want - got)
        self.position += want
        return want

    def truncate(self, size: int | None = None) -> int:
        size = self.position if size is None else size
        self.file.truncate(size)
        self.size = size
        self.written_end = min(self.written_end, size)
        return size

    def flush(self) -> None:
        pass  # nothing is buffered

    def close(self) -> None:
        if not self.closed:
            self.file.close()
        super().close()


@contextlib.contextmanager
def created_sparse(path: str | os.PathLike) -> Iterator[h5py.File]:
    """A new HDF5 file at ``path`` (replacing any file there), open for building; the
    zeros HDF5 fills new chunks with are not written. Closed on leaving the block, and
    synced to the disk when the block completes."""
    target = SparseWriter(Path(path))
    try:
        with h5py.File(target, "w", libver=LIBVER) as f:
            yield f
        os.fsync(target.file.fileno())  # everything HDF5 wrote, now that it is closed
    finally:
        target.close()
