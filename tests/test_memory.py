"""Freed CPU memory kept for reuse during a run: glibc's thresholds raised, then settled."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import featcache
from featcache.capture import memory
from featcache.commands import verify
from featcache.extraction import loop
from tests.stores import synthetic_store


class RecordingLibc:
    """Stands in for glibc: records each mallopt and malloc_trim call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


RAISED = [
    ("mallopt", memory.M_MMAP_THRESHOLD, memory.RUN_MMAP_THRESHOLD),
    ("mallopt", memory.M_TRIM_THRESHOLD, memory.RUN_TRIM_THRESHOLD),
]
SETTLED = [
    ("mallopt", memory.M_MMAP_THRESHOLD, memory.CEILING_MMAP_THRESHOLD),
    ("mallopt", memory.M_TRIM_THRESHOLD, memory.CEILING_TRIM_THRESHOLD),
    ("malloc_trim", 0),
]


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> RecordingLibc:
    fake = RecordingLibc()
    monkeypatch.setattr(memory, "glibc", lambda: fake)
    return fake


def test_thresholds_are_raised_for_the_run_and_settled_after(libc):
    with memory.freed_memory_kept("cpu"):
        assert libc.calls == RAISED
    assert libc.calls == RAISED + SETTLED
    assert memory.CEILING_MMAP_THRESHOLD == 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX


def test_nested_runs_raise_once_and_settle_when_the_last_ends(libc):
    with memory.freed_memory_kept("cpu"):
        with memory.freed_memory_kept(torch.device("cpu")):
            pass
        assert libc.calls == RAISED  # the outer run still keeps its memory
    assert libc.calls == RAISED + SETTLED


def test_settled_even_when_the_run_fails(libc):
    with pytest.raises(RuntimeError), memory.freed_memory_kept("cpu"):
        raise RuntimeError("the run failed")
    assert libc.calls == RAISED + SETTLED


def test_nothing_changes_for_other_devices_or_other_c_libraries(libc, monkeypatch):
    with memory.freed_memory_kept("cuda"):  # a device name; no GPU needed
        pass
    assert libc.calls == []
    monkeypatch.setattr(memory, "glibc", lambda: None)
    with memory.freed_memory_kept("cpu"):
        pass
    memory.settle_thresholds()
    assert libc.calls == []


def record_devices(module, monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """The devices ``module`` enters :func:`~featcache.capture.memory.freed_memory_kept` with."""
    devices: list[torch.device] = []
    real = module.freed_memory_kept

    def recording(device):
        devices.append(torch.device(device))
        return real(device)

    monkeypatch.setattr(module, "freed_memory_kept", recording)
    return devices


def test_an_extraction_runs_inside_the_block(resnet18, images, tmp_path, monkeypatch):
    devices = record_devices(loop, monkeypatch)
    featcache.extract(resnet18, images, ["layer1"], tmp_path / "s.h5", progress=False)
    assert devices == [torch.device("cpu")] * 2  # the row that sizes the store, then the run


def test_verify_recomputes_inside_the_block(tmp_path, monkeypatch):
    store = synthetic_store(tmp_path, "float16")
    devices = record_devices(loop, monkeypatch)  # verify recomputes through the one run
    assert verify.verify_store(store, samples=-1).passed
    assert devices == [torch.device("cpu")]


# Run in a fresh interpreter: how many blocks fault in while kept depends on what the
# heap already holds, and the tests before this one leave it in any state.
PAGE_FAULTS = """
import resource
import torch
from featcache.capture import memory
def page_faults_of(allocations):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(allocations):
        block = torch.ones(16 << 20)  # 64 MiB of float32, every page written
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

memory.settle_thresholds()
unkept = page_faults_of(10)  # above the settled mmap threshold: mapped and unmapped
with memory.freed_memory_kept("cpu"):
    # The heap grows until a freed block fits the next (aligned) request, as over a run's
    # first batches; from then on every block reuses freed memory. Ten blocks are not
    # always enough for that: now and then the next ten still fault two blocks in anew.
    page_faults_of(20)
    kept = page_faults_of(10)
print(unkept, kept)
"""


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    if memory.glibc() is None:
        pytest.skip("keeping freed memory applies to glibc's malloc only")
    run = subprocess.run(
        [sys.executable, "-c", PAGE_FAULTS], capture_output=True, text=True, check=True
    )
    unkept, kept = map(int, run.stdout.split())
    # Every block is faulted in anew: at least its 32 pages of 2 MiB, where transparent
    # huge pages serve it, and 16,384 pages of 4 KiB where they do not.
    assert unkept >= 9 * (64 << 20) // (2 << 20)
    assert kept < unkept / 10
