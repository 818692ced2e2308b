"""The state of a store's path, read once: what a run finds there before it starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.store.paths import partial_path, shards_of
from featcache.store.resume import UPDATE_MARK, stored_resume_key


@dataclass(frozen=True)
class StoreState:
    """What lies at a store's ``path``: a complete store (and the key it was made under,
    None when unreadable), a ``.partial`` beside it (an interrupted run's, or a stopped
    update's), and the shard files of a run of several processes (complete or partial)."""

    path: Path
    complete: bool
    key: Mapping[str, Any] | None
    partial: bool
    partial_key: Mapping[str, Any] | None
    shards: tuple[Path, ...]

    @property
    def update_partial(self) -> bool:
        """Whether the ``.partial`` is a stopped update's (its key has the update mark)."""
        return bool(self.partial_key and UPDATE_MARK in self.partial_key)

    def interrupted_overwrite(self, key: Mapping[str, Any]) -> bool:
        """Whether the ``.partial`` beside a complete store was made under a store key that
        agrees with ``key`` on every entry ``key`` gives: an ``--overwrite`` that was
        stopped, which rerunning the same command resumes, replacing the old store once
        it completes (as the stopped run would have)."""
        stored = self.partial_key
        return (
            self.complete and stored is not None and all(stored.get(k) == v for k, v in key.items())
        )


def store_state(path: str | os.PathLike) -> StoreState:
    """Read what lies at the store path ``path`` now (see `StoreState`)."""
    path = Path(path)
    partial = partial_path(path)
    complete, has_partial = path.exists(), partial.is_file()
    return StoreState(
        path=path,
        complete=complete,
        key=stored_resume_key(path) if path.is_file() else None,
        partial=has_partial,
        partial_key=stored_resume_key(partial) if has_partial else None,
        shards=tuple(shards_of(path)),
    )


def interrupted_overwrite(path: str | os.PathLike, key: Mapping[str, Any]) -> bool:
    """`StoreState.interrupted_overwrite` of the store path ``path`` now."""
    return store_state(path).interrupted_overwrite(key)
