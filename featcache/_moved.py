"""Old module paths of featcache (``featcache.dataset``), importable still as the same
module object at the new path, with a ``DeprecationWarning`` once per path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old dotted path -> new dotted path
MOVED = {
    "featcache.buffer_read": "featcache.read.buffer_read",
    "featcache.channels": "featcache.capture.channels",
    "featcache.cli": "featcache.commands.app",
    "featcache.cli_output": "featcache.commands.output",
    "featcache.config_reference": "featcache.config.reference",
    "featcache.config_yaml": "featcache.config.yaml_io",
    "featcache.dataset": "featcache.read.dataset",
    "featcache.demo": "featcache.commands.demo",
    "featcache.describe": "featcache.store.describe",
    "featcache.distributed": "featcache.extraction.distributed",
    "featcache.extras": "featcache.util.extras",
    "featcache.files": "featcache.util.files",
    "featcache.fingerprints": "featcache.util.fingerprints",
    "featcache.history": "featcache.store.history",
    "featcache.layers": "featcache.capture.layers",
    "featcache.memory": "featcache.capture.memory",
    "featcache.models.tokenizer": "featcache.sources.tokenizer",
    "featcache.padding": "featcache.read.padding",
    "featcache.planning": "featcache.extraction.planning",
    "featcache.plotting": "featcache.util.plotting",
    "featcache.provenance": "featcache.store.provenance",
    "featcache.recorded": "featcache.config.recorded",
    "featcache.reduce": "featcache.capture.reduce",
    "featcache.runtime": "featcache.capture.runtime",
    "featcache.selectors": "featcache.capture.selectors",
    "featcache.shuffled_batches": "featcache.read.shuffled_batches",
    "featcache.spec": "featcache.config.spec",
    "featcache.taps": "featcache.capture.taps",
    "featcache.token_view": "featcache.read.token_view",
    "featcache.units": "featcache.util.units",
    "featcache.urls": "featcache.util.urls",
    "featcache.validation": "featcache.config.validation",
    "featcache.verify": "featcache.commands.verify",
    "featcache.visualize": "featcache.commands.visualize",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the old path's spec on it


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` (only those), warning of the new one."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(
            f"{fullname} moved to {new}; import it from there (the old path will go)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
