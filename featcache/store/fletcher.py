"""HDF5's Fletcher-32 chunk checksum, computed with numpy: bit-exact, several times faster.

HDF5's filter reads a chunk as big-endian 16-bit words ``w_0 .. w_{n-1}`` and keeps two
running sums, folded to 16 bits as it goes: ``sum1 = w_0 + ... + w_k`` and ``sum2`` the
sum of every ``sum1`` so far. Folding ``x`` to ``(x & 0xffff) + (x >> 16)`` keeps ``x``
modulo 65535 and keeps a positive number positive, so the stored halves are

* ``sum1 = S1 mod 65535`` and ``sum2 = S2 mod 65535``, where ``S1 = sum(w_i)`` and
  ``S2 = sum((n - i) * w_i)``, except that a positive multiple of 65535 is stored as
  65535, not 0 (it is 0 only for a chunk of zero bytes);
* stored after the data as a little-endian ``(sum2 << 16) | sum1``.

Two facts make this a few numpy reductions: a big-endian word is 256 times the
little-endian word of the same two bytes, modulo 65535 (because ``65536 = 1``), and with
the words laid out as a ``[M, K]`` matrix, ``sum(i * w_i) = K * sum(m * R_m) +
sum(j * C_j)`` for its row sums ``R`` and column sums ``C``. The words are widened to
32 bits a block at a time first, so that both sums run without numpy's casting buffers
(about a quarter faster than summing the 16-bit words into 32-bit accumulators); they
release the GIL, so a writer or reader thread checks a chunk without holding up the
forward. Each thread widens into one buffer of its own, kept for its next chunk: a new
array of a few MiB per block is memory that glibc may hand back to the kernel when it is
freed, and faulting it in again made a 16 MiB chunk three to eight times slower.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import h5py
import numpy as np

MODULUS = 65535
WIDTH = 2048  # words per row of the [M, K] matrix: K * 65535 fits in 32 bits
# Rows widened and summed at a time (2 MiB of 32-bit words); a column of up to 65,537
# rows sums in 32 bits without overflow.
BLOCK_ROWS = 256
CHECKSUM_BYTES = 4

_buffers = threading.local()  # each thread's [BLOCK_ROWS, WIDTH] uint32 block


def _block_buffer() -> np.ndarray:
    """This thread's buffer for one widened block: ``[BLOCK_ROWS, WIDTH]`` ``uint32``."""
    buffer = getattr(_buffers, "block", None)
    if buffer is None or buffer.shape[0] != BLOCK_ROWS:
        buffer = _buffers.block = np.empty((BLOCK_ROWS, WIDTH), dtype=np.uint32)
    return buffer


def fletcher32(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The Fletcher-32 checksum HDF5 stores after a chunk of ``data`` (its raw bytes)."""
    if isinstance(data, np.ndarray):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(data, dtype=np.uint8)
    odd = len(raw) % 2
    words = raw[: len(raw) - odd].view("<u2")
    n = len(words)
    s1 = s2 = 0  # exact sums over the little-endian words, as Python ints
    buffer = _block_buffer()
    for first in range(0, n - n % WIDTH, WIDTH * BLOCK_ROWS):
        block = words[first : min(first + WIDTH * BLOCK_ROWS, n - n % WIDTH)]
        matrix = buffer[: len(block) // WIDTH]
        np.copyto(matrix, block.reshape(-1, WIDTH))
        rows = matrix.sum(axis=1, dtype=np.uint32).astype(np.uint64)
        cols = matrix.sum(axis=0, dtype=np.uint32).astype(np.uint64)
        total = int(rows.sum())
        # sum over the block of (n - i) * w_i, with i = first + m * WIDTH + j
        weighted = WIDTH * int(np.arange(len(rows), dtype=np.uint64) @ rows) + int(
            np.arange(WIDTH, dtype=np.uint64) @ cols
        )
        s1 += total
        s2 += (n - first) * total - weighted
    tail = words[n - n % WIDTH :].astype(np.uint64)
    if len(tail):
        s1 += int(tail.sum())
        s2 += int((n - np.arange(n - len(tail), n, dtype=np.uint64)) @ tail)
    # Big-endian words are 256 times the little-endian ones, modulo 65535.
    sum1, sum2 = 256 * s1, 256 * s2
    if odd:  # the last byte counts as the high byte of one more word
        last = int(raw[-1]) << 8
        sum2 += sum1 + last
        sum1 += last
    return (_fold(sum2) << 16) | _fold(sum1)


def _fold(value: int) -> int:
    """``value`` modulo 65535 as HDF5 keeps it: 65535 for a positive multiple of 65535."""
    if value == 0:
        return 0
    return value % MODULUS or MODULUS


def checksum_bytes(data: bytes | bytearray | memoryview | np.ndarray) -> bytes:
    """The four bytes HDF5 stores after ``data`` in a chunk written with Fletcher-32."""
    return fletcher32(data).to_bytes(CHECKSUM_BYTES, "little")


def checksum_only(dataset: h5py.Dataset) -> bool:
    """Whether ``dataset`` is chunked with Fletcher-32 as its only filter: each chunk is
    stored as its raw bytes followed by their checksum."""
    if dataset.chunks is None or not dataset.fletcher32:
        return False
    return dataset.id.get_create_plist().get_nfilters() == 1


def plain_chunk_address(dataset: h5py.Dataset, start: int, checksum: bool = True) -> int | None:
    """Where in the file the chunk of ``dataset`` that starts at row ``start`` lies, when
    it is stored as its plain bytes, followed by their checksum with ``checksum``
    (allocated, no filter skipped or applied but Fletcher-32); None otherwise, and HDF5
    must read it."""
    info = dataset.id.get_chunk_info_by_coord((start, *(0 for _ in dataset.shape[1:])))
    return _plain_address(info, stored_chunk_bytes(dataset, checksum))


NOT_PLAIN = -1  # in plain_chunk_addresses: a chunk HDF5 must read
# In plain_chunk_addresses: a chunk the index lists twice. Only a damaged index does (a
# write after a lookup missed the chunk added a second one): which copy HDF5 reads
# depends on how it is looked up, so neither can be trusted.
LISTED_TWICE = -3


def plain_chunk_addresses(dataset: h5py.Dataset, checksum: bool = True) -> np.ndarray:
    """:func:`plain_chunk_address` of each row block of chunks of ``dataset``, in row
    order (:data:`NOT_PLAIN` for None, :data:`LISTED_TWICE` for a chunk listed twice):
    ``int64``, one per chunk along the first axis. Listed in one pass over HDF5's chunk
    index, or looked up chunk by chunk where HDF5 cannot list them (before 1.12.3)."""
    assert dataset.chunks is not None
    chunk_rows = dataset.chunks[0]
    addresses = np.full(-(-len(dataset) // chunk_rows), NOT_PLAIN, dtype=np.int64)
    listed = np.zeros(len(addresses), dtype=bool)
    stored = stored_chunk_bytes(dataset, checksum)

    def note(info: h5py.h5d.StoreInfo) -> None:
        if any(info.chunk_offset[1:]):  # the chunks at row offset 0 on the other axes
            return
        chunk = info.chunk_offset[0] // chunk_rows
        if chunk >= len(addresses):  # beyond the rows (a dataset shrunk at completion)
            return
        if listed[chunk]:
            addresses[chunk] = LISTED_TWICE
            return
        listed[chunk] = True
        address = _plain_address(info, stored)
        if address is not None:
            addresses[chunk] = address

    if not _list_chunks(dataset, note):
        for chunk in range(len(addresses)):
            found = plain_chunk_address(dataset, chunk * chunk_rows, checksum)
            addresses[chunk] = NOT_PLAIN if found is None else found
    return addresses


def stored_chunk_bytes(dataset: h5py.Dataset, checksum: bool) -> int:
    """The bytes a whole chunk of ``dataset`` takes as plain values (and checksum)."""
    assert dataset.chunks is not None
    stored = int(np.prod(dataset.chunks, dtype=np.int64)) * dataset.dtype.itemsize
    return stored + (CHECKSUM_BYTES if checksum else 0)


def _list_chunks(dataset: h5py.Dataset, note: Callable[[h5py.h5d.StoreInfo], None]) -> bool:
    """Call ``note`` with each allocated chunk's HDF5 record; False where HDF5 cannot."""
    try:
        dataset.id.chunk_iter(note)
    except (AttributeError, NotImplementedError):
        return False
    return True


def _plain_address(info: h5py.h5d.StoreInfo, stored: int) -> int | None:
    """The byte offset of the chunk ``info`` describes, when it is allocated, not
    filtered but as expected, and ``stored`` bytes long."""
    if info.byte_offset is None or info.filter_mask != 0 or info.size != stored:
        return None
    return int(info.byte_offset)
