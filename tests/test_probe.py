"""Linear probes: the protocol, both trainers, determinism, reports, plot, CLI, errors.

Stores here are written directly with StoreWriter from seeded Gaussian class clusters,
so each test runs in well under a second or two.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import featcache
from featcache import FeatureStore
from featcache.commands.app import app
from featcache.errors import ConfigError
from featcache.probe import (
    Moments,
    ProbeOptions,
    choose,
    format_result,
    format_table,
    parse_bytes,
    plot_layers,
    probe,
    probe_layers,
    refine_lambdas,
    save_results,
    stratified_split,
)

runner = CliRunner()
CLASSES = ["ant", "bee", "cat", "dog", "eel", "fox"]


def _clusters(n: int, dim: int, classes: int, seed: int, spread: float = 1.0):
    """Rows around seeded class means: float32 [n, dim] and int64 labels [n] (balanced)."""
    means = np.random.default_rng(0).normal(size=(classes, dim)) * spread
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % classes
    return (means[labels] + rng.normal(size=(n, dim))).astype(np.float32), labels


class _Slices(nn.Module):
    """Hands out consecutive slices of a flat input as the outputs of named layers, so a
    store can hold chosen features: ``image [1, 1, total]`` -> ``layer(rows [*shape])``."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.shapes = shapes
        for name in shapes:
            self.add_module(name, nn.Identity())

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        flat, start, out = x.flatten(1), 0, []
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            rows = flat[:, start : start + size].reshape(-1, *shape)
            out.append(getattr(self, name)(rows))
            start += size
        return out


def write_store(
    path: Path,
    features: dict[str, np.ndarray],
    labels: np.ndarray | None,
    *,
    class_names: list[str] | None = None,
    dtype: str = "float32",
    **options: Any,
) -> Path:
    """A complete store, made with featcache.extract, whose layers hold ``features``."""
    model = _Slices({name: value.shape[1:] for name, value in features.items()})
    flat = np.hstack([value.reshape(len(value), -1) for value in features.values()])
    images = torch.from_numpy(flat).reshape(len(flat), 1, 1, -1)
    tensors = (images,) if labels is None else (images, torch.from_numpy(labels))
    featcache.extract(
        model,
        TensorDataset(*tensors),
        list(features),
        path,
        class_names=class_names,
        dtype=dtype,
        batch_size=len(flat),
        progress=False,
        **options,
    )
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """train (480 rows), val (120) and test (240) stores of six classes with two layers:
    ``easy`` [12] (well separated) and ``hard`` [2, 2, 2] (overlapping; 3-d rows)."""
    tmp_path, out = tmp_path_factory.mktemp("stores"), {}
    for split, n, seed in (("train", 480, 1), ("val", 120, 2), ("test", 240, 3)):
        easy, labels = _clusters(n, 12, 6, seed, spread=2.0)
        hard, _ = _clusters(n, 8, 6, seed + 10, spread=0.6)
        out[split] = write_store(
            tmp_path / f"{split}.h5",
            {"easy": easy, "hard": hard.reshape(n, 2, 2, 2)},
            labels,
            class_names=CLASSES,
        )
    return out


def _numbers(result) -> dict:
    out = result.to_dict()
    del out["seconds"]
    return out


def test_full_probe_reports_the_protocol(stores):
    result = probe(stores["train"], "easy", test=stores["test"], progress=False)
    assert result.trainer == "full"
    assert (result.n_train, result.n_val, result.n_test) == (384, 96, 240)  # stratified 0.2
    assert "0.2 of train" in result.validation
    assert result.test["top1"] > 0.9 and result.test["top5"] >= result.test["top1"]
    assert result.test["chance_top1"] == pytest.approx(1 / 6)
    assert set(result.test["per_class"]) == set(CLASSES)
    assert result.test["mean_per_class"] == pytest.approx(
        np.mean(list(result.test["per_class"].values()))
    )
    lambdas = [entry["lambda"] for entry in result.sweep]
    assert lambdas == sorted(lambdas) and len(lambdas) >= 9 + 2
    assert result.lam in lambdas
    assert result.val["top1"] == max(entry["val_top1"] for entry in result.sweep)
    assert set(result.seconds) == {"load", "sweep", "refit", "test", "total"}
    # Provenance: fingerprints are null for stores made from Python; the hash is of the rows.
    rows = FeatureStore(stores["test"]).read("easy").float().numpy()
    info = result.stores["test"]
    assert info["path"] == str(stores["test"]) and info["rows"] == 240
    assert info["config_fingerprint"] is None  # made from Python, not from a config
    assert info["dataset_fingerprint"] == FeatureStore(stores["test"]).attrs["dataset_fingerprint"]
    assert info["weights"]["source"] == "module"
    assert info["features_sha256"] == hashlib.sha256(rows.tobytes()).hexdigest()
    # The returned model reproduces the reported test accuracy.
    labels = torch.from_numpy(FeatureStore(stores["test"]).labels)
    predicted = result.model.predict(torch.from_numpy(rows))
    assert (predicted == labels).double().mean().item() == pytest.approx(result.test["top1"])


def test_same_inputs_same_numbers(stores):
    first = probe(stores["train"], "hard", test=stores["test"], progress=False)
    second = probe(stores["train"], "hard", test=stores["test"], progress=False)
    assert _numbers(first) == _numbers(second)
    other_seed = probe(stores["train"], "hard", test=stores["test"], seed=1, progress=False)
    assert other_seed.stores == first.stores  # same features, another validation split


def test_streaming_trainer_matches_full_batch(stores):
    full = probe(stores["train"], "hard", val=stores["val"], test=stores["test"], progress=False)
    streamed = probe(
        stores["train"],
        "hard",
        val=stores["val"],
        test=stores["test"],
        max_memory="1kB",  # the features need more: auto picks streaming
        batch_size=96,
        progress=False,
    )
    assert streamed.trainer == "streaming" and "max_memory" in streamed.notes[0]
    assert full.test["top1"] > 0.5
    assert abs(streamed.test["top1"] - full.test["top1"]) < 0.05
    assert abs(streamed.val["top1"] - full.val["top1"]) < 0.05
    assert streamed.stores == full.stores  # same rows hashed the same way by both trainers
    assert set(streamed.seconds) == {"statistics", "sweep", "refit", "test", "total"}


def test_streaming_is_seeded_and_reads_low_precision_stores(tmp_path, stores):
    x, y = _clusters(300, 12, 6, 5, spread=2.0)
    path = write_store(tmp_path / "bf16.h5", {"easy": x}, y, class_names=CLASSES, dtype="bfloat16")
    kwargs = {"test": stores["test"], "trainer": "streaming", "batch_size": 100, "epochs": 3}
    first = probe(path, "easy", progress=False, **kwargs)
    assert (first.n_train, first.n_val) == (240, 60)  # val fraction 0.2 of the train store
    assert first.test["top1"] > 0.8
    again = probe(path, "easy", progress=False, **kwargs)
    assert _numbers(again) == _numbers(first)
    workers = probe(path, "easy", progress=False, num_workers=1, **kwargs)
    assert _numbers(workers)["test"] == _numbers(first)["test"]
    full = probe(path, "easy", test=stores["test"], trainer="full", progress=False)
    assert full.test["top1"] > 0.9
    rows = torch.from_numpy(x).to(torch.bfloat16).float().numpy()  # what the store holds
    assert full.stores["train"]["features_sha256"] == hashlib.sha256(rows.tobytes()).hexdigest()
    assert first.stores == full.stores


def test_without_test_store_reports_validation_clearly(stores):
    result = probe(stores["train"], "easy", val=stores["val"], progress=False)
    assert result.test is None and result.n_test == 0
    assert result.top1 == result.val["top1"]
    assert result.validation == f"val store {stores['val']}"
    text = format_result(result)
    assert "no test store" in text and "optimistic" in text
    table = format_table(probe_layers(stores["train"], "all", val=stores["val"], progress=False))
    assert "test top-1" not in table
    assert table.splitlines()[-1].startswith("val top-1 is on the split that chose lambda, so ")
    assert "optimistic; pass a test store (--test)" in table


def test_layers_all_and_lists(stores):
    results = probe_layers(stores["train"], "all", test=stores["test"], progress=False)
    assert [r.layer for r in results] == ["easy", "hard"]
    assert results[1].shape == [2, 2, 2] and results[1].to_dict()["dim"] == 8
    assert results[0].test["top1"] > results[1].test["top1"]
    listed = probe_layers(stores["train"], "hard, easy", test=stores["test"], progress=False)
    assert [r.layer for r in listed] == ["hard", "easy"]
    table = format_table(results).splitlines()
    assert table[0].split() == [
        "layer",
        "dim",
        "lambda",
        "val",
        "top-1",
        "test",
        "top-1",
        "test",
        "top-5",
        "seconds",
    ]
    assert table[1].split()[:2] == ["easy", "12"] and table[2].split()[:2] == ["hard", "8"]
    assert table[-1] == "chance (most frequent class): 16.7%"


def test_plot_is_a_png_of_the_requested_size(stores, tmp_path):
    results = probe_layers(stores["train"], "all", test=stores["test"], progress=False)
    path = plot_layers(results, tmp_path / "curves" / "c.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (720, 420)
        colours = {colour for _, colour in image.convert("RGB").getcolors(1 << 20)}
    assert (45, 110, 180) in colours and (214, 96, 39) in colours  # val and test lines
    with Image.open(plot_layers(results[:1], tmp_path / "one.png", size=(400, 300))) as image:
        assert image.size == (400, 300)


@pytest.mark.parametrize("trainer", ["full", "streaming"])
def test_features_with_inf_are_refused_with_the_fix(tmp_path, trainer):
    features, labels = _clusters(60, 4, 2, 0, spread=2.0)
    features[3, 1] = np.inf
    path = write_store(tmp_path / "inf.h5", {"x": features}, labels, on_nonfinite="keep")
    with pytest.raises(ConfigError, match=r"^the features hold NaN or Inf values .*on_nonfinite"):
        probe_layers(path, "x", options=ProbeOptions(progress=False, trainer=trainer))
    # In the test store too, where no statistics are taken: NaN rows were scored as class 0.
    clean = write_store(tmp_path / "clean.h5", {"x": _clusters(60, 4, 2, 1, 2.0)[0]}, labels)
    features[3, 1] = np.nan
    test = write_store(tmp_path / "nan.h5", {"x": features}, labels, on_nonfinite="keep")
    options = ProbeOptions(progress=False, trainer=trainer)
    with pytest.raises(ConfigError, match=r"^the test store's features of layer x hold NaN or"):
        probe_layers(clean, "x", test=test, options=options)


def test_standardising_is_scale_free_and_leaves_constant_features_alone(tmp_path):
    x = torch.randn(500, 3, dtype=torch.float64) * 1e-7  # small, not constant: gradients
    x[:, 1] = 5.0  # constant
    x[:, 2] = 0.0  # constant
    mean, std = Moments(3).update(x[:200]).merge(Moments(3).update(x[200:])).standardizer("cpu")
    torch.testing.assert_close(std[0], x[:, 0].std(unbiased=False).float())
    assert std[1:].tolist() == [1.0, 1.0]
    features, labels = _clusters(300, 12, 3, 0, spread=2.0)
    top1 = []
    for scale in (1.0, 1e-7):
        path = write_store(tmp_path / f"{scale}.h5", {"x": features * scale}, labels)
        top1.append(probe(path, "x", progress=False).val["top1"])
    assert top1[0] > 0.9 and top1[1] == top1[0]


def test_results_are_replaced_whole_and_bad_names_fail_before_the_fit(
    stores, tmp_path, monkeypatch
):
    options = ProbeOptions(progress=False)
    results = probe_layers(stores["train"], "all", options=options)
    path = save_results(results, tmp_path / "r.json", options=options)
    before = path.read_bytes()
    import featcache.probe.report as report_module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_module.Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_results(results, path, options=options)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    monkeypatch.undo()
    fitted = []
    monkeypatch.setattr(featcache.probe, "probe_layers", lambda *a, **k: fitted.append(1))
    train = stores["train"]
    for flag, name in (("-o", "r.txt"), ("--plot", "p.json")):
        result = runner.invoke(
            app,
            ["probe", str(getattr(train, "path", train)), "-l", "all", flag, str(tmp_path / name)],
        )
        assert result.exit_code == 2 and "does not end in" in result.output and not fitted
    # The default names beside the train store are checked before the fit too.
    copy = tmp_path / "beside" / "train.h5"
    copy.parent.mkdir()
    copy.write_bytes(Path(train).read_bytes())
    for layer, taken in (("easy", "probe-easy.json"), ("all", "probe-layers.png")):
        (copy.parent / taken).mkdir()
        result = runner.invoke(app, ["probe", str(copy), "-l", layer])
        assert result.exit_code == 2 and f"{taken} is a folder" in result.output and not fitted


def test_results_json_records_the_options_the_probe_ran_with(stores, tmp_path):
    train = stores["train"]
    out = tmp_path / "cli.json"
    result = runner.invoke(
        app,
        [
            "probe", str(getattr(train, "path", train)), "-l", "all", "--seed", "3",
            "--val-fraction", "0.3", "--lambdas", "1,1e-2", "-o", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    recorded = json.loads(out.read_text())["options"]
    assert recorded["seed"] == 3 and recorded["val_fraction"] == 0.3
    assert recorded["lambdas"] == [1e-2, 1.0]
    streaming = probe_layers(train, "all", trainer="streaming", epochs=1, progress=False)
    full = probe_layers(train, "all", trainer="full", progress=False)
    document = json.loads(save_results(streaming + full, tmp_path / "api.json").read_text())
    assert document["options"]["trainer"] == "streaming" and document["options"]["epochs"] == 1
    assert "options" not in document["results"][0]  # the same as the document's
    assert document["results"][-1]["options"]["trainer"] == "full"


def test_results_json_holds_everything_needed_to_trace_a_number(stores, tmp_path):
    options = ProbeOptions(progress=False)
    results = probe_layers(stores["train"], "all", test=stores["test"], options=options)
    document = json.loads(save_results(results, tmp_path / "r.json", options=options).read_text())
    assert document["featcache_probe"] == 1 and "torch" in document["versions"]
    assert document["options"]["seed"] == 0
    entry = document["results"][0]
    for key in (
        "layer",
        "trainer",
        "lambda",
        "sweep",
        "val",
        "test",
        "n_train",
        "n_val",
        "n_test",
        "seconds",
        "stores",
        "validation",
    ):
        assert key in entry, key
    assert entry["sweep"][0].keys() >= {"lambda", "val_top1"}
    assert entry["test"]["per_class"]["ant"] >= 0
    assert set(entry["stores"]) == {"train", "test"}


def test_three_classes_have_no_top5(tmp_path):
    x, y = _clusters(90, 4, 3, 0, spread=3.0)
    path = write_store(tmp_path / "three.h5", {"f": x}, y)
    result = probe(path, "f", progress=False)
    assert "top5" not in result.val and result.val["top1"] > 0.8
    assert set(result.val["per_class"]) == {"0", "1", "2"}  # no class names: indices
    assert "top-5" not in format_result(result)


def test_stratified_split_is_seeded_and_keeps_proportions():
    labels = np.repeat(np.arange(4), [50, 30, 15, 1])
    fit, held = stratified_split(labels, 0.2, seed=3)
    assert len(np.intersect1d(fit, held)) == 0 and len(fit) + len(held) == len(labels)
    assert np.bincount(labels[held], minlength=4).tolist() == [10, 6, 3, 0]
    again = stratified_split(labels, 0.2, seed=3)
    assert np.array_equal(fit, again[0]) and np.array_equal(held, again[1])
    assert not np.array_equal(held, stratified_split(labels, 0.2, seed=4)[1])


def test_refinement_and_ties():
    grid = [1e-4, 1e-3, 1e-2]
    assert refine_lambdas(grid, 1e-3, 1) == pytest.approx([10**-3.5, 10**-2.5])
    assert refine_lambdas(grid, 1e-4, 2) == pytest.approx([10 ** (-4 + 1 / 3), 10 ** (-4 + 2 / 3)])
    sweep = [
        {"lambda": 1e-4, "val_top1": 0.9},
        {"lambda": 1e-2, "val_top1": 0.9},
        {"lambda": 1.0, "val_top1": 0.5},
    ]
    assert choose(sweep) == 1e-2  # a tie goes to the stronger regularisation


def test_streaming_moments_match_the_whole_array():
    x = torch.randn(1000, 7, dtype=torch.float64) * 3 + 5
    moments = Moments(7)
    for part in x.split(128):
        moments.update(part)
    assert torch.allclose(moments.mean, x.mean(0))
    assert torch.allclose(moments.m2 / 1000, x.var(0, unbiased=False))
    halves = Moments(7).update(x[:300]).merge(Moments(7).update(x[300:]))
    assert torch.allclose(halves.m2, moments.m2)


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes("2048") == 2048
    with pytest.raises(ConfigError, match="not a size"):
        parse_bytes("lots")


@pytest.fixture(scope="module")
def bad_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Stores that clash with ``stores`` in one way each."""
    tmp_path = tmp_path_factory.mktemp("bad")
    x, y = _clusters(60, 12, 6, 7)
    return {
        "other_layers": write_store(tmp_path / "other.h5", {"easy": x}, y, class_names=CLASSES),
        "wide": write_store(
            tmp_path / "wide.h5", {"easy": np.hstack([x, x]), "hard": x}, y, class_names=CLASSES
        ),
        "unlabelled": write_store(tmp_path / "unlabelled.h5", {"easy": x}, None),
        "one_class": write_store(tmp_path / "one.h5", {"easy": x}, np.zeros(60, dtype=np.int64)),
        "sparse": write_store(tmp_path / "sparse.h5", {"easy": x}, np.where(y == 5, 10**6, y)),
        "minus_one": write_store(
            tmp_path / "minus.h5", {"easy": x}, np.where(np.isin(np.arange(60), [5, 9, 40]), -1, y)
        ),
        "renamed": write_store(
            tmp_path / "renamed.h5",
            {"easy": x, "hard": x[:, :8]},
            y,
            class_names=[c.upper() for c in CLASSES],
        ),
    }


@pytest.mark.parametrize(
    "case, kwargs, message",
    [
        ("missing", {"layer": "layer9"}, "layer 'layer9' is not in the train store"),
        (
            "missing_in_test",
            {"layer": "hard", "test": "other_layers"},
            "layer 'hard' is not in the test store",
        ),
        (
            "layers_differ",
            {"layer": "all", "test": "other_layers"},
            "different layers (easy, hard vs easy)",
        ),
        ("shape", {"layer": "easy", "test": "wide"}, "shape [12] in the train store but [24]"),
        ("unlabelled", {"layer": "easy", "test": "unlabelled"}, "has no labels"),
        (
            "sparse",
            {"train": "sparse", "layer": "easy"},
            "labels run up to 1000000 over 6 classes, so the probe would fit 1000001 outputs",
        ),
        (
            "minus_one",
            {"layer": "easy", "test": "minus_one"},
            "has 3 of its 60 rows labelled -1 (no label), row 5 first; a probe needs every",
        ),
        ("one_class", {"train": "one_class", "layer": "easy"}, "only one class (0)"),
        ("names", {"layer": "easy", "val": "renamed"}, "different class names"),
        ("fraction", {"layer": "easy", "val_fraction": 1.0}, "between 0 and 1"),
        ("fraction0", {"layer": "easy", "val_fraction": 0.0}, "between 0 and 1"),
        ("both", {"layer": "easy", "val": "val", "val_fraction": 0.1}, "not both"),
        (
            "trainer",
            {"layer": "easy", "trainer": "sgd"},
            "trainer is 'sgd'; choose one of: auto, full, streaming",
        ),
        ("same", {"layer": "easy", "test": "train"}, "train and test stores are the same file"),
        ("lambdas", {"layer": "easy", "lambdas": [0.1, -1]}, "positive numbers"),
        ("option", {"layer": "easy", "learning_rate": 1}, "unknown probe option"),
        ("batch", {"layer": "easy", "batch_size": 0}, "batch_size must be a whole number >= 1"),
        ("lr", {"layer": "easy", "lr": -1.0}, "lr must be a number > 0, got -1.0"),
    ],
)
def test_errors_name_the_problem(stores, bad_stores, case, kwargs, message):
    paths = {**stores, **bad_stores}
    kwargs = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    train = kwargs.pop("train", stores["train"])
    layer = kwargs.pop("layer")
    with pytest.raises(ConfigError) as info:
        probe_layers(train, layer, progress=False, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_probe_all_writes_table_json_and_plot(stores, tmp_path):
    out = tmp_path / "report" / "probes.json"
    args = ["probe", str(stores["train"]), "--layer", "all", "--val", str(stores["val"])]
    result = runner.invoke(
        app, [*args, "--test", str(stores["test"]), "-o", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("layer") and lines[1].startswith("easy")
    assert f"wrote {out}" in lines and f"wrote {out.with_suffix('.png')}" in lines
    document = json.loads(out.read_text())
    assert [entry["layer"] for entry in document["results"]] == ["easy", "hard"]
    assert document["results"][0]["validation"] == f"val store {stores['val']}"
    with Image.open(out.with_suffix(".png")) as image:
        assert image.size == (720, 420)


def test_cli_probe_one_layer_defaults_beside_the_train_store(stores):
    result = runner.invoke(
        app,
        [
            "probe",
            str(stores["train"]),
            "-l",
            "easy",
            "--no-progress",
            "--lambdas",
            "1e-3,1e-1",
            "--val-fraction",
            "0.25",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("probe easy [12] (full trainer): 360 train, 120 val")
    assert "no test store" in result.stdout
    path = stores["train"].parent / "probe-easy.json"
    assert f"wrote {path}" in result.stdout and not path.with_suffix(".png").exists()
    sweep = json.loads(path.read_text())["results"][0]["sweep"]
    assert len(sweep) == 2 + 2  # the grid, then one refinement value per neighbour side


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--layer", "nope"], "layer 'nope' is not in the train store"),
        (["--layer", "easy", "--max-memory", "big"], "not a size like 4GiB"),
        (["--layer", "easy", "--lambdas", "a,b"], "--lambdas 'a,b' is not a list"),
        (["--layer", "easy", "--trainer", "magic"], "trainer is 'magic'; choose one of: auto"),
    ],
)
def test_cli_probe_errors_are_one_line_with_exit_2(stores, extra, message):
    result = runner.invoke(app, ["probe", str(stores["train"]), *extra, "--no-progress"])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("featcache: error: ")
    assert message in errors[0] and "Traceback" not in result.stderr


def test_demo_probe_writes_its_results_without_matplotlib(stores, tmp_path, monkeypatch):
    from featcache.commands.demo import run_demo_probe

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    opened = {"train": FeatureStore(stores["train"]), "val": FeatureStore(stores["test"])}
    results, path, chart = run_demo_probe(opened, tmp_path)
    assert chart is None and not path.with_suffix(".png").exists()
    assert [r["layer"] for r in json.loads(path.read_text())["results"]] == ["easy", "hard"]
    assert [r.layer for r in results] == ["easy", "hard"]
