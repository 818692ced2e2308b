"""torchrun: sharded extraction into one logical store, resume per shard, merge."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.errors import ConfigError, FeatcacheError
from featcache.extraction import distributed
from featcache.extraction.distributed import (
    Rank,
    block,
    check_other_world_sizes,
    combine_shards,
    launch_words,
    shard_path,
)
from featcache.store import FeatureStore, StorePlan, StoreWriter, merge_store, partial_path

CONFIG = {
    "model": {"name": "resnet18"},
    "preprocess": {"mean": [0.485, 0.456, 0.406]},  # 32px as it is
    "layers": [{"name": "layer2"}, {"name": "layer4", "reduce": "avg"}],
    "data": {
        "source": "synthetic",
        "kwargs": {"image_size": 32, "num_classes": 5},
        "splits": {"train": {"size": 1200}, "val": {"size": 70}},
    },
    "loader": {"batch_size": 16, "num_workers": 0},
    "store": {"chunk_rows": 24},
    "runtime": {"progress": False},
}


def _config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(dict(CONFIG, output={"dir": str(folder / "out")})))
    return path


def _torchrun(config: Path, processes: int = 2, output: int = subprocess.PIPE) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "featcache",
        "extract",
        str(config),
    ]
    return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)


def _datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of rows, as plain h5py reads it (a combined store's checksums are
    its shards': they guard each shard's own chunks)."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: (
                out.__setitem__(name, obj[()])
                if isinstance(obj, h5py.Dataset)
                and name != "progress"
                and not name.startswith("checksums/")
                else None
            )
        )
    return out


def assert_same_rows(a: Path, b: Path) -> None:
    left, right = _datasets(a), _datasets(b)
    assert sorted(left) == sorted(right)
    for name in left:
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("single")
    subprocess.run(
        [sys.executable, "-m", "featcache", "extract", str(_config(folder))],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return folder / "out"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    process = _torchrun(_config(folder))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    assert output.count("train.h5: 1200 rows") == 1  # only rank 0 reports
    return folder / "out"


@pytest.mark.slow
def test_two_processes_write_the_single_process_store(single, sharded):
    for split in ("train", "val"):
        store = FeatureStore(sharded / f"{split}.h5")
        assert store.complete and store.attrs["world_size"] == 2
        assert store.attrs["shards"] == [shard_path(f"{split}.h5", r, 2).name for r in range(2)]
        with h5py.File(store.path) as f:
            assert f["features/layer2"].is_virtual
        assert_same_rows(store.path, single / f"{split}.h5")
        assert store.layers == ["layer2", "layer4"]
        assert (
            store.attrs["config_fingerprint"]
            == FeatureStore(single / f"{split}.h5").attrs["config_fingerprint"]
        )


@pytest.mark.slow
def test_merge_gives_a_self_contained_equal_file(sharded, tmp_path):
    merged = tmp_path / "merged.h5"
    result = CliRunner().invoke(app, ["merge", str(sharded / "val.h5"), "-o", str(merged)])
    assert result.exit_code == 0, result.output
    expected = _datasets(sharded / "val.h5")
    copy = tmp_path / "elsewhere" / "merged.h5"
    copy.parent.mkdir()
    os.replace(merged, copy)  # no shard files anywhere near it
    with h5py.File(copy, "r") as f:
        assert not f["features/layer2"].is_virtual and f["features/layer2"].chunks
        assert list(f["features"]) == ["layer2", "layer4"]
        assert "shards" not in f.attrs
    assert_same_rows(copy, sharded / "val.h5")
    assert sorted(_datasets(copy)) == sorted(expected)
    assert FeatureStore(copy).attrs["merged_from"] == [
        shard_path("val.h5", r, 2).name for r in range(2)
    ]
    again = CliRunner().invoke(app, ["merge", str(sharded / "val.h5"), "-o", str(copy)])
    assert again.exit_code == 2 and "already exists" in again.stderr


def _rank_pids(rank: int, marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and marker.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive (not gone, and not a zombie left unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_killed_rank_resumes_to_the_single_process_store(single, tmp_path):
    config = _config(tmp_path)
    shard = partial_path(shard_path(tmp_path / "out" / "train.h5", 1, 2))
    process = _torchrun(config)
    deadline = time.monotonic() + 120
    progress = 0
    while process.poll() is None and time.monotonic() < deadline and progress < 100:
        if shard.exists():
            with h5py.File(shard, "r", locking=False) as f:
                progress = int(f["progress"][0])
        time.sleep(0.02)
    pids = _rank_pids(1, str(config))
    assert pids and process.poll() is None, "rank 1 finished before it could be killed"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=120)
    assert process.returncode != 0
    assert shard.exists() and not (tmp_path / "out" / "train.h5").exists()
    # The store's name points to its shards; a shard names the torchrun command.
    with pytest.raises(ConfigError, match=r"2 processes has \d+ rows durable in 2 shards"):
        FeatureStore(tmp_path / "out" / "train.h5")
    with FeatureStore(shard, allow_incomplete=True) as stopped:
        assert stopped.describe().resume_command == (
            f"torchrun --standalone --nproc-per-node 2 -m featcache extract {config}"
        )
    rerun = _torchrun(config)
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    for split in ("train", "val"):
        assert_same_rows(tmp_path / "out" / f"{split}.h5", single / f"{split}.h5")
    # The history counts the rows the shards' runs resumed apart from those they computed.
    last = FeatureStore(tmp_path / "out" / "train.h5").attrs["history"][-1]
    assert last["rows_resumed"] > 0
    assert last["rows_computed"] + last["rows_resumed"] == 1200


@pytest.mark.slow
def test_ranks_left_running_by_a_killed_launcher_still_finish_the_store(single, tmp_path):
    # The launcher can die alone (kill -9 of torchrun; its ranks run in their own
    # sessions): the ranks, joined at the start, meet and combine without it.
    config = _config(tmp_path)
    store = tmp_path / "out" / "train.h5"
    shard = partial_path(shard_path(store, 0, 2))
    launcher = _torchrun(config, output=subprocess.DEVNULL)  # no pipe the ranks keep open
    deadline = time.monotonic() + 120
    while launcher.poll() is None and time.monotonic() < deadline and not shard.exists():
        time.sleep(0.02)
    assert launcher.poll() is None, "the run ended before its launcher could be killed"
    ranks = _rank_pids(0, str(config)) + _rank_pids(1, str(config))
    launcher.kill()
    launcher.wait(timeout=60)
    try:
        deadline = time.monotonic() + 120
        while any(map(_running, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, ranks)), "the ranks hang"
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for split in ("train", "val"):
        assert_same_rows(tmp_path / "out" / f"{split}.h5", single / f"{split}.h5")


def test_blocks_cover_every_row_on_the_batch_grid():
    for n, batch, world in ((1200, 16, 2), (70, 16, 3), (5, 16, 4), (1, 1, 2)):
        blocks = [block(n, batch, r, world) for r in range(world)]
        rows = [i for b in blocks for i in b]
        assert rows == list(range(n))
        assert all(b.start % batch == 0 for b in blocks if b)


def test_a_resume_command_launches_as_many_processes_on_as_many_machines():
    assert launch_words(None) == ["featcache"]
    one_machine = ["torchrun", "--standalone", "--nproc-per-node", "4", "-m", "featcache"]
    assert launch_words(Rank(3, 4, 3, 4)) == launch_words(Rank(0, 4, 0)) == one_machine
    two_machines = ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "-m", "featcache"]
    assert launch_words(Rank(9, 16, 1, 8)) == two_machines


def test_ranks_wait_for_each_other_far_longer_than_torchs_default(monkeypatch):
    # A rank with no rows, or with a shard complete before a resume, reaches the
    # barrier hours before the others; torch's 30 minutes would fail the run.
    joined = {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: joined.update(kw))
    monkeypatch.setattr(distributed.dist, "barrier", lambda: joined.setdefault("barriers", 0))
    Rank(0, 2, 0).barrier()
    assert joined["backend"] == "gloo" and joined["timeout"] >= datetime.timedelta(days=1)
    assert joined["timeout"] > torch.distributed.constants.default_pg_timeout
    assert "barriers" in joined


def test_shards_of_another_world_size_are_refused(tmp_path):
    store = tmp_path / "train.h5"
    stale = shard_path(store, 1, 2)
    partial_path(stale).write_bytes(b"")
    with pytest.raises(ConfigError, match="shards of a run with 2 processes.*--overwrite"):
        check_other_world_sizes(store, 3, overwrite=False)
    check_other_world_sizes(store, 2, overwrite=False)
    check_other_world_sizes(store, 3, overwrite=True)
    assert not partial_path(stale).exists()


def test_a_one_process_run_refuses_the_shards_of_a_torchrun_run(tmp_path, monkeypatch):
    # Rows of a 2-process run that was stopped: a plain run must not start over beside
    # them (and leave them behind), but say how to resume them.
    config = dict(
        CONFIG,
        data=dict(CONFIG["data"], splits={"train": {"size": 12}}),
        output={"dir": str(tmp_path / "out")},
    )
    store = tmp_path / "out" / "train.h5"
    store.parent.mkdir()
    shards = [partial_path(shard_path(store, rank, 2)) for rank in range(2)]
    for shard in shards:
        shard.write_bytes(b"rows of an interrupted rank")
    with pytest.raises(ConfigError, match="shards of a run with 2 processes.*--overwrite"):
        featcache.extract_from_config(config)
    assert not store.exists() and all(shard.exists() for shard in shards)
    overwrite = dict(config, output=dict(config["output"], overwrite=True))
    import featcache.extraction.from_config as from_config

    def failing(*args, **kwargs):
        raise FeatcacheError("the run failed")

    with monkeypatch.context() as patched:  # a run that fails keeps what the shards hold
        patched.setattr(from_config, "run_plan", failing)
        with pytest.raises(FeatcacheError, match="the run failed"):
            featcache.extract_from_config(overwrite)
    assert all(shard.exists() for shard in shards)
    featcache.extract_from_config(overwrite)
    assert len(FeatureStore(store)) == 12 and not any(shard.exists() for shard in shards)


def test_combined_and_merged_stores_keep_the_capture_order_of_layers(tmp_path):
    order = ["layer3", "layer10", "avgpool"]  # neither alphabetical nor its reverse
    shards = []
    for rank in range(2):
        shard = shard_path(tmp_path / "t.h5", rank, 2)
        writer = StoreWriter(StorePlan(shard, 6, ids_width=4, dtype="float32", chunk_rows=4))
        index = np.arange(6 * rank, 6 * rank + 6)
        values = {key: np.full((6, width), rank, np.float32) for width, key in enumerate(order, 1)}
        writer.append(index, [f"r{i}" for i in index], index % 2, values)
        writer.close(complete=True)
        shards.append(shard)
    assert FeatureStore(shards[0]).layers == order
    combined = combine_shards(tmp_path / "t.h5", shards)
    merged = merge_store(combined.path, tmp_path / "merged.h5", progress=False)
    assert combined.layers == order and merged.layers == order
    assert torch.equal(merged.read("layer10")[:, 0], torch.tensor([0.0] * 6 + [1.0] * 6))


def test_missing_or_unshared_shards_are_named(tmp_path):
    store = tmp_path / "train.h5"
    shards = [shard_path(store, r, 2) for r in range(2)]
    with pytest.raises(FeatcacheError, match="shard .*shard-00000-of-00002.h5 is missing; is the"):
        combine_shards(store, shards)
    partial_path(shards[0]).write_bytes(b"")
    with pytest.raises(FeatcacheError, match="missing; it is still being written or its rank"):
        combine_shards(store, shards)
