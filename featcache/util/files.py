"""Output files: a folder that takes them, a name checked before any work, free space, and
a file built beside its target and moved into place durably."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from featcache.errors import ConfigError, FeatcacheError
from featcache.util.units import format_bytes


def prepare_output_folder(folder: Path) -> list[Path]:
    """Create ``folder`` if needed and make sure a file can be written in it; returns the
    folders created, deepest first (for :func:`remove_empty_folders`)."""
    missing = [f for f in (folder, *folder.parents) if not f.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        remove_empty_folders(missing)
        raise ConfigError(f"cannot create output folder {folder}: {exc.strerror}") from exc
    try:  # a real write: permission bits alone say nothing for root or read-only mounts
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        remove_empty_folders(missing)
        raise ConfigError(
            f"output folder {folder} is not writable ({exc.strerror}); choose another output dir"
        ) from exc
    return missing


def remove_empty_folders(folders: Sequence[Path]) -> None:
    """Remove each of ``folders`` (deepest first) that is empty and can be removed."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def output_file(path: str | os.PathLike, suffixes: Sequence[str], what: str) -> Path:
    """``path`` as a file to write, checked before any work: not a folder, named with one
    of ``suffixes``, in a folder that takes a file. Raises :class:`ConfigError`."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{what} {path} is a folder; give a file name such as {path / ('out' + suffixes[0])}"
        )
    if path.suffix.lower() not in suffixes:
        raise ConfigError(
            f"{what} {path} does not end in {' or '.join(suffixes)}; give a name such as "
            f"{path.with_suffix(suffixes[0])}"
        )
    prepare_output_folder(path.parent)
    return path


def free_bytes(path: str | os.PathLike) -> tuple[int, Path]:
    """Free bytes on the filesystem that will hold ``path`` (a folder that may not exist
    yet), and the existing folder they were measured at."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free, folder


def require_space(needed: int, where: Sequence[Path], what: str, go_ahead: str = "") -> None:
    """Raise :class:`FeatcacheError` when ``what`` (``"the run"``), writing the files
    ``where``, needs more bytes than their filesystem has free."""
    free, folder = free_bytes(where[0].parent)
    anyway = f", or {go_ahead} to run anyway" if go_ahead else ""
    if needed > free:
        raise FeatcacheError(
            f"not enough disk space for {', '.join(map(str, where))}: {what} needs about "
            f"{format_bytes(needed)} and {format_bytes(free)} is free on {folder}; free some "
            f"space, write elsewhere (output.dir){anyway}"
        )


@contextlib.contextmanager
def building_beside(target: str | os.PathLike, suffix: str) -> Iterator[Path]:
    """The name ``target`` + ``suffix`` beside ``target``, for a file to build and then
    move into place; the file is removed when the block fails."""
    target = Path(target)
    building = target.with_name(target.name + suffix)
    try:
        yield building
    except BaseException:
        building.unlink(missing_ok=True)
        raise


def replace_durably(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename the closed file ``source`` to ``target`` so that a crash leaves the old name
    or the new one with all the bytes: the file is synced first, its folder after."""
    with open(source, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(source, target)
    if hasattr(os, "O_DIRECTORY"):  # Windows has no folder handles to sync
        folder = os.open(Path(target).parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
