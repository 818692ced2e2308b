"""The optional matplotlib dependency: checked in one place, missing in one line."""

from __future__ import annotations

from featcache.errors import FeatcacheError

PLOT_EXTRA = "pip install 'featcache[plot]'"


def has_matplotlib() -> bool:
    """Whether matplotlib (the ``plot`` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib(purpose: str = "drawing charts") -> None:
    """Make sure matplotlib can be imported, before a function that draws imports it.

    matplotlib is the optional ``plot`` extra, so featcache imports it only inside the
    functions that draw. ``purpose`` leads the error (``"drawing charts needs
    matplotlib; ..."``).

    Raises:
        FeatcacheError: matplotlib is not installed; one line naming the extra.
    """
    if not has_matplotlib():
        raise FeatcacheError(f"{purpose} needs matplotlib; install it with: {PLOT_EXTRA}")
