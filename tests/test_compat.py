"""featcache makes torchvision importable even when its compiled ops cannot load."""

from __future__ import annotations

import subprocess
import sys

import torch

from featcache import _compat


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_featcache_then_torchvision_works():
    result = _python(
        "import featcache, torch, torchvision\n"
        "m = torchvision.models.resnet18().eval()\n"
        "print(tuple(m(torch.zeros(1, 3, 32, 32)).shape))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(1, 1000)"


def test_import_featcache_then_timm_works_and_loads_torch_only_then():
    # timm imports torchvision itself: the check runs at that import, not at featcache's.
    result = _python(
        "import sys, featcache\n"
        "print('torch' in sys.modules)\n"
        "import timm, torch\n"
        "m = timm.create_model('resnet18', num_classes=3).eval()\n"
        "print(tuple(m(torch.zeros(1, 3, 32, 32)).shape))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False", "(1, 3)"]


def test_declared_schemas_match_torchvision_signature():
    _compat.ensure_torchvision_importable()
    import torchvision  # noqa: F401

    for name, signature in _compat.UNCONDITIONAL_OPS.items():
        schema = str(torch._C._get_schema(f"torchvision::{name}", ""))
        assert schema == f"torchvision::{name}{signature}"


def test_declare_is_idempotent():
    _compat.ensure_torchvision_importable()
    assert _compat.declare_torchvision_ops() == []


def test_declares_ops_in_a_process_where_they_are_missing():
    # Load the compat module on its own in a fresh interpreter, so nothing has loaded
    # torchvision's extension or declared the ops yet.
    code = (
        "import importlib.util, torch\n"
        f"spec = importlib.util.spec_from_file_location('compat', {_compat.__file__!r})\n"
        "compat = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(compat)\n"
        "print(compat._has_schema('nms'), compat._has_schema('qnms'))\n"
        "print(sorted(compat.declare_torchvision_ops()))\n"
        "print(compat._has_schema('nms'), compat._has_schema('qnms'))\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False False", "['nms', 'qnms']", "True True"]


def test_without_the_fix_torchvision_import_fails_when_extension_is_broken():
    """Documents the problem being fixed: only meaningful where the extension is broken."""
    if _compat.torchvision_extension_loads():
        result = _python("import torchvision")
        assert result.returncode == 0, result.stderr
    else:
        result = _python("import torchvision")
        assert result.returncode != 0
        assert "torchvision::nms does not exist" in result.stderr


def test_declared_ops_outlive_the_module_that_declared_them():
    # Forgetting featcache's modules (a reload, or tests that re-import modules one by
    # one) and collecting them must not take the declarations with them: torchvision is
    # already imported and looks the ops up again when its submodules load.
    code = (
        "import gc, importlib, sys, torch\n"
        "importlib.import_module('featcache._compat').ensure_torchvision_importable()\n"
        "import torchvision\n"
        "for _ in range(2):\n"
        "    for name in [m for m in sys.modules if m.split('.')[0] == 'featcache']:\n"
        "        del sys.modules[name]\n"
        "    gc.collect()\n"
        "    importlib.import_module('featcache._compat').ensure_torchvision_importable()\n"
        "for name in [m for m in sys.modules if m.split('.')[0] == 'featcache']:\n"
        "    del sys.modules[name]\n"
        "gc.collect()\n"
        "print([str(torch._C._get_schema(f'torchvision::{n}', '')) for n in ('nms', 'qnms')])\n"
        "import torchvision.ops\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert "torchvision::nms(" in result.stdout and "torchvision::qnms(" in result.stdout
