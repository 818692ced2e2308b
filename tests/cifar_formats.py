"""Real CIFAR-10 JPEGs in every source format: an image folder, a saved Hugging Face
dataset, WebDataset shards and a Parquet file, all holding the same bytes in the same order.

Every format's store is compared with the imagefolder store over the same images.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from featcache.sources.tokenizer import Tokenized
from featcache.store import FeatureStore, partial_path
from tests.conftest import shared_file
from tests.stores import durable_rows

PER_CLASS = 20
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

# A tiny seeded run: resnet18 at 32 px, two taps.
BASE_CONFIG: dict[str, Any] = {
    "model": {"name": "resnet18"},
    "layers": [{"name": "layer1", "reduce": "avg"}, {"name": "avgpool", "reduce": "flatten"}],
    "preprocess": {"resize": 32, "crop": 32, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
    "loader": {"batch_size": 16, "num_workers": 0},
    "store": {"chunk_rows": 24},
    "runtime": {"progress": False, "device": "cpu"},
}


def config(data: dict[str, Any], out: Path, **sections: Any) -> dict[str, Any]:
    """:data:`BASE_CONFIG` reading ``data`` and writing into ``out``."""
    return {**BASE_CONFIG, "data": data, "output": {"dir": str(out)}, **sections}


def extract_images(folder: Path, per_class: int = PER_CLASS) -> list[tuple[str, int, bytes]]:
    """The first ``per_class`` train JPEGs of each class of ../shared/data/cifar10-jpeg.tar,
    written as ``folder/<class>/<name>.jpg``; returns ``(id, label, bytes)`` in imagefolder
    order (classes sorted, files sorted)."""
    archive = shared_file("cifar10-jpeg.tar")
    picked: dict[str, list[tuple[str, bytes]]] = {name: [] for name in CLASSES}
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = member.name.split("/")
            if len(parts) != 4 or parts[1] != "train" or not member.isfile():
                continue
            chosen = picked[parts[2]]
            if len(chosen) < per_class:
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                chosen.append((parts[3], data))
            if all(len(v) == per_class for v in picked.values()):
                break
    rows = []
    for label, name in enumerate(CLASSES):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for file, data in sorted(picked[name]):
            (folder / name / file).write_bytes(data)
            rows.append((f"{name}/{file}", label, data))
    return rows


def key_of(sample_id: str) -> str:
    """The WebDataset key of an imagefolder id: ``cat/0001.jpg`` -> ``cat/0001``."""
    return sample_id.rsplit(".", 1)[0]


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    rows: list[tuple[str, int, bytes]], folder: Path, shards: int = 4, prefix: str = "train"
) -> list[Path]:
    """``folder/<prefix>-00000{0..shards-1}.tar``: consecutive blocks of ``rows``, each
    sample a ``<key>.jpg`` and a ``<key>.cls`` member."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, block in enumerate(np.array_split(np.arange(len(rows)), shards)):
        path = folder / f"{prefix}-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in block:
                sample_id, label, data = rows[i]
                add_member(tar, f"{key_of(sample_id)}.jpg", data)
                add_member(tar, f"{key_of(sample_id)}.cls", str(label).encode())
        paths.append(path)
    return paths


def write_hf(rows: list[tuple[str, int, bytes]], folder: Path) -> Path:
    """A ``DatasetDict`` with split ``train`` (Image, ClassLabel and id features), saved
    with ``save_to_disk``."""
    import datasets

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "img": datasets.Image(),
            "label": datasets.ClassLabel(names=list(CLASSES)),
        }
    )
    table = {
        "id": [r[0] for r in rows],
        "img": [{"bytes": r[2], "path": None} for r in rows],
        "label": [r[1] for r in rows],
    }
    train = datasets.Dataset.from_dict(table, features=features)
    datasets.DatasetDict({"train": train}).save_to_disk(str(folder))
    return folder


def write_parquet(rows: list[tuple[str, int, bytes]], path: Path, row_group_size: int = 32) -> Path:
    """A Parquet file with columns id, image (bytes) and label (class names)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": [r[0] for r in rows],
            "image": pa.array([r[2] for r in rows], type=pa.binary()),
            "label": [CLASSES[r[1]] for r in rows],
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def read_store(path: Path) -> dict[str, Any]:
    """Ids, labels and every feature array of a store."""
    with h5py.File(path, "r") as f:
        out: dict[str, Any] = {
            "ids": [v.decode() if isinstance(v, bytes) else str(v) for v in f["ids"][()]],
            "labels": f["labels"][()] if "labels" in f else None,
        }
        for layer in f["features"]:
            out[layer] = f["features"][layer][()]
        out["class_names"] = f.attrs.get("class_names")
    return out


def assert_same_as_imagefolder(
    store: Path, reference: Path, to_reference_id: Any = lambda i: i
) -> None:
    """``store`` has the rows of the imagefolder ``reference`` store, in the same order,
    with equal features and labels; its ids map to the reference's through
    ``to_reference_id``."""
    got, want = read_store(store), read_store(reference)
    assert [to_reference_id(i) for i in got["ids"]] == want["ids"]
    np.testing.assert_array_equal(got["labels"], want["labels"])
    for layer in ("layer1", "avgpool"):
        assert got[layer].shape == want[layer].shape
        np.testing.assert_array_equal(got[layer], want[layer], err_msg=layer)


def killed_mid_run(config_file: Path, store: Path, rows: int, cwd: Path) -> int:
    """``featcache extract config_file`` in a subprocess, killed with SIGKILL once the
    partial ``store`` holds ``rows`` durable rows; returns the rows it kept."""
    command = [sys.executable, "-m", "featcache", "extract", str(config_file)]
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, written = time.monotonic() + 180, 0
    while process.poll() is None and time.monotonic() < deadline and written < rows:
        written = durable_rows(partial_path(store))
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read() if process.stderr else ""
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    return FeatureStore(store, allow_incomplete=True).rows_written


def slow_resnet18(delay: float = 0.1) -> torch.nn.Module:
    """A seeded resnet18 whose forward sleeps ``delay`` seconds per batch: a run long enough
    to be killed mid-way."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    model.register_forward_pre_hook(lambda module, args: time.sleep(delay))
    return model


class WordLengths:
    """A tokenizer for tests: one token per word, its length (plus 1; 0 pads)."""

    name, pad_id, max_length = "word-lengths", 0, 8

    def __call__(self, texts, max_length):
        ids = [[len(w) + 1 for w in t.split()] for t in texts]
        cut = [ids_[:max_length] if max_length else ids_ for ids_ in ids]
        return Tokenized(cut, [len(a) != len(b) for a, b in zip(ids, cut, strict=True)])
