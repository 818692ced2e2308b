"""A text source end to end through the CLI: extract, info, layers, verify, probe."""

from __future__ import annotations

import re

import pytest
import yaml
from typer.testing import CliRunner

from featcache.commands.app import app
from featcache.store import FeatureStore
from tests.texts import write_text_config

transformers = pytest.importorskip("transformers")
runner = CliRunner()


@pytest.fixture
def text_config(tmp_path):
    """A tiny random BERT saved with a byte-level tokenizer, JSONL splits, and a config."""
    return write_text_config(tmp_path)


def test_text_source_from_jsonl_through_the_cli_then_probe(text_config, tmp_path):
    result = runner.invoke(app, ["extract", str(text_config)])
    assert result.exit_code == 0, result.output
    train = tmp_path / "out" / "train.h5"
    store = FeatureStore(train)
    assert len(store) == 60
    assert store.labels.tolist() == [i % 2 for i in range(60)]
    assert store.ids[:2] == ["train-0", "train-1"]
    assert store.is_per_token("tokens") and not store.is_per_token("mean")
    assert store.file["truncated"].shape == (60,) and store.file["num_tokens"].shape == (60,)
    assert store.attrs["preprocessing"].startswith("tokenizer hf:")

    info = runner.invoke(app, ["info", str(train)])
    assert info.exit_code == 0 and "[T, 32]" in info.stdout, info.output
    layers = runner.invoke(app, ["layers", str(text_config)])
    assert layers.exit_code == 0, layers.output
    assert "tokens)" in layers.stdout and "encoder.layer.1" in layers.stdout
    assert "[T, 32] tokens" in layers.stdout

    show = runner.invoke(app, ["show", str(train), "-l", "tokens", "-o", str(tmp_path / "x.png")])
    assert show.exit_code == 2 and "per-token rows (text)" in show.stderr

    verify = runner.invoke(app, ["verify", str(train), "--samples", "-1"])
    assert verify.exit_code == 0, verify.output
    assert "60 rows recomputed" in verify.stdout

    probe = runner.invoke(
        app,
        ["probe", str(train), "--layer", "mean", "--test", str(tmp_path / "out" / "test.h5"),
         "--no-progress"],
    )  # fmt: skip
    assert probe.exit_code == 0, probe.output
    # The two word classes are separable from the pooled features of a random BERT.
    accuracy = float(re.search(r"test +top-1 ([\d.]+)%", probe.stdout).group(1))
    assert accuracy >= 80, probe.stdout


def test_text_data_for_an_image_model_is_one_line(text_config):
    spec = yaml.safe_load(text_config.read_text())
    spec["model"] = {"name": "resnet18"}
    text_config.write_text(yaml.safe_dump(spec))
    result = runner.invoke(app, ["extract", str(text_config)])
    assert result.exit_code == 2
    assert "takes images; text data needs a text model" in result.stderr


def test_a_missing_text_column_lists_the_columns(text_config):
    result = runner.invoke(app, ["extract", str(text_config), "--set", "data.text_column=body"])
    assert result.exit_code == 2
    assert "body" in result.stderr and "id, text, label" in result.stderr


@pytest.mark.slow
def test_torchrun_over_a_text_source_equals_one_process(text_config, tmp_path):
    from tests.test_distributed import _torchrun, assert_same_rows

    assert runner.invoke(app, ["extract", str(text_config)]).exit_code == 0
    spec = yaml.safe_load(text_config.read_text())
    spec["output"]["dir"] = str(tmp_path / "ranks")
    ranked = tmp_path / "ranks.yaml"
    ranked.write_text(yaml.safe_dump(spec))
    process = _torchrun(ranked)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    for split in ("train", "test"):
        combined = tmp_path / "ranks" / f"{split}.h5"
        assert FeatureStore(combined).attrs["world_size"] == 2
        assert_same_rows(combined, tmp_path / "out" / f"{split}.h5")


def test_a_text_run_speaks_of_texts_and_keeps_other_libraries_out_of_its_lines(
    text_config, monkeypatch
):
    """The speed is texts/s; transformers' progress bars and other libraries' warnings
    do not reach featcache's output as its own lines (``--debug`` shows them, as theirs)."""
    import contextlib
    import warnings

    from featcache.models import hf

    pretrained = ["--set", "model.weights=pretrained"]  # transformers loads them with a bar
    result = runner.invoke(app, ["extract", str(text_config), *pretrained])
    assert result.exit_code == 0, result.output
    assert "texts/s" in result.stdout and "images/s" not in result.stdout
    assert "Loading weights" not in result.stderr
    info = runner.invoke(app, ["info", str(text_config.parent / "out" / "train.h5")])
    assert "texts/s" in info.stdout

    quiet = hf.quiet_loading

    @contextlib.contextmanager
    def noisy_loading():  # another library warns while the model loads
        warnings.warn("this feature is in beta", UserWarning, stacklevel=1)
        with quiet():
            yield

    monkeypatch.setattr(hf, "quiet_loading", noisy_loading)
    again = runner.invoke(app, ["extract", str(text_config), "--overwrite"])
    assert again.exit_code == 0, again.output
    assert "beta" not in again.stderr and "featcache: warning" not in again.stderr
    debug = runner.invoke(app, ["--debug", "extract", str(text_config), "--overwrite"])
    assert "UserWarning from " in debug.stderr and "this feature is in beta" in debug.stderr
