"""A store reads only its own bytes, and the shard files beside it that it lists: else a
store shared or downloaded could make its readers return any file they can open."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from featcache.errors import first_line
from featcache.store import codec
from featcache.store.metadata import UNREADABLE_METADATA, metadata_problem


def foreign_data_problem(file: h5py.File) -> str:
    """Why ``file`` would take values from outside itself ("" when it would not): a link
    that is not a hard one, external storage, a virtual dataset over anything but its
    listed shards beside it, or a shard missing, incomplete, damaged or not self-contained."""
    shards = codec.attr(file, "shards")
    if isinstance(shards, np.ndarray):  # written as an array of names rather than JSON
        shards = [s.decode() if isinstance(s, bytes) else str(s) for s in shards.ravel()]
    shards = [] if shards is None else shards
    if not isinstance(shards, list) or not all(_plain_name(s) for s in shards):
        return f"its shard list {shards!r:.80} names files that are not beside it"
    problem = _problem(file, shards)
    folder = Path(file.filename).parent
    for shard in shards if not problem else ():
        if not (folder / shard).is_file():
            return f"its shard {shard} is missing (the store reads its rows from it)"
        try:
            with h5py.File(folder / shard, "r") as f:
                own = _problem(f, [])
                if own:
                    return f"its shard {shard} is not self-contained: {own}"
                done = f.attrs.get("complete")
                damage = metadata_problem(f) or ("" if done else "it is incomplete")
        except OSError as exc:
            damage = f"it cannot be read ({first_line(exc)})"
        if damage:
            return f"its shard {shard} is damaged: {damage}"
    return problem


def _problem(file: h5py.File, shards: Sequence[str]) -> str:
    links: dict[str, Any] = {}
    try:
        file.visititems_links(links.__setitem__)
    except UNREADABLE_METADATA as exc:  # a damaged group: HDF5 fails its checksum
        return f"its metadata cannot be read ({first_line(exc)})"
    for name, link in links.items():
        if not isinstance(link, h5py.HardLink):
            target = getattr(link, "filename", None) or getattr(link, "path", "")
            return f"{name} is a link to {target}, not a dataset or group of the store"
        obj = file[name]
        if not isinstance(obj, h5py.Dataset):
            continue
        if obj.id.get_create_plist().get_external_count():
            return f"{name} keeps its values in another file (HDF5 external storage)"
        for source in obj.virtual_sources() if obj.is_virtual else ():
            if source.file_name != "." and source.file_name not in shards:
                return (
                    f"{name} is a virtual dataset over {source.file_name}, which is not "
                    "one of the store's shards"
                )
    return ""


def _plain_name(name: Any) -> bool:
    """Whether ``name`` is a file name alone (no folder, not ``.`` or ``..``)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
