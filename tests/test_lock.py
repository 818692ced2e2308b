"""One writer per store: the lock, a second run refused, a killed run leaving nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from featcache.commands.app import app
from featcache.commands.verify import verify_store
from featcache.errors import IncompleteStoreError
from featcache.store import FeatureStore, partial_path
from featcache.store.lock import StoreBusyError, holder, lock_path, writer_lock
from tests.stores import durable_rows

REPO = Path(__file__).resolve().parents[1]
HOLD = """
import sys
from featcache.store.lock import writer_lock
with writer_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture
def held(tmp_path):
    """A child process holding the lock of ``tmp_path / "s.h5"``; yields (path, process)."""
    path = tmp_path / "s.h5"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    yield path, child
    if child.poll() is None:
        child.kill()
    child.wait(timeout=30)


def test_a_held_store_is_refused_naming_its_writer(held):
    path, child = held
    with pytest.raises(StoreBusyError) as info:
        with writer_lock(path):
            pass
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert f"pid {child.pid} on host {socket.gethostname()}, started " in message
    assert "do not pass --overwrite" in message
    found = holder(path)
    assert found is not None and found.pid == child.pid and found.output == str(path)


def test_release_removes_the_lock_file_and_frees_the_store(held):
    path, child = held
    assert lock_path(path).exists()
    assert child.stdin is not None
    child.stdin.close()  # the child leaves its with block
    child.wait(timeout=30)
    assert not lock_path(path).exists() and holder(path) is None
    with writer_lock(path) as record:
        assert record.pid == os.getpid() and holder(path) == record
    assert not lock_path(path).exists()


def test_a_killed_holder_leaves_no_lock(held):
    path, child = held
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert lock_path(path).exists()  # the file stays, the lock died with the process
    assert holder(path) is None
    with writer_lock(path) as record:
        assert record.pid == os.getpid()


def test_nested_locks_in_one_process_share_the_lock(tmp_path):
    path = tmp_path / "s.h5"
    with writer_lock(path) as outer, writer_lock(path) as inner:
        assert inner == outer
        assert holder(path) == outer
    assert holder(path) is None and not lock_path(path).exists()


# Whole runs: `featcache extract` twice on one output.

SLOW_CONFIG = {
    "model": {"factory": "tests.factories:SlowNet", "kwargs": {"delay": 0.15}},
    "layers": [{"name": "conv", "reduce": "avg"}, {"name": "fc"}],
    "data": {
        "source": "synthetic",
        "kwargs": {"image_size": 16, "num_classes": 3},
        "splits": {"train": {"size": 320}},
    },
    "preprocess": {"resize": 16, "crop": 16},
    "loader": {"batch_size": 8, "num_workers": 0},
    "store": {"chunk_rows": 16},
    "runtime": {"progress": False},
}


def _start(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "featcache", "extract", str(config), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=REPO,
    )


def _run_extract(config: Path, *extra: str) -> subprocess.CompletedProcess:
    """`featcache extract CONFIG ...` to its end, output captured."""
    command = [sys.executable, "-m", "featcache", "extract", str(config), *extra]
    return subprocess.run(
        command, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300
    )


def _wait_for(condition, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("second", [(), ("--overwrite",)], ids=["plain", "overwrite"])
def test_a_second_run_is_refused_and_the_first_finishes(tmp_path, second):
    config = tmp_path / "c.yaml"
    hold = tmp_path / "hold"  # while it exists, the first run waits before each batch
    # The hold keeps the first run in its middle; a short delay is enough to meet it.
    model = {"factory": "tests.factories:SlowNet", "kwargs": {"delay": 0.05, "hold": str(hold)}}
    out = {"dir": str(tmp_path / "out")}
    config.write_text(yaml.safe_dump({**SLOW_CONFIG, "model": model, "output": out}))
    store = tmp_path / "out" / "train.h5"
    first = _start(config)
    _wait_for(partial_path(store).exists, first)  # the first is writing rows
    hold.touch()  # and stays in the middle of its run, however slow the second is to start
    result = _run_extract(config, *second)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"featcache: error: {store} is being written by pid {first.pid}")
    assert first.poll() is None, "the first run must still be going"
    assert partial_path(store).exists() and not store.exists()

    hold.unlink()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert not lock_path(store).exists() and not partial_path(store).exists()
    with FeatureStore(store) as fs:
        assert len(fs) == 320
    result = verify_store(store, samples=4, trust_factory=True)
    assert result.passed, [check for check in result.checks if not check.ok]


@pytest.mark.slow
def test_info_on_a_partial_store_names_its_writer_and_the_resume_command(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**SLOW_CONFIG, "output": {"dir": str(tmp_path / "out")}}))
    store = tmp_path / "out" / "train.h5"
    run = _start(config)
    try:
        _wait_for(lambda: durable_rows(partial_path(store)) > 0, run)
        text = CliRunner().invoke(app, ["info", str(store)]).stdout
        assert "status     INCOMPLETE (" in text
        assert f"writer     pid {run.pid} on host {socket.gethostname()}, started" in text
        assert f"resume     featcache extract {config}" in text
        assert f"           run it from {REPO} (relative paths in the config)" in text
        # Opening it says how far the running writer has got (its HDF5 lock is no bar).
        with pytest.raises(IncompleteStoreError) as caught:
            FeatureStore(store)
        assert caught.value.rows > 0 and f"({caught.value.rows} rows written" in str(caught.value)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=60)
    result = CliRunner().invoke(app, ["info", str(store), "--json"])
    assert '"writer": null' in result.stdout
    text = CliRunner().invoke(app, ["info", str(store)]).stdout
    assert "writer     none: the run stopped" in text

    # The killed run's lock blocks nothing: a rerun resumes and completes the store.
    rerun = _run_extract(config)
    assert rerun.returncode == 0, rerun.stderr
    with FeatureStore(store) as fs:
        assert len(fs) == 320 and fs.complete
    assert not lock_path(store).exists()


def test_merge_writes_its_output_under_the_lock(held, tmp_path):
    from featcache.store import merge_store
    from tests.stores import synthetic_store

    path, child = held
    source = synthetic_store(tmp_path / "source")
    with pytest.raises(StoreBusyError, match=f"is being written by pid {child.pid} on host"):
        merge_store(source, path, progress=False)
    assert not path.exists() and not path.with_name(path.name + ".copying").exists()
    assert holder(path).pid == child.pid  # the holder's lock is untouched
    merged = merge_store(source, tmp_path / "single.h5", progress=False)
    assert len(merged) == len(FeatureStore(source)) and holder(merged.path) is None
