"""Every module imports on its own in a fresh interpreter: no cycles, no order dependence."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys

import featcache
from featcache._moved import MOVED

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(featcache.__path__, "featcache.")
    if m.name != "featcache.__main__"
)


def test_the_package_lists_its_modules():
    assert "featcache.extraction.loop" in MODULES and "featcache.store.codec" in MODULES


def test_each_module_imports_alone():
    # One interpreter; before each import every featcache module is forgotten, so a module
    # that only imports after another one (or through a cycle) fails here. Third-party
    # modules stay loaded: importing torch afresh for each module would take minutes.
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'featcache']:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        print(name, type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, *MODULES], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr


def test_importing_featcache_loads_no_heavy_module():
    code = (
        "import sys, featcache\n"
        "heavy = [m for m in ('featcache.extraction', 'featcache.store', 'h5py', 'featcache.probe',"
        " 'torch', 'torchvision') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert callable(featcache.extract) and featcache.FeatureStore.__name__ == "FeatureStore"


def run_command_line(args: list[str], modules: tuple[str, ...]) -> tuple[str, list[str]]:
    """Run ``featcache ARGS`` in a fresh interpreter (it must succeed): its output, and
    which of ``modules`` it loaded."""
    code = (
        "import sys\n"
        "from featcache.commands.app import app\n"
        "try:\n"
        f"    app({args!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        f"print([m for m in {modules!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    *lines, loaded = out.stdout.splitlines()
    return "\n".join(lines), ast.literal_eval(loaded)


def test_the_command_line_help_loads_no_torch():
    # --help, --version and usage errors answer at once, without loading torch.
    assert run_command_line(["extract", "--help"], ("torch", "h5py"))[1] == []


def test_info_merge_and_quick_verify_read_a_store_without_loading_torch(tmp_path):
    # Store commands answer in well under a second: torch is loaded only to make tensors,
    # and `info`, `merge` and `verify --quick` make none.
    import torch

    from featcache.store import FeatureStore

    store = featcache.extract(
        torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)),
        torch.utils.data.TensorDataset(torch.randn(10, 1, 2, 2), torch.arange(10)),
        ["1"],
        tmp_path / "s.h5",
        batch_size=4,
        progress=False,
    )
    store.close()
    heavy = ("torch", "torchvision")
    shown, loaded = run_command_line(["info", str(tmp_path / "s.h5")], heavy)
    assert "complete, 10 rows" in shown and loaded == []
    merge = ["merge", str(tmp_path / "s.h5"), "--output", str(tmp_path / "m.h5")]
    assert run_command_line(merge, heavy)[1] == []
    shown, loaded = run_command_line(["verify", "--quick", str(tmp_path / "m.h5")], heavy)
    assert "verify: PASS" in shown and "ok    finite" in shown and loaded == []
    merged, original = FeatureStore(tmp_path / "m.h5"), FeatureStore(tmp_path / "s.h5")
    assert merged.read("1").dtype == torch.float16
    assert torch.equal(merged.read("1"), original.read("1"))


def test_subpackages_are_reachable_as_attributes():
    code = (
        "import featcache\n"
        "print(featcache.probe.probe.__module__, featcache.verify.verify_store.__name__,"
        " 'probe' in dir(featcache))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["featcache.probe.api", "verify_store", "True"], out.stderr


def test_every_old_module_path_imports_the_moved_module_with_a_warning():
    code = (
        "import importlib, json, warnings\n"
        "from featcache._moved import MOVED\n"
        "seen = {}\n"
        "for old, new in MOVED.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    moved = importlib.import_module(new)\n"
        "    said = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "    seen[old] = [module is moved, moved.__spec__.name, said[:1]]\n"
        "print(json.dumps(seen))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    seen = json.loads(out.stdout)
    assert sorted(seen) == sorted(MOVED), out.stderr
    for old, new in MOVED.items():
        warning = f"{old} moved to {new}; import it from there (the old path will go)"
        assert seen[old] == [True, new, [warning]], old


def test_a_moved_public_name_imports_from_its_old_place():
    code = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    from featcache.dataset import FeatureDataset\n"
        "except DeprecationWarning as warning:\n"
        "    print(warning)\n"
        "warnings.simplefilter('ignore')\n"
        "from featcache.dataset import FeatureDataset\n"
        "from featcache.cli import app\n"
        "import featcache\n"
        "print(FeatureDataset is featcache.FeatureDataset, app.info.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split("\n")[:2] == [
        "featcache.dataset moved to featcache.read.dataset; import it from there (the old "
        "path will go)",
        "True featcache",
    ], out.stderr
