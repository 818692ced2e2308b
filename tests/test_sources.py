from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import featcache  # noqa: F401  (imported before torchvision: it makes torchvision importable)

# isort: split
import torchvision
from torchvision import transforms

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources import IMAGE_EXTENSIONS, SourceDataset, build_source, load_rgb


@pytest.fixture
def transform():
    return transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])


def _check_image(image: torch.Tensor) -> None:
    assert isinstance(image, torch.Tensor)
    assert image.dtype == torch.float32
    assert image.shape == (3, 32, 32)
    assert image.min() >= 0.0 and image.max() <= 1.0


def _noise(size=(40, 30), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def _palette_image(transparent: bool) -> Image.Image:
    image = Image.new("P", (20, 20), 0)
    image.putpalette([200, 10, 10, 0, 0, 255] + [0, 0, 0] * 254)
    image.paste(1, (0, 0, 10, 20))
    if transparent:
        image.info["transparency"] = bytes([0, 128])  # per-entry alpha: a PNG tRNS table
    return image


# --- imagefolder ---------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """data/train/{birds,cats,dogs,empty}/... with one image mode per file."""
    split = tmp_path / "data" / "train"
    for name in ("birds", "cats/nested", "dogs", "empty/sub", ".ipynb_checkpoints"):
        (split / name).mkdir(parents=True)
    Image.fromarray(_noise()).save(split / "birds/i.bmp")
    Image.fromarray(_noise(seed=1)).save(split / "cats/a.jpg")
    Image.fromarray(_noise(seed=2)).save(split / "cats/b.JPG", format="JPEG")
    Image.fromarray(_noise(seed=3)).convert("L").save(split / "cats/c.png")
    _palette_image(transparent=False).save(split / "cats/nested/d.png")
    _palette_image(transparent=True).save(split / "dogs/e.png")
    Image.new("RGBA", (16, 16), (200, 10, 10, 0)).save(split / "dogs/f.png")
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(split / "dogs/g.jpg")
    Image.fromarray(np.full((8, 12), 32768, np.uint16)).save(split / "dogs/h.png")
    # Not images, or hidden: skipped.
    (split / "cats/notes.txt").write_text("not an image")
    (split / "cats/.hidden.jpg").write_bytes(b"")
    (split / "empty/sub/readme.md").write_text("nothing here")
    Image.fromarray(_noise()).save(split / ".ipynb_checkpoints/x.jpg")
    return tmp_path / "data"


EXPECTED_IDS = [
    "birds/i.bmp",
    "cats/a.jpg",
    "cats/b.JPG",
    "cats/c.png",
    "cats/nested/d.png",
    "dogs/e.png",
    "dogs/f.png",
    "dogs/g.jpg",
    "dogs/h.png",
]


def test_imagefolder_rows_labels_ids(tree, transform):
    ds = build_source(DataSpec(root=str(tree)), "train", transform)
    assert isinstance(ds, SourceDataset)
    assert len(ds) == len(ds.ids) == 9
    assert ds.ids == EXPECTED_IDS
    assert ds.class_names == ["birds", "cats", "dogs", "empty"]
    assert ds.has_labels
    labels = [ds[i][1] for i in range(len(ds))]
    assert labels == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert all(ds.class_names[y] == ds.ids[i].split("/")[0] for i, y in enumerate(labels))
    for i in range(len(ds)):
        _check_image(ds[i][0])
    assert torch.equal(ds[-1][0], ds[8][0])
    with pytest.raises(IndexError):
        ds[9]


def test_a_limit_is_a_source_of_rows_spread_over_the_split(tree, transform):
    full = build_source(DataSpec(root=str(tree), content_hash=True), "train", transform)
    ds = build_source(DataSpec(root=str(tree), content_hash=True, limit=4), "train", transform)
    taken = [0, 3, 5, 8]  # of 9: the first, the last and evenly between
    assert len(ds) == 4 and ds.ids == [EXPECTED_IDS[i] for i in taken]
    assert ds.labels == [0, 1, 2, 2] == [full.labels[i] for i in taken]  # birds, cats, dogs
    assert ds.class_names == full.class_names and repr(ds).startswith("SpreadRows(4 of")
    for i, row in enumerate(taken):
        assert torch.equal(ds[i][0], full[row][0]) and ds[i][1] == full[row][1]
    hashes = full.row_columns["content_hash"]
    assert ds.row_columns["content_hash"].tolist() == [hashes[i] for i in taken]
    stamps = getattr(full, "change_stamps", lambda: None)()
    assert getattr(ds, "change_stamps", lambda: None)() == (
        None if stamps is None else [stamps[i] for i in taken]
    )
    again = pickle.loads(pickle.dumps(ds))  # into DataLoader workers
    assert again.ids == ds.ids and torch.equal(again[1][0], ds[1][0])
    assert ds.fingerprint() == again.fingerprint() != full.fingerprint()
    wider = build_source(DataSpec(root=str(tree), limit=9), "train", transform)
    assert wider.ids == EXPECTED_IDS and type(wider) is type(full)  # all rows: the source


def test_imagefolder_split_subfolder_dot(tree, transform):
    ds = build_source(DataSpec(root=str(tree / "train"), splits={"all": "."}), "all", transform)
    assert ds.ids == EXPECTED_IDS


def test_imagefolder_follows_links_but_not_back_up_a_cycle(tree, transform):
    cats = tree / "train" / "cats"
    (cats / "loop").symlink_to("..", target_is_directory=True)  # train/cats/loop -> train
    (tree / "train" / "birds" / "more_dogs").symlink_to(tree / "train" / "dogs")
    ds = build_source(DataSpec(root=str(tree)), "train", transform)
    assert len(ds) == 9 + 4  # the linked dogs folder once; the loop not at all
    assert [i for i in ds.ids if i.startswith("birds/more_dogs/")] == [
        "birds/more_dogs/" + i.split("/", 1)[1] for i in EXPECTED_IDS if i.startswith("dogs/")
    ]


def test_a_file_name_that_is_not_utf8_is_named_in_one_line(tree, transform):
    cats = tree / "train" / "cats"
    image = (cats / sorted(os.listdir(cats))[0]).read_bytes()
    with open(os.path.join(os.fsencode(cats), b"caf\xe9.png"), "wb") as handle:  # Latin-1
        handle.write(image)
    with pytest.raises(ConfigError, match=r"^file name b'.*caf\\xe9.png' is not valid UTF-8"):
        build_source(DataSpec(root=str(tree)), "train", transform)


def test_splits_with_different_classes_are_refused_before_any_work(tree, tmp_path):
    val = tree / "val" / "dogs"
    val.mkdir(parents=True)
    Image.fromarray(_noise()).save(val / "d.png")
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer1", "reduce": "avg"}],
        "data": {"root": str(tree), "splits": {"train": "train", "val": "val"}},
        "preprocess": {"resize": 32, "crop": 32},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    with pytest.raises(ConfigError, match=r"^splits 'train' and 'val' have different classes"):
        featcache.extract_from_config(config)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    for name in ("birds", "cats", "empty"):  # the same class folders, empty ones too
        (tree / "val" / name).mkdir()
    stores = featcache.extract_from_config(config)
    assert stores["val"].class_names == stores["train"].class_names
    assert list(stores["val"].labels) == [2]


def test_imagefolder_modes_convert_to_rgb(tree):
    ds = build_source(DataSpec(root=str(tree)), "train", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. PIL's "Palette images with Transparency" warning
        images = dict(zip(ds.ids, (ds[i][0] for i in range(len(ds))), strict=True))
    assert all(image.mode == "RGB" for image in images.values())
    # Alpha is dropped, not composited: the colour under a fully transparent pixel stays.
    assert images["dogs/f.png"].getpixel((0, 0)) == (200, 10, 10)
    assert images["dogs/e.png"].getpixel((0, 0)) == (0, 0, 255)
    assert images["dogs/e.png"].getpixel((15, 0)) == (200, 10, 10)
    assert images["cats/nested/d.png"].getpixel((15, 0)) == (200, 10, 10)
    r, g, b = images["dogs/g.jpg"].getpixel((8, 8))  # CMYK (0, 255, 255, 0) is red
    assert r > 200 and g < 50 and b < 50
    # 16-bit grey 32768 scales to ~128; clipping would give 255.
    assert images["dogs/h.png"].getpixel((0, 0)) == (128, 128, 128)


def test_load_rgb_scales_16_and_32_bit(tmp_path):
    values = np.array([[0, 257 * 10, 32768, 65535]], np.uint16)
    Image.fromarray(values).save(tmp_path / "grey16.png")
    assert Image.open(tmp_path / "grey16.png").mode == "I;16"
    Image.fromarray(values.astype(np.int32)).save(tmp_path / "grey32.tif")
    assert Image.open(tmp_path / "grey32.tif").mode == "I"
    for name in ("grey16.png", "grey32.tif"):
        image = load_rgb(tmp_path / name)
        assert image.mode == "RGB"
        assert np.asarray(image)[0, :, 0].tolist() == [0, 10, 128, 255]
    Image.fromarray(np.array([[0.0, 0.5, 1.0]], np.float32)).save(tmp_path / "float.tif")
    with pytest.raises(FeatcacheError, match=r"float.tif: a 32-bit float image \(mode F\)"):
        load_rgb(tmp_path / "float.tif")  # PIL alone makes it black


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("empty.jpg", b"", "empty"),
        ("text.jpg", b"this is not a JPEG file\n" * 10, "cannot identify"),
        ("truncated.jpg", "truncate", "truncated"),
        ("missing.jpg", None, "not found"),
    ],
)
def test_load_rgb_errors(tmp_path, name, content, reason):
    path = tmp_path / name
    if content == "truncate":
        buffer = io.BytesIO()
        Image.fromarray(_noise((64, 64))).save(buffer, format="JPEG", quality=95)
        content = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(FeatcacheError) as info:
        load_rgb(path)
    message = str(info.value)
    assert message.startswith(f"cannot decode image {path}: ")
    assert reason in message
    assert "\n" not in message
    assert not isinstance(info.value, ConfigError)


def test_imagefolder_bad_image_fails_on_access(tree, transform):
    (tree / "train/cats/z.jpg").write_bytes(b"")
    ds = build_source(DataSpec(root=str(tree)), "train", transform)
    with pytest.raises(FeatcacheError, match="z.jpg: the file is empty"):
        ds[ds.ids.index("cats/z.jpg")]


def test_missing_root_and_split_folder(tmp_path, transform):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"data root not found: {missing}; set data.root"):
        build_source(DataSpec(root=str(missing)), "train", transform)
    with pytest.raises(ConfigError, match=f"data root not found: {tmp_path / 'train'}"):
        build_source(DataSpec(root=str(tmp_path)), "train", transform)
    with pytest.raises(ConfigError, match="unknown split 'test'; data.splits has: train"):
        build_source(DataSpec(root=str(tmp_path)), "test", transform)


def test_empty_split_folder(tmp_path, transform):
    (tmp_path / "train").mkdir()
    with pytest.raises(ConfigError) as info:
        build_source(DataSpec(root=str(tmp_path)), "train", transform)
    assert str(tmp_path / "train") in str(info.value) and ".jpg" in str(info.value)
    (tmp_path / "train/cats").mkdir()
    (tmp_path / "train/cats/a.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"no images .*\.png.*1 class folders"):
        build_source(DataSpec(root=str(tmp_path)), "train", transform)


def test_image_extensions():
    assert all(ext.startswith(".") and ext == ext.lower() for ext in IMAGE_EXTENSIONS)
    assert {".jpg", ".jpeg", ".png", ".webp"} <= set(IMAGE_EXTENSIONS)


# --- manifest ------------------------------------------------------------------------


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "root" / "imgs"
    folder.mkdir(parents=True)
    for i in range(4):
        Image.fromarray(_noise(seed=i)).save(folder / f"{i}.png")
    return tmp_path / "root"


def _manifest(root: Path, name: str, text: str, transform) -> SourceDataset:
    (root / name).write_text(text)
    return build_source(
        DataSpec(source="manifest", root=str(root), splits={"s": name}), "s", transform
    )


def test_manifest_csv_int_labels(images, transform):
    absolute = images / "imgs" / "3.png"
    text = f"path,label,note\nimgs/0.png,0,x\nimgs/1.png,2,y\n\n{absolute},1,z\n"
    ds = _manifest(images, "m.csv", text, transform)
    assert ds.ids == ["imgs/0.png", "imgs/1.png", str(absolute)]
    assert [ds[i][1] for i in range(3)] == [0, 2, 1]
    assert ds.has_labels and ds.class_names is None
    direct = transform(Image.open(images / "imgs/1.png").convert("RGB"))
    assert torch.equal(ds[1][0], direct)


def test_manifest_in_subfolder_paths_relative_to_manifest(images, transform):
    (images / "lists").mkdir()
    ds = _manifest(images, "lists/m.jsonl", '{"path": "../imgs/2.png", "label": 5}\n', transform)
    assert ds.ids == ["../imgs/2.png"] and ds[0][1] == 5
    _check_image(ds[0][0])


def test_manifest_jsonl_string_labels(images, transform):
    rows = [("imgs/0.png", "zebra"), ("imgs/1.png", "ant"), ("imgs/2.png", "zebra")]
    text = "\n".join(json.dumps({"path": p, "label": y}) for p, y in rows) + "\n\n"
    ds = _manifest(images, "m.jsonl", text, transform)
    assert ds.class_names == ["ant", "zebra"]
    assert [ds[i][1] for i in range(3)] == [1, 0, 1]
    assert ds.has_labels
    _check_image(ds[2][0])


def test_manifest_csv_string_labels(images, transform):
    ds = _manifest(images, "m.csv", "label,path\ncat,imgs/0.png\n7b,imgs/1.png\n", transform)
    assert ds.class_names == ["7b", "cat"]
    assert [ds[i][1] for i in range(2)] == [1, 0]


def test_manifest_fingerprint_covers_row_order_and_labels(images, transform):
    def fingerprint(text: str) -> str:
        return _manifest(images, "m.csv", text, transform).fingerprint(content=True)

    rows = ["imgs/0.png,cat", "imgs/1.png,dog", "imgs/2.png,cat"]
    first = fingerprint("path,label\n" + "\n".join(rows) + "\n")
    assert fingerprint("path,label\n" + "\n".join(rows) + "\n") == first
    # The same files in another order, or with other labels, are other rows.
    assert fingerprint("path,label\n" + "\n".join(rows[::-1]) + "\n") != first
    swapped = ["imgs/0.png,dog", "imgs/1.png,cat", "imgs/2.png,dog"]
    assert fingerprint("path,label\n" + "\n".join(swapped) + "\n") != first
    unlabeled = fingerprint("path\nimgs/0.png\nimgs/1.png\nimgs/2.png\n")
    assert unlabeled != first
    assert fingerprint("path\nimgs/2.png\nimgs/1.png\nimgs/0.png\n") != unlabeled


def test_imagefolder_fingerprint_follows_the_files(tree):
    spec = DataSpec(source="imagefolder", root=str(tree), splits={"train": "train"})
    before = build_source(spec, "train", None).fingerprint()
    Image.fromarray(_noise(size=(9, 9))).save(tree / "train/birds/i.bmp")  # another size
    assert build_source(spec, "train", None).fingerprint() != before


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("m.csv", "path\nimgs/0.png\nimgs/1.png\n"),
        ("m.jsonl", '{"path": "imgs/0.png"}\n{"path": "imgs/1.png", "label": null}\n'),
    ],
)
def test_manifest_without_labels(images, transform, name, text):
    ds = _manifest(images, name, text, transform)
    assert not ds.has_labels and ds.class_names is None
    assert [ds[i][1] for i in range(2)] == [-1, -1]
    _check_image(ds[0][0])


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("m.csv", "file,label\nimgs/0.png,1\n", "line 1: no 'path' column"),
        ("m.csv", "path,label\nimgs/0.png,1\nimgs/1.png,cat\n", "line 3: label 'cat'"),
        ("m.csv", "path,label\nimgs/0.png,1\nimgs/1.png,\nimgs/2.png,2\n", "line 3: no label"),
        ("m.csv", "path,label\nimgs/0.png,1\nimgs/9.png,1\n", "line 3: image not found"),
        ("m.csv", "path,label\nimgs/0.png,1,extra\n", "line 2: 3 cells"),
        ("m.jsonl", '{"path": "imgs/0.png"}\n\n{"path": "imgs/1.png"\n', "line 3: not valid JSON"),
        ("m.jsonl", '{"path": "imgs/0.png"}\n{"file": "imgs/1.png"}\n', "line 2: no 'path' key"),
        ("m.jsonl", '{"path": "imgs/0.png", "label": 1}\n{"path": "imgs/1.png"}\n', "line 2"),
        ("m.jsonl", '{"path": "imgs/0.png", "label": 1.5}\n', "line 1: label 1.5"),
        ("m.jsonl", '{"path": "imgs/0.png", "label": -1}\n', "line 1: label -1 must be >= 0"),
        ("m.jsonl", "\n", "has no rows"),
        ("m.txt", "imgs/0.png\n", "must be a .csv or .jsonl"),
    ],
)
def test_manifest_errors(images, transform, name, text, match):
    with pytest.raises(ConfigError, match=match) as info:
        _manifest(images, name, text, transform)
    assert str(images / name) in str(info.value)
    assert "\n" not in str(info.value)


def test_manifest_missing_file(images, transform):
    spec = DataSpec(source="manifest", root=str(images), splits={"train": "nope.csv"})
    with pytest.raises(ConfigError, match="manifest not found: .*nope.csv"):
        build_source(spec, "train", transform)


def test_file_sources_reject_kwargs(images, transform):
    spec = DataSpec(source="manifest", root=str(images), kwargs={"foo": 1})
    with pytest.raises(ConfigError, match=r"data.kwargs \(foo\) is not used"):
        build_source(spec, "train", transform)


# --- torchvision ---------------------------------------------------------------------

FAKE = {"size": 10, "image_size": [3, 20, 24], "num_classes": 3}


def test_torchvision_fakedata(transform):
    spec = DataSpec(source="torchvision", dataset="FakeData", kwargs=FAKE, splits={"train": {}})
    ds = build_source(spec, "train", transform)
    assert len(ds) == 10
    assert ds.ids == [f"FakeData:{i}" for i in range(10)]
    assert ds.has_labels and ds.class_names is None
    reference = torchvision.datasets.FakeData(**FAKE)
    for i in range(10):
        image, label = ds[i]
        _check_image(image)  # the transform resized 20x24 to 32x32
        ref_image, ref_label = reference[i]
        assert type(label) is int and label == int(ref_label)
        assert torch.equal(image, transform(ref_image))


def test_torchvision_split_mapping_and_kwargs(transform):
    spec = DataSpec(
        source="torchvision",
        dataset="FakeData",
        kwargs=FAKE,
        splits={"train": {}, "test": {"size": 4, "random_offset": 100}},
    )
    test = build_source(spec, "test", transform)
    assert len(test) == 4
    assert not torch.equal(test[0][0], build_source(spec, "train", transform)[0][0])


class TensorImages(torch.utils.data.Dataset):
    """Images as arrays and tensors in the layouts torchvision datasets use."""

    classes = ["grey", "colour", "chw"]

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i):
        if i == 0:
            return np.full((6, 5), 77, np.uint8), 0
        if i == 1:
            return np.full((6, 5, 3), (1, 2, 3), np.uint8), np.int64(1)
        return torch.full((3, 6, 5), 9, dtype=torch.uint8), torch.tensor(2)


def test_torchvision_image_folder_fingerprint_and_splits(tmp_path):
    for split, colour in (("train", 40), ("val", 200)):
        for label in ("cat", "dog"):
            (tmp_path / split / label).mkdir(parents=True)
            Image.new("RGB", (8, 8), (colour,) * 3).save(tmp_path / split / label / "a.png")
    # ImageFolder takes no split argument: one folder per split, or the splits would
    # all hold every image, labelled by split.
    named = DataSpec(source="torchvision", dataset="ImageFolder", root=str(tmp_path),
                     splits={"train": "train", "val": "val"})  # fmt: skip
    with pytest.raises(ConfigError, match="ImageFolder takes no split or train argument"):
        build_source(named, "train", None)
    spec = DataSpec(
        source="torchvision",
        dataset="ImageFolder",
        splits={"train": {"root": str(tmp_path / "train")}, "val": {"root": str(tmp_path / "val")}},
    )
    train, val = build_source(spec, "train", None), build_source(spec, "val", None)
    assert [train[i][0].getpixel((0, 0)) for i in range(2)] == [(40,) * 3] * 2
    assert val[0][0].getpixel((0, 0)) == (200,) * 3
    # The fingerprint follows the files, not only their number.
    before, before_content = train.fingerprint(), train.fingerprint(content=True)
    Image.new("RGB", (8, 8), (41,) * 3).save(tmp_path / "train" / "dog" / "a.png")
    again = build_source(spec, "train", None)
    assert again.fingerprint() == before  # same size: only the bytes tell
    assert again.fingerprint(content=True) != before_content
    (tmp_path / "train" / "dog" / "a.png").rename(tmp_path / "train" / "dog" / "b.png")
    assert build_source(spec, "train", None).fingerprint() != before


def test_torchvision_converts_arrays_and_tensors(monkeypatch):
    monkeypatch.setattr(torchvision.datasets, "TensorImages", TensorImages, raising=False)
    spec = DataSpec(source="torchvision", dataset="TensorImages", splits={"train": None})
    ds = build_source(spec, "train", None)
    assert ds.class_names == ["grey", "colour", "chw"]
    rows = [ds[i] for i in range(3)]
    assert [label for _, label in rows] == [0, 1, 2]
    assert all(image.mode == "RGB" and image.size == (5, 6) for image, _ in rows)
    assert [image.getpixel((0, 0)) for image, _ in rows] == [(77,) * 3, (1, 2, 3), (9,) * 3]


def test_torchvision_unknown_dataset(transform):
    with pytest.raises(ConfigError, match="unknown torchvision dataset 'FakeDat'.*FakeData"):
        build_source(DataSpec(source="torchvision", dataset="FakeDat"), "train", transform)
    with pytest.raises(ConfigError, match="did you mean .*CIFAR10"):
        build_source(DataSpec(source="torchvision", dataset="cifar10"), "train", transform)


def test_torchvision_not_on_disk(tmp_path, transform):
    spec = DataSpec(
        source="torchvision",
        dataset="CIFAR10",
        root=str(tmp_path),
        splits={"test": {"train": False}},
    )
    with pytest.raises(ConfigError) as info:
        build_source(spec, "test", transform)
    message = str(info.value)
    assert message.startswith(f"cannot open torchvision dataset CIFAR10 at {tmp_path}: ")
    assert "never downloads" in message and "download=True" not in message
    no_root = DataSpec(source="torchvision", dataset="CIFAR10")
    with pytest.raises(ConfigError, match="CIFAR10 needs data.root"):
        build_source(no_root, "train", transform)


def test_torchvision_bad_arguments(tmp_path, transform):
    def spec(**fields):
        return DataSpec(source="torchvision", dataset="CIFAR10", root=str(tmp_path), **fields)

    with pytest.raises(ConfigError, match="never downloads"):
        build_source(spec(kwargs={"download": True}), "train", transform)
    with pytest.raises(ConfigError, match="data.kwargs.transform"):
        build_source(spec(kwargs={"transform": None}), "train", transform)
    with pytest.raises(ConfigError, match="'val' is neither train nor test"):
        build_source(spec(splits={"val": "val"}), "val", transform)
    with pytest.raises(ConfigError, match="check data.kwargs"):
        build_source(spec(kwargs={"colour": 1}), "train", transform)


# --- synthetic -----------------------------------------------------------------------


def _synthetic(**splits) -> DataSpec:
    return DataSpec(source="synthetic", kwargs={"image_size": 16}, splits=splits)


def _pixels(ds: SourceDataset, i: int) -> np.ndarray:
    return np.asarray(ds[i][0])


def test_synthetic_deterministic_and_split_dependent():
    spec = _synthetic(train={"size": 20}, test={"size": 20})
    a, b = build_source(spec, "train", None), build_source(spec, "train", None)
    test = build_source(spec, "test", None)
    assert a.ids == [f"synthetic:{i}" for i in range(20)]
    assert a[3][0].mode == "RGB" and a[3][0].size == (16, 16)
    for i in (0, 7, 19):
        assert np.array_equal(_pixels(a, i), _pixels(b, i))
        assert not np.array_equal(_pixels(a, i), _pixels(test, i))
    assert np.array_equal(_pixels(a, 7), _pixels(a, 7))  # independent of access order
    seeded = build_source(_synthetic(train={"size": 20, "seed": 1}), "train", None)
    assert not np.array_equal(_pixels(a, 0), _pixels(seeded, 0))


def test_synthetic_options_and_balance(transform):
    kwargs = {"num_classes": 5, "size": 99}
    spec = DataSpec(source="synthetic", kwargs=kwargs, splits={"train": {"size": 50}})
    ds = build_source(spec, "train", transform)
    assert len(ds) == 50
    assert ds.class_names == [f"class_{k}" for k in range(5)]
    labels = [ds[i][1] for i in range(50)]
    assert labels[:6] == [0, 1, 2, 3, 4, 0]
    assert Counter(labels) == {k: 10 for k in range(5)}
    _check_image(ds[0][0])
    default = build_source(DataSpec(source="synthetic", splits={"train": "train"}), "train", None)
    assert len(default) == 256 and len(default.class_names) == 10
    assert default[0][0].size == (64, 64)


@pytest.mark.parametrize(
    ("kwargs", "split", "match"),
    [
        ({"colour": 1}, None, "unknown synthetic option data.kwargs.colour; known options"),
        ({}, {"colour": 1}, "unknown synthetic option data.splits.train.colour"),
        ({"size": 0}, None, "data.kwargs.size must be"),
        ({}, {"size": 0}, "data.splits.train.size must be"),  # named where it was given
    ],
)
def test_synthetic_bad_options(kwargs, split, match):
    spec = DataSpec(source="synthetic", kwargs=kwargs, splits={"train": split})
    with pytest.raises(ConfigError, match=match):
        build_source(spec, "train", None)


def test_synthetic_classes_are_separable():
    spec = _synthetic(train={"size": 200}, test={"size": 100})

    def colours(split):
        ds = build_source(spec, split, None)
        x = np.stack([_pixels(ds, i).reshape(-1, 3).mean(0) for i in range(len(ds))])
        return x, np.array([ds[i][1] for i in range(len(ds))])

    x, y = colours("train")
    means = np.stack([x[y == k].mean(0) for k in range(10)])
    gaps = np.linalg.norm(means[:, None] - means[None], axis=-1)[~np.eye(10, dtype=bool)]
    assert gaps.min() > 3 * x[y == 0].std(0).max()  # class means differ beyond the spread
    x_test, y_test = colours("test")
    nearest = np.linalg.norm(x_test[:, None] - means[None], axis=-1).argmin(1)
    assert (nearest == y_test).mean() > 0.9


# --- pickling and workers ------------------------------------------------------------


def test_sources_pickle(tree, images, transform):
    (images / "m.csv").write_text("path,label\nimgs/0.png,a\n")
    specs = [
        DataSpec(root=str(tree)),
        DataSpec(source="manifest", root=str(images), splits={"train": "m.csv"}),
        DataSpec(source="torchvision", dataset="FakeData", kwargs=FAKE, splits={"train": {}}),
        _synthetic(train={"size": 5}),
    ]
    for spec in specs:
        ds = build_source(spec, "train", transform)
        copy = pickle.loads(pickle.dumps(ds))
        assert copy.ids == ds.ids and copy.class_names == ds.class_names
        assert torch.equal(copy[0][0], ds[0][0]) and copy[0][1] == ds[0][1]


def test_dataloader_workers_match_direct_access(transform):
    ds = build_source(_synthetic(train={"size": 12}), "train", transform)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    images, labels = zip(*loader, strict=True)
    assert torch.equal(torch.cat(images), torch.stack([ds[i][0] for i in range(12)]))
    assert torch.cat(labels).tolist() == [i % 10 for i in range(12)]


# --- real photos -----------------------------------------------------------------------


def test_hymenoptera(hymenoptera_root, transform):
    hymenoptera = hymenoptera_root
    spec = DataSpec(root=str(hymenoptera), splits={"train": "train", "val": "val"})
    for split in ("train", "val"):
        ds = build_source(spec, split, transform)
        assert ds.class_names == ["ants", "bees"]
        expected = [
            path.relative_to(hymenoptera / split).as_posix()
            for name in ("ants", "bees")
            for path in sorted((hymenoptera / split / name).iterdir())
        ]
        assert ds.ids == expected
        counts = {
            name: len(list((hymenoptera / split / name).iterdir())) for name in ds.class_names
        }
        assert Counter(i.split("/")[0] for i in ds.ids) == counts
        assert len(ds) == sum(counts.values()) > 100

    val = build_source(spec, "val", transform)
    for i in range(len(val)):
        image, label = val[i]
        _check_image(image)
        assert val.ids[i].startswith(val.class_names[label] + "/")

    train = build_source(spec, "train", transform)
    placeholder = train.ids.index("ants/imageNotFound.gif")
    for i in (0, placeholder, len(train) // 2, len(train) - 1):
        _check_image(train[i][0])
    assert train[placeholder][1] == 0


def test_jpeg_draft_decoding_keeps_the_shorter_side_covered(tmp_path):
    from featcache.sources import load_rgb

    Image.new("RGB", (1200, 900), (10, 200, 30)).save(tmp_path / "big.jpg")
    Image.new("RGB", (1200, 900), (10, 200, 30)).save(tmp_path / "big.png")
    Image.new("RGB", (300, 200), (10, 200, 30)).save(tmp_path / "small.jpg")
    assert load_rgb(tmp_path / "big.jpg").size == (1200, 900)
    assert load_rgb(tmp_path / "big.jpg", 256).size == (600, 450)  # 1/4 would go below 256
    assert load_rgb(tmp_path / "big.jpg", 100).size == (150, 113)  # 1/8
    assert load_rgb(tmp_path / "big.png", 100).size == (1200, 900)  # only JPEG has drafts
    assert load_rgb(tmp_path / "small.jpg", 150).size == (300, 200)


def test_decode_size_reaches_file_sources(tmp_path):
    root = tmp_path / "train" / "a"
    root.mkdir(parents=True)
    Image.new("RGB", (800, 800), (1, 2, 3)).save(root / "x.jpg")
    data = DataSpec(source="imagefolder", root=str(tmp_path), splits={"train": "train"})
    source = build_source(data, "train", None, decode_size=200)
    image, _ = source[0]
    assert image.size == (200, 200)


def test_labels_of_mixed_kinds_are_one_clear_error():
    from featcache.sources.tabular import class_indices

    assert class_indices(["b", "a", "b"], "label").__getitem__(1) == ["a", "b"]
    with pytest.raises(
        ConfigError, match=r"^label: labels mix integers \(3\) and strings \('cat'\)"
    ):
        class_indices([3, "cat"], "label")
    with pytest.raises(ConfigError, match=r"^label: label 1.5 is a float; labels must be all"):
        class_indices([1, 1.5], "label")
