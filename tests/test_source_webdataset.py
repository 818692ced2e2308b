"""The webdataset source over real CIFAR-10 JPEGs packed into tar shards."""

from __future__ import annotations

import os
import pickle
import tarfile
import time
import warnings
from pathlib import Path

import pytest
import yaml

import featcache
from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources import build_source
from featcache.sources.tabular import brace_expand
from featcache.store import FeatureStore, partial_path
from tests.cifar_formats import (
    add_member,
    assert_same_as_imagefolder,
    config,
    extract_images,
    key_of,
    killed_mid_run,
    write_shards,
)
from tests.test_distributed import _torchrun, assert_same_rows
from tests.test_resume import assert_same_store
from tests.test_shards import failing_after

REPO = Path(__file__).resolve().parents[1]
SHARDS = "shards/train-{000000..000003}.tar"
pytestmark = pytest.mark.usefixtures("index_cache")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    """Images in a folder and the same images in four shards, and the imagefolder store."""
    root = tmp_path_factory.mktemp("cifar")
    rows = extract_images(root / "images")
    write_shards(rows, root / "shards")
    data = {"source": "imagefolder", "root": str(root), "splits": {"train": "images"}}
    featcache.extract_from_config(config(data, root / "reference"))
    return root


def wds(root: Path, value=SHARDS, **options) -> dict:
    return {"source": "webdataset", "root": str(root), "splits": {"train": value}, **options}


def test_brace_expansion():
    assert brace_expand("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert brace_expand("{x,y}/{8..10}") == ["x/8", "x/9", "x/10", "y/8", "y/9", "y/10"]
    assert brace_expand("plain.tar") == ["plain.tar"]
    assert brace_expand("odd{}.tar") == ["odd{}.tar"]
    # As in bash: only bounds written with leading zeros pad.
    assert brace_expand("s-{0..10}.tar")[:2] == ["s-0.tar", "s-1.tar"]
    assert brace_expand("s-{00..10}.tar")[:2] == ["s-00.tar", "s-01.tar"]
    assert brace_expand("s-{9..010}.tar")[0] == "s-009.tar"


def test_same_features_labels_and_order_as_imagefolder(cifar, tmp_path):
    loader = {"batch_size": 16, "num_workers": 2}  # the source pickles into workers
    stores = featcache.extract_from_config(config(wds(cifar), tmp_path / "out", loader=loader))
    store = stores["train"]
    assert store.complete and len(store) == 200
    assert store.ids[:2] == ["airplane/0000", "airplane/0001"]
    assert_same_as_imagefolder(store.path, cifar / "reference" / "train.h5", lambda k: k + ".jpg")


def test_shards_as_a_list_and_a_glob(cifar):
    data = DataSpec(
        source="webdataset",
        root=str(cifar),
        splits={"a": ["shards/train-000000.tar", "shards/train-00000[1-3].tar"], "b": SHARDS},
    )
    a, b = build_source(data, "a", None), build_source(data, "b", None)
    assert a.ids == b.ids and len(a) == 200
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint(content=True) != a.fingerprint()
    assert len(pickle.dumps(a)) < 20_000  # paths and small arrays, no image bytes
    a.decode_size = 16  # accepted like FileSource.decode_size
    image, label = a[5]
    assert image.size == (16, 16) and label == 0  # 32 >= 2 x 16: a half-scale draft


def test_shard_indexes_are_cached_until_the_shard_changes(cifar, index_cache, monkeypatch):
    from featcache.sources import webdataset

    data = DataSpec(source="webdataset", root=str(cifar), splits={"t": SHARDS})
    first = build_source(data, "t", None)
    assert len(list(index_cache.glob("*.json"))) == 4
    calls = []
    index_shard = webdataset._index_shard
    monkeypatch.setattr(webdataset, "_index_shard", lambda *a: calls.append(a) or index_shard(*a))
    again = build_source(data, "t", None)
    assert not calls and again.ids == first.ids
    assert (again.offset == first.offset).all() and (again.labels == first.labels).all()
    shard = cifar / "shards" / "train-000002.tar"
    os.utime(shard, ns=(time.time_ns(), time.time_ns()))  # rewritten, as far as we can tell
    assert build_source(data, "t", None).ids == first.ids
    assert [call[1] for call in calls] == ["shards/train-000002.tar"]
    monkeypatch.setenv("FEATCACHE_CACHE_DIR", "")  # no cache at all
    build_source(data, "t", None)
    assert len(calls) == 5


def test_draft_mode_decodes_large_jpegs_smaller(tmp_path):
    from PIL import Image

    buffer = __import__("io").BytesIO()
    Image.new("RGB", (400, 300), (200, 10, 10)).save(buffer, "JPEG")
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        add_member(tar, "big.jpg", buffer.getvalue())
    source = build_source(
        DataSpec(source="webdataset", splits={"t": str(tmp_path / "s.tar")}), "t", None
    )
    assert source[0][0].size == (400, 300) and not source.has_labels
    source.decode_size = 64
    assert source[0][0].size == (100, 75)  # the 1/4 scale still covers 64


@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(cifar, tmp_path):
    model = {"factory": "tests.cifar_formats:slow_resnet18", "kwargs": {"delay": 0.1}}
    loader = {"batch_size": 8, "num_workers": 0}
    reference = config(wds(cifar), tmp_path / "reference", model=model, loader=loader)
    featcache.extract_from_config(reference)
    path = tmp_path / "killed.yaml"
    path.write_text(
        yaml.safe_dump(config(wds(cifar), tmp_path / "killed", model=model, loader=loader))
    )
    store = tmp_path / "killed" / "train.h5"
    kept = killed_mid_run(path, store, 40, REPO)
    assert not store.exists() and 0 < kept < 200
    featcache.extract_from_config(path)  # the same command, resumed here
    assert not partial_path(store).exists()
    assert_same_store(store, tmp_path / "reference" / "train.h5")


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(cifar, tmp_path):
    single = featcache.extract_from_config(config(wds(cifar), tmp_path / "single"))["train"]
    path = tmp_path / "torchrun.yaml"
    path.write_text(yaml.safe_dump(config(wds(cifar), tmp_path / "sharded")))
    process = _torchrun(path, processes=2)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    sharded = FeatureStore(tmp_path / "sharded" / "train.h5")
    assert sharded.attrs["world_size"] == 2
    assert_same_rows(sharded.path, single.path)
    # Each rank took whole shards: rank 0's file ends where a shard ends.
    source = build_source(DataSpec(**wds(cifar)), "train", None)
    first_rank = FeatureStore(tmp_path / "sharded" / sharded.attrs["shards"][0])
    assert len(first_rank) in source.shard_starts


def test_stopped_shard_jobs_are_finished_by_jobs_of_another_number(cifar, tmp_path, monkeypatch):
    # Jobs of 2 over four tar shards, the first stopped part way, finished by jobs of 3.
    single = featcache.extract_from_config(config(wds(cifar), tmp_path / "single"))["train"]
    sharded = config(wds(cifar), tmp_path / "sharded")
    with failing_after(monkeypatch, 4), pytest.raises(FeatcacheError, match="stopped part way"):
        featcache.extract_from_config(sharded, shard="0/2")
    for job in (2, 0, 1):
        stores = featcache.extract_from_config(sharded, shard=f"{job}/3")
    assert_same_rows(stores["train"].path, single.path)
    history = stores["train"].attrs["history"]
    assert sum(record["rows_computed"] + record["rows_resumed"] for record in history) == 200
    assert any(record["rows_resumed"] for record in history)


def test_a_corrupt_image_names_its_key_and_is_skipped_on_request(cifar, tmp_path):
    rows = extract_images(tmp_path / "images", per_class=2)
    rows[3] = (rows[3][0], rows[3][1], b"\xff\xd8\xff\xe0 not really a jpeg")
    write_shards(rows, tmp_path / "shards", shards=2)
    data = wds(tmp_path, "shards/train-{000000..000001}.tar")
    bad = key_of(rows[3][0])
    with pytest.raises(
        FeatcacheError, match=f"cannot decode image {bad}.jpg in shard shards/train-000000.tar"
    ):
        featcache.extract_from_config(config(data, tmp_path / "fail"))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        store = featcache.extract_from_config(
            config(
                data,
                tmp_path / "skip",
                loader={"batch_size": 4, "num_workers": 0, "on_error": "skip"},
            )
        )["train"]
    assert len(store) == 19 and bad not in store.ids
    assert bad in str(store.skipped)


def test_a_truncated_or_garbage_shard_is_one_line_naming_it(cifar, tmp_path):
    good = cifar / "shards" / "train-000001.tar"
    folder = tmp_path / "shards"
    folder.mkdir()
    half = good.stat().st_size // 2 // 512 * 512
    (folder / "cut.tar").write_bytes(good.read_bytes()[:half])  # at a block boundary
    (folder / "cut2.tar").write_bytes(good.read_bytes()[: half + 700])  # inside a member
    (folder / "junk.tar").write_bytes(os.urandom(5000))
    (folder / "empty.tar").write_bytes(b"")
    with tarfile.open(good) as tar:
        third = tar.getmembers()[2].offset
    middle = bytearray(good.read_bytes())
    middle[third : third + 512] = b"\x07" * 512  # a damaged header part-way through
    (folder / "damaged.tar").write_bytes(bytes(middle))
    for name, reason in [
        ("cut.tar", "is truncated"),
        ("cut2.tar", "is truncated"),
        ("junk.tar", "cannot be read as a tar file"),
        ("empty.tar", "cannot be read as a tar file"),
        ("damaged.tar", "is corrupt|not a readable tar|is truncated"),
    ]:
        data = DataSpec(source="webdataset", root=str(tmp_path), splits={"t": f"shards/{name}"})
        with pytest.raises(ConfigError, match=f"shard shards/{name} ({reason})") as info:
            build_source(data, "t", None)
        assert "\n" not in str(info.value)


def test_duplicate_keys_name_the_key_and_both_shards(cifar, tmp_path):
    shard = (cifar / "shards" / "train-000002.tar").read_bytes()
    (tmp_path / "a.tar").write_bytes(shard)
    (tmp_path / "b.tar").write_bytes(shard)
    data = DataSpec(source="webdataset", root=str(tmp_path), splits={"t": "{a,b}.tar"})
    with pytest.raises(
        ConfigError, match=r"sample key '\w+/\d+' is in two shards, a.tar and b.tar"
    ):
        build_source(data, "t", None)


def test_bad_split_values_and_samples(cifar, tmp_path):
    with pytest.raises(ConfigError, match="file not found: .*train-000004.tar"):
        build_source(
            DataSpec(
                source="webdataset",
                root=str(cifar),
                splits={"t": "shards/train-{000003..000009}.tar"},
            ),
            "t",
            None,
        )
    with pytest.raises(ConfigError, match="matches no file"):
        build_source(
            DataSpec(source="webdataset", root=str(cifar), splits={"t": "shards/*.tgz"}), "t", None
        )
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        add_member(tar, "a.cls", b"1")
        add_member(tar, "a.txt", b"hello")
    with pytest.raises(
        ConfigError,
        match=r"sample 'a' in shard s.tar has no image member \(its extensions: cls, txt\)",
    ):
        build_source(
            DataSpec(source="webdataset", root=str(tmp_path), splits={"t": "s.tar"}), "t", None
        )
    with pytest.raises(ConfigError, match="id_column does not apply"):
        build_source(
            DataSpec(source="webdataset", root=str(tmp_path), id_column="x", splits={"t": "s.tar"}),
            "t",
            None,
        )


def test_json_labels_by_name(tmp_path):
    from PIL import Image

    buffer = __import__("io").BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "PNG")
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for key, kind in [("x1", "dog"), ("x2", "cat"), ("x3", "dog")]:
            add_member(tar, f"{key}.png", buffer.getvalue())
            add_member(tar, f"{key}.json", f'{{"kind": "{kind}"}}'.encode())
    data = DataSpec(
        source="webdataset", root=str(tmp_path), label_column="kind", splits={"t": "s.tar"}
    )
    source = build_source(data, "t", None)
    assert source.class_names == ["cat", "dog"] and [source[i][1] for i in range(3)] == [1, 0, 1]
    with pytest.raises(ConfigError, match="no sample's json member has that field"):
        build_source(
            DataSpec(
                source="webdataset", root=str(tmp_path), label_column="nope", splits={"t": "s.tar"}
            ),
            "t",
            None,
        )


def _cls_shard(path: Path, seed: int, rows: int = 12, prefix: str = "s") -> None:
    """A shard of small PNGs keyed ``<prefix>NNN`` with integer .cls labels 0..2 (no class
    names anywhere)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i in range(rows):
            image = io.BytesIO()
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(image, format="PNG")
            add_member(tar, f"{prefix}{i:03d}.png", image.getvalue())
            add_member(tar, f"{prefix}{i:03d}.cls", str(i % 3).encode())


@pytest.mark.parametrize("as_file", [False, True])
def test_class_names_name_integer_labels_so_probes_accept_the_test_store(tmp_path, as_file):
    from featcache.probe import probe

    _cls_shard(tmp_path / "train.tar", 0)
    _cls_shard(tmp_path / "test.tar", 1)
    names = ["cat", "dog", "fox"]
    (tmp_path / "names.txt").write_text("\n".join(names) + "\n")
    data = {
        "source": "webdataset",
        "root": str(tmp_path),
        "splits": {"train": "train.tar", "test": "test.tar"},
        "class_names": str(tmp_path / "names.txt") if as_file else names,
    }
    stores = featcache.extract_from_config(config(data, tmp_path / "out"))
    assert stores["train"].class_names == stores["test"].class_names == names
    assert stores["train"].describe().format().count("3 classes (cat, dog, fox)") == 1
    result = probe(stores["train"], "layer1", test=stores["test"], progress=False)
    assert result.test is not None and result.num_classes == 3


def test_class_names_that_do_not_cover_the_labels_are_refused(tmp_path):
    _cls_shard(tmp_path / "train.tar", 0)
    data = {"source": "webdataset", "root": str(tmp_path), "splits": {"train": "train.tar"}}
    with pytest.raises(ConfigError, match=r"names 2 classes, but the source has label 2"):
        featcache.extract_from_config(config({**data, "class_names": ["a", "b"]}, tmp_path / "o"))
    with pytest.raises(ConfigError, match=r"data.class_names file .*missing.txt cannot be read"):
        featcache.extract_from_config(
            config({**data, "class_names": str(tmp_path / "missing.txt")}, tmp_path / "o")
        )
