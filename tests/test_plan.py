"""``featcache plan`` before a run: its byte estimates against the stores the run then
writes, and the free-space check that refuses a run the disk cannot hold."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.errors import FeatcacheError
from featcache.extraction.estimate import LayerSize, store_bytes
from tests.texts import write_text_config

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"
runner = CliRunner()


def written_bytes(path: Path, key: str) -> int:
    """Bytes HDF5 allocated for one layer's values in a finished store."""
    with h5py.File(path, "r") as f:
        return int(f["features"][key].id.get_storage_size())


def test_plan_of_the_demo_config_then_its_run_within_5_percent(tmp_path):
    out = tmp_path / "out"
    overrides = [f"output.dir={out}", "runtime.progress=false"]
    planned = featcache.plan(DEMO, overrides, batches=1)
    assert [s.split for s in planned.splits] == ["train", "val"]
    assert [s.estimate.rows for s in planned.splits] == [512, 256]
    assert planned.free > 0 and planned.fits and planned.needed == planned.bytes
    assert planned.seconds is not None and planned.seconds > 0
    assert planned.suggested_batch_size in {t.batch_size for t in planned.timings}
    assert [t.batch_size for t in planned.timings] == [32, 64, 128]
    assert not out.exists()  # planning writes nothing

    stores = featcache.extract_from_config(DEMO, overrides)
    for split in planned.splits:
        path = stores[split.split].path
        size = path.stat().st_size
        assert abs(split.estimate.bytes - size) <= 0.05 * size, (split.split, size)
        for layer in split.estimate.layers:  # dense layers: exact
            assert not layer.per_token
            assert split.estimate.layer_bytes[layer.key] == written_bytes(path, layer.key)


def test_plan_of_per_token_layers_within_15_percent(tmp_path):
    pytest.importorskip("transformers")
    config = write_text_config(tmp_path)  # a tiny BERT over short texts
    planned = featcache.plan(config, batches=1)
    stores = featcache.extract_from_config(config)
    for split in planned.splits:
        estimate = split.estimate
        tokens = {layer.key: layer.per_token for layer in estimate.layers}
        assert tokens == {"mean": False, "tokens": True}
        path = stores[split.split].path
        with h5py.File(path, "r") as f:
            assert estimate.tokens == len(f["features/tokens"])
        size = path.stat().st_size
        assert abs(estimate.bytes - size) <= 0.15 * size, (split.split, size)
        assert estimate.layer_bytes["tokens"] == written_bytes(path, "tokens")


def test_featcache_plan_prints_rows_bytes_free_space_time_and_a_batch_size(tmp_path):
    args = ["plan", str(DEMO), "--set", f"output.dir={tmp_path / 'out'}", "--batches", "1"]
    args += ["--set", "data.splits.train.size=96", "--set", "data.splits.val.size=32"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["split", "rows", "store", "path"]
    assert lines[1].split()[:2] == ["train", "96"] and lines[2].split()[:2] == ["val", "32"]
    assert lines[3].split() == ["layer", "stored", "as", "dtype", "train", "val"]
    assert lines[4].split()[:5] == ["layer3", "[256]", "float16", "48.0", "KiB"]  # 96 x 512 B
    assert lines[7].startswith("disk ") and "free on" in lines[7] and lines[7].endswith(": fits")
    assert lines[8].startswith("time ") and "for 128 rows" in lines[8]
    assert "rows/s at batch size 64 on cpu" in lines[8]
    assert lines[9].startswith("batch size ") and "suggested (32: " in lines[9]
    assert not (tmp_path / "out").exists()


def test_store_bytes_counts_whole_chunks_and_checksums():
    layer = LayerSize("x", (3,), "float32")  # 12 bytes a row: one chunk holds all rows
    base = store_bytes(10, [layer], ids_width=4, checksum=False)
    assert store_bytes(11, [layer], ids_width=4, checksum=False) - base > 12 + 8 + 8 + 4 - 1
    chunked = store_bytes(10, [layer], ids_width=4, chunk_rows=4, checksum=False)
    unchunked = store_bytes(12, [layer], ids_width=4, chunk_rows=4, checksum=False)
    assert chunked == unchunked  # 10 rows in chunks of 4 take 3 whole chunks, as 12 do
    summed = store_bytes(10, [layer], ids_width=4, chunk_rows=4, checksum=True)
    # an XXH3 checksum (8 bytes) per chunk of index, ids, labels and the layer: 3 chunks each
    assert summed - chunked == 8 * 3 * 4


class CountingImages(torch.utils.data.Dataset):
    """40 random 32x32 images that count how often they are read."""

    def __init__(self) -> None:
        self.images = torch.randn(40, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        self.reads = 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        return self.images[i], i % 4


def small_disk(monkeypatch, free: int) -> None:
    """Make every free-space query see ``free`` bytes."""
    usage = shutil.disk_usage("/")
    fake = type(usage)(usage.total, usage.total - free, free)
    monkeypatch.setattr("featcache.util.files.shutil.disk_usage", lambda path: fake)


def test_a_run_the_disk_cannot_hold_is_refused_before_the_first_batch(
    monkeypatch, tmp_path, resnet18
):
    small_disk(monkeypatch, 10_000)
    forwards = []
    resnet18.layer1.register_forward_hook(lambda *args: forwards.append(len(args[1][0])))
    dataset = CountingImages()
    path = tmp_path / "out" / "train.h5"
    with pytest.raises(FeatcacheError) as refused:
        featcache.extract(resnet18, dataset, ["layer1"], path, batch_size=8, progress=False)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"not enough disk space for {path}: the run needs about ")
    assert "and 9.8 KiB is free on " in message and "--ignore-free-space" in message
    assert forwards == [1]  # the one row that sized the store; no batch ran
    assert not path.parent.exists()  # nothing written: no lock, no folder left

    store = featcache.extract(
        resnet18, dataset, ["layer1"], path, batch_size=8, progress=False, check_space=False
    )
    assert len(store) == 40 and forwards[1:] == [8] * 5  # going ahead runs every batch


def test_extract_on_the_command_line_refuses_in_one_line_and_can_go_ahead(monkeypatch, tmp_path):
    small_disk(monkeypatch, 100_000)
    args = ["extract", str(DEMO), "--set", f"output.dir={tmp_path / 'out'}"]
    args += ["--set", "runtime.progress=false"]
    args += ["--set", "data.splits.train.size=64", "--set", "data.splits.val.size=32"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 1
    (line,) = [line for line in refused.stderr.splitlines() if line.strip()]
    assert line.startswith("featcache: error: not enough disk space for ")
    assert "train.h5, " in line and "val.h5: the run needs about " in line  # both splits
    assert not list((tmp_path / "out").glob("*.h5*"))

    done = runner.invoke(app, [*args, "--ignore-free-space"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "out" / "train.h5").is_file()


def test_a_resumed_run_needs_only_the_rows_left(tmp_path, resnet18):
    """The bytes a partial store already holds on disk are not needed again."""
    from featcache.extraction import estimate
    from featcache.store import partial_path

    path = tmp_path / "train.h5"
    planned = estimate(resnet18, CountingImages(), ["layer1"], path, batch_size=8)
    assert planned.needed(overwrite=False) == planned.bytes
    partial_path(path).write_bytes(b"\1" * 8192)
    assert planned.needed(overwrite=False) == planned.bytes - 8192
    assert planned.needed(overwrite=True) == planned.bytes


UNSHARE = shutil.which("unshare")


def can_mount_tmpfs(folder: Path) -> bool:
    if UNSHARE is None:
        return False
    probe = [UNSHARE, "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs"]
    done = subprocess.run([*probe, "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


def test_a_run_on_a_filesystem_too_small_for_it_is_refused(tmp_path):
    """A real 1 MiB tmpfs (in a user and mount namespace of its own) for the demo's
    1.9 MiB of stores: refused before anything is written."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not can_mount_tmpfs(disk):
        pytest.skip("no tmpfs can be mounted here (unshare --user --mount); mocked above")
    out = disk / "out"
    command = (
        f"mount -t tmpfs -o size=1m tmpfs {disk} && "
        f"{sys.executable} -m featcache extract {DEMO} --set output.dir={out} "
        "--set runtime.progress=false; echo rc=$?; ls -A {out}"
    ).replace("{out}", str(out))
    done = subprocess.run(
        [UNSHARE, "--user", "--map-root-user", "--mount", "sh", "-c", command],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = done.stdout.split()
    assert "rc=1" in lines and lines[-1] == "rc=1", done.stdout  # and ls found nothing
    (line,) = [line for line in done.stderr.splitlines() if "error" in line]
    assert line.startswith(f"featcache: error: not enough disk space for {out}/train.h5, ")
    assert " is free on " in line and "--ignore-free-space" in line
