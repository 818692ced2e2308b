"""What ``loader.decode: fast`` buys and costs: decoding speed against feature change.

featcache decodes images in full by default (``exact``): the pixels are those of the
model's own preprocessing. ``fast`` decodes a JPEG at 1/2, 1/4 or 1/8 scale (Pillow's
draft mode, in the DCT) whenever it is at least twice the size the resize needs, then
resizes from there. This script times both over real photos through featcache's own
decoder (:func:`featcache.sources.decode.load_rgb`) and the model's transform, and
compares the features:

* at 224 px (torchvision's resnet18 eval transform: resize 256, centre crop 224), the
  relative change of pooled ``layer4`` features of a seeded random resnet18;
* at 32 px (resize 32, centre crop 32), the relative change of pooled ``layer3``
  features of the pretrained CIFAR ResNet-20 in ``../shared/data/weights``, and how
  many predicted classes change.

Run: ``python scripts/bench_decode.py [--photos N] [--rounds R]``. Speeds are photos per
second of CPU time on one thread (decoding and the transform only), the median of
``--rounds`` passes over the photos.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import featcache  # noqa: F401  (before torchvision: makes it importable beside torch)
from featcache.sources.decode import load_rgb

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def photos_from_tar(folder: Path, count: int) -> list[Path]:
    """Up to ``count`` hymenoptera JPEGs, extracted into ``folder``."""
    with tarfile.open(SHARED / "hymenoptera.tar") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.name.endswith(".jpg")), key=lambda m: m.name
        )[:count]
        tar.extractall(folder, members=members, filter="data")
    return [folder / m.name for m in members]


def timed(paths: Sequence[Path], decode: Callable[[Path], torch.Tensor], rounds: int) -> float:
    """Photos per second of this thread's CPU time (robust to other processes on the
    machine), the median over ``rounds`` passes."""
    rates = []
    for _ in range(rounds):
        start = time.thread_time()
        for path in paths:
            decode(path)
        rates.append(len(paths) / (time.thread_time() - start))
    return statistics.median(rates)


def relative_change(exact: torch.Tensor, fast: torch.Tensor) -> torch.Tensor:
    """Per row, ||fast - exact|| / ||exact||."""
    return (fast - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-12)


def features(
    model: torch.nn.Module, layer: str, images: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Average-pooled output of ``layer`` and the model's logits, for the images."""
    captured: list[torch.Tensor] = []
    module = dict(model.named_modules())[layer]
    handle = module.register_forward_hook(lambda m, a, out: captured.append(out.mean((2, 3))))
    with torch.no_grad():
        logits = torch.cat(
            [model(torch.stack(images[i : i + 32])) for i in range(0, len(images), 32)]
        )
    handle.remove()
    return torch.cat(captured), logits


def cifar_resnet20() -> torch.nn.Module | None:
    weights = SHARED / "weights" / "resnet20-12fca82f.th"
    if not weights.exists():
        return None
    sys.path.insert(0, str(REPO))
    from tests.cifar_resnet import resnet20

    state = torch.load(weights, map_location="cpu", weights_only=True)["state_dict"]
    model = resnet20()
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    return model.eval()


def main(argv: Sequence[str] | None = None) -> int:
    import torchvision
    from torchvision import transforms as T

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--photos", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = photos_from_tar(Path(tmp), args.photos)
        sides = sorted(min(load_rgb(p).size) for p in paths)
        print(f"{len(paths)} hymenoptera photos, shorter side {sides[0]} to {sides[-1]} px")
        print(f"{'pipeline (photos per CPU second)':<50}{'exact':>8}{'fast':>8}{'speed-up':>10}")
        setups = [
            (
                "224 px: resize 256, crop 224 (random resnet18)",
                torchvision.models.ResNet18_Weights.DEFAULT.transforms(),
                256,
                lambda: torchvision.models.resnet18().eval(),
                "layer4",
            ),
            (
                "32 px: resize 32, crop 32 (pretrained ResNet-20)",
                T.Compose(
                    [
                        T.Resize(32),
                        T.CenterCrop(32),
                        T.ToTensor(),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                    ]
                ),
                32,
                cifar_resnet20,
                "layer3",
            ),
        ]
        changes = []
        for label, transform, side, build, layer in setups:
            exact = timed(paths, lambda p, t=transform: t(load_rgb(p)), args.rounds)
            fast = timed(paths, lambda p, t=transform, s=side: t(load_rgb(p, s)), args.rounds)
            print(f"{label:<50}{exact:>8.1f}{fast:>8.1f}{fast / exact:>9.2f}x")
            torch.manual_seed(0)
            model = build()
            if model is None:
                continue
            exact_images = [transform(load_rgb(p)) for p in paths]
            fast_images = [transform(load_rgb(p, side)) for p in paths]
            ours, exact_logits = features(model, layer, exact_images)
            theirs, fast_logits = features(model, layer, fast_images)
            change = relative_change(ours, theirs)
            flipped = int((exact_logits.argmax(1) != fast_logits.argmax(1)).sum())
            changes.append((label, layer, change, flipped))
        print()
        print("feature change, fast against exact (relative L2 per photo)")
        for label, layer, change, flipped in changes:
            print(
                f"{label:<30} {layer:<7} median {change.median():.1%}, max {change.max():.1%}; "
                f"predicted class changed for {flipped} of {len(change)}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
