"""FeatureDataset: lazy per-worker reads, batched reads, in-memory mode, labels."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

import featcache
from featcache import FeatureDataset, FeatureStore
from featcache.errors import ConfigError


@pytest.fixture
def store_path(resnet18, images, tmp_path):
    path = tmp_path / "s.h5"
    featcache.extract(
        resnet18,
        images,
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
    assert clone._file is None
    assert torch.equal(clone[0][0], first)


def test_missing_layer_is_named(store_path):
    with pytest.raises(
        ConfigError, match="layer 'layer4' is not in store .* it holds: layer3, layer2"
    ):
        FeatureDataset(store_path, "layer4")


def test_unlabeled_store_gives_minus_one(resnet18, tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, 32, 32))
    path = tmp_path / "u.h5"
    featcache.extract(resnet18, data, ["avgpool"], path, progress=False)
    dataset = FeatureDataset(path, "avgpool")
    assert not dataset.has_labels
    assert dataset[2][1].item() == -1


def test_store_reader_errors(tmp_path):
    with pytest.raises(ConfigError, match="store not found"):
        FeatureStore(tmp_path / "nope.h5")
    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5")
    with pytest.raises(ConfigError, match="not a readable HDF5 store"):
        FeatureStore(junk)
