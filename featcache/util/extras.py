"""Optional dependencies (extras): imported only when used, missing in one line."""

from __future__ import annotations

import importlib
from types import ModuleType

from featcache.errors import FeatcacheError

# import name -> the extra of featcache that installs it
EXTRAS = {
    "matplotlib": "plot",
    "timm": "timm",
    "transformers": "hf",
    "open_clip": "open_clip",
    "datasets": "datasets",
    "pyarrow": "parquet",
}


def install_command(extra: str) -> str:
    """``pip install 'featcache[<extra>]'``."""
    return f"pip install 'featcache[{extra}]'"


def require(name: str, purpose: str) -> ModuleType:
    """Import the optional package ``name`` (a key of :data:`EXTRAS`) and return it.

    Raises:
        FeatcacheError: not installed; one line led by ``purpose``, naming the extra
            (``"timm:vit_b needs timm; install it with: pip install 'featcache[timm]'"``).
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        raise FeatcacheError(
            f"{purpose} needs {name}; install it with: {install_command(EXTRAS[name])}"
        ) from None
