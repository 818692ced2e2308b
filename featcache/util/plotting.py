"""The optional matplotlib dependency for charts: checked in one place, missing in one line."""

from __future__ import annotations

import importlib

from featcache.util.extras import install_command, require

PLOT_EXTRA = install_command("plot")


def has_matplotlib() -> bool:
    """Whether matplotlib (the ``plot`` extra) can be imported."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def require_matplotlib(purpose: str = "drawing charts") -> None:
    """Make sure matplotlib can be imported.

    Raises:
        FeatcacheError: not installed; one line led by ``purpose``, naming the extra.
    """
    require("matplotlib", purpose)
