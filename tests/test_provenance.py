"""The store key (one record of what decides a store's bytes) and the config fingerprint."""

from __future__ import annotations

import dataclasses

from featcache.config.spec import load_config
from featcache.extraction.sharding import combined_key
from featcache.store.provenance import StoreKey, config_fingerprint, store_attributes

BASE = {
    "model": {"name": "resnet18"},
    "layers": ["layer1"],
    "data": {"source": "synthetic", "splits": ["train"]},
}


def _key(**changes) -> StoreKey:
    key = StoreKey(
        config_fingerprint="c",
        weights={"source": "module", "sha256": "w"},
        dataset_fingerprint="d",
        source_rows=10,
        rows=(0, 10),
        taps=({"key": "layer1"},),
        store_dtype="float16",
        chunk_rows=None,
        compression=None,
        batch_size=4,
        on_nonfinite="fail",
        layout={"device": "cuda:1", "channels_last": True, "amp": None},
    )
    return dataclasses.replace(key, **changes)


def test_key_round_trips_through_json_and_names_its_differences():
    key = _key()
    stored = key.to_json()
    assert "world_size" not in stored and stored["rows"] == [0, 10]
    assert key.matches(stored)
    assert _key(store_dtype="float32").differences(stored) == ["store_dtype"]
    assert key.differences(None) == sorted(stored)


def test_a_combined_key_is_the_same_from_every_shard_and_any_number_of_processes():
    a = combined_key(_key(rows=(0, 4)), 10)
    b = combined_key(
        _key(rows=(4, 10), layout={"device": "cuda:0", "channels_last": True, "amp": None}), 10
    )
    assert a == b and a.world_size is None and a.rows == (0, 10)
    assert a.to_json()["layout"]["device"] == "cuda"


def test_store_attributes_hold_the_key_and_provenance():
    attrs = store_attributes(_key(), {"split": "train"}, device="cpu", class_names=["a"])
    assert attrs["resume_key"] == _key().to_json() and attrs["split"] == "train"
    assert attrs["weights"] == {"source": "module", "sha256": "w"}
    assert attrs["class_names"] == ["a"] and "torch" in attrs["versions"]


def test_config_fingerprint_leaves_out_only_content_free_keys():
    base = config_fingerprint(load_config(BASE))
    same = load_config(BASE, ["loader.num_workers=0", "output.dir=x", "loader.on_error=skip"])
    assert config_fingerprint(same) == base
    assert config_fingerprint(load_config(BASE, ["loader.batch_size=8"])) != base


def test_keys_added_later_leave_older_fingerprints_alone():
    """Stores written before the text, bucketing and decoding keys existed still resume
    and verify: those keys count only when set to something the older stores did not do.
    Older stores decoded JPEGs at reduced scale, so a config read from one is the demo with
    ``loader.decode=fast``; today's default (exact) is a different computation."""
    from pathlib import Path

    from featcache.config.spec import from_dict, load_config, to_dict
    from featcache.store.provenance import config_fingerprint, recorded_config

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    before = "46da3231fe426448512a98c32e85c683c2b492b11245f28dd9526b58d9ab6bbf"
    assert config_fingerprint(load_config(demo, ["loader.decode=fast"])) == before
    assert config_fingerprint(load_config(demo)) != before
    older = to_dict(load_config(demo))
    del older["loader"]["decode"], older["data"]["limit"], older["data"]["class_names"]
    assert config_fingerprint(from_dict(recorded_config(older))) == before
    assert config_fingerprint(load_config(demo, ["loader.bucket_by_length=true"])) != before
    texts = "data={source: text, root: r, splits: {train: t.csv}%s}"
    plain = config_fingerprint(load_config(demo, [texts % ""]))
    assert config_fingerprint(load_config(demo, [texts % ", max_length: 32"])) != plain
