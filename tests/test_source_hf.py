"""The hf source over real CIFAR-10 JPEGs saved as a Hugging Face dataset."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import featcache
from featcache.config.spec import DataSpec
from featcache.errors import ConfigError
from featcache.sources import build_source
from tests.cifar_formats import (
    CLASSES,
    WordLengths,
    assert_same_as_imagefolder,
    config,
    extract_images,
    write_hf,
)

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> tuple[Path, list]:
    """Images in a folder, the same images as a saved DatasetDict, the imagefolder store."""
    root = tmp_path_factory.mktemp("cifar")
    rows = extract_images(root / "images")
    write_hf(rows, root / "saved")
    data = {"source": "imagefolder", "root": str(root), "splits": {"train": "images"}}
    featcache.extract_from_config(config(data, root / "reference"))
    return root, rows


def hf(root: Path, dataset: str = "saved", **options) -> DataSpec:
    return DataSpec(
        source="hf", root=str(root), dataset=dataset, splits={"train": "train"}, **options
    )


def test_same_features_labels_and_order_as_imagefolder(cifar, tmp_path):
    root, _ = cifar
    data = {
        "source": "hf",
        "root": str(root),
        "dataset": "saved",
        "splits": {"train": "train"},
        "id_column": "id",
    }
    loader = {"batch_size": 16, "num_workers": 2}
    store = featcache.extract_from_config(config(data, tmp_path / "out", loader=loader))["train"]
    assert store.complete and store.class_names == list(CLASSES)
    assert_same_as_imagefolder(store.path, root / "reference" / "train.h5")


def test_defaults_ids_classes_and_pickling(cifar):
    root, rows = cifar
    source = build_source(hf(root), "train", None)
    assert len(source) == 200 and source.has_labels
    assert source.ids[:2] == ["saved/train/0", "saved/train/1"]
    assert source.class_names == list(CLASSES)
    image, label = source[199]
    assert image.mode == "RGB" and image.size == (32, 32) and label == rows[199][1]
    assert len(pickle.dumps(source)) < 20_000  # the Arrow files' paths, not their rows
    assert pickle.loads(pickle.dumps(source))[3][1] == rows[3][1]
    source.decode_size = 16  # as build_source sets FileSource.decode_size
    assert source[0][0].size == (16, 16)
    again = build_source(hf(root), "train", None)
    assert again.fingerprint() == source.fingerprint()


def test_one_saved_dataset_and_other_column_kinds(tmp_path, cifar):
    _, rows = cifar
    table = {
        "name": [f"n{i}" for i in range(6)],
        "png": [r[2] for r in rows[:6]],  # raw bytes, not an Image feature
        "kind": ["b", "a", "b", "c", "a", "a"],
    }
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "one"))
    data = DataSpec(
        source="hf", dataset=str(tmp_path / "one"), splits={"x": "anything"},
        image_column="png", label_column="kind", id_column="name",
    )  # fmt: skip
    source = build_source(data, "x", None)
    assert source.ids == table["name"] and source.class_names == ["a", "b", "c"]
    assert [source[i][1] for i in range(6)] == [1, 0, 1, 2, 0, 0]
    unlabelled = build_source(
        DataSpec(source="hf", dataset=str(tmp_path / "one"), image_column="png"), "train", None
    )
    assert not unlabelled.has_labels and unlabelled[0][1] == -1
    with pytest.raises(
        ConfigError,
        match=r"no column of one split train is an Image feature; set data.image_column; "
        r"its columns: name \(Value\), png \(Value\), kind \(Value\)",
    ):
        build_source(DataSpec(source="hf", dataset=str(tmp_path / "one")), "train", None)


def test_missing_columns_and_splits_are_named(cifar):
    root, _ = cifar
    with pytest.raises(
        ConfigError,
        match=r"data.label_column 'labels' is not a column of saved split train; "
        "its columns: id, img, label",
    ):
        build_source(hf(root, label_column="labels"), "train", None)
    with pytest.raises(
        ConfigError,
        match=r"data.image_column 'image' is not a column .*its columns: id, img, label",
    ):
        build_source(hf(root, image_column="image"), "train", None)
    data = DataSpec(source="hf", root=str(root), dataset="saved", splits={"test": "test"})
    with pytest.raises(ConfigError, match=r"has no split 'test'; its splits: train"):
        build_source(data, "test", None)
    with pytest.raises(ConfigError, match="not a folder written by save_to_disk"):
        build_source(hf(root, dataset="images"), "train", None)
    with pytest.raises(ConfigError, match="both set"):
        build_source(hf(root, image_column="img", text_column="id"), "train", None)


def test_a_hub_dataset_not_in_the_cache_names_the_download_command(tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
        monkeypatch.setattr(datasets.config, name, True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    data = DataSpec(source="hf", dataset="uoft-cs/cifar10", splits={"train": "train"})
    with pytest.raises(ConfigError) as info:
        build_source(data, "train", None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot load Hugging Face dataset 'uoft-cs/cifar10' split 'train'")
    assert message.endswith(
        "on a machine with internet: "
        """python -c "import datasets; datasets.load_dataset('uoft-cs/cifar10')\""""
    )


def test_unlabelled_classlabel_rows_mean_no_labels(tmp_path, cifar):
    _, rows = cifar
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    )
    table = {"img": [{"bytes": r[2], "path": None} for r in rows[:3]], "label": [-1, -1, -1]}
    datasets.DatasetDict(
        {"test": datasets.Dataset.from_dict(table, features=features)}
    ).save_to_disk(str(tmp_path / "d"))
    source = build_source(
        DataSpec(source="hf", dataset=str(tmp_path / "d"), splits={"test": "test"}), "test", None
    )
    assert (
        not source.has_labels and np.asarray([source[i][1] for i in range(3)]).tolist() == [-1] * 3
    )


def test_a_text_column_makes_a_text_source(tmp_path):
    table = {"sentence": ["a bb", "ccc dddd eeeee"], "label": [1, 0]}
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
    )
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(tmp_path / "sst"))
    folder = str(tmp_path / "sst")
    data = DataSpec(source="hf", dataset=folder, text_column="sentence", max_length=2)
    source = build_source(data, "train", None, tokenizer=WordLengths())
    assert source.class_names == ["neg", "pos"] and source.ids == ["sst/train/0", "sst/train/1"]
    tokens, label = source[1]
    assert tokens["input_ids"].tolist() == [4, 5] and label == 0  # cut to max_length 2
