"""Exceptions that carry one user-facing line naming the problem and the fix."""

from __future__ import annotations


class FeatcacheError(Exception):
    """A failure the user can act on. ``str(err)`` is a single line; no traceback needed.

    ``exit_code`` is what the CLI exits with: 1 for runtime failures.
    """

    exit_code = 1


class ConfigError(FeatcacheError):
    """Bad usage or configuration: unknown keys, models, layers, paths. CLI exit code 2."""

    exit_code = 2
