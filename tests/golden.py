"""Golden stores: five runs whose rows must not change when featcache's code is rebuilt.

Each scenario runs through the public face only (``featcache.extract_from_config`` and
``python -m featcache extract`` under torchrun), so it outlives any move of the modules
behind it. The rows it writes (features, ids, labels, index, and a per-token layer's
offsets and token ids) are kept in ``tests/golden/<scenario>.npz``; ``test_golden.py``
runs each scenario again and compares.

``python -m tests.golden`` writes the golden files anew. Do that only when a change of
the rows is intended, and say why in the commit.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import yaml

import featcache
from tests.test_update import image_folder, write_image
from tests.texts import write_text_config

GOLDEN = Path(__file__).parent / "golden"
ROW_DATASETS = ("ids", "labels", "index", "offsets", "token_ids")
DEMO = Path(featcache.__file__).parent / "demo.yaml"


def rows_of(path: Path) -> dict[str, np.ndarray]:
    """A store's rows as plain h5py reads them: ``features/<layer>``, and the row columns."""
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        for layer, dataset in f["features"].items():
            out[f"features/{layer}"] = dataset[()]
        for name in ROW_DATASETS:
            if name in f and isinstance(f[name], h5py.Dataset):
                out[name] = f[name][()]
    return out


def _image_config(root: Path, out: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model": {"name": "resnet18"},  # random weights, seeded
        "preprocess": {"mean": [0.485, 0.456, 0.406]},
        "layers": [{"name": "layer2", "reduce": "avg"}, {"name": "layer4"}],
        "data": {"source": "imagefolder", "root": str(root), "splits": ["train"]},
        "loader": {"batch_size": 8, "num_workers": 0},
        "store": {"dtype": "float16", "chunk_rows": 8},
        "output": {"dir": str(out)},
        "runtime": {"progress": False, "seed": 0},
        **extra,
    }


def demo(folder: Path) -> dict[str, Path]:
    """The demo's config (its model, layers and store), over fewer synthetic rows."""
    config = yaml.safe_load(DEMO.read_text())
    config["data"]["splits"] = {"train": {"size": 48}, "val": {"size": 24}}
    config["output"] = {"dir": str(folder / "out")}
    config["runtime"]["progress"] = False
    stores = featcache.extract_from_config(config)
    return {f"demo-{split}": Path(store.path) for split, store in stores.items()}


def tokens(folder: Path) -> dict[str, Path]:
    """A random BERT over JSONL texts: a mean-pooled layer and per-token rows."""
    config = yaml.safe_load(write_text_config(folder).read_text())
    config["data"]["splits"] = {"train": "train.jsonl"}
    stores = featcache.extract_from_config(config)
    return {"tokens": Path(stores["train"].path)}


def many_models(folder: Path) -> dict[str, Path]:
    """Two models over one pass of an image folder."""
    image_folder(folder / "images", 20)
    config = _image_config(folder / "images", folder / "out")
    del config["model"], config["layers"], config["preprocess"]
    config["models"] = [
        {"key": "resnet", "model": {"name": "resnet18"},
         "layers": [{"name": "layer3", "reduce": "avg"}]},
        {"key": "mobilenet", "model": {"name": "mobilenet_v3_small"},
         "layers": [{"name": "features.3", "reduce": "max"}], "preprocess": {"resize": 40}},
    ]  # fmt: skip
    stores = featcache.extract_from_config(config)
    return {f"many-{name.replace('/', '-')}": Path(store.path) for name, store in stores.items()}


def update(folder: Path) -> dict[str, Path]:
    """A store of 20 images, then an update after 4 are added, 1 replaced and a layer added."""
    root = folder / "images"
    files = image_folder(root, 20)
    featcache.extract_from_config(_image_config(root, folder / "out"))
    image_folder(root, 24)
    write_image(files[5], 1000)
    config = _image_config(root, folder / "out")
    config["layers"].append({"name": "layer3", "reduce": "max"})
    stores = featcache.extract_from_config(config, update=True)
    return {"update": Path(stores["train"].path)}


def torchrun(folder: Path) -> dict[str, Path]:
    """Two processes under torchrun, combined into one store."""
    image_folder(folder / "images", 40)
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(_image_config(folder / "images", folder / "out")))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "featcache", "extract", str(config),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return {"torchrun": folder / "out" / "train.h5"}


SCENARIOS: dict[str, Callable[[Path], dict[str, Path]]] = {
    "demo": demo,
    "tokens": tokens,
    "many_models": many_models,
    "update": update,
    "torchrun": torchrun,
}


def golden_rows(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"{name}.npz") as golden:
        return dict(golden)


def cpu_capability() -> str:
    """The vector instructions torch's CPU kernels run with: other hardware may round
    the last bit of a float differently."""
    return str(torch.backends.cpu.get_cpu_capability())


def write_all(folder: Path) -> None:
    """Run every scenario under ``folder`` and keep its rows as the golden files."""
    GOLDEN.mkdir(exist_ok=True)
    for scenario, run in SCENARIOS.items():
        for name, path in run(folder / scenario).items():
            np.savez_compressed(GOLDEN / f"{name}.npz", **rows_of(path))
    (GOLDEN / "cpu_capability.txt").write_text(cpu_capability() + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_all(Path(tmp))
