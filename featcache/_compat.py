"""Make ``import torchvision`` work when its compiled ops cannot load.

When torchvision's C++ extension does not match the installed torch (a CUDA torchvision
beside a CPU-only torch), ``import torchvision`` raises "operator torchvision::nms does
not exist": its ``_meta_registrations.py`` registers fake kernels for ``nms`` and ``qnms``
without checking that the ops exist (pytorch/vision#9085). featcache calls neither, so
declaring the two schemas (without kernels) lets the import succeed. The check runs on
the first import of torchvision, by anyone, so ``import featcache`` loads no torch.
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


def torchvision_extension_loads() -> bool:
    """Try to load torchvision's compiled ops into torch; return whether they loaded."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    paths = [os.path.join(folder, "_C" + suffix) for folder in folders for suffix in suffixes]
    found = next((path for path in paths if os.path.exists(path)), None)
    if found is None:  # torchvision has no compiled extension
        return False
    try:
        torch.ops.load_library(found)
    except (OSError, RuntimeError):
        return False
    return True


def declare_torchvision_ops() -> list[str]:
    """Declare the schemas of :data:`UNCONDITIONAL_OPS` that do not exist yet; returns
    the names declared.

    ``torch.library.define`` without a ``lib`` keeps the ops for the life of the process;
    a ``Library`` held here would remove them when collected (after a module reload).
    """
    import torch

    missing = [name for name in UNCONDITIONAL_OPS if not _has_schema(name)]
    for name in missing:
        torch.library.define(f"torchvision::{name}", UNCONDITIONAL_OPS[name])
    return missing


def ensure_torchvision_importable() -> None:
    """Call before the first ``import torchvision``; a no-op when its extension loads."""
    if importlib.util.find_spec("torchvision") is not None and not torchvision_extension_loads():
        declare_torchvision_ops()


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """An import hook running :func:`ensure_torchvision_importable` before torchvision's
    first import; the import itself is left to the usual finders."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> None:
        if name == "torchvision":
            if self in sys.meta_path:  # first: the check itself looks torchvision up
                sys.meta_path.remove(self)
            ensure_torchvision_importable()
        return None


def guard_torchvision_import() -> None:
    """Have :func:`ensure_torchvision_importable` run before torchvision is first imported,
    whoever imports it."""
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
