"""`featcache verify`: passes on good stores, names the rows of altered ones."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.commands.verify import verify_store
from featcache.errors import ConfigError
from featcache.store import seal
from tests.stores import corrupt_row, refresh_checksums, synthetic_store

runner = CliRunner()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_verify_passes_on_a_good_store(tmp_path, dtype):
    result = verify_store(synthetic_store(tmp_path, dtype), samples=-1)
    assert result.passed, [c for c in result.checks if not c.ok]
    names = {check.name for check in result.checks}
    assert {"complete", "config", "weights", "dataset", "alignment", "ids", "labels"} <= names
    assert {"finite", "values", "layers", "taps", "key", "checksums", "unique ids"} <= names
    assert result.rows == list(range(30))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_quick_verify_finds_a_nan_written_with_a_valid_checksum(tmp_path, dtype):
    # All-ones bits are a NaN in each stored dtype; the chunk's checksum is recorded
    # afterwards, as a writer that stored the NaN itself would have.
    path = synthetic_store(tmp_path, dtype)
    corrupt_row(path, "features/layer4", 13, nbytes=4, skip=8, fill=0xFF)
    refresh_checksums(path)
    result = verify_store(path, quick=True)
    checks = {check.name: check for check in result.checks}
    assert checks["checksums"].ok and not checks["finite"].ok
    assert checks["finite"].detail == "NaN or Inf in layer layer4"


def test_verify_compares_the_recorded_store_key(tmp_path):
    """The layers and weights recorded in the store's key are checked, not only the config."""
    path = synthetic_store(tmp_path)
    with h5py.File(path, "r+") as f:
        key = json.loads(f.attrs["resume_key"])
        key["taps"][1]["reduce"] = "max"
        key["weights"]["seed"] = 123
        f.attrs["resume_key"] = json.dumps(key)
        seal(f)  # a store written with that key, not one damaged since
    result = verify_store(path, samples=0)
    failed = {check.name for check in result.checks if not check.ok}
    assert failed == {"taps", "weights"}


def test_verify_fails_naming_the_altered_row(tmp_path):
    path = synthetic_store(tmp_path, checksum=False)  # only recomputing can tell
    corrupt_row(path, "features/layer2", 17, nbytes=64, skip=16, fill=0x7B)
    result = verify_store(path, samples=-1)
    assert not result.passed
    (values,) = [c for c in result.checks if c.name == "values"]
    assert not values.ok and "layer2: rows 17 differ" in values.detail
    cli = runner.invoke(app, ["verify", str(path), "--samples", "-1"])
    assert cli.exit_code == 1
    assert "FAIL  values" in cli.stdout and "rows 17" in cli.stdout
    assert "verify: FAIL (values)" in cli.stdout


def test_verify_always_checks_first_and_last_rows(tmp_path):
    path = synthetic_store(tmp_path, checksum=False)
    corrupt_row(path, "features/layer2", 29, nbytes=64, skip=16, fill=0x7B)
    result = verify_store(path, samples=2, seed=3)
    assert 0 in result.rows and 29 in result.rows and len(result.rows) == 4
    assert not result.passed
    with pytest.raises(ConfigError, match="samples must be .* or -1 for every row, got -2"):
        verify_store(path, samples=-2)
    refused = runner.invoke(app, ["verify", str(path), "--samples", "-5"])
    assert refused.exit_code == 2 and "got -5" in refused.output


def test_checksums_catch_a_flipped_byte_without_the_model(tmp_path):
    path = synthetic_store(tmp_path)
    quick = runner.invoke(app, ["verify", str(path), "--quick"])
    assert quick.exit_code == 0, quick.output
    assert "ok    checksums  every chunk matches its checksum" in quick.stdout
    assert "values" not in quick.stdout  # nothing was recomputed
    corrupt_row(
        path, "features/layer2", 17, nbytes=64, skip=16
    )  # chunk_rows 4: the chunk of rows 16-19
    for extra in (["--quick"], []):
        cli = runner.invoke(app, ["verify", str(path), *extra])
        assert cli.exit_code == 1, cli.output
        assert "FAIL  checksums  corrupted chunks: features/layer2 rows 16-19" in cli.stdout
        assert "verify: FAIL (checksums)" in cli.stdout


@pytest.mark.parametrize(("key", "check"), [("ids", "unique ids"), ("index", "alignment")])
def test_a_corrupted_row_table_is_a_failed_check_not_an_error(tmp_path, key, check):
    path = synthetic_store(tmp_path)
    corrupt_row(path, key, 5, nbytes=1)
    cli = runner.invoke(app, ["verify", str(path), "--quick"])
    assert cli.exit_code == 1, cli.output
    assert f"FAIL  checksums  corrupted chunks: {key} rows 4-7" in cli.stdout
    assert f"verify: FAIL ({check}, checksums)" in cli.stdout
    result = verify_store(path, quick=True)
    assert {c.name for c in result.checks if not c.ok} == {check, "checksums"}


def test_quick_verify_checks_alignment_and_the_key(tmp_path):
    path = synthetic_store(tmp_path)
    with h5py.File(path, "r+") as f:
        f["index"][3] = f["index"][2]  # a row claims another row's source sample
    result = verify_store(path, quick=True)
    assert {c.name for c in result.checks if not c.ok} == {"alignment", "checksums"}
    refresh_checksums(path)  # as if written so
    result = verify_store(path, quick=True)
    assert {c.name for c in result.checks if not c.ok} == {"alignment"}
    with h5py.File(path, "r+") as f:
        f["index"][3] = 3
        config = json.loads(f.attrs["config"])
        config["model"]["name"] = "resnet34"  # the recorded config no longer makes the key
        f.attrs["config"] = json.dumps(config)
        seal(f)
    refresh_checksums(path)
    result = verify_store(path, quick=True)
    assert {c.name for c in result.checks if not c.ok} == {"key"}


def test_quick_verify_of_an_incomplete_store_checks_the_rows_written_so_far(tmp_path):
    store = synthetic_store(tmp_path)
    path = store.with_name(store.name + ".partial")
    store.rename(path)  # as a run stopped after 16 of its 30 rows leaves it
    with h5py.File(path, "r+") as f:
        f.attrs["complete"] = False
        f["progress"][0] = 16
    result = verify_store(path, quick=True)
    assert {c.name for c in result.checks if not c.ok} == {"complete"}
    (alignment,) = [c for c in result.checks if c.name == "alignment"]
    assert alignment.detail == "16 rows + 0 skipped = the first 16 of 30 source samples, in order"
    with h5py.File(path, "r+") as f:
        f["index"][5:16] = np.arange(6, 17)  # in order, but source sample 5 is missing
    refresh_checksums(path)
    result = verify_store(path, quick=True)
    assert {c.name for c in result.checks if not c.ok} == {"complete", "alignment"}


def test_verify_runs_no_code_named_in_a_store(tmp_path):
    marker = tmp_path / "factory-ran"
    config = {
        "model": {"factory": "tests.factories:touching_net", "kwargs": {"marker": str(marker)}},
        "layers": [{"name": "conv", "reduce": "avg"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 16, "num_classes": 3},
            "splits": {"val": {"size": 12}},
        },
        "preprocess": {"resize": 16, "crop": 16},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    path = featcache.extract_from_config(config)["val"].path
    marker.unlink()
    refused = runner.invoke(app, ["verify", str(path)])
    assert refused.exit_code == 2
    errors = [line for line in refused.stderr.splitlines() if line.strip()]
    assert errors == [
        f"featcache: error: {path} records a config that would import tests.factories and "
        f"call tests.factories:touching_net(marker={str(marker)!r}) (model.factory); verify "
        "runs no code named in a store: pass --trust-factory to run it, or --config FILE to "
        "rebuild from your own"
    ]
    assert not marker.exists()
    for command in (["info"], ["verify", "--quick"], ["show", "-l", "conv", "-o", "x.png"]):
        runner.invoke(app, [command[0], str(path), *command[1:]])
        assert not marker.exists(), command

    trusted = runner.invoke(app, ["verify", str(path), "--trust-factory"])
    assert trusted.exit_code == 0, trusted.output
    assert "--trust-factory: verify will import tests.factories and call" in trusted.stderr
    assert marker.exists()

    marker.unlink()
    own = tmp_path / "own.yaml"
    own.write_text(json.dumps(config))
    rebuilt = runner.invoke(app, ["verify", str(path), "--config", str(own)])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert f"(rebuilt from {own})" in rebuilt.stdout and marker.exists()


def test_verify_cli_pass_and_altered_ids(tmp_path):
    path = synthetic_store(tmp_path)
    ok = runner.invoke(app, ["verify", str(path)])
    assert ok.exit_code == 0, ok.output
    assert "verify: PASS (10 rows recomputed)" in ok.stdout
    with h5py.File(path, "r+") as f:
        f["ids"][5] = b"synthetic:99"
    refresh_checksums(path)  # a store written so: its chunks pass, its ids are wrong
    bad = runner.invoke(app, ["verify", str(path)])
    assert bad.exit_code == 1 and "FAIL  ids        rows 5 differ" in bad.stdout


def test_verify_sees_changed_data_and_skips(tmp_path):
    root = tmp_path / "images" / "all" / "things"
    root.mkdir(parents=True)
    for i in range(5):
        Image.new("RGB", (24, 24), (i * 40, 10, 10)).save(root / f"{i}.png")
    (root / "2b.png").write_bytes(b"")  # skipped
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer1", "reduce": "avg"}],
        "data": {"root": str(tmp_path / "images"), "splits": ["all"]},
        "preprocess": {"resize": 32},
        "loader": {"on_error": "skip"},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    with pytest.warns(UserWarning, match="1 of 6 samples skipped"):
        path = featcache.extract_from_config(config)["all"].path
    result = verify_store(path, samples=-1)
    assert result.passed, [c for c in result.checks if not c.ok]
    (alignment,) = [c for c in result.checks if c.name == "alignment"]
    assert "5 rows + 1 skipped = 6 source samples" in alignment.detail
    noise = np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8)
    Image.fromarray(noise).save(root / "3.png")  # the data changed
    result = verify_store(path, samples=-1)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"dataset", "stamps", "values"}
    assert failed["stamps"].startswith("row 3, things/3.png: changed on disk since extraction")
    for name in ("3.png", "4.png"):  # the data shrank: rows 3 and 4 point past its end
        (root / name).unlink()
    result = verify_store(path, samples=-1)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"dataset", "ids", "labels", "values"}
    assert (
        failed["values"] == "not recomputed: rows 3, 4 are samples past the 4 the source holds now"
    )


def test_verify_needs_a_recorded_config(resnet18, images, tmp_path):
    store = featcache.extract(resnet18, images, ["layer1"], tmp_path / "s.h5", progress=False)
    with pytest.raises(ConfigError, match="records no config"):
        verify_store(store.path)
    assert runner.invoke(app, ["verify", str(store.path)]).exit_code == 2


def test_same_config_twice_same_arrays_and_fingerprints(tmp_path):
    a = featcache.FeatureStore(synthetic_store(tmp_path / "a"))
    b = featcache.FeatureStore(synthetic_store(tmp_path / "b"))
    for layer in a.layers:
        assert torch.equal(a.read(layer), b.read(layer))
    for key in ("config_fingerprint", "dataset_fingerprint", "weights"):
        assert a.attrs[key] == b.attrs[key]


def test_a_store_that_kept_inf_values_verifies(tmp_path):
    # Inputs scaled by 1e7 overflow float16 in layer4: kept as Inf, recomputed as Inf.
    config = {
        "model": {"name": "resnet18", "weights": None},
        "layers": [{"name": "layer4", "reduce": "avg"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 2},
            "splits": {"val": {"size": 6}},
        },
        "preprocess": {"mean": [0.5] * 3, "std": [1e-7] * 3},
        "store": {"dtype": "float16", "on_nonfinite": "keep"},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    store = featcache.extract_from_config(config)["val"]
    assert torch.isinf(store.read("layer4")).any()
    result = verify_store(store.path, samples=-1)
    assert result.passed, [c for c in result.checks if not c.ok]


def test_verify_and_cam_from_another_folder_read_the_data_where_the_run_started(
    tmp_path, monkeypatch
):
    """The config's relative paths are relative to the folder the run started in, which
    the store records: verify and cam find the data from any folder, and say which."""
    from featcache.commands.visualize import source_image

    project = tmp_path / "project"
    for i in range(4):
        folder = project / "data" / "val" / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    monkeypatch.chdir(project)
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer2", "reduce": "avg"}],
        "data": {"source": "imagefolder", "root": "data", "splits": ["val"]},
        "preprocess": {"mean": [0.485, 0.456, 0.406]},
        "loader": {"num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": "out"},
        "runtime": {"progress": False},
    }
    path = featcache.extract_from_config(config)["val"].path.resolve()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = verify_store(path, samples=-1)
    assert result.passed, [check for check in result.checks if not check.ok]
    (config_check,) = [check for check in result.checks if check.name == "config"]
    assert f"relative paths from {project}, where the run started" in config_check.detail
    cli = runner.invoke(app, ["verify", str(path), "--samples", "0"])
    assert cli.exit_code == 0 and f"relative paths from {project}" in cli.stdout
    assert source_image(path, 1).size == (32, 32)
