"""Config loading, overrides, validation errors and fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import featcache
from featcache.commands.demo import demo_config_path
from featcache.config.spec import apply_override, load_config, parse_layers, to_dict
from featcache.config.yaml_io import read_yaml
from featcache.errors import ConfigError
from featcache.store.provenance import config_fingerprint as fingerprint

REPO = Path(__file__).resolve().parents[1]
BASE = {
    "model": {"name": "resnet18"},
    "layers": ["layer1"],
    "data": {"source": "synthetic", "splits": ["train"]},
}


def test_defaults_and_layer_shorthand():
    spec = load_config(BASE)
    assert spec.layers[0].name == "layer1" and spec.layers[0].reduce == "none"
    assert spec.data.splits == {"train": "train"}
    assert spec.store.dtype == "float16" and spec.runtime.device == "auto"
    assert spec.store_path("train") == Path("features/train.h5")


def test_overrides_are_parsed_as_yaml():
    spec = load_config(
        BASE,
        [
            "loader.batch_size=8",
            "preprocess.mean=[0.5, 0.5, 0.5]",
            "store.compression=lzf",
            "model.weights=null",
            "data.kwargs.size=12",
            "runtime.channels_last=true",
        ],
    )
    assert spec.loader.batch_size == 8
    assert spec.preprocess.mean == [0.5, 0.5, 0.5]
    assert spec.store.compression == "lzf"
    assert spec.data.kwargs == {"size": 12}
    assert spec.runtime.channels_last is True


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.spilts=[a]", "unknown config key data.spilts"),
        ("loader.batch_sise=3", "unknown config key loader.batch_sise"),
        ("bogus.key=1", "unknown config key bogus"),
        ("loader.batch_size=many", "loader.batch_size must be a whole number >= 1, got a string"),
        ("loader.batch_size=0", "loader.batch_size must be a whole number >= 1"),
        ("store.dtype=int4", "store.dtype is 'int4'; choose one of"),
        ("store.compression=zstd:30", "store.compression is 'zstd:30'; choose gzip, gzip:<1-9>"),
        ("model.factory=pkg.mod:make", "set exactly one of model.name"),
        ("layers=[]", "name at least one layer"),
        ("layers=[{name: a, reduce: pool}]", "layers[0].reduce is 'pool'"),
        ("layers=[{name: a, reduce: adaptive_avg}]", "needs size"),
        ("layers=[{name: a, wat: 1}]", "unknown config key layers[0].wat"),
        ("preprocess.mean=[1, 2]", "preprocess.mean must list 3 numbers"),
        ("preprocess.std=[0.2, 0, 0.2]", "preprocess.std [0.2, 0.0, 0.2] has a zero"),
        ("preprocess={resize: 32, crop: 40}", "preprocess.crop 40 is larger than resize 32"),
        ("preprocess.interpolation=nearest", "interpolation nearest applies to the resize, and"),
        ("preprocess.std=[1e-6, 1, 1]", "got a string '1e-6' (YAML reads 1e-6 as text; write"),
        ("data.splits=[.]", "'.' is not a usable split name (it names the store file"),
        ("data.splits=[..]", "use a plain name, mapped to a folder: {all: '..'}"),
        ("data.source=lmdb", "data.source is 'lmdb'; choose one of"),
        ("data.source=hf", "data.dataset must name a Hugging Face dataset"),
        ("data.source=imagefolder", "data.root is required"),
        # Keys the chosen source would ignore (the base config is synthetic).
        ("data.label_column=class", "data.label_column is not used by data.source=synthetic"),
        ("data.root=/data", "data.root is not used by data.source=synthetic (only by"),
        ("data.max_length=16", "data.max_length is not used by image data"),
        ("data={source: hf, dataset: x, kwargs: {streaming: true}}", "data.kwargs (streaming)"),
        (
            "data={source: manifest, root: r, splits: {t: m.csv}, image_column: img}",
            "data.image_column is not used by data.source=manifest (only by hf, parquet, ",
        ),
        ("nokey", "not of the form key.sub=value"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(BASE, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is a folder, not a config"):
        load_config(tmp_path)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("model: {name: r\xe9snet}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.yaml is not UTF-8 text \(byte 15\); save it"):
        load_config(latin)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(listy)


def test_a_key_given_twice_is_refused_not_resolved_silently(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text(
        "model: {name: resnet18}\nlayers: [layer3]\ndata: {source: synthetic}\nlayers: [layer4]\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(twice)
    assert "twice.yaml: the key 'layers' is given twice (lines 2 and 4); keep one" in str(err.value)
    nested = tmp_path / "nested.yaml"
    nested.write_text("model:\n  name: resnet18\n  weights: null\n  name: resnet50\n")
    with pytest.raises(ConfigError, match=r"key 'name' is given twice \(lines 2 and 4\)"):
        load_config(nested)
    with pytest.raises(ConfigError, match=r"override 'model=\{name: a, name: b\}': the key 'name'"):
        load_config({"layers": ["layer3"]}, ["model={name: a, name: b}"])


def test_equal_keys_in_different_mappings_and_merge_keys_are_not_repeats():
    assert read_yaml("a: {x: 1}\nb: {x: 1}\n") == {"a": {"x": 1}, "b": {"x": 1}}
    merged = "base: &base {name: resnet18, weights: null}\nmodel:\n  <<: *base\n  name: resnet34\n"
    assert read_yaml(merged)["model"] == {"name": "resnet34", "weights": None}


def test_apply_override_refuses_to_descend_into_a_scalar():
    raw = {"loader": {"batch_size": 4}}
    with pytest.raises(ConfigError, match="loader.batch_size is not a mapping"):
        apply_override(raw, "loader.batch_size.x=1")


def test_overrides_given_as_one_string_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"^overrides must be a list .* pass \['output.dir=x'\]$"):
        load_config(BASE, "output.dir=x")
    with pytest.raises(ConfigError, match=r"^overrides apply to a config file or mapping, not"):
        featcache.extract_from_config(load_config(BASE), ["output.dir=x"])


def test_fingerprint_ignores_output_and_progress_only():
    a = load_config(BASE)
    b = load_config(BASE, ["output.dir=elsewhere", "runtime.progress=false"])
    c = load_config(BASE, ["store.dtype=float32"])
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)
    assert load_config(to_dict(a)) == a  # the stored config rebuilds the same spec


def test_parse_layers_accepts_names_mappings_and_specs():
    layers = parse_layers(["a", {"name": "b", "reduce": "avg"}, *parse_layers("c")])
    assert [layer.name for layer in layers] == ["a", "b", "c"]
    with pytest.raises(ConfigError, match=r"layers\[0\].capture"):
        parse_layers([{"name": "a", "capture": "gradient"}])


def test_shipped_configs_load_and_demo_copy_matches_package():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)
    shipped = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    embedded = yaml.safe_load(demo_config_path().read_text())
    assert shipped == embedded
