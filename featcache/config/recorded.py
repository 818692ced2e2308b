"""A store's recorded config, rebuilt where it was made: its relative paths resolved
against the folder the run started in (``working_folder``; older stores record
``resume_folder``), so that ``verify`` and ``cam`` work from anywhere."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcache.config.spec import Spec, load_config
from featcache.util.urls import is_url

# Where a config keeps paths, as (section, key); model.name only after "hf:".
PATH_KEYS = (
    ("data", "root"),
    ("data", "dataset"),
    ("data", "class_names"),
    ("model", "checkpoint"),
    ("model", "weights"),
    ("model", "name"),
)


@dataclasses.dataclass(frozen=True)
class RecordedSpec:
    """The spec a store records, its relative paths resolved against ``folder`` (None: the
    current folder, for a store that records none or whose folder is gone), and the spec
    as written (``written``: what its config fingerprint was computed from)."""

    spec: Spec
    folder: Path | None
    written: Spec

    def where(self) -> str:
        """The folder in words, for a command's output."""
        if self.folder is None:
            return "relative paths from the current folder"
        return f"relative paths from {self.folder}, where the run started"


def recorded_spec(config: Mapping[str, Any], attrs: Mapping[str, Any]) -> RecordedSpec:
    """The spec of a store's recorded ``config``, its relative paths made absolute against
    the folder its attributes ``attrs`` record, where that folder still holds them."""
    recorded = attrs.get("working_folder") or attrs.get("resume_folder")
    folder = Path(recorded) if isinstance(recorded, str) and Path(recorded).is_dir() else None
    written = load_config(config)
    if folder is None or folder == Path.cwd():
        return RecordedSpec(written, None, written)
    return RecordedSpec(load_config(resolve_paths(config, folder)), folder, written)


def resolve_paths(config: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """``config`` with each relative path of :data:`PATH_KEYS` that exists under
    ``folder`` made absolute there; anything else is left as written."""
    resolved = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    for section, key in PATH_KEYS:
        part = resolved.get(section)
        if not isinstance(part, dict) or not isinstance(part.get(key), str):
            continue
        value: str = part[key]
        prefix = "hf:" if (section, key) == ("model", "name") else ""
        if prefix and not value.startswith(prefix):
            continue
        path = value[len(prefix) :]
        # relative paths only: a URL is the same from any folder
        if path and not is_url(path) and not os.path.isabs(path) and (folder / path).exists():
            part[key] = prefix + str(folder / path)
    return resolved
