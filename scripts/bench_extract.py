"""Extraction throughput: featcache against the bare forward pass, in one process.

Prints images/s and the ratio to the bare eager forward (full network, default layout)
measured in the same run, for a full-depth tap (``avgpool``) and an early one
(``layer2``), next to a hand-written hook loop that appends to lists and saves with h5py
at the end. Images are random tensors held in memory, so the numbers measure the
backbone and the caching machinery, not image decoding.

    python scripts/bench_extract.py --model resnet18 --size 112 --images 512 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch

from featcache import extract  # featcache first: it makes torchvision importable

# isort: split
import torchvision


def bare_forward(model: torch.nn.Module, data: torch.Tensor, batch: int) -> None:
    with torch.inference_mode():
        for start in range(0, len(data), batch):
            model(data[start : start + batch])


def hooks_to_lists(model, data, batch, layer: str, path: Path) -> None:
    """The common hand-written approach: hooks append to a list, saved at the end."""
    kept: list[torch.Tensor] = []
    module = dict(model.named_modules())[layer]
    handle = module.register_forward_hook(lambda m, a, out: kept.append(out.flatten(1).clone()))
    try:
        bare_forward(model, data, batch)
    finally:
        handle.remove()
    with h5py.File(path, "w") as f:
        f["features"] = torch.cat(kept).numpy().astype(np.float16)


def featcache_run(model, data, batch, layer: str, path: Path) -> None:
    dataset = torch.utils.data.TensorDataset(data, torch.zeros(len(data), dtype=torch.long))
    extract(
        model,
        dataset,
        [{"name": layer, "reduce": "avg" if layer != "avgpool" else "flatten"}],
        path,
        batch_size=batch,
        num_workers=0,
        progress=False,
        overwrite=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None).eval()
    data = torch.randn(args.images, 3, args.size, args.size)
    folder = Path(tempfile.mkdtemp(prefix="featcache-bench-"))
    cases: dict[str, Callable[[], None]] = {
        "bare eager forward (full network)": lambda: bare_forward(model, data, args.batch),
    }
    for layer in ("avgpool", "layer2"):
        cases[f"hooks -> lists -> h5py, {layer}"] = lambda layer=layer: hooks_to_lists(
            model, data, args.batch, layer, folder / "lists.h5"
        )
        cases[f"featcache.extract, {layer}"] = lambda layer=layer: featcache_run(
            model, data, args.batch, layer, folder / "fc.h5"
        )

    bare_forward(model, data[: args.batch], args.batch)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)

    base = statistics.median(seconds["bare eager forward (full network)"])
    print(
        f"{args.model} at {args.size}px, {args.images} images, batch {args.batch}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'case':<40} {'images/s':>9} {'vs bare':>8}")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"{name:<40} {args.images / median:>9.1f} {base / median:>7.2f}x")


if __name__ == "__main__":
    main()
