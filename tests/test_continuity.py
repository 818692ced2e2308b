"""A run continues a store only when a few stored rows, recomputed, come out the same."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import ConcatDataset, Subset

import featcache
from featcache.errors import ConfigError, FeatcacheError
from featcache.store import FeatureStore, partial_path
from tests.stores import durable_rows
from tests.test_resume import assert_same_store

CLASSES = ("cat", "dog", "fox")


def _image_folder(root: Path, seed: int, per_class: int = 20) -> Path:
    """An ImageFolder of 36x36 JPEGs, the same file names whatever the seed."""
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:04d}.jpg", quality=90)
    return root


# The user's script: an ImageFolder with its own transform, through the Python API. Each
# sample sleeps a little, so that a kill lands while the run is under way.
SCRIPT = textwrap.dedent(
    """
    import featcache  # first
    import sys, time, torch, torchvision
    from torchvision import transforms as T

    class Slow:
        def __call__(self, image):
            time.sleep(float(sys.argv[4]))
            return image

    torch.manual_seed(0)
    tf = T.Compose([Slow(), T.Resize(int(sys.argv[3])), T.ToTensor()])
    ds = torchvision.datasets.ImageFolder(sys.argv[1], transform=tf)
    featcache.extract(torchvision.models.resnet18(), ds, [{"name": "layer3", "reduce": "avg"}],
                      sys.argv[2], batch_size=10, chunk_rows=10, num_workers=0, progress=False)
    """
)


def _run(script: Path, folder: Path, store: Path, size: int, sleep: float = 0.0):
    return subprocess.run(
        [sys.executable, str(script), str(folder), str(store), str(size), str(sleep)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _killed_mid_run(script: Path, folder: Path, store: Path, size: int) -> int:
    """Run the script until some rows are durable, kill -9 it; the durable rows."""
    process = subprocess.Popen(
        [sys.executable, str(script), str(folder), str(store), str(size), "0.02"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = partial_path(store)
    deadline = time.monotonic() + 120
    rows = 0
    try:
        while time.monotonic() < deadline and process.poll() is None and rows < 10:
            time.sleep(0.05)
            rows = durable_rows(partial)
    finally:
        process.kill()
        process.wait()
    assert rows >= 10 and not store.exists(), "the kill did not land mid-run"
    return rows


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Two ImageFolders of the same length and file names, other pixels; the script."""
    root = tmp_path_factory.mktemp("continuity")
    script = root / "run.py"
    script.write_text(SCRIPT)
    return _image_folder(root / "test", 1), _image_folder(root / "train", 2), script


@pytest.mark.slow
def test_a_killed_run_resumes_over_its_own_data_only(folders, tmp_path):
    """Killed mid-run, then rerun over another folder of the same file names and another
    transform: refused in one line, nothing written. Rerun over its own data: the rows of
    an uninterrupted run."""
    import torchvision
    from torchvision import transforms as T

    test_folder, train_folder, script = folders
    store = tmp_path / "mix.h5"
    _killed_mid_run(script, test_folder, store, 32)
    refused = _run(script, train_folder, store, 48)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert "ConfigError: cannot resume" in last
    assert "row 0 (id 'cat/0000.jpg'), layer 'layer3': values differ by" in last
    assert "--overwrite (overwrite=True in Python)" in last and "another path" in last
    assert partial_path(store).exists() and not store.exists()

    resumed = _run(script, test_folder, store, 32)
    assert resumed.returncode == 0, resumed.stderr
    torch.manual_seed(0)  # as the script builds its model
    model = torchvision.models.resnet18()
    folder = torchvision.datasets.ImageFolder(
        test_folder, transform=T.Compose([T.Resize(32), T.ToTensor()])
    )
    options = {"batch_size": 10, "chunk_rows": 10, "num_workers": 0, "progress": False}
    layers = [{"name": "layer3", "reduce": "avg"}]
    reference = featcache.extract(model, folder, layers, tmp_path / "reference.h5", **options)
    assert_same_store(store, reference.path)
    assert FeatureStore(store).ids[:2] == ["cat/0000.jpg", "cat/0001.jpg"]


class Images(torch.utils.data.Dataset):
    """30 seeded 32x32 images with labels; ``offset`` shifts every pixel."""

    def __init__(self, offset: float = 0.0, fail_at: int | None = None):
        self.offset = offset
        self.fail_at = fail_at
        self.ids = [f"img/{i}" for i in range(30)]

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise RuntimeError("simulated crash")
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 32, 32, generator=g) + self.offset, i % 3


LAYERS = [{"name": "layer2"}, {"name": "layer3", "reduce": "avg"}]
OPTIONS = {"batch_size": 4, "chunk_rows": 4, "progress": False, "num_workers": 0}


def test_a_finished_store_is_returned_by_a_rerun_of_the_same_computation(resnet18, tmp_path):
    path = tmp_path / "s.h5"
    first = featcache.extract(resnet18, Images(), LAYERS, path, **OPTIONS)
    rows = first.read("layer2")
    first.close()
    again = featcache.extract(resnet18, Images(), LAYERS, path, **OPTIONS)
    assert torch.equal(again.read("layer2"), rows)


def test_a_finished_store_of_other_data_under_the_same_ids_is_refused(resnet18, tmp_path):
    path = tmp_path / "s.h5"
    featcache.extract(resnet18, Images(), LAYERS, path, **OPTIONS).close()
    with pytest.raises(ConfigError, match=r"^store .*s\.h5 was not made by this computation: row"):
        featcache.extract(resnet18, Images(offset=0.5), LAYERS, path, **OPTIONS)
    store = featcache.extract(resnet18, Images(offset=0.5), LAYERS, path, overwrite=True, **OPTIONS)
    assert store.complete


def test_a_resume_compares_per_token_rows_too(tmp_path):
    """Per-token rows of a text model: a resume over other texts of the same ids and
    lengths is refused; over the same texts, it ends as an uninterrupted run."""
    from tests.test_tokens import TEXTS, run, stopped_run, text_rows

    layers = ["encoder.layer.0"]
    options = {"chunk_rows": 2}
    path = tmp_path / "t.h5"
    model = stopped_run(text_rows(), layers, path, 3, **options)
    assert len(FeatureStore(path, allow_incomplete=True)) >= 4
    mirrored = text_rows([text[::-1] for text in TEXTS])
    with pytest.raises(ConfigError, match=r"cannot resume .*row \d .*layer 'encoder.layer.0'"):
        run(model, mirrored, layers, path, **options)
    run(model, text_rows(), layers, path, **options)
    reference = run(model, text_rows(), layers, tmp_path / "r.h5", **options)
    assert_same_store(path, reference.path)


def test_other_labels_under_the_same_ids_are_refused(resnet18, tmp_path):
    class Relabelled(Images):
        def __getitem__(self, i):
            image, label = super().__getitem__(i)
            return image, (label + 1) % 3

    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Images(fail_at=17), LAYERS, path, **OPTIONS)
    with pytest.raises(ConfigError, match=r"cannot resume .*row 0 \(id 'img/0'\): label 1 vs 0"):
        featcache.extract(resnet18, Relabelled(), LAYERS, path, **OPTIONS)


def test_image_folder_ids_and_classes_reach_the_store_through_subset(folders, tmp_path):
    import torchvision
    from torchvision import transforms as T

    test_folder, train_folder, _ = folders
    model = torchvision.models.resnet18().eval()
    transform = T.Compose([T.Resize(32), T.ToTensor()])
    folder = torchvision.datasets.ImageFolder(test_folder, transform=transform)
    subset = Subset(folder, [25, 3, 50])
    store = featcache.extract(model, subset, "layer1", tmp_path / "s.h5", progress=False)
    assert store.ids == ["dog/0005.jpg", "cat/0003.jpg", "fox/0010.jpg"]
    assert store.class_names == list(CLASSES)
    assert store.labels.tolist() == [1, 0, 2]
    both = ConcatDataset([folder, torchvision.datasets.ImageFolder(train_folder)])
    from featcache.extraction.dataset_info import dataset_classes, dataset_ids

    ids = dataset_ids(both)
    assert ids is not None and ids[0] == "test/cat/0000.jpg" and ids[60] == "train/cat/0000.jpg"
    assert dataset_classes(both) == list(CLASSES)
