"""Every CLI command end to end on tiny inputs; errors are one line with the right code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from featcache.commands.app import app
from featcache.store import FeatureStore

runner = CliRunner()


@pytest.fixture
def config_file(tmp_path) -> Path:
    config = {
        "model": {"name": "resnet18"},
        "preprocess": {"mean": [0.485, 0.456, 0.406]},  # 32px as it is
        "layers": [{"name": "layer3", "reduce": "avg"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 3},
            "splits": {"train": {"size": 12}},
        },
        "loader": {"batch_size": 6},
        "output": {"dir": str(tmp_path / "out")},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _error_line(result) -> str:
    """The one error line; progress bars may share stderr, tracebacks may not."""
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("featcache: error: ")
    return lines[0]


def test_help_for_every_command():
    for args in ([], ["extract"], ["layers"], ["info"], ["demo"]):
        result = runner.invoke(app, [*args, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output


def test_version():
    import featcache

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"featcache {featcache.__version__}\n"


def test_usage_errors_are_one_plain_line():
    result = runner.invoke(app, ["verify", "--bogus"])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if "Error" in line]
    assert errors == ["Error: No such option: --bogus"], result.output
    assert not any(ch in result.output for ch in "\u256d\u2502\u2500"), result.output  # no box


def test_extract_then_info(config_file, tmp_path):
    result = runner.invoke(app, ["extract", str(config_file), "--set", "store.dtype=float32"])
    assert result.exit_code == 0, result.output
    path = tmp_path / "out" / "train.h5"
    assert f"{path}: 12 rows; layer3 [256]" in result.stdout
    assert FeatureStore(path).dtype("layer3").is_floating_point
    info = runner.invoke(app, ["info", str(path)])
    assert info.exit_code == 0, info.output
    assert "complete, 12 rows" in info.stdout
    assert "layer3" in info.stdout and "[256]" in info.stdout and "float32" in info.stdout
    as_json = json.loads(runner.invoke(app, ["info", str(path), "--json"]).stdout)
    assert as_json["complete"] is True
    assert as_json["layers"]["layer3"]["shape"] == [256]
    assert as_json["config"]["store"]["dtype"] == "float32"


def test_rerun_of_a_finished_config_is_a_no_op_and_changes_need_overwrite(config_file, tmp_path):
    first = runner.invoke(app, ["extract", str(config_file)])
    assert first.exit_code == 0 and "already complete" not in first.stdout
    path = tmp_path / "out" / "train.h5"
    before = path.stat().st_mtime_ns
    again = runner.invoke(app, ["extract", str(config_file)])  # resumes: nothing left to do
    assert again.exit_code == 0 and path.stat().st_mtime_ns == before
    assert again.stdout.strip().endswith("images/s; already complete")
    changed = runner.invoke(app, ["extract", str(config_file), "--set", "store.dtype=float32"])
    assert changed.exit_code == 2
    assert "already exists" in _error_line(changed) and "--overwrite" in _error_line(changed)
    assert path.stat().st_mtime_ns == before
    replaced = runner.invoke(
        app, ["extract", str(config_file), "--set", "store.dtype=float32", "--overwrite"]
    )
    assert replaced.exit_code == 0
    assert FeatureStore(path).dtype("layer3") == torch.float32


@pytest.mark.parametrize(
    "override, expected",
    [
        ("layers=[layer5]", "unknown layer 'layer5'; close matches: layer4"),
        ("model.name=resnet181", "resnet18"),
        ("loader.batch_sise=4", "unknown config key loader.batch_sise"),
    ],
)
def test_config_errors_exit_2_with_one_line(config_file, override, expected):
    result = runner.invoke(app, ["extract", str(config_file), "--set", override])
    assert result.exit_code == 2
    assert expected in _error_line(result)


def test_runtime_errors_exit_1_and_debug_shows_traceback(tmp_path):
    root = tmp_path / "images" / "train" / "cats"
    root.mkdir(parents=True)
    (root / "broken.jpg").write_bytes(b"")
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "resnet18"},
                "layers": ["layer1"],
                "data": {"root": str(tmp_path / "images"), "splits": ["train"]},
                "preprocess": {"resize": 32},
                "output": {"dir": str(tmp_path / "out")},
            }
        )
    )
    result = runner.invoke(app, ["extract", str(config)])
    assert result.exit_code == 1
    assert "broken.jpg" in _error_line(result)
    debug = runner.invoke(app, ["--debug", "extract", str(config), "--overwrite"])
    assert debug.exit_code == 1 and "Traceback" in debug.stderr


def test_interrupted_extract_names_the_command_that_resumes(config_file, monkeypatch):
    def interrupted(config, overrides, check_space, shard):
        assert overrides == ["loader.batch_size=4", "output.overwrite=true"] and check_space
        assert shard is None
        raise KeyboardInterrupt

    monkeypatch.setattr("featcache.extraction.extract_from_config", interrupted)
    args = ["extract", str(config_file), "--set", "loader.batch_size=4", "--overwrite"]
    result = runner.invoke(app, args)
    assert result.exit_code == 130
    assert result.stderr.strip() == (
        f"featcache: interrupted; what was written is kept, and `featcache extract "
        f"{config_file} --set loader.batch_size=4` resumes it"
    )


def test_an_interrupted_shard_job_names_the_job_that_resumes(config_file, monkeypatch):
    def interrupted(config, overrides, check_space, shard):
        assert shard == "1/4"
        raise KeyboardInterrupt

    monkeypatch.setattr("featcache.extraction.extract_from_config", interrupted)
    result = runner.invoke(app, ["extract", str(config_file), "--shard", "1/4"])
    assert result.exit_code == 130
    assert f"`featcache extract {config_file} --shard 1/4` resumes it" in result.stderr


def test_layers_lists_names_types_and_shapes(config_file):
    result = runner.invoke(app, ["layers", "resnet18", "--input-size", "32"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in result.stdout.splitlines()[1:]}
    assert rows["layer4"] == ["Sequential", "[512, 1, 1]"]
    assert rows["layer2.0.conv1"] == ["Conv2d", "[128, 4, 4]"]
    assert rows["fc"] == ["Linear", "[1000]"]
    from_config = runner.invoke(app, ["layers", str(config_file), "--input-size", "32"])
    assert from_config.exit_code == 0 and "layer3" in from_config.stdout
    unknown = runner.invoke(app, ["layers", "resnet181"])
    assert unknown.exit_code == 2 and "resnet18" in _error_line(unknown)


def test_info_errors(tmp_path):
    result = runner.invoke(app, ["info", str(tmp_path / "missing.h5")])
    assert result.exit_code == 2 and "store not found" in _error_line(result)


def test_demo_via_python_m(tmp_path):
    """The demo as a user runs it, a real process (`python -m featcache`): its stores,
    then its probes."""
    result = subprocess.run(
        [sys.executable, "-m", "featcache", "demo", "--output", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "train.h5: 512 rows" in result.stdout
    assert "status     complete" in result.stdout
    train = FeatureStore(tmp_path / "demo" / "train.h5")
    assert train.layers == ["layer3", "layer4", "avgpool"]
    assert len(FeatureStore(tmp_path / "demo" / "val.h5")) == 256
    # Then its probes, against chance, each column named by the rows it scores.
    lines = result.stdout.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("linear probes:"))
    assert lines[heading] == (
        "linear probes: lambda chosen on a held-out 20% of train.h5, refit on all of "
        "train.h5, scored on val.h5"
    )
    assert lines[heading + 1].split("  ")[-4:] == [
        "20% of train.h5 top-1",
        "val.h5 top-1",
        "val.h5 top-5",
        "seconds",
    ]
    assert "test top-1" not in result.stdout and "val top-1" not in result.stdout
    assert [line.split()[0] for line in lines[heading + 2 : heading + 5]] == [
        "layer3",
        "layer4",
        "avgpool",
    ]
    best = next(line for line in result.stdout.splitlines() if line.startswith("best layer"))
    accuracy, chance = (float(word.rstrip("%")) for word in best.split() if word.endswith("%"))
    assert accuracy > 3 * chance and chance == pytest.approx(10.2, abs=0.1)
    assert (tmp_path / "demo" / "probe-layers.json").is_file()
    assert (tmp_path / "demo" / "probe-layers.png").is_file()


def test_names_from_a_store_cannot_drive_the_terminal(config_file, tmp_path):
    import h5py

    from featcache.commands.output import terminal_safe
    from featcache.store import codec, seal

    assert runner.invoke(app, ["extract", str(config_file)]).exit_code == 0
    path = tmp_path / "out" / "train.h5"
    planted = ["cat\x1b[2K\rok", "dog\x1b]0;title\x07", "\u202eemag", "tab\tok"]
    with h5py.File(path, "r+") as f:
        codec.write_attrs(f, {"class_names": planted})
        seal(f)  # a store written with those names
    info = runner.invoke(app, ["info", str(path)])
    assert info.exit_code == 0, info.output
    line = next(row for row in info.stdout.splitlines() if row.startswith("labels"))
    assert line.endswith(r"(cat\x1b[2K\rok, dog\x1b]0;title\x07, \u202eemag, tab	ok)")
    assert not any(ch in info.stdout for ch in "\x1b\r\x07\u202e")
    assert terminal_safe("plain text\nsecond line") == "plain text\nsecond line"


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    # `featcache layers ... | head -1`: the pipe closes while featcache still writes.
    code = (
        "import sys, featcache.commands.app, featcache.models\n"
        "def listing(*args, **kwargs):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "featcache.models.backbone_layers = listing\n"
        "sys.argv = ['featcache', 'layers', 'resnet18']\n"
        "featcache.commands.app.main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.parametrize("name", ["out #1", "123", "null", "caf\u00e9 [x]"])
def test_demo_output_folder_is_taken_as_written(name):
    from featcache.commands.demo import demo_spec

    assert demo_spec(name).output.dir == name  # never YAML: no comment, number or null
    assert demo_spec(f"runs/{name}").output.dir == f"runs/{name}"


@pytest.mark.parametrize(
    ("factory", "flags", "message"),
    [
        ("identity", [], r"no submodule runs in the model's forward\(\), so the only layer"),
        ("Unused", [], r"forward\(\) \(--all lists the ones it holds\)"),
        ("identity", ["--all"], r"no submodule runs in the model's forward\(\), so"),
    ],
)
def test_layers_of_a_model_with_nothing_to_list_is_one_line(tmp_path, factory, flags, message):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"model: {{factory: 'tests.factories:{factory}', weights: null}}\nlayers: [fc]\n"
        "data: {source: synthetic, kwargs: {image_size: 16}, splits: {train: {size: 4}}}\n"
    )
    result = runner.invoke(app, ["layers", str(config), *flags])
    assert result.exit_code == 2, result.output
    assert re.search(message, result.stderr) and len(result.stderr.strip().splitlines()) == 1
    listed = runner.invoke(app, ["layers", str(config), "--all"]) if factory == "Unused" else None
    assert listed is None or re.search(r"^fc +Linear +-", listed.stdout, re.M)


def test_limit_spreads_samples_over_the_split_into_their_own_folder(config_file, tmp_path):
    result = runner.invoke(app, ["extract", str(config_file), "--limit", "5"])
    assert result.exit_code == 0, result.output
    trial = tmp_path / "out" / "limit-5" / "train.h5"
    assert f"{trial}: 5 rows" in result.stdout
    assert not (tmp_path / "out" / "train.h5").exists()  # the full store's place stays free
    taken = [0, 3, 6, 8, 11]  # of 12, evenly spaced from the first to the last
    with FeatureStore(trial) as store:
        assert store.index.tolist() == list(range(5)) and store.config["data"]["limit"] == 5
    full = runner.invoke(app, ["extract", str(config_file)])
    assert full.exit_code == 0, full.output
    with FeatureStore(tmp_path / "out" / "train.h5") as store, FeatureStore(trial) as spread:
        assert len(store) == 12 and spread.ids == [store.ids[i] for i in taken]
        assert torch.equal(store.read("layer3")[taken], spread.read("layer3"))
    rerun = runner.invoke(app, ["extract", str(config_file), "--limit", "5"])
    assert rerun.exit_code == 0 and "already complete" in rerun.stdout


def _class_folder(root: Path, sizes: dict[str, int]) -> Path:
    """A class folder of 32x32 PNGs, ``sizes[name]`` in each class."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for name, count in sizes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(root / name / f"{i:02d}.png")
    return root


def test_limit_over_a_class_folder_takes_every_class_so_a_probe_trains(tmp_path):
    root = _class_folder(tmp_path / "data" / "train", {"ants": 14, "bees": 8, "cats": 8})
    config = tmp_path / "folder.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "resnet18"},
                "preprocess": {"mean": [0.485, 0.456, 0.406]},
                "layers": [{"name": "layer3", "reduce": "avg"}],
                "data": {"source": "imagefolder", "root": str(root.parent), "splits": ["train"]},
                "loader": {"batch_size": 4, "num_workers": 0},
                "output": {"dir": str(tmp_path / "out")},
            }
        )
    )
    result = runner.invoke(app, ["extract", str(config), "--limit", "12"])
    assert result.exit_code == 0, result.output
    trial = tmp_path / "out" / "limit-12" / "train.h5"
    files = sorted(str(p.relative_to(root)) for p in root.glob("*/*.png"))
    with FeatureStore(trial) as store:  # the first 12 would all be ants
        assert store.ids == [files[p] for p in (0, 3, 5, 8, 11, 13, 16, 18, 21, 24, 26, 29)]
        assert store.labels.tolist() == [0] * 6 + [1] * 3 + [2] * 3
    checked = runner.invoke(app, ["verify", str(trial), "--samples", "4"])
    assert checked.exit_code == 0, checked.output  # rebuilt from the config: the same rows
    probed = runner.invoke(app, ["probe", str(trial), "-l", "layer3", "--no-progress"])
    assert probed.exit_code == 0, probed.output
    assert "only one class" not in probed.output


def test_layers_of_a_config_probe_at_its_own_input_size(config_file):
    result = runner.invoke(app, ["layers", str(config_file)])
    assert result.exit_code == 0, result.output
    assert "input 32px" in result.stdout.splitlines()[0]  # the data's 32 px, not 224
    assert "layer4 " in result.stdout and "[512, 1, 1]" in result.stdout


def test_info_shows_the_preprocessing_and_the_gradient_target(tmp_path):
    config = {
        "model": {"name": "resnet18"},
        "preprocess": {"resize": 36, "crop": 32},
        "layers": ["layer2", {"name": "layer2", "capture": "grad", "target": "predicted"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 40},
            "splits": {"val": {"size": 4}},
        },
        "loader": {"num_workers": 0},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    path = tmp_path / "grad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert runner.invoke(app, ["extract", str(path)]).exit_code == 0
    info = runner.invoke(app, ["info", str(tmp_path / "out" / "val.h5")])
    assert info.exit_code == 0, info.output
    lines = info.stdout.splitlines()
    (grad,) = [line for line in lines if line.strip().startswith("layer2@grad")]
    assert grad.endswith("layer2 grad, reduce=none, target=predicted")
    (preprocess,) = [line for line in lines if line.startswith("preprocess ")]
    assert "Resize(size=36" in preprocess and "CenterCrop(size=(32, 32))" in preprocess
    assert "decode     exact" in lines


@pytest.mark.parametrize(
    "override, expected",
    [
        ("layers=[layer5]", "unknown layer 'layer5'"),
        ("model.name=resnet181", "resnet18"),
        ("data.splits.train.size=0", "data.splits.train.size must be a whole number"),
    ],
)
def test_a_refused_run_leaves_no_output_folder_behind(config_file, tmp_path, override, expected):
    """The folders a refused run created go (it never wrote into them); one that was
    there before stays."""
    made = tmp_path / "made"
    made.mkdir()
    for out in (tmp_path / "new" / "deeper", made):
        args = ["extract", str(config_file), "--set", override, "--set", f"output.dir={out}"]
        result = runner.invoke(app, args)
        assert result.exit_code != 0 and expected in _error_line(result)
    assert not (tmp_path / "new").exists()
    assert made.is_dir() and not any(made.iterdir())
