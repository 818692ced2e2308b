"""Exceptions that carry one user-facing line naming the problem and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FeatcacheError(Exception):
    """A failure the user can act on. ``str(err)`` is a single line; no traceback needed.

    ``exit_code`` is what the CLI exits with: 1 for runtime failures.
    """

    exit_code = 1


class ConfigError(FeatcacheError):
    """Bad usage or configuration: unknown keys, models, layers, paths. CLI exit code 2."""

    exit_code = 2


class FeatcacheWarning(UserWarning):
    """Something the user should know that does not stop the run (the CLI prints these as
    ``featcache: warning: ...``)."""


class CorruptStoreError(FeatcacheError):
    """A store is damaged: a chunk fails its checksum (or its decoding), and
    the message names the store, the dataset and the rows of the bad chunk; or its
    metadata (headers, attributes, chunk indexes) fails its checksums or digests, and the
    message says which."""


class IncompleteStoreError(FeatcacheError):
    """A store whose run has not finished (it was interrupted, or is still running) was
    opened for reading. ``path`` is the store, ``rows`` its rows written durably so far."""

    def __init__(self, message: str, path: str, rows: int):
        super().__init__(message)
        self.path, self.rows = path, rows


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The first line of an exception's message, whitespace collapsed, led by the class
    name with ``with_type``; an empty message gives the class name alone."""
    lines = str(exc).strip().splitlines()
    text = " ".join(lines[0].split()) if lines else ""
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if with_type else text


def did_you_mean(name: str, choices: Iterable[str], *, parenthesised: bool = False) -> str:
    """``"; did you mean a, b?"`` (or ``" (did you mean a, b?)"``) naming up to three close
    matches of ``name`` among ``choices``; ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=3)
    if not close:
        return ""
    question = f"did you mean {', '.join(close)}?"
    return f" ({question})" if parenthesised else f"; {question}"
