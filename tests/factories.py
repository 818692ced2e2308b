"""Model factories the tests name in configs (``model.factory: tests.factories:...``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn


class SlowNet(nn.Module):
    """A tiny convolutional net that sleeps ``delay`` seconds per batch, so that a run
    lasts long enough for another process to meet it, and waits before each batch while
    the file ``hold`` exists, so that a test decides when the run may go on.

    The test-only fault switch: ``fail`` is a file name in which ``{rank}`` stands for
    the process's torchrun rank (0 outside torchrun); while that file exists, the
    process's batch number ``fail_after`` (counted from 0) deletes it and raises, so the
    fault strikes once."""

    def __init__(
        self,
        delay: float = 0.1,
        hold: str | None = None,
        fail: str | None = None,
        fail_after: int = 0,
    ):
        super().__init__()
        self.delay, self.hold = delay, hold
        self.fail = None if fail is None else Path(fail.format(rank=os.environ.get("RANK", "0")))
        self.fail_after, self.batches = fail_after, 0
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        while self.hold is not None and Path(self.hold).exists():
            time.sleep(0.02)
        self.batches += 1
        if self.fail is not None and self.batches > self.fail_after and self.fail.exists():
            self.fail.unlink()
            raise RuntimeError(f"injected fault after {self.fail_after} batches")
        return self.fc(self.pool(self.conv(x)).flatten(1))


def touching_net(marker: str) -> nn.Module:
    """A tiny net whose construction creates the file ``marker``: a visible side effect."""
    Path(marker).touch()
    return SlowNet(delay=0.0)


def identity() -> nn.Module:
    """A model without submodules: nothing to list but the model itself."""
    return nn.Identity()


class Unused(nn.Module):
    """A model whose one submodule forward() never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2
