"""Shared fixtures: tiny seeded models and datasets, and the real data beside the repo."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch

import featcache  # noqa: F401  (makes torchvision importable before the tests import it)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_file(name: str) -> Path:
    """A file from ../shared/data, or skip the test with the reason."""
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"real data {path} is not present (it lives beside the repo, not in it)")
    return path


def unpack(archive: Path, target: Path) -> None:
    """Extract the tar file ``archive`` into ``target``, refusing any member that would
    land outside it or is no plain file or folder: with tarfile's ``data`` filter where
    this Python has it (3.12, and 3.10.12 or 3.11.4 on), else checked here first."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(target, filter="data")
            return
        root = target.resolve()
        for member in tar.getmembers():
            if not (member.isfile() or member.isdir()):
                raise ValueError(f"{archive}: member {member.name!r} is no file or folder")
            if not (root / member.name).resolve().is_relative_to(root):
                raise ValueError(f"{archive}: member {member.name!r} lands outside {target}")
        tar.extractall(target)  # every member checked above


@pytest.fixture(scope="session")
def hymenoptera_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """../shared/data/hymenoptera.tar extracted once per session; the hymenoptera_data folder."""
    target = tmp_path_factory.mktemp("hymenoptera")
    unpack(shared_file("hymenoptera.tar"), target)
    return target / "hymenoptera_data"


@pytest.fixture
def index_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """WebDataset shard indexes go to a fresh folder (inherited by the runs in
    subprocesses); the folder the indexes are written to."""
    folder = tmp_path / "featcache-cache"
    monkeypatch.setenv("FEATCACHE_CACHE_DIR", str(folder))
    return folder / "wds-index"


@pytest.fixture
def resnet18() -> torch.nn.Module:
    """A seeded, randomly initialised torchvision resnet18 in eval mode."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


@pytest.fixture
def images() -> torch.utils.data.TensorDataset:
    """20 random 32x32 images with labels 0..4."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(20, 3, 32, 32, generator=generator)
    return torch.utils.data.TensorDataset(x, torch.arange(20) % 5)
