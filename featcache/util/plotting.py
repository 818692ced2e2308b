"""The optional matplotlib dependency for charts: checked in one place, missing in one line."""

from __future__ import annotations

from featcache.util.extras import has_module, install_command, require

PLOT_EXTRA = install_command("plot")


def has_matplotlib() -> bool:
    """Whether matplotlib (the ``plot`` extra) can be imported."""
    return has_module("matplotlib")


def require_matplotlib(purpose: str = "drawing charts") -> None:
    """Make sure matplotlib can be imported.

    Raises:
        FeatcacheError: not installed; one line led by ``purpose``, naming the extra.
    """
    require("matplotlib", purpose)
