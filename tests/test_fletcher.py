"""featcache's Fletcher-32 against the checksums HDF5 itself stores, and the writer's
whole chunks (written as stored, with that checksum) against HDF5's own reads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import pytest
import torch

from featcache.store import StoreWriter, codec, fletcher, scan_chunks
from featcache.store.fletcher import (
    checksum_bytes,
    checksum_only,
    fletcher32,
    plain_chunk_address,
    plain_chunk_addresses,
)


def _reference(data: bytes) -> int:
    """HDF5's algorithm, word by word (H5_checksum_fletcher32), for small inputs."""
    sum1 = sum2 = 0
    words = [(data[i] << 8) | data[i + 1] for i in range(0, len(data) - 1, 2)]
    for first in range(0, len(words), 360):
        for word in words[first : first + 360]:
            sum1 += word
            sum2 += sum1
        sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
        sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    if len(data) % 2:
        sum1 += data[-1] << 8
        sum2 += sum1
        sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
        sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
    sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    return (sum2 << 16) | sum1


@pytest.mark.parametrize("size", [0, 1, 2, 3, 719, 720, 4096, 4097, 3 * 4096 + 5, 10_000])
def test_matches_hdf5s_algorithm_on_random_bytes(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert fletcher32(data) == _reference(data)


@pytest.mark.parametrize("data", [bytes(9), b"\xff" * 8194, b"\xff" * 8192 + b"\x01"])
def test_sums_that_are_multiples_of_65535_are_kept_as_hdf5_keeps_them(data):
    assert fletcher32(data) == _reference(data)


def test_threads_checking_at_once_each_get_their_own_sums():
    # Each thread widens its blocks into a buffer of its own; a shared one would mix them.
    rng = np.random.default_rng(7)
    chunks = [rng.integers(0, 256, 3 * 2**20 + 11, dtype=np.uint8) for _ in range(4)]
    expected = [fletcher32(chunk) for chunk in chunks]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(fletcher32, chunks)) == expected


@pytest.mark.parametrize(
    ("dtype", "shape", "chunks"),
    [
        ("float16", (64, 8192), (32, 8192)),  # 512 KiB chunks
        ("uint16", (8, 4096), (8, 4096)),  # every word 0xffff
        ("uint8", (9, 333), (3, 333)),  # odd chunk sizes
        ("float32", (40, 3000), (40, 3000)),  # zeros
        ("uint8", (2, 5 * 2**20 + 3), (1, 5 * 2**20 + 3)),  # chunks of several blocks
    ],
)
def test_matches_the_checksums_hdf5_stores(tmp_path, dtype, shape, chunks):
    rng = np.random.default_rng(0)
    if dtype == "uint16":
        values = np.full(shape, 0xFFFF, dtype=dtype)
    elif dtype == "float32":
        values = np.zeros(shape, dtype=dtype)
    elif dtype == "uint8":
        values = rng.integers(0, 256, shape, dtype=np.uint8)
    else:
        values = rng.standard_normal(shape).astype(dtype)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        dataset = f.create_dataset("x", data=values, chunks=chunks, fletcher32=True)
        assert checksum_only(dataset)
        for i in range(dataset.id.get_num_chunks()):
            _, stored = dataset.id.read_direct_chunk(dataset.id.get_chunk_info(i).chunk_offset)
            assert checksum_bytes(stored[:-4]) == stored[-4:]


def test_only_a_checksum_alone_counts_as_checksum_only(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        plain = f.create_dataset("plain", shape=(8, 4), dtype="f4", chunks=(4, 4))
        both = f.create_dataset(
            "both", shape=(8, 4), dtype="f4", chunks=(4, 4), fletcher32=True, compression="gzip"
        )
        assert not checksum_only(plain) and not checksum_only(both)


def test_chunks_the_writer_writes_as_stored_pass_hdf5s_own_check(tmp_path):
    rows = 21  # five whole chunks of 4 rows, written as stored, and a partial one
    values = np.random.default_rng(1).standard_normal((rows, 6, 5)).astype(np.float32)
    path = tmp_path / "s.h5"
    writer = StoreWriter(path, rows, ids_width=2, chunk_rows=4)
    index = np.arange(rows)
    encoded = codec.to_numpy(codec.encode(torch.from_numpy(values), "float16"))
    for start in range(0, rows, 7):  # batches that straddle chunks
        stop = min(start + 7, rows)
        writer.append(
            index[start:stop],
            [str(i) for i in index[start:stop]],
            index[start:stop],
            {"a": encoded[start:stop]},
        )
    writer.close(complete=True)
    assert scan_chunks(path) == []  # HDF5 reads and checks every chunk
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["features/a"][:], encoded)
        np.testing.assert_array_equal(f["labels"][:], index)


@pytest.mark.parametrize(
    "options",
    [
        {"fletcher32": True},
        {"fletcher32": False},
        {"fletcher32": True, "compression": "gzip"},  # filtered: HDF5 must read every chunk
    ],
)
@pytest.mark.parametrize("listed", [True, False], ids=["chunk-list", "chunk-by-chunk"])
def test_the_chunk_list_gives_each_chunks_address_as_looked_up_alone(
    tmp_path, monkeypatch, options, listed
):
    if not listed:  # an HDF5 that cannot list a dataset's chunks (before 1.12.3)
        monkeypatch.setattr(fletcher, "_list_chunks", lambda dataset, note: False)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        dataset = f.create_dataset("x", (50, 6), dtype="f2", chunks=(8, 6), **options)
        dataset[0:8] = 1.0
        dataset[24:43] = np.arange(19 * 6).reshape(19, 6)  # chunks 1 and 2 never written
        checksum = options["fletcher32"]
        listed = plain_chunk_addresses(dataset, checksum)
        alone = [plain_chunk_address(dataset, start, checksum) for start in range(0, 50, 8)]
    assert listed is not None and listed.dtype == np.int64
    assert listed.tolist() == [-1 if a is None else a for a in alone]
    assert alone[1] is None and alone[2] is None
    assert (alone[0] is None) == ("compression" in options)


def test_the_chunk_list_takes_the_first_chunk_of_each_row_block(tmp_path):
    with h5py.File(tmp_path / "s.h5", "w") as f:
        dataset = f.create_dataset("x", (16, 6), dtype="f2", chunks=(8, 3), fletcher32=True)
        dataset[0:8] = 1.0
        dataset[8:16, 3:6] = 2.0  # rows 8-15: only the second chunk along axis 1 written
        listed = plain_chunk_addresses(dataset)
        alone = [plain_chunk_address(dataset, start) for start in (0, 8)]
    assert listed is not None
    assert alone[0] is not None and alone[1] is None
    assert listed.tolist() == [alone[0], -1]
