"""End-to-end extraction: stored values, rows, attributes, errors, reproducibility."""

from __future__ import annotations

import errno

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import featcache
from featcache.config.spec import load_config, to_dict
from featcache.errors import ConfigError, FeatcacheError
from featcache.store import FeatureStore, StoreWriter, partial_path
from featcache.store.provenance import config_fingerprint as fingerprint


def resnet_outputs(model, x):
    """Every top-level stage of a torchvision ResNet, computed by hand."""
    out = {}
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    for name in ("layer1", "layer2", "layer3", "layer4"):
        x = getattr(model, name)(x)
        out[name] = x
    out["avgpool"] = model.avgpool(x)
    out["fc"] = model.fc(out["avgpool"].flatten(1))
    return out


LAYERS = [
    {"name": "layer1"},  # reduce none
    {"name": "layer2", "reduce": "adaptive_avg", "size": 2},
    {"name": "layer3", "reduce": "avg"},
    {"name": "layer3", "reduce": "max", "key": "layer3_max"},
    {"name": "layer4", "capture": "input", "reduce": "flatten"},
    {"name": "avgpool", "reduce": "flatten"},
]


def expected(model, x):
    with torch.no_grad():
        o = resnet_outputs(model, x)
    return {
        "layer1": o["layer1"],
        "layer2": F.adaptive_avg_pool2d(o["layer2"], 2),
        "layer3": o["layer3"].mean((2, 3)),
        "layer3_max": o["layer3"].amax((2, 3)),
        "layer4@input": o["layer3"].flatten(1),
        "avgpool": o["avgpool"].flatten(1),
    }


def test_stored_features_equal_direct_computation(resnet18, images, tmp_path):
    store = featcache.extract(
        resnet18, images, LAYERS, tmp_path / "s.h5", dtype="float32", batch_size=8, progress=False
    )
    want = expected(resnet18, images.tensors[0])
    assert store.layers == list(want)
    for key, value in want.items():
        got = store.read(key)
        assert got.dtype == torch.float32 and got.shape == value.shape, key
        torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-5, msg=key)


def test_the_store_returned_is_not_checked_again(resnet18, images, tmp_path, monkeypatch):
    """The store extract returns was sealed a moment before by this process: opening it
    costs nothing more, and reads as a store opened anew does."""
    import featcache.store.reader as reader_module

    checks = []
    original = reader_module.metadata_problem
    monkeypatch.setattr(
        reader_module, "metadata_problem", lambda f, **kw: checks.append(f) or original(f, **kw)
    )
    store = featcache.extract(resnet18, images, ["layer1"], tmp_path / "f.h5", progress=False)
    assert checks == [] and store.complete and len(store) == len(images)
    again = FeatureStore(tmp_path / "f.h5")
    assert len(checks) == 1 and torch.equal(store.read("layer1"), again.read("layer1"))
    assert store.ids == again.ids and repr(store) == repr(again)


def test_the_weights_are_hashed_on_the_writer_thread(resnet18, images, tmp_path, monkeypatch):
    """A model given from Python is identified by a hash of its weights, which takes a
    while on big models: it runs beside the first batches, not before them, on a new
    store and on an overwrite alike. Only a partial store beside a complete one must be
    compared with the run's key first."""
    import threading

    import featcache.extraction.plan as plan_module

    threads = []
    original = plan_module.module_fingerprint
    monkeypatch.setattr(
        plan_module,
        "module_fingerprint",
        lambda m: threads.append(threading.current_thread().name) or original(m),
    )
    path = tmp_path / "w.h5"
    featcache.extract(resnet18, images, ["layer1"], path, progress=False)
    featcache.extract(resnet18, images, ["layer1"], path, progress=False, overwrite=True)
    assert threads == ["featcache-writer", "featcache-writer"]


@pytest.mark.parametrize(
    "dtype, torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)]
)
def test_half_precision_stores(resnet18, images, tmp_path, dtype, torch_dtype):
    store = featcache.extract(
        resnet18, images, ["layer3"], tmp_path / "s.h5", dtype=dtype, progress=False
    )
    with torch.no_grad():
        want = resnet_outputs(resnet18, images.tensors[0])["layer3"]
    got = store.read("layer3")
    assert got.dtype == torch_dtype
    torch.testing.assert_close(got.float(), want.to(torch_dtype).float(), rtol=2e-2, atol=2e-2)
    with h5py.File(store.path) as f:  # bfloat16 is kept as its raw 16 bits
        raw = f["features/layer3"]
        assert raw.dtype == (np.uint16 if dtype == "bfloat16" else np.float16)
        assert raw.attrs["dtype"] == dtype.encode()  # fixed-length UTF-8 text


def test_rows_order_labels_ids_and_chunking(resnet18, images, tmp_path):
    ids = [f"img/{i:03d}.png" for i in range(20)]
    store = featcache.extract(
        resnet18,
        images,
        [{"name": "layer2", "reduce": "avg"}],
        tmp_path / "s.h5",
        ids=ids,
        class_names=["a", "b", "c", "d", "e"],
        batch_size=3,  # batches straddle chunk boundaries
        chunk_rows=4,
        num_workers=2,
        progress=False,
    )
    assert len(store) == 20 and store.complete and store.rows_written == 20
    assert store.ids == ids
    np.testing.assert_array_equal(store.index, np.arange(20))
    np.testing.assert_array_equal(store.labels, np.arange(20) % 5)
    assert store.class_names == ["a", "b", "c", "d", "e"]
    with h5py.File(store.path) as f:
        assert f["features/layer2"].chunks == (4, 128)
    with torch.no_grad():
        want = resnet_outputs(resnet18, images.tensors[0])["layer2"].mean((2, 3))
    torch.testing.assert_close(
        store.read("layer2", [19, 0, 7, 7]).float(), want[[19, 0, 7, 7]], rtol=1e-2, atol=1e-2
    )


def test_h5py_alone_reads_the_store(resnet18, images, tmp_path):
    path = tmp_path / "s.h5"
    featcache.extract(resnet18, images, ["avgpool"], path, progress=False)
    with h5py.File(path, "r") as f:
        assert set(f) == {"checksums", "features", "ids", "index", "labels", "progress"}
        assert set(f["checksums"]) == {"features", "ids", "index", "labels"}
        assert f["features/avgpool"].shape == (20, 512, 1, 1)
        assert f["features/avgpool"].dtype == np.float16
        assert f["labels"].dtype == np.int64 and f["index"].dtype == np.int64
        assert f["ids"].asstr()[0] == "TensorDataset:0"
        attrs = dict(f.attrs)
    for key in (
        "featcache_format",
        "complete",
        "rows_written",
        "num_rows",
        "created",
        "versions",
        "device",
        "dataset_fingerprint",
        "taps",
    ):
        assert key in attrs, key
    assert bool(attrs["complete"]) and attrs["num_rows"] == 20


def test_unlabeled_dataset_has_no_labels(resnet18, tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(5, 3, 32, 32))
    store = featcache.extract(resnet18, data, ["layer1"], tmp_path / "s.h5", progress=False)
    assert store.labels is None and not store.has_labels


def test_existing_store_is_never_overwritten_silently(resnet18, images, tmp_path):
    path = tmp_path / "s.h5"
    featcache.extract(resnet18, images, ["layer1"], path, progress=False)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="already exists.*--overwrite"):
        featcache.extract(resnet18, images, ["layer2"], path, progress=False)
    assert path.read_bytes() == before
    store = featcache.extract(resnet18, images, ["layer2"], path, overwrite=True, progress=False)
    assert store.layers == ["layer2"]


def test_arguments_that_would_make_a_bad_store_are_refused(resnet18, images, tmp_path):
    path = tmp_path / "s.h5"
    ids = [f"i{n}" for n in range(20)]
    ids[7] = "i3"
    with pytest.raises(ConfigError, match=r"^id 'i3' is given to rows 3 and 7; every row needs"):
        featcache.extract(resnet18, images, ["layer1"], path, ids=ids, progress=False)
    with pytest.raises(ConfigError, match=r"^class_names must be a list of names, got the str"):
        featcache.extract(resnet18, images, ["layer1"], path, class_names="abc", progress=False)
    with pytest.raises(ConfigError, match=r"^model must be a torch.nn.Module, got str 'resnet18'"):
        featcache.extract("resnet18", images, ["layer1"], path, progress=False)
    with pytest.raises(ConfigError, match=r"^rows must be a range of source positions, got list"):
        featcache.extract(resnet18, images, ["layer1"], path, rows=[1, 2], progress=False)
    with pytest.raises(ConfigError, match=r"^prefix_tokens must be a whole number >= 0, got '1'"):
        featcache.extract(resnet18, images, ["layer1"], path, prefix_tokens="1", progress=False)
    assert not any(tmp_path.iterdir())


def test_unusable_output_path(resnet18, images, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create output folder"):
        featcache.extract(resnet18, images, ["layer1"], blocker / "s.h5", progress=False)


def test_unknown_option_is_named(resnet18, images, tmp_path):
    with pytest.raises(ConfigError, match="unknown option 'batchsize'"):
        featcache.extract(resnet18, images, ["layer1"], tmp_path / "s.h5", batchsize=3)


class Failing(torch.utils.data.Dataset):
    def __init__(self, fail_at: int):
        self.fail_at = fail_at

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == self.fail_at:
            raise RuntimeError(f"cannot read sample {i}")
        return torch.full((3, 32, 32), float(i) / 40), i % 3


def test_a_failed_overwrite_keeps_the_complete_store_it_was_to_replace(resnet18, tmp_path):
    path = tmp_path / "s.h5"
    featcache.extract(resnet18, Failing(-1), ["layer1"], path, batch_size=8, progress=False)
    before = path.read_bytes()
    with pytest.raises(FeatcacheError, match="cannot read sample 30"):
        featcache.extract(
            resnet18, Failing(30), ["layer2"], path, batch_size=8, overwrite=True, progress=False
        )
    assert path.read_bytes() == before and FeatureStore(path).layers == ["layer1"]
    assert partial_path(path).exists()  # the new run's rows, for a resume
    store = featcache.extract(
        resnet18, Failing(-1), ["layer2"], path, batch_size=8, overwrite=True, progress=False
    )
    assert store.layers == ["layer2"] and not partial_path(path).exists()


def test_failure_leaves_an_incomplete_store_and_no_hooks(resnet18, tmp_path):
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="cannot read sample 30 .sample Failing:30.; set"):
        featcache.extract(
            resnet18, Failing(30), ["layer1"], path, batch_size=4, chunk_rows=8, progress=False
        )
    assert all(not m._forward_hooks for m in resnet18.modules())
    with pytest.raises(FeatcacheError, match="incomplete .* rows written.*allow_incomplete"):
        FeatureStore(path)
    store = FeatureStore(path, allow_incomplete=True)
    assert not store.complete
    durable = store.rows_written
    # The rows appended before the batch with the bad sample (28) in whole chunks of 8.
    assert durable == 24
    np.testing.assert_array_equal(store.index[:durable], np.arange(durable))
    with pytest.raises(FeatcacheError, match="incomplete"):
        featcache.FeatureDataset(path, "layer1")


def test_writer_errors_reach_the_caller(resnet18, images, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = StoreWriter.append

    def append(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StoreWriter, "append", append)
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="disk full while writing"):
        featcache.extract(resnet18, images, ["layer1"], path, batch_size=2, progress=False)
    assert not FeatureStore(path, allow_incomplete=True).complete


def test_model_mode_is_restored(resnet18, images, tmp_path):
    resnet18.train()
    featcache.extract(resnet18, images, ["layer1"], tmp_path / "s.h5", progress=False)
    assert resnet18.training


def demo_like(tmp_path, **extra):
    config = {
        "model": {"name": "resnet18"},
        "preprocess": {"mean": [0.485, 0.456, 0.406]},  # 32px as it is
        "layers": [{"name": "layer4", "reduce": "avg"}, "avgpool"],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 4},
            "splits": {"train": {"size": 24}, "val": {"size": 12}},
        },
        "loader": {"batch_size": 8},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    config.update(extra)
    return config


def test_extract_from_config_writes_one_store_per_split_with_provenance(tmp_path):
    config = demo_like(tmp_path)
    stores = featcache.extract_from_config(config, ["store.dtype=float32"])
    assert set(stores) == {"train", "val"}
    train, val = stores["train"], stores["val"]
    assert len(train) == 24 and len(val) == 12
    spec = load_config(config, ["store.dtype=float32"])
    attrs = train.attrs
    assert train.config == to_dict(spec)
    assert attrs["config_fingerprint"] == fingerprint(spec)
    assert attrs["weights"] == {"model": "resnet18", "source": "random", "seed": 0}
    assert attrs["split"] == "train" and train.class_names == [f"class_{k}" for k in range(4)]
    assert train.ids[:2] == ["synthetic:0", "synthetic:1"]
    assert train.shape("layer4") == (512,) and train.shape("avgpool") == (512, 1, 1)
    assert not np.array_equal(train.read("layer4")[:12].numpy(), val.read("layer4").numpy())


def test_same_config_twice_gives_identical_bytes(tmp_path):
    first = featcache.extract_from_config(demo_like(tmp_path / "a"))["train"]
    second = featcache.extract_from_config(demo_like(tmp_path / "b"))["train"]
    for layer in first.layers:
        assert torch.equal(first.read(layer), second.read(layer))
    assert first.attrs["config_fingerprint"] == second.attrs["config_fingerprint"]
    assert first.attrs["dataset_fingerprint"] == second.attrs["dataset_fingerprint"]


def test_config_refuses_existing_outputs_before_any_work(tmp_path):
    config = demo_like(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "val.h5").write_bytes(b"precious")
    with pytest.raises(ConfigError, match="val.h5; pass --overwrite .overwrite=True in Python."):
        featcache.extract_from_config(config)
    assert not (tmp_path / "out" / "train.h5").exists()
    assert (tmp_path / "out" / "val.h5").read_bytes() == b"precious"


def test_hymenoptera_photos_end_to_end(hymenoptera_root, tmp_path):
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer4", "reduce": "avg"}],
        "data": {"source": "imagefolder", "root": str(hymenoptera_root), "splits": ["val"]},
        "preprocess": {"resize": 40, "crop": 32},
        "loader": {"batch_size": 32},
        "output": {"dir": str(tmp_path)},
        "runtime": {"progress": False},
    }
    store = featcache.extract_from_config(config)["val"]
    files = sorted(
        p.relative_to(hymenoptera_root / "val").as_posix()
        for p in (hymenoptera_root / "val").rglob("*")
        if p.is_file()
    )
    assert store.ids == files
    assert store.class_names == ["ants", "bees"]
    np.testing.assert_array_equal(
        store.labels, [0 if name.startswith("ants/") else 1 for name in files]
    )
    features = store.read("layer4").float()
    assert features.shape == (len(files), 512) and torch.isfinite(features).all()
    assert features.std(0).mean() > 0  # real, varied activations


@pytest.mark.parametrize(
    "options",
    [{"compression": "lzf"}, {"compression": "gzip"}, {"channels_last": True}, {"amp": "bf16"}],
)
def test_runtime_and_store_options_keep_values(resnet18, images, tmp_path, options):
    store = featcache.extract(
        resnet18,
        images,
        [{"name": "layer3", "reduce": "avg"}],
        tmp_path / "s.h5",
        dtype="float32",
        progress=False,
        **options,
    )
    with torch.no_grad():
        want = resnet_outputs(resnet18, images.tensors[0])["layer3"].mean((2, 3))
    tolerance = 5e-2 if "amp" in options else 1e-4  # bf16 autocast keeps ~3 significant digits
    torch.testing.assert_close(store.read("layer3"), want, rtol=tolerance, atol=tolerance)
    with h5py.File(store.path) as f:
        assert f["features/layer3"].compression == options.get("compression")


def test_dataset_of_pil_images_gets_a_clear_error(resnet18, tmp_path):
    from PIL import Image

    class Pictures(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return Image.new("RGB", (32, 32)), 0

    with pytest.raises(ConfigError, match="must be a tensor .* got a Image.*transform"):
        featcache.extract(resnet18, Pictures(), ["layer1"], tmp_path / "s.h5")
    assert not (tmp_path / "s.h5").exists()


def _tiny_vit():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32
    ).eval()


def test_token_reductions_of_a_vit_equal_a_direct_computation(tmp_path):
    vit = _tiny_vit()
    x = torch.randn(6, 3, 32, 32)
    layers = [
        {"name": "encoder.layers[-1]", "reduce": "cls", "key": "cls"},
        {"name": "encoder.layers[-1]", "reduce": "mean", "key": "mean"},
        {"name": "encoder.layers[-1]", "reduce": "cls+mean", "key": "both"},
        {"name": "encoder.layers[-1]", "reduce": "patches", "key": "grid"},
        {"name": "encoder.layers[:2]", "reduce": "avg"},
    ]
    dataset = torch.utils.data.TensorDataset(x)
    store = featcache.extract(
        vit, dataset, layers, tmp_path / "vit.h5", prefix_tokens=1, dtype="float32",
        batch_size=4, progress=False,
    )  # fmt: skip
    seen = {}
    hooks = [
        vit.encoder.layers[i].register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(i, out.detach())
        )
        for i in range(3)
    ]
    with torch.no_grad():
        vit(x)
    for hook in hooks:
        hook.remove()
    last = seen[2]  # [6, 1 + 16, 16]: a class token, then a 4 x 4 grid of patch tokens
    expected = {
        "cls": last[:, 0],
        "mean": last[:, 1:].mean(1),
        "both": torch.cat([last[:, 0], last[:, 1:].mean(1)], 1),
        "grid": last[:, 1:].transpose(1, 2).reshape(6, 16, 4, 4),
        "encoder.layers.encoder_layer_0": seen[0][:, 1:].mean(1),
        "encoder.layers.encoder_layer_1": seen[1][:, 1:].mean(1),
    }
    assert store.layers == list(expected)
    for key, want in expected.items():
        torch.testing.assert_close(store.read(key), want, rtol=1e-4, atol=1e-5)
    key = store.attrs["resume_key"]
    assert key["tokens"] == {"prefix_tokens": 1, "sequence_first": False}


def test_inputs_the_model_refuses_fail_in_one_line_naming_their_shape(tmp_path):
    images = torch.utils.data.TensorDataset(torch.randn(4, 3, 16, 16))  # the ViT takes 32 px
    with pytest.raises(FeatcacheError) as caught:
        featcache.extract(_tiny_vit(), images, ["encoder"], tmp_path / "v.h5", progress=False)
    # The first row to meet the model is the one that sizes the store, in a batch of its own.
    assert str(caught.value) == (
        "the model fails on a batch of inputs [1, 3, 16, 16] (AssertionError: Wrong image "
        "height! Expected 32 but got 16!); check that the preprocessing (preprocess.resize, "
        "crop) or the dataset gives inputs the model takes"
    )


def test_layer_index_out_of_range_names_the_container_length(tmp_path):
    dataset = torch.utils.data.TensorDataset(torch.randn(2, 3, 32, 32))
    with pytest.raises(ConfigError, match=r"index 3 is out of range; encoder.layers has 3 entr"):
        featcache.extract(
            _tiny_vit(), dataset, ["encoder.layers[3]"], tmp_path / "x.h5", progress=False
        )
    assert not (tmp_path / "x.h5").exists()


class _OneByOne(torch.utils.data.Dataset):
    """The same samples as a TensorDataset, served one at a time."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]


@pytest.mark.parametrize("labelled", [True, False])
def test_tensor_datasets_are_sliced_whole_with_the_same_result(
    resnet18, images, tmp_path, labelled
):
    from featcache.extraction.batches import Batch, SourceRows

    dataset = images if labelled else torch.utils.data.TensorDataset(images.tensors[0])
    block = SourceRows(dataset, range(4, 20)).__getitems__([2, 3, 4])
    assert isinstance(block, Batch) and block.rows.tolist() == [6, 7, 8]
    assert block.inputs.data_ptr() == dataset.tensors[0][6].data_ptr()  # a view, no copy
    options = dict(batch_size=6, chunk_rows=4, dtype="float32", progress=False)
    fast = featcache.extract(resnet18, dataset, ["layer1"], tmp_path / "a.h5", **options)
    slow = featcache.extract(
        resnet18, _OneByOne(dataset), ["layer1"], tmp_path / "b.h5", ids=fast.ids, **options
    )
    assert torch.equal(fast.read("layer1"), slow.read("layer1"))
    assert fast.has_labels == labelled
    if labelled:
        assert fast.labels.tolist() == slow.labels.tolist() == (torch.arange(20) % 5).tolist()


def test_the_resolved_preprocessing_is_recorded(tmp_path):
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer1", "reduce": "avg"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32},
            "splits": {"val": {"size": 4}},
        },
        "preprocess": {"resize": 36, "crop": 32},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    store = featcache.extract_from_config(config)["val"]
    recorded = store.attrs["preprocessing"]
    assert recorded.startswith("Compose(") and "Resize(size=36" in recorded
    assert "CenterCrop(size=(32, 32))" in recorded


def test_skipped_rows_and_compression_together(tmp_path):
    """A store shrunk by skipped rows below one chunk still copies into a compressed file."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1))
    images = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    images[4] = float("nan")
    data = torch.utils.data.TensorDataset(images, torch.arange(10))
    with pytest.warns(UserWarning, match="1 of 10 samples skipped"):
        store = featcache.extract(
            net, data, ["1"], tmp_path / "s.h5", on_nonfinite="skip", compression="gzip",
            num_workers=0, progress=False,
        )  # fmt: skip
    assert len(store) == 9 and store.file["features/1"].compression == "gzip"
    assert 4 not in store.index.tolist()


class Labelled(torch.utils.data.Dataset):
    """One small image per label given, with that label."""

    def __init__(self, labels):
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.full((3, 8, 8), float(i)), self.labels[i]


def test_labels_are_class_indices_or_one_clear_error(tmp_path):
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    options = dict(progress=False, overwrite=True, on_error="skip", batch_size=2)
    kinds = [1, np.int64(2), torch.tensor(0), 3.0, None]
    store = featcache.extract(model, Labelled(kinds), ["1"], tmp_path / "s.h5", **options)
    assert store.labels.tolist() == [1, 2, 0, 3, -1]
    bad = [
        (["cat", "dog"], "label at row 0 is 'cat', not a class index.*class_names"),
        ([0, 1.7], "label at row 1 is 1.7, not a class index.*whole number"),
        ([torch.tensor([1, 0]), 0], r"row 0 is a tensor of shape \[2\], not a class index"),
        ([None, 1, 2], "row 1 of the dataset has the label 1, but its first row has none"),
    ]
    for labels, message in bad:  # never taken for unreadable samples and skipped
        with pytest.raises(ConfigError, match=message):
            featcache.extract(model, Labelled(labels), ["1"], tmp_path / "s.h5", **options)
    floats = torch.utils.data.TensorDataset(torch.zeros(2, 3, 8, 8), torch.tensor([0.0, 1.5]))
    with pytest.raises(ConfigError, match="label at row 1 is 1.5, not a class index"):
        featcache.extract(model, floats, ["1"], tmp_path / "t.h5", progress=False)


def test_an_empty_dataset_is_named_as_such(tmp_path):
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    empty = torch.utils.data.TensorDataset(torch.zeros(0, 3, 8, 8))
    with pytest.raises(ConfigError, match=r"^the dataset \(TensorDataset\) has no rows"):
        featcache.extract(model, empty, ["1"], tmp_path / "s.h5", progress=False)
    assert not list(tmp_path.iterdir())
