"""Runs of several processes: torchrun groups and --shard jobs write shards, any number of
processes resumes them, and the store combined over them equals a one-process store."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    combine_shards,
    launch_words,
    parse_shard,
    shard_path,
    share_rows,
)
from featcache.extraction.from_config import resume_command
from featcache.store import FeatureStore, StorePlan, StoreWriter, merge_store, partial_path
from featcache.store.paths import store_path_of
from tests.stores import durable_rows

REPO = Path(__file__).resolve().parents[1]

CONFIG: dict[str, Any] = {
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


def _slow_config(
    folder: Path, size: int, chunk_rows: int, delay: float = 0.0, fail_after: int = 0
) -> Path:
    """A config of the tiny SlowNet over ``size`` rows of one split, batches of 8, with
    its fault switch ``folder/fail-{rank}`` and hold file ``folder/hold``; the config file
    in ``folder``, its stores in ``folder/out``."""
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {
        "delay": delay,
        "hold": str(folder / "hold"),
        "fail": str(folder / "fail-{rank}"),
        "fail_after": fail_after,
    }
    config = {
        "model": {"factory": "tests.factories:SlowNet", "kwargs": kwargs},
        "preprocess": CONFIG["preprocess"],
        "layers": [{"name": "conv"}, {"name": "fc"}],
        "data": {
            "source": "synthetic",
            "kwargs": {"image_size": 32, "num_classes": 5},
            "splits": {"train": {"size": size}},
        },
        "loader": {"batch_size": 8, "num_workers": 0},
        "store": {"chunk_rows": chunk_rows},
        "runtime": {"progress": False},
        "output": {"dir": str(folder / "out")},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _env() -> dict[str, str]:
    """The environment of featcache processes: ``tests.factories`` importable."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _torchrun(
    config: Path, processes: int = 2, output: int = subprocess.PIPE, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        *extra,
        "-m",
        "featcache",
        "extract",
        str(config),
    ]
    return subprocess.Popen(
        command, stdout=output, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO
    )


def _extract(config: Path, *words: str) -> subprocess.Popen:
    """``featcache extract CONFIG WORDS...`` as a plain process, its output piped."""
    command = [sys.executable, "-m", "featcache", "extract", str(config), *words]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO
    )


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a launcher's ranks, in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _finished(process: subprocess.Popen, timeout: float = 300) -> str:
    """The output of ``process``, which must exit 0 within ``timeout`` seconds (else it
    and its children are killed)."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_children(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"still running after {timeout} s:\n{output}")
    assert process.returncode == 0, output
    return output


def _wait_until(condition: Callable[[], bool], process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _shard_rows(store: Path, batch_size: int) -> tuple[int, int, int]:
    """Of the shards beside ``store``: the rows they hold durably (a complete one's rows,
    a partial one's durable rows), the rows a resume keeps of them (a partial one's
    durable rows back to the batch grid, from its first row) and the rows of the complete
    ones."""
    durable = kept = complete = 0
    files = [*store.parent.glob(f"{store.stem}.shard-*.h5"), *store.parent.glob("*.h5.partial")]
    for file in files:
        with h5py.File(file, "r", locking=False) as f:
            if f.attrs.get("complete"):
                rows = int(f.attrs["num_rows"])
                durable, kept, complete = durable + rows, kept + rows, complete + rows
            else:
                rows = int(f["progress"][0])
                durable, kept = durable + rows, kept + rows // batch_size * batch_size
    return durable, kept, complete


def _datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of rows, as plain h5py reads it (a combined store's checksums are
    its shards': they guard each shard's own chunks)."""
    out: dict[str, np.ndarray] = {}
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


def _history(store: Path) -> list[dict[str, Any]]:
    with FeatureStore(store) as fs:
        return list(fs.attrs["history"])


def _rows_of_records(history: list[dict[str, Any]]) -> int:
    return sum(record["rows_computed"] + record["rows_resumed"] for record in history)


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
def slow_single(tmp_path_factory) -> Callable[[int, int], Path]:
    """The one-process train store of ``_slow_config(size, chunk_rows)``, computed in this
    process once for each."""
    made: dict[tuple[int, int], Path] = {}

    def reference(size: int, chunk_rows: int) -> Path:
        if (size, chunk_rows) not in made:
            folder = tmp_path_factory.mktemp(f"slow-single-{size}")
            featcache.extract_from_config(_slow_config(folder, size, chunk_rows))
            made[size, chunk_rows] = folder / "out" / "train.h5"
        return made[size, chunk_rows]

    return reference


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    process = _torchrun(_config(folder))
    output = _finished(process)
    assert output.count("train.h5: 1200 rows") == 1  # only rank 0 reports
    return folder / "out"


@pytest.mark.slow
def test_two_processes_write_the_single_process_store(single, sharded):
    for split, rows in (("train", 1200), ("val", 70)):
        store = FeatureStore(sharded / f"{split}.h5")
        assert store.complete and store.attrs["world_size"] == 2
        starts = [block(rows, 16, r, 2).start for r in range(2)]
        assert starts[1] % 16 == 0 and 0 < starts[1] < rows
        assert store.attrs["shards"] == [shard_path(f"{split}.h5", s).name for s in starts]
        with h5py.File(store.path) as f:
            assert f["features/layer2"].is_virtual
        assert_same_rows(store.path, single / f"{split}.h5")
        assert store.layers == ["layer2", "layer4"]
        assert (
            store.attrs["config_fingerprint"]
            == FeatureStore(single / f"{split}.h5").attrs["config_fingerprint"]
        )
        # One launch computed every row, its two ranks' records as one.
        [record] = store.attrs["history"]
        assert record["rows_computed"] == rows and record["rows_resumed"] == 0
        assert record["launch"]


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
        shard_path("val.h5", block(70, 16, r, 2).start).name for r in range(2)
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


def _found_ranks(pids: dict[int, int], world_size: int, marker: str) -> bool:
    """Whether the process of every rank is running, adding each one found to ``pids``."""
    for rank in range(world_size):
        found = _rank_pids(rank, marker)
        if len(found) == 1:
            pids[rank] = found[0]
    return len(pids) == world_size


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive (not gone, and not a zombie left unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_three_killed_ranks_resume_with_two_to_the_single_process_store(single, tmp_path):
    config = _config(tmp_path)
    store = tmp_path / "out" / "train.h5"
    partials = [partial_path(shard_path(store, block(1200, 16, r, 3).start)) for r in range(3)]
    process = _torchrun(config, processes=3)
    pids = {}
    _wait_until(lambda: _found_ranks(pids, 3, str(config)), process, "every rank started")
    # Each rank is stopped (SIGSTOP) once it has durable rows, so that none completes its
    # shard while a slower one starts; then all are killed, one by one (each runs in a
    # session of its own).
    paused: set[int] = set()

    def stop_ranks_with_rows() -> bool:
        for rank, pid in pids.items():
            if rank not in paused and durable_rows(partials[rank]) >= 24:
                os.kill(pid, signal.SIGSTOP)
                paused.add(rank)
        return len(paused) == 3

    _wait_until(stop_ranks_with_rows, process, "every rank had durable rows")
    assert process.poll() is None
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=120)
    assert process.returncode != 0
    assert all(p.exists() for p in partials) and not store.exists()
    durable, kept, complete = _shard_rows(store, 16)
    assert complete == 0 and 0 < kept <= durable < 1200
    # The store's name points to its shards; a shard names the command it was run with.
    with pytest.raises(
        ConfigError,
        match=rf"not found: .*; 3 shards \(train\.shard-0{{12}}\.h5\.partial, \.\.\.\) hold "
        rf"{durable} rows durably and have not been combined yet",
    ):
        FeatureStore(store)
    with FeatureStore(partials[1], allow_incomplete=True) as stopped:
        assert stopped.describe().resume_command == (
            f"torchrun --standalone --nproc-per-node 3 -m featcache extract {config}"
        )

    output = _finished(_torchrun(config, processes=2))
    assert output.count("train.h5: 1200 rows") == 1
    for split in ("train", "val"):
        assert_same_rows(tmp_path / "out" / f"{split}.h5", single / f"{split}.h5")
    with FeatureStore(store) as fs:
        assert fs.attrs["world_size"] == 2
        shards = list(fs.attrs["shards"])
    # The three stopped shards are kept, sealed with their durable rows.
    assert {p.name.removesuffix(".partial") for p in partials} <= set(shards)
    assert len(shards) > 3 and not any(p.exists() for p in partials)
    # The killed launch completed no shard, so it has no record: its rows that were
    # durable are the rerun's resumed rows, and the rerun computed only the rest.
    [rerun] = _history(store)
    assert rerun["rows_computed"] <= 1200 - durable + 24 * 3
    assert rerun["rows_computed"] == 1200 - kept
    assert rerun["rows_resumed"] == kept


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 3])
def test_stopped_shard_jobs_resume_with_another_number_of_processes(
    slow_single, tmp_path, processes
):
    config = _slow_config(tmp_path, 200, 16, fail_after=6)
    store = tmp_path / "out" / "train.h5"
    # Two jobs of two, each stopped by a fault on its model's 7th forward, part way
    # through its block. The second first completes the first's stopped shard with the
    # rows it keeps (recomputing two of its batches to check that it continues them).
    for job in ("0/2", "1/2"):
        (tmp_path / "fail-0").touch()
        with pytest.raises(FeatcacheError, match="injected fault"):
            featcache.extract_from_config(config, shard=job)
    stopped = partial_path(shard_path(store, block(200, 8, 1, 2).start))
    assert shard_path(store, 0).exists() and stopped.exists() and not store.exists()
    durable, kept, complete = _shard_rows(store, 8)
    assert 0 < complete < kept < 200

    if processes == 1:
        stores = featcache.extract_from_config(config)
        assert stores["train"].path == store
    else:
        output = _finished(_torchrun(config, processes=processes))
        assert output.count("train.h5: 200 rows") == 1
    assert_same_rows(store, slow_single(200, 16))
    with FeatureStore(store) as fs:
        assert fs.attrs["world_size"] == processes
        assert shard_path(store, 0).name in fs.attrs["shards"]
        assert stopped.name.removesuffix(".partial") in fs.attrs["shards"]
    # The second job's record holds the first one's rows it kept; the rerun's, the rows
    # it kept of the second's and those no shard held.
    history = _history(store)
    assert len(history) == 2 and len({record["launch"] for record in history}) == 2
    assert (history[0]["rows_computed"], history[0]["rows_resumed"]) == (0, complete)
    assert history[1]["rows_computed"] == 200 - kept
    assert history[1]["rows_resumed"] == kept - complete
    assert _rows_of_records(history) == 200


@pytest.mark.slow
def test_shard_jobs_in_any_order_one_killed_and_rerun_combine_the_store(slow_single, tmp_path):
    config = _slow_config(tmp_path, 320, 16, delay=0.1)
    store = tmp_path / "out" / "train.h5"
    starts = [block(320, 8, job, 4).start for job in range(4)]
    assert starts == [0, 80, 160, 240]
    # Job 0 starts once job 2 computes its rows (past finding stopped shards to seal),
    # and is killed part way through its block.
    first = _extract(config, "--shard", "2/4")
    computing = partial_path(shard_path(store, 160))
    _wait_until(lambda: computing.exists() or store_path_of(computing).exists(), first, "job 2")
    killed = _extract(config, "--shard", "0/4")
    stopped = partial_path(shard_path(store, 0))
    _wait_until(lambda: durable_rows(stopped) >= 16, killed, "job 0 had durable rows")
    (tmp_path / "hold").touch()  # the jobs wait before their next batch: job 0 is part way
    killed.kill()
    killed.communicate(timeout=60)
    (tmp_path / "hold").unlink()
    assert stopped.exists()
    output = _finished(first)
    assert "rows of shard 2/4 done; other jobs' rows remain" in output and not store.exists()
    durable = durable_rows(stopped)
    kept = durable // 8 * 8
    assert 0 < kept < 80
    with FeatureStore(stopped, allow_incomplete=True) as fs:
        resume = fs.describe().resume_command  # checked last

    for job in [_extract(config, "--shard", job) for job in ("3/4", "1/4")]:  # side by side
        _finished(job)
    assert not store.exists()
    info = CliRunner().invoke(app, ["info", str(store)])
    assert info.exit_code == 0, info.output
    lines = info.stdout.splitlines()
    assert lines[0] == f"{store}: not combined yet; 4 shards hold {320 - 80 + kept} of 320 rows"
    assert lines[-1] == f"  remaining: {80 - kept} rows ({kept}-80)"

    output = _finished(_extract(config, "--shard", "0/4"))  # the last: it combines
    assert "train.h5: 320 rows" in output
    assert_same_rows(store, slow_single(320, 16))
    with FeatureStore(store) as fs:
        expected = [shard_path(store, start).name for start in sorted([*starts, kept])]
        assert fs.attrs["shards"] == expected
    # One record per job that completed rows, in the order they finished: job 3 or job 1
    # (whichever sealed it first) kept the rows of the killed job 0, whose rerun computed
    # the rest of its block.
    history = _history(store)
    assert [record["rows_computed"] for record in history] == [80, 80, 80, 80 - kept]
    assert sorted(record["rows_resumed"] for record in history[1:3]) == [0, kept]
    assert history[0]["rows_resumed"] == history[3]["rows_resumed"] == 0
    assert len({record["launch"] for record in history}) == 4
    # The stopped job names the command that resumes it: the same plain job.
    assert resume == f"featcache extract {config} --shard 0/4"


@pytest.mark.slow
def test_an_elastic_restart_after_a_failed_rank_completes_the_store(slow_single, tmp_path):
    # 3 batches: rank 0 computes one, rank 1 two. Rank 1 fails on its second batch,
    # one batch after rank 0 has completed its shard; torchrun restarts both once.
    config = _slow_config(tmp_path, 24, 8, delay=0.5, fail_after=2)  # forward 1 is a probe
    (tmp_path / "fail-1").touch()
    process = _torchrun(config, processes=2, extra=("--max-restarts", "1"))
    output = _finished(process, timeout=90)
    assert "injected fault" in output and not (tmp_path / "fail-1").exists()
    store = tmp_path / "out" / "train.h5"
    assert_same_rows(store, slow_single(24, 8))
    history = _history(store)
    assert len(history) == 2 and history[0]["launch"] != history[1]["launch"]
    assert (history[0]["rows_computed"], history[0]["rows_resumed"]) == (8, 0)
    # Rank 1's first batch, written before it failed, is kept; the restart computed the rest.
    assert (history[1]["rows_computed"], history[1]["rows_resumed"]) == (8, 8)


@pytest.mark.slow
def test_ranks_left_running_by_a_killed_launcher_still_finish_the_store(single, tmp_path):
    # The launcher can die alone (kill -9 of torchrun; its ranks run in their own
    # sessions): the ranks, joined at the start, meet and combine without it.
    config = _config(tmp_path)
    store = tmp_path / "out" / "train.h5"
    shard = partial_path(shard_path(store, 0))
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


def test_missing_rows_are_shared_evenly_in_whole_batches():
    # 10 + 11 batches over 3 ranks: 7 each, rank 1's across the gap of held rows.
    shares = share_rows([range(16, 96), range(112, 200)], 3, 8)
    assert shares == [[range(16, 72)], [range(72, 96), range(112, 144)], [range(144, 200)]]
    # Rows that start off the grid (after a stopped shard) end their first batch on it.
    assert share_rows([range(5, 40)], 2, 16) == [[range(5, 16)], [range(16, 40)]]
    assert share_rows([range(0, 8)], 2, 8) == [[], [range(0, 8)]]
    assert share_rows([], 2, 8) == [[], []]
    # A sharded source is cut at its shards, nearest an even split of the rows.
    assert share_rows([range(0, 100)], 2, 8, [30, 60]) == [[range(0, 60)], [range(60, 100)]]


def test_a_resume_command_launches_as_many_processes_on_as_many_machines(tmp_path):
    assert launch_words(None) == ["featcache"]
    one_machine = ["torchrun", "--standalone", "--nproc-per-node", "4", "-m", "featcache"]
    assert launch_words(Rank(3, 4, 3, 4)) == launch_words(Rank(0, 4, 0)) == one_machine
    two_machines = ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "-m", "featcache"]
    assert launch_words(Rank(9, 16, 1, 8)) == two_machines
    # A --shard job runs alone: it resumes as the same plain job, never under torchrun
    # (which refuses --shard).
    config = tmp_path / "c.yaml"
    assert resume_command(config, (), parse_shard("1/4")) == (
        f"featcache extract {config} --shard 1/4"
    )
    assert resume_command(config, (), None) == f"featcache extract {config}"


def test_ranks_wait_for_each_other_far_longer_than_torchs_default(monkeypatch):
    # A rank with no rows, or with a shard complete before a resume, reaches the
    # barrier hours before the others; torch's 30 minutes would fail the run.
    # Each elastic attempt's group keys its store apart: the agent keeps one store across
    # restarts, with the keys of the attempt before.
    joined: dict[str, Any] = {}
    store = torch.distributed.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))  # a key never set fails, not hangs

    def rendezvous(url, timeout):
        joined["rendezvous"] = (url, timeout)
        yield store, 0, 2

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: "backend" in joined)
    monkeypatch.setattr(distributed.dist, "rendezvous", rendezvous)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: joined.update(kw))
    monkeypatch.setattr(distributed.dist, "barrier", lambda: joined.setdefault("barriers", 0))
    Rank(0, 2, 0).barrier()
    assert joined["backend"] == "gloo" and joined["timeout"] >= datetime.timedelta(days=1)
    assert joined["timeout"] > torch.distributed.constants.default_pg_timeout
    assert joined["rendezvous"] == ("env://", joined["timeout"])
    assert (joined["rank"], joined["world_size"]) == (0, 2) and "barriers" in joined
    joined["store"].set("key", "value")
    assert store.get("featcache/attempt-3/key") == b"value"


def test_shard_jobs_are_given_as_i_of_n_and_never_overwrite(tmp_path, monkeypatch):
    assert parse_shard("2/4") == Rank(2, 4, 0, 1, group=False)
    for bad in ("4/4", "1", "-1/4", "a/b", "1/0"):
        with pytest.raises(ConfigError, match="give I/N with 0 <= I < N"):
            parse_shard(bad)
    config = dict(CONFIG, output={"dir": str(tmp_path / "out"), "overwrite": True})
    with pytest.raises(ConfigError, match="--overwrite with --shard"):
        featcache.extract_from_config(config, shard="0/2")
    config = dict(CONFIG, output={"dir": str(tmp_path / "out")})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="under torchrun the ranks share the rows"):
        featcache.extract_from_config(config, shard="0/2")
    assert not (tmp_path / "out").exists()


def test_a_one_process_run_names_an_unreadable_shard_and_overwrite_replaces_them(
    tmp_path, monkeypatch
):
    # A plain run over the shards of a run of several goes on from them: one it cannot
    # read is named, with the ways out; --overwrite starts over, and deletes the shards
    # only once its own store has replaced them.
    config = dict(
        CONFIG,
        data=dict(CONFIG["data"], splits={"train": {"size": 12}}),
        output={"dir": str(tmp_path / "out")},
    )
    store = tmp_path / "out" / "train.h5"
    store.parent.mkdir()
    shards = [partial_path(shard_path(store, start)) for start in (0, 16)]
    for shard in shards:
        shard.write_bytes(b"rows of an interrupted rank")
    with pytest.raises(
        FeatcacheError, match=r"shard .*shard-000000000000\.h5\.partial cannot be read.*--overwrite"
    ):
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
        shard = shard_path(tmp_path / "t.h5", 6 * rank)
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
    shards = [shard_path(store, start) for start in (0, 600)]
    assert shards[1].name == "train.shard-000000000600.h5"
    with pytest.raises(FeatcacheError, match=r"shard .*shard-000000000000\.h5 is missing; is the"):
        combine_shards(store, shards)
    partial_path(shards[0]).write_bytes(b"")
    with pytest.raises(FeatcacheError, match="missing; it is still being written or its rank"):
        combine_shards(store, shards)
