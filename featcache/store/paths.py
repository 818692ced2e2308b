"""Where a store's files live: the store, its ``.partial`` and skip log, torchrun shards,
and moving a finished file into place durably."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import h5py

from featcache.errors import ConfigError

PARTIAL_SUFFIX = ".partial"
SKIPPED_SUFFIX = ".skipped.jsonl"
# How to replace a store, for an error line read on the command line or in Python.
OVERWRITE = "--overwrite (overwrite=True in Python)"
SHARD_PATTERN = re.compile(r"\.shard-(\d{5})-of-(\d{5})\.h5(\.partial)?$")


def partial_path(path: str | os.PathLike) -> Path:
    """Where the store at ``path`` lives while it is being written."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL_SUFFIX)


def store_path_of(partial: str | os.PathLike) -> Path:
    """The store a ``.partial`` file becomes when complete (any other path unchanged)."""
    partial = Path(partial)
    return partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))


def skipped_log_path(path: str | os.PathLike) -> Path:
    """The append-only log of skipped samples kept beside a partial store."""
    path = Path(path)
    return path.with_name(path.name + SKIPPED_SUFFIX)


def readable_path(path: str | os.PathLike) -> Path:
    """The file to read the store at ``path`` from: the file itself where it exists; else
    a store's ``.partial`` while it is not complete, or a ``.partial``'s store once it is."""
    path = Path(path)
    if path.is_file():
        return path
    if path.name.endswith(PARTIAL_SUFFIX):
        return store_path_of(path)
    return partial_path(path)


def open_readonly(path: str | os.PathLike, **options: object) -> h5py.File:
    """Open a store file read-only. A ``.partial`` one is opened without HDF5's file lock,
    which its running writer may hold (HDF5 requires the same choice for every handle a
    process holds on one file, so every reader opens it this way)."""
    if str(path).endswith(PARTIAL_SUFFIX):
        options["locking"] = False
    return h5py.File(path, "r", **options)


def shard_path(path: str | os.PathLike, rank: int, world_size: int) -> Path:
    """The shard rank ``rank`` of ``world_size`` writes for the store at ``path``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.shard-{rank:05d}-of-{world_size:05d}{path.suffix}")


def check_output_path(path: Path, overwrite: bool) -> None:
    """Refuse to clobber a complete store, and fail early when the folder cannot take one."""
    if path.exists() and not overwrite:
        raise ConfigError(f"store already exists: {path}; pass {OVERWRITE} to replace it")
    if path.exists() and path.is_dir():
        raise ConfigError(f"output path {path} is a folder; give a file path ending in .h5")
    prepare_output_folder(path.parent)


def prepare_output_folder(folder: Path) -> None:
    """Create ``folder`` if needed and make sure a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create output folder {folder}: {exc.strerror}") from exc
    try:  # a real write: permission bits alone say nothing for root or read-only mounts
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            f"output folder {folder} is not writable ({exc.strerror}); choose another output dir"
        ) from exc


def output_file(path: str | os.PathLike, suffixes: Sequence[str], what: str) -> Path:
    """``path`` as a file to write (a results file, a picture), checked before any work:
    not a folder, named with one of ``suffixes``, in a folder that exists (created if
    needed) and takes a file.

    Raises:
        ConfigError: one line naming the problem and a name that would do.
    """
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


def shards_of(path: str | os.PathLike) -> dict[Path, int]:
    """The torchrun shard files (complete or ``.partial``) beside the store at ``path``,
    in name order, each with the number of processes it was written for."""
    path = Path(path)
    if not path.parent.is_dir():
        return {}
    found = {}
    for candidate in sorted(path.parent.glob(f"{glob.escape(path.stem)}.shard-*")):
        match = SHARD_PATTERN.match(candidate.name, len(path.stem))  # right after the stem
        if match:
            found[candidate] = int(match.group(2))
    return found


def check_other_world_sizes(
    path: str | os.PathLike, world_size: int, overwrite: bool, delete: bool = True
) -> list[Path]:
    """Refuse shards left by a run with another number of processes; with ``overwrite``,
    delete them (or, without ``delete``, leave that to the caller) and return them."""
    path = Path(path)
    # shard file -> the world size it was written for
    stale = {shard: size for shard, size in shards_of(path).items() if size != world_size}
    if stale and overwrite:
        for candidate in stale if delete else ():
            candidate.unlink(missing_ok=True)
        return list(stale)
    if stale:
        sizes = sorted(set(stale.values()))
        first = next(iter(stale))
        raise ConfigError(
            f"{path} has shards of a run with {', '.join(map(str, sizes))} processes "
            f"({first.name}, ...); rerun with that many processes to resume it "
            f"(`featcache info {first}` prints the command), or pass {OVERWRITE} to start over"
        )
    return []


def remove_store(path: str | os.PathLike) -> None:
    """Delete a store and any partial state of it."""
    Path(path).unlink(missing_ok=True)
    remove_partial(path)


def remove_partial(path: str | os.PathLike) -> None:
    """Delete the partial state of the store at ``path`` (its ``.partial`` file and skip
    log), and leave a complete store there in place: a run with ``--overwrite`` replaces
    it only once the new store is complete, so a run that fails keeps the old one."""
    for candidate in (partial_path(path), skipped_log_path(path)):
        candidate.unlink(missing_ok=True)


@contextlib.contextmanager
def building_beside(target: str | os.PathLike, suffix: str) -> Iterator[Path]:
    """The name ``target`` + ``suffix`` beside ``target``, for a file to build and then
    move into place; the file is removed when the block fails, so that a failed copy
    leaves nothing behind."""
    target = Path(target)
    building = target.with_name(target.name + suffix)
    try:
        yield building
    except BaseException:
        building.unlink(missing_ok=True)
        raise


def replace_durably(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename the closed file ``source`` to ``target`` so that a crash or power cut
    leaves the old name or the new one with all of the file's bytes: the file is synced
    before the rename and its folder after it (where the system can sync a folder)."""
    with open(source, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(source, target)
    _sync_folder(Path(target).parent)


def _sync_folder(folder: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows has no folder handles to sync
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
