"""featcache.store.sparse: new files built without writing HDF5's zero fill."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

import featcache  # noqa: F401  (the compat shim before anything imports torchvision)
from featcache.store import StoreWriter
from featcache.store.integrity import scan_chunks
from featcache.store.sparse import SparseWriter, created_sparse


def _checksummed(f: h5py.File, rows: int) -> None:
    """A checksummed dataset allocated at creation, as StoreWriter allocates its own."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    f.create_dataset(
        "x",
        shape=(rows, 64),
        dtype=np.float16,
        chunks=(16, 64),
        maxshape=(None, 64),
        fletcher32=True,
        dcpl=dcpl,
        fill_time="never",
    )
    f.attrs["note"] = "same"


def _layout(path) -> dict:
    """Each dataset's shape, dtype, chunks, filters and stored chunk sizes, and the attrs."""
    with h5py.File(path, "r") as f:
        x = f["x"]
        sizes = [x.id.get_chunk_info(i).size for i in range(x.id.get_num_chunks())]
        return {
            "attrs": dict(f.attrs),
            "x": (x.shape, x.dtype, x.chunks, x.maxshape, x.fletcher32, sizes),
            "values": x[:].tobytes(),
        }


def test_same_file_as_hdf5_builds_without_writing_the_zeros(tmp_path):
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        _checksummed(f, 4096)
    with created_sparse(tmp_path / "sparse.h5") as f:
        _checksummed(f, 4096)
    plain, sparse = _layout(tmp_path / "plain.h5"), _layout(tmp_path / "sparse.h5")
    assert len(plain["x"][-1]) == 4096 // 16  # every chunk allocated at creation
    assert set(plain["x"][-1]) == {16 * 64 * 2 + 4}  # each with its checksum
    assert sparse == plain
    assert os.stat(tmp_path / "plain.h5").st_blocks * 512 > 4096 * 64 * 2
    assert os.stat(tmp_path / "sparse.h5").st_blocks * 512 < 64 * 1024


def test_untouched_chunks_read_as_zeros_and_pass_their_checksum(tmp_path):
    with created_sparse(tmp_path / "s.h5") as f:
        _checksummed(f, 4096)
    with h5py.File(tmp_path / "s.h5", "r+") as f:
        f["x"][32:48] = np.ones((16, 64), np.float16)
    with h5py.File(tmp_path / "s.h5", "r") as f:
        values = f["x"][:]  # HDF5 checks every chunk's checksum on the way
        assert values[32:48].min() == 1 and np.count_nonzero(values) == 16 * 64


def test_a_new_checksummed_store_takes_disk_space_only_as_rows_are_written(tmp_path):
    rows, dim = 4096, 2048  # 16 MB of float16
    path = tmp_path / "s.h5"
    writer = StoreWriter(path, rows, ids_width=8, checksum=True, attrs={})
    features = {"f": np.ones((64, dim), np.float16)}
    writer.append(np.arange(64), [str(i) for i in range(64)], np.zeros(64), features)
    on_disk = os.stat(writer.partial).st_blocks * 512
    assert os.stat(writer.partial).st_size > rows * dim * 2
    assert on_disk < 4 * 1024 * 1024  # the rows written so far, not the allocated size
    for start in range(64, rows, 64):
        index = np.arange(start, start + 64)
        writer.append(index, [str(i) for i in index], np.zeros(64), features)
    writer.close(complete=True, attrs={})
    assert scan_chunks(path) == []
    with h5py.File(path, "r") as f:
        assert f["features/f"].fletcher32
        assert (f["features/f"][:] == 1).all()


def test_sparse_writer_skips_only_zeros_past_everything_written(tmp_path):
    target = SparseWriter(tmp_path / "f.bin")
    target.write(b"head")
    target.seek(100)
    target.write(bytes(50))  # past the end: left unwritten
    assert target.skipped == 50
    target.seek(2)
    target.write(bytes(2))  # zeros over written bytes are written
    target.seek(0)
    assert target.read(4) == b"he\0\0"
    target.seek(120)
    assert target.read(100) == bytes(30)  # up to the size HDF5 sees, unwritten bytes as zeros
    target.truncate(200)
    target.close()
    data = (tmp_path / "f.bin").read_bytes()
    assert data == b"he\0\0" + bytes(196)


def test_a_failed_build_leaves_the_file_closed(tmp_path):
    with pytest.raises(RuntimeError), created_sparse(tmp_path / "f.h5") as f:
        f.attrs["a"] = 1
        raise RuntimeError("stop")
    os.remove(tmp_path / "f.h5")  # closed: removable everywhere
