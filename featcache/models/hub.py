"""Where a ``hf:`` model's files come from: a hub repository's cached snapshot, or a folder."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.config.spec import ModelSpec
from featcache.errors import FeatcacheError, first_line


@dataclass(frozen=True)
class Source:
    """Where a ``hf:`` reference points: a hub repository (and revision) or a local folder."""

    ref: str  # as written after "hf:"
    repo: str  # repo id, or the folder as written
    revision: str | None = None
    folder: Path | None = None  # set for a local folder

    @property
    def location(self) -> str:
        """What ``from_pretrained`` is given: the repo id or the folder path."""
        return str(self.folder) if self.folder is not None else self.repo


def remote_kwargs(source: Source, model: ModelSpec) -> dict[str, Any]:
    """The revision, and an explicit ``trust_remote_code`` (unset, transformers would ask)."""
    revision = {} if source.revision is None else {"revision": source.revision}
    return {**revision, "trust_remote_code": model.trust_remote_code}


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' progress bars off inside the block."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


def check_reachable(source: Source) -> None:
    """Raise :func:`not_cached`'s error at once when a hub repository's ``config.json`` is
    neither cached nor reachable: one request, not the hub client's half minute of retries."""
    if source.folder is not None:
        return
    import huggingface_hub
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return  # transformers reads the cache alone and fails fast by itself
    cached = huggingface_hub.try_to_load_from_cache(
        source.repo, "config.json", revision=source.revision
    )
    if isinstance(cached, str):
        return
    url = huggingface_hub.hf_hub_url(source.repo, "config.json", revision=source.revision)
    try:
        huggingface_hub.get_hf_file_metadata(url, timeout=10, retry_on_errors=False)
    except huggingface_hub.errors.HfHubHTTPError:
        return  # the hub answered: transformers says what it answered (no access, no repo)
    except Exception as exc:  # no network, no name resolution, a timeout
        raise not_cached(source, exc) from exc


def not_cached(source: Source, exc: BaseException) -> FeatcacheError:
    if source.folder is not None:
        return FeatcacheError(f"hf:{source.ref}: cannot load {source.folder}: {first_line(exc)}")
    from huggingface_hub import constants

    revision = f" --revision {source.revision}" if source.revision else ""
    where = f"in the local Hugging Face cache {constants.HF_HUB_CACHE}"
    if "/" in source.repo:  # "owner/name" may as well be a folder, relative to another one
        where = f"a folder {source.repo} in {Path.cwd()}, nor {where}"
    return FeatcacheError(
        f"hf:{source.ref} is not {where} (and could not be downloaded: {first_line(exc)}); "
        f"for a hub repository, download it with: hf download {source.repo}{revision}"
    )


def snapshot(source: Source) -> Path:
    """The local folder, or the cached snapshot holding the files just read."""
    if source.folder is not None:
        return source.folder
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(source.repo, "config.json", revision=source.revision)
    if not isinstance(path, str):
        raise not_cached(source, FileNotFoundError("config.json"))
    return Path(path).parent
