"""Where a store's files live: the store, its ``.partial`` and skip log, torchrun shards."""

from __future__ import annotations

import contextlib
import glob
import os
import re
from pathlib import Path

import h5py

from featcache.errors import ConfigError, FeatcacheError
from featcache.util.compression import FILTER_NAMES, PLUGIN_INSTALL, load_plugins
from featcache.util.files import prepare_output_folder

PARTIAL_SUFFIX = ".partial"
# How to replace a store, for an error line read on the command line or in Python.
OVERWRITE = "--overwrite (overwrite=True in Python)"
READ_CACHE_BYTES = 16 << 20  # HDF5 chunk cache per open dataset
# A shard is named by the first source row it holds; older releases named it by rank.
SHARD_PATTERN = re.compile(r"\.shard-(\d{12}|\d{5}-of-\d{5})\.h5(\.partial)?$")


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
    return path.with_name(path.name + ".skipped.jsonl")


def readable_path(path: str | os.PathLike) -> Path:
    """The file to read the store at ``path`` from: the file itself where it exists; else
    a store's ``.partial`` while it is not complete, or a ``.partial``'s store once it is."""
    path = Path(path)
    if path.is_file():
        return path
    return store_path_of(path) if path.name.endswith(PARTIAL_SUFFIX) else partial_path(path)


def open_readonly(path: str | os.PathLike) -> h5py.File:
    """Open a store file read-only, with hdf5plugin's filters registered where installed.

    A ``.partial`` is opened without HDF5's file lock, which its running writer may hold
    (HDF5 needs the same choice for every handle of a process on one file).

    Raises:
        FeatcacheError: a dataset of the file needs an HDF5 filter that this process
            cannot apply; one line naming it and how to install it.
    """
    plugins = load_plugins()
    locking = False if str(path).endswith(PARTIAL_SUFFIX) else None
    file = h5py.File(path, "r", rdcc_nbytes=READ_CACHE_BYTES, locking=locking)
    missing = missing_filter(file) if plugins is None else ""  # else every filter is there
    if missing:
        file.close()
        raise FeatcacheError(
            f"store {path} is compressed with {missing}, which is not available here; "
            f"install hdf5plugin with: {PLUGIN_INSTALL}"
        )
    return file


def missing_filter(file: h5py.File) -> str:
    """The first HDF5 filter a layer of ``file`` needs that HDF5 cannot apply here, as
    ``"zstd (HDF5 filter 32015, in features/layer1)"``; "" when none, or when the layers'
    headers cannot be read (the readers' own checks name that damage). A combined store's
    layers are virtual: the filters are its shards', all alike (one store key)."""
    with contextlib.suppress(KeyError, OSError, RuntimeError, ValueError, IndexError):
        features = file.get("features")
        keys = list(features) if isinstance(features, h5py.Group) else []
        for key in keys:
            layer = features[key]
            if layer.is_virtual:
                source = layer.virtual_sources()[0]
                with h5py.File(Path(file.filename).parent / source.file_name, "r") as shard:
                    plist = shard[source.dset_name].id.get_create_plist()
            else:
                plist = layer.id.get_create_plist()
            for i in range(plist.get_nfilters()):
                code, _, _, label = plist.get_filter(i)
                if not h5py.h5z.filter_avail(code):
                    text = label.decode(errors="replace") if isinstance(label, bytes) else label
                    named = FILTER_NAMES.get(code) or text.split(";")[0].strip() or "filter"
                    return f"{named} (HDF5 filter {code}, in features/{key})"
    return ""


def shard_path(path: str | os.PathLike, first_row: int) -> Path:
    """The shard of the store at ``path`` whose rows start at source row ``first_row``:
    ``<stem>.shard-000000001200.h5``, whichever process, or how many, wrote it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.shard-{first_row:012d}{path.suffix}")


def check_output_path(path: Path, overwrite: bool) -> None:
    """Refuse to clobber a complete store, and fail early when the folder cannot take one."""
    if path.exists() and not overwrite:
        raise ConfigError(f"store already exists: {path}; pass {OVERWRITE} to replace it")
    if path.exists() and path.is_dir():
        raise ConfigError(f"output path {path} is a folder; give a file path ending in .h5")
    prepare_output_folder(path.parent)


def shards_of(path: str | os.PathLike) -> list[Path]:
    """The shard files (complete or ``.partial``) beside the store at ``path``, by name."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    candidates = sorted(path.parent.glob(f"{glob.escape(path.stem)}.shard-*"))
    # the name must go on right after the stem: train.shard-..., not trainer.shard-...
    return [c for c in candidates if SHARD_PATTERN.match(c.name, len(path.stem))]


def remove_store(path: str | os.PathLike) -> None:
    """Delete a store and any partial state of it."""
    Path(path).unlink(missing_ok=True)
    remove_partial(path)


def remove_partial(path: str | os.PathLike) -> None:
    """Delete the ``.partial`` file and skip log of the store at ``path``; a complete store
    stays (``--overwrite`` replaces it only once the new one is complete)."""
    for candidate in (partial_path(path), skipped_log_path(path)):
        candidate.unlink(missing_ok=True)
