"""Linear probes on real data: CIFAR-10 JPEGs and MNIST through a pretrained CIFAR ResNet-20.

Uses ../shared/data (skips with the reason when it is absent). The stores are built with
featcache itself; about a minute on 2 CPU cores.
"""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import featcache
from featcache.probe import evaluate, knn, probe
from tests.cifar_resnet import resnet20
from tests.conftest import shared_file, unpack

WEIGHTS = "weights/resnet20-12fca82f.th"
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def cifar_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Average-pooled layer3 of the pretrained ResNet-20 over the CIFAR-10 JPEGs:
    the 10,000 train images (1,000 per class) and all 10,000 test images."""
    archive = shared_file("cifar10-jpeg.tar")
    weights = shared_file(WEIGHTS)
    root = tmp_path_factory.mktemp("cifar")
    unpack(archive, root)
    config = {
        "model": {
            "factory": "tests.cifar_resnet:resnet20",
            "checkpoint": str(weights),
            "strip_prefix": "module.",
        },
        "layers": [{"name": "layer3", "reduce": "avg"}],
        "data": {
            "source": "imagefolder",
            "root": str(root / "cifar10-jpeg"),
            "splits": ["train", "test"],
        },
        "preprocess": {"mean": MEAN, "std": STD},  # the images are 32x32 already
        "loader": {"batch_size": 256},
        "store": {"dtype": "float32"},
        "output": {"dir": str(root / "features")},
        "runtime": {"progress": False},
    }
    stores = featcache.extract_from_config(config)
    return {split: store.path for split, store in stores.items()}


def test_cifar10_probe_on_pretrained_layer3_beats_80_percent(cifar_stores):
    start = time.perf_counter()
    result = probe(cifar_stores["train"], "layer3", test=cifar_stores["test"], progress=False)
    seconds = time.perf_counter() - start

    # The network's own classifier on the same stored features (they are linear's input).
    checkpoint = torch.load(shared_file(WEIGHTS), map_location="cpu", weights_only=True)[
        "state_dict"
    ]
    test = featcache.FeatureStore(cifar_stores["test"])
    logits = test.read("layer3") @ checkpoint["module.linear.weight"].T
    own = (logits + checkpoint["module.linear.bias"]).argmax(1)
    own_top1 = (own.numpy() == test.labels).mean()
    print(
        f"\nCIFAR-10 JPEG, ResNet-20 avg-pooled layer3 [64]: probe test top-1 "
        f"{result.test['top1']:.4f}, top-5 {result.test['top5']:.4f} (lambda {result.lam:.2e}, "
        f"val top-1 {result.val['top1']:.4f}, {result.n_train}/{result.n_val}/{result.n_test} "
        f"rows); the network's own classifier {own_top1:.4f}; probe {seconds:.1f} s"
    )
    assert 0.79 < own_top1 < 0.83  # the stored features are the ones the classifier sees
    assert result.test["top1"] > 0.80
    assert result.test["top5"] > 0.97
    assert result.n_test == 10_000 and result.num_classes == 10
    assert set(result.test["per_class"]) == set(test.class_names)
    for role in ("train", "test"):  # every number traces back to its features
        info = result.stores[role]
        assert info["config_fingerprint"] and info["dataset_fingerprint"]
        assert len(info["features_sha256"]) == 64


def test_cifar10_knn_and_few_shot_beside_the_linear_probe(cifar_stores):
    """Weighted k-NN on every train row, and 1- and 10-shot probes over 3 draws, on the
    same features: sensible accuracies, ordered as the amount of data says."""
    train, test = cifar_stores["train"], cifar_stores["test"]
    nn = knn(train, "layer3", test=test, progress=False)
    few = evaluate(
        train,
        "layer3",
        test=test,
        methods="linear,knn",
        shots=[1, 10],
        draws=3,
        ks=[10, 20],
        progress=False,
    )
    by = {(r.method, r.shots): r.top1 for r in few}
    print(
        "\nCIFAR-10 JPEG, ResNet-20 avg-pooled layer3: k-NN test top-1 "
        + ", ".join(f"k={k} {m['top1']:.4f}" for k, m in sorted(nn.metrics.items()))
        + "; few-shot mean top-1 over 3 draws: "
        + ", ".join(f"{method} {shots}-shot {top1:.4f}" for (method, shots), top1 in by.items())
    )
    assert nn.n_train == 10_000 and nn.n_test == 10_000
    assert nn.metrics[20]["top1"] > 0.78 and nn.metrics[200]["top5"] > 0.97
    for method in ("linear", "knn"):
        assert 0.3 < by[(method, 1)] < by[(method, 10)] < nn.metrics[20]["top1"] + 0.02
        assert by[(method, 10)] > 0.7


def _mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """The MNIST test set as normalised float32 [10000, 3, 32, 32] (padded, grey repeated)
    and int64 labels [10000]."""
    folder = shared_file("mnist-test")
    with gzip.open(folder / "t10k-images-idx3-ubyte.gz", "rb") as f:
        raw = f.read()
    magic, n, rows, cols = np.frombuffer(raw[:16], dtype=">i4")
    assert magic == 2051
    images = np.frombuffer(raw[16:], dtype=np.uint8).reshape(n, rows, cols)
    labels_raw = (folder / "t10k-labels-idx1-ubyte").read_bytes()
    assert np.frombuffer(labels_raw[:4], dtype=">i4")[0] == 2049
    labels = torch.from_numpy(np.frombuffer(labels_raw[8:], dtype=np.uint8).astype(np.int64))
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    x = torch.nn.functional.pad(x, (2, 2, 2, 2)).unsqueeze(1).repeat(1, 3, 1, 1)
    x = (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
    return x, labels


def _pretrained() -> torch.nn.Module:
    state = torch.load(shared_file(WEIGHTS), map_location="cpu", weights_only=True)["state_dict"]
    model = resnet20()
    model.load_state_dict({key.removeprefix("module."): value for key, value in state.items()})
    return model


def _random() -> torch.nn.Module:
    torch.manual_seed(0)
    return resnet20()


def test_mnist_transfer_pretrained_beats_random_weights(tmp_path):
    """MNIST test set split 5,000 / 5,000 (seeded); a probe on pretrained features must
    beat the same probe on features of the same network with random weights."""
    x, y = _mnist()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    halves = {"train": order[:5000], "test": order[5000:]}
    top1, seconds = {}, {}
    for name, build in (("pretrained", _pretrained), ("random", _random)):
        model = build()
        paths = {}
        for split, rows in halves.items():
            paths[split] = tmp_path / name / f"{split}.h5"
            featcache.extract(
                model,
                TensorDataset(x[rows], y[rows]),
                [{"name": "layer3", "reduce": "avg"}],
                paths[split],
                ids=[f"mnist-t10k:{i}" for i in rows.tolist()],
                class_names=[str(d) for d in range(10)],
                batch_size=256,
                dtype="float32",
                progress=False,
            )
        start = time.perf_counter()
        result = probe(paths["train"], "layer3", test=paths["test"], progress=False)
        seconds[name] = time.perf_counter() - start
        top1[name] = result.test["top1"]
    print(
        f"\nMNIST (5,000 train / 5,000 test), ResNet-20 avg-pooled layer3: probe test top-1 "
        f"pretrained {top1['pretrained']:.4f} ({seconds['pretrained']:.1f} s), "
        f"random weights {top1['random']:.4f} ({seconds['random']:.1f} s)"
    )
    assert top1["pretrained"] > 0.80
    assert top1["pretrained"] - top1["random"] >= 0.10
