"""Change stamps: a sample replaced under the same name is recomputed by an update, and
named by verify, a resume and a rerun, whatever its source (files, objects, shards)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torchvision
from PIL import Image

import featcache
from featcache.commands.verify import verify_store
from featcache.errors import ConfigError, FeatcacheError, FeatcacheWarning
from featcache.sources.stamps import change_report, changed_rows, describe_change, stamp_array
from featcache.store import FeatureStore, partial_path
from tests.test_update import config, image_folder, last_run, write_image


def replace_image(path: Path) -> None:
    """Another 32 px image under ``path``'s name, of another size in bytes."""
    size = path.stat().st_size
    gradient = np.linspace(0, 255, 32 * 32 * 3).astype(np.uint8).reshape(32, 32, 3)
    Image.fromarray(gradient).save(path)
    assert path.stat().st_size != size


def extract(cfg: dict, **options) -> FeatureStore:
    return featcache.extract_from_config(cfg, **options)["train"]


def fresh(cfg: dict, folder: Path) -> FeatureStore:
    return extract(dict(cfg, output={"dir": str(folder)}))


def assert_same_rows(got: FeatureStore, want: FeatureStore) -> None:
    """The same ids, labels, index and features, byte for byte."""
    assert got.ids == want.ids
    np.testing.assert_array_equal(got.labels, want.labels)
    np.testing.assert_array_equal(got.index, want.index)
    for layer in want.layers:
        np.testing.assert_array_equal(got.read(layer).numpy(), want.read(layer).numpy())


def failed_stamps(path: Path) -> str:
    result = verify_store(path, samples=0)
    failed = {check.name: check.detail for check in result.checks if not check.ok}
    assert "stamps" in failed, failed
    return failed["stamps"]


def test_a_file_replaced_in_place_with_another_size_is_named_and_recomputed(tmp_path):
    root = tmp_path / "photos"
    files = image_folder(root, 24)
    cfg = config(root, tmp_path / "out")
    first = extract(cfg)
    assert first.stamps is not None and first.stamps[0].startswith(b"size=")
    first.close()
    replaced = files[9]
    sample = replaced.relative_to(root / "train").as_posix()
    row = FeatureStore(first.path).ids.index(sample)
    replace_image(replaced)  # another image under the same name
    detail = failed_stamps(first.path)
    assert detail.startswith(f"row {row}, {sample}: changed on disk since extraction (size ")
    assert detail.endswith("rerun with --update")

    updated = extract(cfg, update=True)
    run = last_run(updated)
    assert (run["rows_computed"], run["rows_reused"]) == (1, 23)
    assert_same_rows(updated, fresh(cfg, tmp_path / "fresh"))
    assert verify_store(updated.path, samples=0).passed


def test_a_file_of_the_same_size_with_a_newer_mtime_is_recomputed(tmp_path):
    root = tmp_path / "photos"
    image_folder(root, 20)
    target = root / "train" / "ants" / "same-size.bmp"  # uncompressed: the size is fixed
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(target)
    cfg = config(root, tmp_path / "out")
    extract(cfg).close()
    size, stat = target.stat().st_size, target.stat()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(target)
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    assert target.stat().st_size == size
    detail = failed_stamps(tmp_path / "out" / "train.h5")
    assert "ants/same-size.bmp: changed on disk since extraction (modified " in detail
    updated = extract(cfg, update=True)
    assert last_run(updated)["rows_computed"] == 1
    assert_same_rows(updated, fresh(cfg, tmp_path / "fresh"))


def test_a_touched_but_unchanged_file_is_reused_under_content_hash(tmp_path):
    root = tmp_path / "photos"
    files = image_folder(root, 16)
    cfg = config(root, tmp_path / "out", content_hash=True)
    first = extract(cfg)
    before = first.read("layer4").numpy()
    first.close()
    stat = files[2].stat()
    os.utime(files[2], ns=(stat.st_atime_ns, stat.st_mtime_ns + 7_000_000_000))
    updated = extract(cfg, update=True)  # the hashes match: nothing to update
    assert [run["kind"] for run in updated.attrs["history"]] == ["extract"]
    np.testing.assert_array_equal(updated.read("layer4").numpy(), before)
    result = verify_store(updated.path, samples=0)
    assert result.passed and "stamps" not in [check.name for check in result.checks]
    # A plain rerun finds the store complete, the touched file no reason to refuse.
    extract(cfg).close()


def test_a_store_without_stamps_is_updated_as_before_with_one_warning(tmp_path, monkeypatch):
    import featcache.extraction.api as api

    root = tmp_path / "photos"
    files = image_folder(root, 12)
    cfg = config(root, tmp_path / "out")
    with monkeypatch.context() as patched:
        patched.setattr(api, "dataset_stamps", lambda dataset: None)
        old = extract(cfg)
    assert old.stamps is None
    old.close()
    # Replaced in place, past the rows an update recomputes to check what it reuses:
    # without stamps, nothing sees it (data.content_hash would).
    replace_image(files[10])
    with pytest.warns(FeatcacheWarning, match="records no change stamps") as caught:
        updated = extract(cfg, update=True)
    assert sum("change stamps" in str(w.message) for w in caught) == 1
    assert last_run(updated)["rows_computed"] == 0
    assert updated.stamps is not None  # the updated store records them from now on


def test_a_rerun_and_a_resume_name_the_files_changed_since_their_rows_were_written(
    resnet18, tmp_path
):
    root = tmp_path / "photos"
    image_folder(root, 30)

    class Failing(torchvision.datasets.ImageFolder):
        fail_at: int | None = 20

        def __getitem__(self, i):
            if i == self.fail_at:
                raise FeatcacheError("simulated crash")
            return super().__getitem__(i)

    transform = torchvision.transforms.ToTensor()
    dataset = Failing(str(root / "train"), transform=transform)
    options = {"batch_size": 4, "chunk_rows": 4, "num_workers": 0, "progress": False}
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, dataset, ["layer1"], path, **options)
    assert partial_path(path).exists()
    # A durable row's file, replaced since; not among the rows the resume recomputes to
    # prove it continues (those of the first and the last durable batch).
    changed = dataset.samples[9][0]
    replace_image(Path(changed))
    dataset.fail_at = None
    with pytest.warns(FeatcacheWarning, match="changed on disk since extraction") as caught:
        store = featcache.extract(resnet18, dataset, ["layer1"], path, **options)
    message = next(str(w.message) for w in caught if "changed on disk" in str(w.message))
    sample = Path(changed).relative_to(root / "train").as_posix()
    assert f"row 9, {sample}: changed on disk" in message and "--update" in message
    # The row keeps the stamp it was read under, so it still shows as changed.
    current = featcache.extraction.dataset_info.dataset_stamps(dataset)
    assert changed_rows(store.stamps, current[store.index]).tolist() == [9]
    store.close()
    # A plain rerun refuses the stale store, naming the row; an update recomputes it.
    with pytest.raises(ConfigError, match=f"row 9, {sample}: changed on disk .*--update"):
        featcache.extract(resnet18, dataset, ["layer1"], path, **options)
    updated = featcache.extract(resnet18, dataset, ["layer1"], path, update=True, **options)
    assert last_run(updated)["rows_computed"] == 1
    want = featcache.extract(resnet18, dataset, ["layer1"], tmp_path / "fresh.h5", **options)
    assert_same_rows(updated, want)


def test_webdataset_rows_of_a_replaced_shard_are_recomputed(tmp_path, index_cache):
    from tests.test_source_webdataset import _cls_shard

    for n in range(2):
        _cls_shard(tmp_path / "shards" / f"s{n}.tar", seed=n, rows=8, prefix=f"s{n}-")
    cfg = config(tmp_path, tmp_path / "out")
    data = {"source": "webdataset", "root": str(tmp_path), "splits": {"train": "shards/*.tar"}}
    cfg["data"] = data
    first = extract(cfg)
    assert b"shard_size=" in first.stamps[0] and b"shard_mtime_ns=" in first.stamps[0]
    first.close()
    second = tmp_path / "shards" / "s1.tar"
    stat = second.stat()
    _cls_shard(second, seed=5, rows=8, prefix="s1-")  # other images under the same keys
    os.utime(second, ns=(stat.st_atime_ns, stat.st_mtime_ns + 3_000_000_000))
    detail = failed_stamps(tmp_path / "out" / "train.h5")
    assert detail.startswith("row 8, ") and "and 5 more row(s)" in detail
    updated = extract(cfg, update=True)
    run = last_run(updated)
    assert (run["rows_computed"], run["rows_reused"]) == (8, 8)
    assert_same_rows(updated, fresh(cfg, tmp_path / "fresh"))


def test_info_says_how_changes_are_seen(tmp_path):
    from typer.testing import CliRunner

    from featcache.commands.app import app

    root = tmp_path / "photos"
    image_folder(root, 8)
    store = extract(config(root, tmp_path / "out"))
    output = CliRunner().invoke(app, ["info", str(store.path)]).output
    assert "changes    a change stamp per row (size, mtime_ns)" in output
    synthetic = featcache.extract_from_config(
        {
            "model": {"name": "resnet18"},
            "layers": [{"name": "layer1", "reduce": "avg"}],
            "data": {"source": "synthetic", "splits": {"train": {"size": 8, "image_size": 32}}},
            "output": {"dir": str(tmp_path / "syn")},
            "runtime": {"progress": False},
        }
    )["train"]
    assert synthetic.stamps is None
    output = CliRunner().invoke(app, ["info", str(synthetic.path)]).output
    assert "changes    none recorded" in output


def test_stamps_say_what_changed():
    size = describe_change(b"size=10\tmtime_ns=1", b"size=12\tmtime_ns=2")
    assert size == "size 10 -> 12"
    moved = describe_change(b"size=10\tmtime_ns=0", b"size=10\tmtime_ns=1000000000")
    assert moved == ("modified 1970-01-01 00:00:00.000000 UTC -> 1970-01-01 00:00:01.000000 UTC")
    assert describe_change(b"size=3\tversion=a", b"size=3\tversion=b") == "version a -> b"
    stored = stamp_array(["size=1", "", "size=2", "size=3"])
    current = stamp_array(["size=1", "size=9", "", "size=4"])
    assert changed_rows(stored, current).tolist() == [3]  # unknown stamps never count
    report = change_report([3, 4, 5, 6], list("abcd"), stored[[3] * 4], current[[3] * 4], 2)
    assert report.endswith("; and 2 more row(s)") and report.count("changed since") == 2


def test_an_s3_object_overwritten_is_named_and_recomputed(tmp_path):
    pytest.importorskip("moto")
    from tests.object_servers import BUCKET, moto_s3, s3, upload

    root = tmp_path / "photos"
    files = image_folder(root, 12)
    with moto_s3() as endpoint:
        url = upload(endpoint, root, "stamped")
        cfg = config(root, tmp_path / "out")
        cfg["data"] = {
            "source": "imagefolder",
            "root": url,
            "splits": ["train"],
            "storage_options": {"endpoint_url": f"http://{endpoint}"},
        }
        first = extract(cfg)
        assert b"version=" in first.stamps[0]
        first.close()
        write_image(files[5], 555)
        relative = files[5].relative_to(root).as_posix()
        s3(endpoint).pipe(f"{BUCKET}/stamped/{relative}", files[5].read_bytes())
        sample = files[5].relative_to(root / "train").as_posix()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            detail = failed_stamps(tmp_path / "out" / "train.h5")
        assert f"{sample}: changed since extraction (" in detail
        updated = extract(cfg, update=True)
        assert last_run(updated)["rows_computed"] == 1
        assert_same_rows(updated, fresh(cfg, tmp_path / "fresh"))
