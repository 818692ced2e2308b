"""Make ``import torchvision`` work when its compiled ops cannot load.

torchvision ships a C++ extension (``torchvision/_C``) that defines the
``torchvision::*`` operators. When that extension does not match the installed
torch (a CUDA build of torchvision beside a CPU-only torch, for instance), the
extension fails to load and ``import torchvision`` then raises
``RuntimeError: operator torchvision::nms does not exist``, because
``torchvision/_meta_registrations.py`` registers fake kernels for ``nms`` and
``qnms`` without checking that the ops exist (pytorch/vision#9085).

featcache needs only torchvision's models, transforms and datasets, none of
which call those ops, so declaring the two schemas is enough for the import to
succeed. The declared ops have no kernels: calling them raises torch's usual
"could not run ... with arguments from the 'CPU' backend" error, which is the
honest answer when the extension is missing.

``import featcache`` does not import torch: it calls :func:`guard_torchvision_import`,
and the check runs when torchvision is first imported, by featcache or by any other
library (timm, open_clip). So ``featcache --help`` answers without loading torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

# Op schemas that torchvision registers fake kernels for at import time, unconditionally.
UNCONDITIONAL_OPS: dict[str, str] = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _has_schema(name: str) -> bool:
    import torch

    try:
        torch._C._get_schema(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


def _extension_path() -> str | None:
    """Path of torchvision's compiled extension, or None when torchvision has none."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = os.path.join(folder, "_C" + suffix)
            if os.path.exists(candidate):
                return candidate
    return None


def torchvision_extension_loads() -> bool:
    """Try to load torchvision's compiled ops into torch; return whether they loaded."""
    import torch

    path = _extension_path()
    if path is None:
        return False
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError):
        return False
    return True


def declare_torchvision_ops() -> list[str]:
    """Declare the schemas of :data:`UNCONDITIONAL_OPS` that do not exist yet.

    Returns the names declared (empty when all were already there). The declarations
    live as long as the process: ``torch.library.define`` without a ``lib`` keeps its
    library alive inside torch, whereas a ``Library`` held by this module would remove
    the ops when garbage-collected, for instance after the module is reloaded.
    """
    import torch

    missing = [name for name in UNCONDITIONAL_OPS if not _has_schema(name)]
    for name in missing:
        torch.library.define(f"torchvision::{name}", UNCONDITIONAL_OPS[name])
    return missing


def ensure_torchvision_importable() -> None:
    """Call before the first ``import torchvision``; a no-op when its extension loads."""
    if importlib.util.find_spec("torchvision") is None:
        return
    if not torchvision_extension_loads():
        declare_torchvision_ops()


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """An import hook that runs :func:`ensure_torchvision_importable` once, just before
    the first import of torchvision, then leaves the import to the usual finders."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> None:
        if name == "torchvision":
            if self in sys.meta_path:  # first: the check itself looks torchvision up
                sys.meta_path.remove(self)
            ensure_torchvision_importable()
        return None


def guard_torchvision_import() -> None:
    """Have :func:`ensure_torchvision_importable` run before torchvision is first imported
    in this process, whoever imports it; nothing to do when it is imported already."""
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
