"""Updating a store: only new or changed samples and new layers are computed, and the
result equals a fresh extraction of the current dataset and config."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

import featcache
from featcache.commands.app import app
from featcache.commands.verify import verify_store
from featcache.errors import ConfigError
from featcache.extraction.continuity import tolerance_of
from featcache.store import FeatureStore, partial_path
from featcache.store.state import store_state
from tests.test_resume import assert_same_store

CLASSES = ("ants", "bees", "wasps", "flies")
LAYERS = [{"name": "layer2", "reduce": "avg"}, {"name": "layer4", "reduce": "avg"}]


def write_image(path: Path, seed: int, size: int = 32) -> None:
    """A random RGB PNG of ``size`` px: its bytes (and features) depend on ``seed``."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def image_folder(root: Path, count: int) -> list[Path]:
    """``count`` images spread over :data:`CLASSES` under ``root/train``."""
    files = [root / "train" / CLASSES[i % len(CLASSES)] / f"img{i:04d}.png" for i in range(count)]
    for i, file in enumerate(files):
        write_image(file, i)
    return files


def config(root: Path, out: Path, layers: list[dict[str, Any]] = LAYERS, **data: Any) -> dict:
    return {
        "model": {"name": "resnet18"},  # random weights, seeded
        "preprocess": {"mean": [0.485, 0.456, 0.406]},  # 32 px as they are
        "layers": layers,
        "data": {"source": "imagefolder", "root": str(root), "splits": ["train"], **data},
        "loader": {"batch_size": 16, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(out)},
        "runtime": {"progress": False},
    }


def last_run(store: FeatureStore) -> dict[str, Any]:
    return store.attrs["history"][-1]


def assert_equal_stores(got: FeatureStore, want: FeatureStore, tolerance: float = 0.0) -> None:
    """Same ids in the same order, same labels and index, features equal within
    ``tolerance`` of each row's largest magnitude (0: bit for bit)."""
    assert got.ids == want.ids
    np.testing.assert_array_equal(got.labels, want.labels)
    np.testing.assert_array_equal(got.index, want.index)
    assert got.layers == want.layers
    for layer in want.layers:
        a, b = got.read(layer).float().numpy(), want.read(layer).float().numpy()
        assert a.shape == b.shape
        if tolerance == 0.0:
            np.testing.assert_array_equal(a, b, err_msg=layer)
        else:
            scale = np.abs(b).reshape(len(b), -1).max(axis=1).reshape(-1, *[1] * (b.ndim - 1))
            assert np.all(np.abs(a - b) <= tolerance * scale), layer


def test_update_of_a_grown_and_changed_folder_computes_only_new_and_changed(tmp_path):
    root = tmp_path / "photos"
    files = image_folder(root, 80)
    cfg = config(root, tmp_path / "out", content_hash=True)
    first = featcache.extract_from_config(cfg)["train"]
    before, old_ids = first.read("layer4"), first.ids
    first.close()
    # 8 new (10%), 2 changed bytes (2.5%), 2 deleted (2.5%)
    for i in range(80, 88):
        write_image(root / "train" / CLASSES[i % len(CLASSES)] / f"img{i:04d}.png", i)
    for file in (files[3], files[41]):
        write_image(file, 1000 + files.index(file))
    for file in (files[10], files[77]):
        file.unlink()
    updated = featcache.extract_from_config(cfg, update=True)["train"]
    run = last_run(updated)
    assert (run["kind"], run["rows_computed"], run["rows_reused"]) == ("update", 10, 76)
    assert (run["layers_computed"], run["layers_reused"]) == (0, 2)
    assert [r["kind"] for r in updated.attrs["history"]] == ["extract", "update"]
    fresh = featcache.extract_from_config(dict(cfg, output={"dir": str(tmp_path / "fresh")}))
    assert_equal_stores(updated, fresh["train"], tolerance_of("float32", None)[0])
    # The reused rows are the old store's bytes.
    sample = "bees/img0005.png"
    np.testing.assert_array_equal(
        updated.read("layer4", [updated.ids.index(sample)]), before[[old_ids.index(sample)]]
    )
    result = verify_store(updated.path, samples=-1)
    assert result.passed, [c for c in result.checks if not c.ok]


def test_update_that_adds_a_layer_computes_only_that_layer(tmp_path):
    root = tmp_path / "photos"
    image_folder(root, 40)
    cfg = config(root, tmp_path / "out")
    first = featcache.extract_from_config(cfg)["train"]
    before = {layer: first.read(layer).numpy() for layer in first.layers}
    first.close()
    layers = [*LAYERS, {"name": "layer1", "reduce": "avg"}]
    updated = featcache.extract_from_config(dict(cfg, layers=layers), update=True)["train"]
    run = last_run(updated)
    assert (run["rows_computed"], run["rows_reused"]) == (0, 40)
    assert (run["layers_computed"], run["layers_reused"]) == (1, 2)
    for layer, values in before.items():
        np.testing.assert_array_equal(updated.read(layer).numpy(), values, err_msg=layer)
    fresh = featcache.extract_from_config(
        dict(cfg, layers=layers, output={"dir": str(tmp_path / "fresh")})
    )["train"]
    # The same batches as a fresh run: the new layer is bit for bit the fresh one.
    assert_equal_stores(updated, fresh)


def test_update_drops_removed_layers_and_vanished_samples(tmp_path):
    root = tmp_path / "photos"
    files = image_folder(root, 24)
    cfg = config(root, tmp_path / "out")
    featcache.extract_from_config(cfg)["train"].close()
    files[5].unlink()
    updated = featcache.extract_from_config(dict(cfg, layers=LAYERS[:1]), update=True)["train"]
    run = last_run(updated)
    assert (run["rows_computed"], run["rows_reused"], run["layers_computed"]) == (0, 23, 0)
    fresh = featcache.extract_from_config(
        dict(cfg, layers=LAYERS[:1], output={"dir": str(tmp_path / "fresh")})
    )["train"]
    assert_equal_stores(updated, fresh)


def test_update_of_a_current_store_or_a_missing_one(tmp_path):
    root = tmp_path / "photos"
    image_folder(root, 20)
    cfg = config(root, tmp_path / "out")
    made = featcache.extract_from_config(cfg, update=True)["train"]  # none yet: extracted
    assert last_run(made)["kind"] == "extract"
    made.close()
    again = featcache.extract_from_config(cfg, update=True)["train"]  # nothing to do
    assert len(again.attrs["history"]) == 1


def test_update_refuses_another_model_and_overwrite(tmp_path):
    root = tmp_path / "photos"
    image_folder(root, 20)
    cfg = config(root, tmp_path / "out")
    store = featcache.extract_from_config(cfg)["train"]
    stored = store.path.read_bytes()
    store.close()
    other = dict(cfg, model={"name": "resnet34"})
    with pytest.raises(ConfigError, match=r"cannot update .*model.*--overwrite"):
        featcache.extract_from_config(other, update=True)
    resized = dict(cfg, preprocess={"resize": 40, "mean": [0.485, 0.456, 0.406]})
    with pytest.raises(ConfigError, match=r"preprocess.resize.*--overwrite"):
        featcache.extract_from_config(resized, update=True)
    half = dict(cfg, store={"dtype": "float16"})
    with pytest.raises(ConfigError, match=r"store dtype.*--overwrite"):
        featcache.extract_from_config(half, update=True)
    overwriting = dict(cfg, output={**cfg["output"], "overwrite": True})
    with pytest.raises(ConfigError, match="exclude each other"):
        featcache.extract_from_config(overwriting, update=True)
    assert store.path.read_bytes() == stored  # untouched
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["extract", str(config_file), "--update", "--overwrite"])
    assert result.exit_code != 0
    assert "exclude each other" in result.output


def test_cli_update_reports_what_it_computed_and_info_shows_the_history(tmp_path):
    from typer.testing import CliRunner

    root = tmp_path / "photos"
    image_folder(root, 20)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config(root, tmp_path / "out")))
    runner = CliRunner()
    assert runner.invoke(app, ["extract", str(config_file)]).exit_code == 0
    write_image(root / "train" / "ants" / "new.png", 500)
    result = runner.invoke(app, ["extract", str(config_file), "--update"])
    assert result.exit_code == 0, result.output
    assert "update: computed 1 rows and 0 layers, reused 20 rows and 2 layers" in result.output
    info = runner.invoke(app, ["info", str(tmp_path / "out" / "train.h5")])
    assert "history" in info.output and "update: computed 1 rows" in info.output


def slow_config(root: Path, out: Path) -> dict:
    """A tiny net that sleeps per batch: an update long enough to be killed mid-way."""
    return dict(
        config(root, out, layers=[{"name": "conv", "reduce": "avg"}, {"name": "fc"}]),
        model={"factory": "tests.factories:SlowNet", "kwargs": {"delay": 0.1}},
        loader={"batch_size": 4, "num_workers": 0},
        store={"dtype": "float32", "chunk_rows": 4},
    )


@pytest.mark.slow
def test_sigkill_during_an_update_then_rerun_equals_the_uninterrupted_update(tmp_path):
    root = tmp_path / "photos"
    files = image_folder(root, 24)
    cfg = slow_config(root, tmp_path / "out")
    store = tmp_path / "out" / "train.h5"
    featcache.extract_from_config(cfg)["train"].close()
    original = {"ids": FeatureStore(store).ids, "fc": FeatureStore(store).read("fc").numpy()}
    for i in range(24, 64):
        write_image(root / "train" / CLASSES[i % len(CLASSES)] / f"img{i:04d}.png", i)
    files[2].unlink()
    reference = tmp_path / "reference" / "train.h5"
    reference.parent.mkdir()
    shutil.copy(store, reference)
    featcache.extract_from_config(dict(cfg, output={"dir": str(reference.parent)}), update=True)

    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "featcache", "extract", str(config_file), "--update"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    partial = partial_path(store)
    rng = random.Random(20261127)
    kills = reads = 0

    def old_store_reads() -> None:  # whole and unchanged while the update runs
        nonlocal reads
        with FeatureStore(store) as old:
            assert old.ids == original["ids"]
            np.testing.assert_array_equal(old.read("fc").numpy(), original["fc"])
        reads += 1

    for _ in range(3):
        process = subprocess.Popen(
            command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 120
        while process.poll() is None and not partial.exists() and time.monotonic() < deadline:
            old_store_reads()
        kill_at = time.monotonic() + rng.uniform(0.1, 0.8)  # while rows are being written
        while process.poll() is None and time.monotonic() < kill_at:
            old_store_reads()
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait(timeout=60)
        old_store_reads()
    assert kills >= 2, f"only {kills} kills landed during the update; the test proves nothing"
    assert partial.exists()
    with pytest.raises(ConfigError, match="stopped update.*--update"):
        featcache.extract_from_config(cfg)  # a plain run does not take it for its own
    subprocess.run(command, cwd=repo, env=env, check=True, capture_output=True, timeout=300)
    assert not partial.exists()
    assert_same_store(store, reference)
    assert reads > 10
    run = last_run(FeatureStore(store))
    assert (run["rows_computed"], run["rows_reused"]) == (40, 23)


def test_python_update_of_a_tensor_dataset(resnet18, tmp_path):
    import torch

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(30, 3, 32, 32, generator=generator)
    y = torch.arange(30) % 3
    ids = [f"sample-{i}" for i in range(30)]
    path = tmp_path / "store.h5"
    layers = ["layer2", {"name": "layer4", "reduce": "avg"}]
    options = {"batch_size": 8, "dtype": "float32", "progress": False}
    dataset = torch.utils.data.TensorDataset(x[:24], y[:24])
    featcache.extract(resnet18, dataset, layers, path, ids=ids[:24], **options).close()
    grown = torch.utils.data.TensorDataset(x, y)
    updated = featcache.extract(resnet18, grown, layers, path, ids=ids, update=True, **options)
    assert (last_run(updated)["rows_computed"], last_run(updated)["rows_reused"]) == (6, 24)
    fresh = featcache.extract(resnet18, grown, layers, tmp_path / "fresh.h5", ids=ids, **options)
    assert_equal_stores(updated, fresh, tolerance_of("float32", None)[0])
    import torchvision

    torch.manual_seed(1)
    other = torchvision.models.resnet18().eval()  # other weights
    with pytest.raises(ConfigError, match="cannot update .*weights differ"):
        featcache.extract(other, grown, layers, path, ids=ids, update=True, **options)
    with pytest.raises(ConfigError, match="exclude each other"):
        featcache.extract(resnet18, grown, layers, path, update=True, overwrite=True)
    # A transform the fingerprints cannot see: the reused rows, recomputed, differ.
    brighter = torch.utils.data.TensorDataset(x[:28] * 2, y[:28])
    with pytest.raises(ConfigError, match="cannot update .*recomputed now differs"):
        featcache.extract(resnet18, brighter, layers, path, ids=ids[:28], update=True, **options)


def stop_an_update(config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run an update of ``config`` that stops just before its store completes."""
    from featcache.extraction import update

    def stop(self):
        raise RuntimeError("stopped")

    with monkeypatch.context() as patch:
        patch.setattr(update.MergedRows, "finish", stop)
        with pytest.raises(RuntimeError, match="stopped"):
            featcache.extract_from_config(config, update=True)


def stopped_over_added_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A store of 40 images, 8 images added, and an update of it stopped: the config, the
    store's path and bytes, and the added images."""
    root = tmp_path / "photos"
    image_folder(root, 40)
    cfg = config(root, tmp_path / "out", layers=[{"name": "layer2", "reduce": "avg"}])
    store = featcache.extract_from_config(cfg)["train"]
    stored = store.path.read_bytes()
    store.close()
    added = [root / "train" / CLASSES[i % len(CLASSES)] / f"img{i:04d}.png" for i in range(40, 48)]
    for i, file in enumerate(added, start=40):
        write_image(file, i)
    stop_an_update(cfg, monkeypatch)
    assert store_state(store.path).update_partial
    return cfg, store.path, stored, added


def test_a_stopped_update_is_redone_by_update_and_refused_by_a_plain_run(tmp_path, monkeypatch):
    cfg, path, stored, _ = stopped_over_added_images(tmp_path, monkeypatch)
    assert path.read_bytes() == stored  # the old store, whole
    with pytest.raises(ConfigError, match="stopped update.*--update"):
        featcache.extract_from_config(cfg)
    updated = featcache.extract_from_config(cfg, update=True)["train"]
    assert not partial_path(path).exists()
    assert last_run(updated)["rows_computed"] == 8
    fresh = featcache.extract_from_config(dict(cfg, output={"dir": str(tmp_path / "fresh")}))
    assert_equal_stores(updated, fresh["train"], tolerance_of("float32", None)[0])


@pytest.mark.parametrize("then", ["store deleted", "folder restored"])
def test_update_over_a_stopped_update_it_no_longer_needs(tmp_path, monkeypatch, then):
    """The stopped update is dropped: the store is extracted afresh (its store was
    deleted), or found complete (the folder is back as the store holds it)."""
    cfg, path, stored, added = stopped_over_added_images(tmp_path, monkeypatch)
    if then == "store deleted":
        path.unlink()
    else:
        for file in added:
            file.unlink()
    got = featcache.extract_from_config(cfg, update=True)["train"]
    assert not partial_path(path).exists()
    if then == "store deleted":
        fresh = featcache.extract_from_config(dict(cfg, output={"dir": str(tmp_path / "fresh")}))
        assert len(got) == 48
        assert_equal_stores(got, fresh["train"])
    else:
        got.close()
        assert path.read_bytes() == stored


def test_info_of_a_stopped_update_says_to_rerun_it_with_update(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    root = tmp_path / "photos"
    image_folder(root, 20)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config(root, tmp_path / "out", layers=LAYERS[:1])))
    store = featcache.extract_from_config(path)["train"]
    store.close()
    write_image(root / "train" / CLASSES[0] / "img0100.png", 100)
    stop_an_update(path, monkeypatch)
    assert store_state(store.path).update_partial
    info = CliRunner().invoke(app, ["info", str(partial_path(store.path))])
    assert info.exit_code == 0, info.output
    assert "rerun it to resume" not in info.stdout
    assert "the update stopped; rerun it with --update" in info.stdout
    assert f"resume     featcache extract {path} --update\n" in info.stdout
