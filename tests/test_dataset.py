"""FeatureDataset: lazy per-worker reads, batched reads, chunk-aware shuffled batches,
in-memory mode, chunk cache, labels."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featcache
from featcache import FeatureDataset, FeatureStore
from featcache.errors import ConfigError, CorruptStoreError, FeatcacheError, IncompleteStoreError
from featcache.read import dataset as dataset_module
from featcache.read.dataset import ShuffledBatches
from featcache.store import StorePlan, StoreWriter, codec, partial_path, seal
from featcache.store import rows as rows_module
from tests.stores import corrupt_row


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """20 rows of a seeded resnet18: layer3 [256] and layer2 [128, 2, 2], bfloat16, 6-row chunks."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(20, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("dataset") / "s.h5"
    featcache.extract(
        model,
        torch.utils.data.TensorDataset(x, torch.arange(20) % 5),
        [
            {"name": "layer3", "reduce": "avg"},
            {"name": "layer2", "reduce": "adaptive_avg", "size": 2},
        ],
        path,
        dtype="bfloat16",
        chunk_rows=6,
        progress=False,
    )
    return path


@pytest.fixture(autouse=True)
def blocks_of_one_chunk(monkeypatch):
    """The shuffling reader reads blocks of one chunk of these small stores (with
    featcache's own chunk sizes, a block is about 1 MiB of whole chunks)."""
    monkeypatch.setattr(dataset_module, "BLOCK_BYTES", 1)


def write_store(path, rows=203, dims=None, *, chunk_rows=16, dtype="float16", **options):
    """A complete store written by StoreWriter: seeded normal rows, labels ``row % 7``."""
    dims = dims or {"a": 8}
    rng = np.random.default_rng(0)
    writer = StoreWriter(
        StorePlan(path, rows, ids_width=6, dtype=dtype, chunk_rows=chunk_rows, **options)
    )
    index = np.arange(rows)
    features = {
        key: codec.as_array(codec.encode(torch.from_numpy(rng.standard_normal((rows, dim))), dtype))
        for key, dim in dims.items()
    }
    writer.append(index, [f"{i:06d}" for i in index], index % 7, features)
    writer.close(complete=True)
    return path


@pytest.fixture(scope="module")
def rows_path(tmp_path_factory):
    """203 rows of a [8] float16 layer in 16-row chunks: 13 blocks, the last one of 11 rows."""
    return write_store(tmp_path_factory.mktemp("rows") / "r.h5")


def collect(batches):
    """Concatenated features, labels and rows of ``(features, labels, rows)`` batches."""
    batches = list(batches)
    return (
        torch.cat([b[0] for b in batches]),
        torch.cat([b[1] for b in batches]),
        torch.cat([b[2] for b in batches]),
    )


def test_loader_with_two_workers_matches_direct_reads(store_path):
    dataset = FeatureDataset(store_path, "layer3")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(dataset, batch_size=7, sampler=order, num_workers=2)
    store = FeatureStore(store_path)
    direct = store.read("layer3").float()
    labels = torch.from_numpy(store.labels)
    seen = []
    for batch_number, (features, label) in enumerate(loader):
        rows = order[batch_number * 7 : (batch_number + 1) * 7]
        assert features.dtype == torch.float32 and features.shape == (len(rows), 256)
        assert torch.equal(features, direct[rows])
        assert torch.equal(label, labels[rows])
        seen += rows
    assert sorted(seen) == list(range(20))


def test_single_items_and_negative_indices(store_path):
    dataset = FeatureDataset(store_path, "layer3", dtype=None)
    features, label = dataset[3]
    assert features.dtype == torch.bfloat16 and features.shape == (256,)
    assert label.item() == 3 % 5
    assert torch.equal(dataset[-1][0], dataset[19][0])
    with pytest.raises(IndexError):
        dataset[20]
    # A row number that is not a whole number is refused, not truncated to row 1.
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match=f"row numbers must be integers, got {bad!r}"):
            dataset[bad]
    with pytest.raises(TypeError, match=r"got 1.0 \(float64\)"):
        dataset.__getitems__([1, 2.0])


def test_several_layers_give_a_dict_and_in_memory_matches(store_path):
    lazy = FeatureDataset(store_path, ["layer3", "layer2"])
    memory = FeatureDataset(store_path, ["layer3", "layer2"], in_memory=True)
    rows = [5, 1, 1, 17]
    for a, b in zip(lazy.__getitems__(rows), memory.__getitems__(rows), strict=True):
        assert set(a[0]) == {"layer3", "layer2"}
        assert a[0]["layer2"].shape == (128, 2, 2)
        assert torch.equal(a[0]["layer3"], b[0]["layer3"])
        assert torch.equal(a[0]["layer2"], b[0]["layer2"])
        assert torch.equal(a[1], b[1])
    batch = next(iter(DataLoader(memory, batch_size=4)))
    assert batch[0]["layer2"].shape == (4, 128, 2, 2)


def test_dataset_pickles_without_its_file_handle(store_path):
    dataset = FeatureDataset(store_path, "layer3")
    first = dataset[0][0]
    clone = pickle.loads(pickle.dumps(dataset))
    assert not clone._handle.is_open
    assert torch.equal(clone[0][0], first)


def test_missing_layer_is_named(store_path):
    with pytest.raises(
        ConfigError, match="layer 'layer4' is not in store .* it holds: layer3, layer2"
    ):
        FeatureDataset(store_path, "layer4")


def test_unlabeled_store_gives_minus_one(tmp_path):
    path = tmp_path / "u.h5"
    writer = StoreWriter(StorePlan(path, 4, ids_width=1, has_labels=False))
    writer.append(np.arange(4), list("abcd"), None, {"a": np.ones((4, 3), np.float16)})
    writer.close(complete=True)
    dataset = FeatureDataset(path, "a")
    assert not dataset.has_labels
    assert dataset[2][1].item() == -1
    assert next(dataset.batches(4))[1].tolist() == [-1] * 4


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("batch_size", "buffer_rows"), [(7, None), (7, 16), (64, 1), (300, 40)])
def test_batches_give_every_row_once_with_its_stored_values(
    rows_path, shuffle, batch_size, buffer_rows
):
    dataset = FeatureDataset(rows_path, "a")
    store = FeatureStore(rows_path)
    direct, labels = store.read("a").float(), torch.from_numpy(store.labels)
    batches = list(
        dataset.batches(batch_size, shuffle=shuffle, buffer_rows=buffer_rows, with_index=True)
    )
    sizes = [len(b[1]) for b in batches]
    assert sizes[:-1] == [batch_size] * (len(batches) - 1) and 0 < sizes[-1] <= batch_size
    for features, label, rows in batches:
        assert features.dtype == torch.float32 and features.shape == (len(rows), 8)
        assert label.dtype == torch.int64 and rows.dtype == torch.int64
        assert torch.equal(features, direct[rows]) and torch.equal(label, labels[rows])
    order = torch.cat([b[2] for b in batches])
    assert sorted(order.tolist()) == list(range(203))
    assert order.tolist() != list(range(203)) if shuffle else order.tolist() == list(range(203))


def test_shuffled_order_depends_on_seed_and_epoch_only(rows_path):
    dataset = FeatureDataset(rows_path, "a")
    clone = pickle.loads(pickle.dumps(dataset))

    def order(d, **kw):
        return collect(d.batches(16, with_index=True, **kw))[2].tolist()

    first = order(dataset, seed=3, epoch=1)
    assert order(dataset, seed=3, epoch=1) == first == order(clone, seed=3, epoch=1)
    assert order(dataset, seed=3, epoch=2) != first
    assert order(dataset, seed=4, epoch=1) != first
    # A batch mixes rows of several blocks, not one block's rows in a row.
    first_batch = next(dataset.batches(16, seed=3, epoch=1, with_index=True))[2]
    assert len(set((first_batch // dataset.block_rows).tolist())) > 2


def test_two_iterators_at_once_do_not_share_a_buffer(rows_path):
    dataset = FeatureDataset(rows_path, "a")
    pairs = zip(dataset.batches(10, seed=1), dataset.batches(10, seed=1), strict=True)
    for (x, y), (x2, y2) in pairs:
        assert torch.equal(x, x2) and torch.equal(y, y2)
    alone = collect(dataset.batches(10, seed=1, with_index=True))
    again = collect(dataset.batches(10, seed=1, with_index=True))  # reuses the kept buffer
    assert all(torch.equal(a, b) for a, b in zip(alone, again, strict=True))


def _record_reads(monkeypatch, delay: float = 0.0) -> list[tuple[str, tuple[int, int]]]:
    """(thread name, row range) of every block read by FeatureDataset.batches from now."""
    reads = []
    original = rows_module.Rows.read

    def read(self, start, stop, out):
        if self.name.startswith("features/"):
            reads.append((threading.current_thread().name, (start, stop)))
            time.sleep(delay)  # lets the other thread take a block meanwhile
        original(self, start, stop, out)

    monkeypatch.setattr(rows_module.Rows, "read", read)
    return reads


def test_the_next_buffer_is_read_on_a_thread_that_ends_with_the_epoch(rows_path, monkeypatch):
    dataset = FeatureDataset(rows_path, "a")
    reads = _record_reads(monkeypatch)
    before = set(threading.enumerate())
    main = threading.current_thread().name
    batches = dataset.batches(8, buffer_rows=32, with_index=True)
    next(batches)
    first_buffer = 32 // dataset.block_rows
    assert len(reads) >= first_buffer  # the first buffer, and the next one begun
    assert {name for name, _ in reads} <= {main, "featcache-read_0"}
    batches.close()  # leaving the epoch early waits for the block being read
    assert set(threading.enumerate()) <= before  # and the reading thread is gone
    reads.clear()
    assert len(list(dataset.batches(8, buffer_rows=32, read_ahead=False))) == 26
    assert {name for name, _ in reads} == {main}  # every block read here, once
    assert sorted(span for _, span in reads) == sorted(set(span for _, span in reads))
    assert sum(b - a for _, (a, b) in reads) == 203
    direct = FeatureStore(rows_path).read("a")
    features, labels, rows = collect(dataset.batches(8, buffer_rows=32, with_index=True))
    assert sorted(rows.tolist()) == list(range(203)) and torch.equal(features, direct[rows])
    alone = collect(dataset.batches(8, buffer_rows=32, with_index=True, read_ahead=False))
    assert all(torch.equal(a, b) for a, b in zip(alone, (features, labels, rows), strict=True))


def test_a_buffer_the_batches_wait_for_is_read_on_both_threads(rows_path, monkeypatch):
    dataset = FeatureDataset(rows_path, "a")
    reads = _record_reads(monkeypatch, delay=0.02)
    features, labels, rows = collect(dataset.batches(8, buffer_rows=203, with_index=True))
    assert {name for name, _ in reads} == {threading.current_thread().name, "featcache-read_0"}
    spans = [span for _, span in reads]
    assert len(spans) == len(set(spans)) and sum(b - a for a, b in spans) == 203  # each once
    direct = FeatureStore(rows_path).read("a")
    assert sorted(rows.tolist()) == list(range(203)) and torch.equal(features, direct[rows])


def test_a_bad_chunk_stops_the_epoch_before_any_of_its_rows(tmp_path):
    path = write_store(tmp_path / "s.h5")
    corrupt_row(path, "features/a", 100)  # rows 96-111
    seen = []
    with pytest.raises(CorruptStoreError, match="layer a rows 96-111 fail their checksum"):
        for _, _, rows in FeatureDataset(path, "a").batches(8, buffer_rows=32, with_index=True):
            seen.extend(rows.tolist())
    assert seen and not set(seen) & set(range(96, 112))


def test_drop_last_keeps_only_full_batches(rows_path):
    dataset = FeatureDataset(rows_path, "a")
    batches = list(dataset.batches(20, drop_last=True, with_index=True))
    assert [len(b[1]) for b in batches] == [20] * 10
    rows = torch.cat([b[2] for b in batches]).tolist()
    assert len(set(rows)) == 200 and set(rows) <= set(range(203))
    assert [len(b[1]) for b in dataset.batches(300, drop_last=True)] == []


def test_several_layers_give_dicts_in_the_asked_dtype(store_path):
    dataset = FeatureDataset(store_path, ["layer3", "layer2"], dtype=None)
    store = FeatureStore(store_path)
    for features, labels, rows in dataset.batches(8, buffer_rows=6, with_index=True):
        assert set(features) == {"layer3", "layer2"}
        assert features["layer2"].shape == (len(rows), 128, 2, 2)
        for layer, values in features.items():
            assert values.dtype == torch.bfloat16
            assert torch.equal(values, store.read(layer, rows.numpy()))
        assert torch.equal(labels, rows % 5)


def test_in_memory_batches_equal_file_batches(store_path):
    layers = ["layer3", "layer2"]
    lazy = FeatureDataset(store_path, layers)
    memory = FeatureDataset(store_path, layers, in_memory=True)
    for kw in ({"seed": 5, "epoch": 2}, {"shuffle": False}, {"buffer_rows": 1}):
        for a, b in zip(
            lazy.batches(7, with_index=True, **kw),
            memory.batches(7, with_index=True, **kw),
            strict=True,
        ):
            assert torch.equal(a[2], b[2]) and torch.equal(a[1], b[1])
            for layer in layers:
                assert a[0][layer].dtype == b[0][layer].dtype == torch.float32
                assert torch.equal(a[0][layer], b[0][layer])


def test_layers_chunked_differently_are_read_in_whole_blocks(tmp_path):
    path = write_store(tmp_path / "m.h5", dims={"a": 8, "b": 3})
    with h5py.File(path, "r+") as f:  # rechunk b: 5-row chunks against a's 16
        values, attrs = f["features/b"][:], dict(f["features/b"].attrs)
        del f["features/b"]
        f["features"].create_dataset("b", data=values, chunks=(5, 3)).attrs.update(attrs)
        seal(f)  # as if written so
    dataset = FeatureDataset(path, ["a", "b"], dtype=None)
    assert dataset.block_rows == 16
    store = FeatureStore(path)
    features, _, rows = collect(
        (torch.cat([f["a"], f["b"]], 1), y, i)
        for f, y, i in dataset.batches(9, buffer_rows=32, with_index=True)
    )
    assert sorted(rows.tolist()) == list(range(203))
    assert torch.equal(features[:, :8], store.read("a", rows.numpy()))
    assert torch.equal(features[:, 8:], store.read("b", rows.numpy()))


def test_shuffled_batches_in_two_workers_give_every_row_once_per_epoch(rows_path):
    dataset = FeatureDataset(rows_path, "a")
    direct = FeatureStore(rows_path).read("a").float()
    shuffled = dataset.shuffled(10, seed=2, with_index=True)
    assert isinstance(shuffled, ShuffledBatches)
    # One process: exactly the batches of dataset.batches for the same seed and epoch.
    shuffled.set_epoch(4)
    assert torch.equal(
        collect(shuffled)[2], collect(dataset.batches(10, seed=2, epoch=4, with_index=True))[2]
    )
    shuffled.set_epoch(0)
    loader = DataLoader(shuffled, batch_size=None, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in (0, 1, 0):
        shuffled.set_epoch(epoch)  # reaches the persistent workers through shared memory
        features, labels, rows = collect(loader)
        assert sorted(rows.tolist()) == list(range(203))
        assert torch.equal(features, direct[rows]) and torch.equal(labels, rows % 7)
        orders.append(rows.tolist())
    assert orders[0] == orders[2] != orders[1]


def test_chunk_cache_is_none_for_plain_or_checksummed_chunks_and_holds_compressed_ones(
    tmp_path,
):
    plain = FeatureDataset(write_store(tmp_path / "p.h5", checksum=False), "a")
    assert plain.features("a").id.get_access_plist().get_chunk_cache()[:2] == (0, 0)
    # Checksummed chunks are checked once by featcache and then read row by row.
    summed = FeatureDataset(write_store(tmp_path / "s.h5"), "a")
    assert summed.features("a").id.get_access_plist().get_chunk_cache()[:2] == (0, 0)
    path = write_store(
        tmp_path / "c.h5", 600, {"a": 1024}, chunk_rows=512, dtype="float32", compression="gzip"
    )
    compressed = FeatureDataset(path, "a")  # 2 MiB chunks: a cache of 4 of them
    nslots, nbytes, _ = compressed.features("a").id.get_access_plist().get_chunk_cache()
    assert nbytes == 4 * 512 * 1024 * 4 and nslots >= 400
    assert all(nslots % d for d in range(2, int(nslots**0.5) + 1))  # prime
    rows = [599, 3, 512, 511, 3]
    kept = FeatureStore(path)  # open meanwhile, it holds no compressed layer open
    direct = kept.read("a", rows)
    assert torch.equal(torch.stack([x for x, _ in compressed.__getitems__(rows)]), direct)
    compressed.close()
    sized = FeatureDataset(path, "a", chunk_cache=32 << 20)
    assert sized.features("a").id.get_access_plist().get_chunk_cache()[1] == 32 << 20
    kept.close()
    clone = pickle.loads(pickle.dumps(sized))
    assert not clone._handle.is_open and clone._spare is None
    assert clone.features("a").id.get_access_plist().get_chunk_cache()[1] == 32 << 20


def test_incomplete_store_is_refused_or_read_up_to_its_durable_rows(tmp_path):
    path = tmp_path / "i.h5"
    writer = StoreWriter(StorePlan(path, 100, ids_width=6, dtype="float16", chunk_rows=16))
    index = np.arange(48)  # three whole chunks of 16 rows: all durable
    values = np.random.default_rng(0).standard_normal((48, 8)).astype(np.float16)
    writer.append(index, [f"{i:06d}" for i in index], index % 7, {"a": values})
    writer.close(complete=False)
    with pytest.raises(FeatcacheError, match="incomplete .48 rows written"):
        FeatureDataset(path, "a")
    dataset = FeatureDataset(path, "a", allow_incomplete=True, dtype=None)
    assert len(dataset) == 48
    assert torch.equal(dataset[-1][0], torch.from_numpy(values[47]))
    with pytest.raises(IndexError):
        dataset[48]
    features, labels, rows = collect(dataset.batches(16, with_index=True))
    assert sorted(rows.tolist()) == list(range(48))
    assert torch.equal(features, torch.from_numpy(values)[rows])
    # The same file copied to a store's name is still incomplete, and refused as such.
    copied = tmp_path / "copied.h5"
    shutil.copyfile(partial_path(path), copied)
    for reader in (FeatureStore, lambda p: FeatureDataset(p, "a")):
        with pytest.raises(IncompleteStoreError, match=r"copied.h5 is incomplete \(48 rows"):
            reader(copied)
    assert len(FeatureDataset(copied, "a", allow_incomplete=True)) == 48


def test_a_partial_named_beside_an_older_complete_store_is_read_alone(tmp_path):
    # An interrupted --overwrite: the old store stays complete, the new run's rows are in
    # its .partial; each, named, must be read whole and alone.
    path = tmp_path / "s.h5"
    index = np.arange(40)
    for values, complete in ((1.0, True), (-1.0, False)):
        writer = StoreWriter(StorePlan(path, 40, ids_width=4, dtype="float32", chunk_rows=8))
        rows = index if complete else index[:24]
        features = np.full((len(rows), 3), values, np.float32)
        writer.append(rows, [f"r{i}" for i in rows], (rows + complete) % 2, {"a": features})
        writer.close(complete=complete)
    partial = partial_path(path)
    with pytest.raises(IncompleteStoreError, match="24 rows written, in s.h5.partial; the s.h5"):
        FeatureStore(partial)
    with pytest.raises(IncompleteStoreError):
        FeatureDataset(partial, "a")
    for in_memory in (False, True):
        new = FeatureDataset(partial, "a", allow_incomplete=True, in_memory=in_memory)
        features, labels, rows = collect(new.batches(8, shuffle=False, with_index=True))
        assert len(new) == 24 and rows.tolist() == list(range(24))
        assert torch.equal(features, torch.full((24, 3), -1.0))
        assert labels.tolist() == [i % 2 for i in range(24)]
    old = FeatureDataset(path, "a")
    assert len(old) == 40 and torch.equal(old[5][0], torch.ones(3)) and old[5][1] == 0


def test_getitems_reads_any_order_and_repeats(store_path):
    dataset = FeatureDataset(store_path, "layer2", dtype=None)
    rows = [10, 3, 9, 4, 4, 19, 0, 5, 6]
    got = torch.stack([x for x, _ in dataset.__getitems__(rows)])
    assert torch.equal(got, FeatureStore(store_path).read("layer2", rows))
    assert dataset.__getitems__([]) == []


def test_bad_batch_options_are_refused(rows_path):
    dataset = FeatureDataset(rows_path, "a")
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        dataset.batches(0)
    with pytest.raises(ValueError, match="buffer_rows must be at least 1"):
        dataset.batches(4, buffer_rows=0)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        ShuffledBatches(dataset, 0)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"layers": 123}, r"^layers must be a layer key or a list of them, got 123$"),
        ({"layers": ["a", 1]}, r"^layers must be a layer key or a list of them"),
        ({"layers": "a", "dtype": "float64"}, r"^dtype must be a torch.dtype such as torch.f"),
        ({"layers": "a", "path": None}, r"^FeatureDataset takes a store path, got NoneType$"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(rows_path, arguments, message):
    arguments = {"path": rows_path, **arguments}
    with pytest.raises(ConfigError, match=message):
        FeatureDataset(arguments.pop("path"), **arguments)


SPAWNED_EPOCH = """
import sys
from torch.utils.data import DataLoader
from featcache import FeatureDataset
if __name__ == "__main__":
    dataset = FeatureDataset(sys.argv[1], "a", dtype=None)
    loader = DataLoader(dataset, batch_size=40, num_workers=1, multiprocessing_context="spawn")
    print("rows", sum(len(features) for features, _ in loader))
"""


def test_an_epoch_in_a_spawned_worker_over_a_torchrun_store_ends_cleanly(tmp_path):
    """A spawned DataLoader worker exiting with a combined store open crashed (SIGSEGV)
    in HDF5's shutdown until featcache closed its handles at exit."""
    from featcache.extraction.distributed import combine_shards

    shards = [write_store(tmp_path / f"s{i}.h5", 50 + 7 * i) for i in range(2)]
    combine_shards(tmp_path / "all.h5", shards).close()
    script = tmp_path / "epoch.py"
    script.write_text(SPAWNED_EPOCH)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "all.h5")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["rows", "107"]


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_a_combined_store_opens_its_virtual_dataset_for_the_first_read_only(
    tmp_path, monkeypatch, compression
):
    """Later reads go straight to the shards: opening a virtual dataset costs more than a
    one-row read."""
    from featcache.extraction.distributed import combine_shards

    shards = [
        write_store(tmp_path / f"s{i}.h5", 50 + 7 * i, compression=compression) for i in range(2)
    ]
    combine_shards(tmp_path / "all.h5", shards).close()
    opened: list[str] = []
    real_init = h5py.Dataset.__init__

    def counting(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if self.is_virtual:
            opened.append(self.name)

    monkeypatch.setattr(h5py.Dataset, "__init__", counting)
    direct = torch.cat([FeatureStore(shard).read("a") for shard in shards])
    store = FeatureStore(tmp_path / "all.h5")
    dataset = FeatureDataset(tmp_path / "all.h5", "a", dtype=None)
    store.read("a", [0])
    dataset[0]
    opened.clear()
    for row in (60, 3, 106, 49, 50):
        assert torch.equal(store.read("a", [row]), direct[[row]])
        assert torch.equal(dataset[row][0], direct[row])
    assert opened == []
    store.close()
    dataset.close()


def test_virtual_store_over_shards_reads_like_one_file(tmp_path):
    from featcache.extraction.distributed import combine_shards

    shards = [write_store(tmp_path / f"s{i}.h5", 50 + 7 * i) for i in range(2)]
    combine_shards(tmp_path / "all.h5", shards).close()
    dataset = FeatureDataset(tmp_path / "all.h5", "a", dtype=None)
    direct = torch.cat([FeatureStore(shard).read("a") for shard in shards])
    features, _, rows = collect(dataset.batches(16, with_index=True))
    assert sorted(rows.tolist()) == list(range(107))
    assert torch.equal(features, direct[rows])
    assert torch.equal(dataset[60][0], direct[60])
