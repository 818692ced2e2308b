"""Differential sweep: featcache's stored features against each zoo's own pipeline.

For many architectures of each model kind, with random (seeded) weights, featcache runs
its config path (``model.name``, no ``preprocess``: the zoo's own transform) over real
photos into a float32 store, capturing stage or block outputs raw and average-pooled.
The reference is the zoo's own pipeline over the same files: its eval transform on the
photo decoded in full, then its own way to reach intermediate features:

* torchvision: the default weights' ``transforms()`` and
  ``torchvision.models.feature_extraction.create_feature_extractor``;
* timm: ``resolve_model_data_config`` + ``create_transform`` and
  ``forward_intermediates`` (NCHW maps, prefix tokens dropped);
* hf: the image processor's ``pixel_values`` and ``output_hidden_states``.

One line per architecture gives the largest difference over the reference's largest
magnitude, raw and pooled; a summary follows. Run::

    python scripts/zoo_sweep.py                      # every kind, 6 hymenoptera photos
    python scripts/zoo_sweep.py --kinds timm --photos 12 --models resnet18,mambaout_femto
    python scripts/zoo_sweep.py --decode fast        # what draft JPEG decoding changes

The photos come from ``../shared/data/hymenoptera.tar`` (or ``--photo-dir``, a folder of
JPEGs). A pass needs a relative difference below ``--tolerance`` (float32 rounding of the
same forward run in another memory layout or batch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

import featcache  # before torchvision or timm: makes torchvision importable beside torch

REPO = Path(__file__).resolve().parents[1]
PHOTOS_TAR = REPO.parent / "shared" / "data" / "hymenoptera.tar"

# (name, modules to capture, modules whose output keeps its channels last)
TORCHVISION = [
    ("resnet18", ["layer1", "layer2", "layer3", "layer4"], ()),
    ("resnet50", ["layer1", "layer3", "layer4"], ()),
    ("mobilenet_v3_small", ["features.3", "features.8", "features.12"], ()),
    ("efficientnet_b0", ["features.2", "features.5", "features.8"], ()),
    ("convnext_tiny", ["features.1", "features.3", "features.7"], ()),
    ("regnet_y_400mf", ["trunk_output.block1", "trunk_output.block4"], ()),
    ("densenet121", ["features.denseblock1", "features.norm5"], ()),
    ("shufflenet_v2_x0_5", ["stage2", "stage4", "conv5"], ()),
    ("squeezenet1_1", ["features.5", "features.12"], ()),
    ("googlenet", ["inception3b", "inception5b"], ()),
    ("inception_v3", ["Mixed_5d", "Mixed_7c"], ()),
    ("swin_t", ["features.1", "features.3", "features.7", "norm"], ("features", "norm")),
    ("swin_v2_t", ["features.3", "features.7"], ("features",)),
    ("vit_b_16", ["encoder.layers.encoder_layer_5", "encoder.layers.encoder_layer_11"], ()),
]

TIMM = [
    "resnet18",
    "resnet50d",
    "efficientnet_b0",
    "mobilenetv3_small_100",
    "mobilenetv4_conv_small",
    "convnext_atto",
    "convnextv2_atto",
    "swin_tiny_patch4_window7_224",
    "swinv2_cr_tiny_ns_224",
    "mambaout_femto",
    "vit_tiny_patch16_224",
    "deit_tiny_distilled_patch16_224",
    "vit_small_patch14_reg4_dinov2",
    "eva02_tiny_patch14_224",
    "regnetx_002",
    "densenet121",
    "ghostnet_100",
    "efficientvit_b0",
    "fastvit_t8",
    "edgenext_xx_small",
    "poolformer_s12",
    "mobilevit_xxs",
    "repvit_m0_9",
    "levit_128s",
    "caformer_s18",
    "pvt_v2_b0",
    "hgnetv2_b0",
    "inception_v3",
    "xcit_nano_12_p16_224",
    "sequencer2d_s",
    "tiny_vit_5m_224",
    "gcvit_xxtiny",
    "focalnet_tiny_srf",
    "volo_d1_224",
    "starnet_s1",
    "lcnet_050",
]


def _hf_models() -> list[tuple[str, Callable[[Any], Any], Callable[[Any], Any]]]:
    """(name, config builder, processor builder) of small Hugging Face vision models."""
    small = dict(num_hidden_layers=4)
    return [
        ("vit", lambda t: t.ViTConfig(**small), lambda t: t.ViTImageProcessor()),
        ("deit", lambda t: t.DeiTConfig(**small), lambda t: t.DeiTImageProcessor()),
        ("dinov2", lambda t: t.Dinov2Config(**small), lambda t: t.BitImageProcessor()),
        (
            "dinov2-registers",
            lambda t: t.Dinov2WithRegistersConfig(**small),
            lambda t: t.BitImageProcessor(),
        ),
        ("beit", lambda t: t.BeitConfig(**small), lambda t: t.BeitImageProcessor()),
        (
            "data2vec-vision",
            lambda t: t.Data2VecVisionConfig(**small),
            lambda t: t.BeitImageProcessor(),
        ),
        (
            "clip",
            lambda t: t.CLIPConfig(vision_config={"num_hidden_layers": 4}),
            lambda t: t.CLIPImageProcessor(),
        ),
        (
            "siglip",
            lambda t: t.SiglipConfig(vision_config={"num_hidden_layers": 4}),
            lambda t: t.SiglipImageProcessor(),
        ),
        ("convnext", lambda t: t.ConvNextConfig(), lambda t: t.ConvNextImageProcessor()),
        ("convnextv2", lambda t: t.ConvNextV2Config(), lambda t: t.ConvNextImageProcessor()),
        ("resnet", lambda t: t.ResNetConfig(), lambda t: t.ConvNextImageProcessor()),
        ("regnet", lambda t: t.RegNetConfig(), lambda t: t.ConvNextImageProcessor()),
        ("swin", lambda t: t.SwinConfig(), lambda t: t.ViTImageProcessor()),
        ("mobilevit", lambda t: t.MobileViTConfig(), lambda t: t.MobileViTImageProcessor()),
    ]


@dataclasses.dataclass(frozen=True)
class Settings:
    """How featcache runs in the sweep, and which architectures it covers."""

    decode: str = "exact"  # loader.decode
    # runtime.channels_last: the references' own layout by default. channels_last
    # (featcache's default on the CPU) reorders sums, and some randomly initialised
    # networks amplify that rounding (MobileViT's last stage by about 1%), which would
    # hide what the sweep looks for.
    channels_last: bool | str = False
    only: frozenset[str] | None = None  # architecture names (None: all)

    def wants(self, name: str) -> bool:
        return self.only is None or name in self.only


@dataclasses.dataclass
class Outcome:
    """One architecture's result: the largest relative differences, or why it was skipped."""

    kind: str
    name: str
    layers: int = 0
    raw: float = 0.0
    pooled: float = 0.0
    skipped: str = ""
    seconds: float = 0.0

    def passed(self, tolerance: float) -> bool:
        return not self.skipped and self.raw <= tolerance and self.pooled <= tolerance

    def line(self, tolerance: float) -> str:
        label = f"{self.kind}:{self.name}"
        if self.skipped:
            return f"{label:<44} skipped: {self.skipped}"
        verdict = "ok" if self.passed(tolerance) else "DIFFERS"
        return (
            f"{label:<44} {self.layers:>2} layers  raw {self.raw:8.1e}  pooled "
            f"{self.pooled:8.1e}  {verdict}  ({self.seconds:.1f} s)"
        )


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| over max |theirs|."""
    if ours.shape != theirs.shape:
        return float("inf")
    scale = float(theirs.abs().max()) or 1.0
    return float((ours.float() - theirs.float()).abs().max()) / scale


def as_reference(stored: torch.Tensor, reference: torch.Tensor, prefix: int, nhwc: bool) -> Any:
    """A stored raw output ``[N, ...]`` in the reference's form: ``[N, H, W, C]`` as
    ``[N, C, H, W]``; ``[N, T, D]`` tokens (``prefix`` of them before the patch tokens) as
    the ``[N, D, h, w]`` grid an NCHW reference holds."""
    if nhwc and stored.dim() == 4:
        stored = stored.permute(0, 3, 1, 2)
    if stored.dim() == 3 and reference.dim() == 4:
        n, d, h, w = reference.shape
        # A layer before the model adds its prefix tokens holds the patch tokens alone.
        prefix = 0 if stored.shape[1] == h * w else prefix
        patches = stored[:, prefix:]
        if patches.shape[1] == h * w:
            stored = patches.transpose(1, 2).reshape(n, d, h, w)
    return stored


def pooled_reference(reference: torch.Tensor, prefix: int) -> torch.Tensor:
    """The reference averaged over its spatial axes (NCHW) or its patch tokens."""
    if reference.dim() == 4:
        return reference.mean(dim=(2, 3))
    if reference.dim() == 3:
        return reference[:, prefix:].mean(dim=1)
    return reference


def run_featcache(
    model: dict[str, Any], modules: Sequence[str], photos: Path, out: Path, settings: Settings
) -> featcache.FeatureStore:
    """featcache's config path over the photos: each module raw and average-pooled."""
    layers: list[dict[str, Any]] = []
    for name in modules:
        layers.append({"name": name, "key": f"{name}@raw"})
        layers.append({"name": name, "reduce": "avg", "key": f"{name}@avg"})
    config = {
        "model": model,
        "layers": layers,
        "data": {"source": "imagefolder", "root": str(photos), "splits": ["val"]},
        "loader": {"batch_size": 8, "num_workers": 0, "decode": settings.decode},
        "store": {"dtype": "float32"},
        "output": {"dir": str(out), "overwrite": True},
        "runtime": {
            "progress": False,
            "device": "cpu",
            "seed": 0,
            "channels_last": settings.channels_last,
        },
    }
    return featcache.extract_from_config(config)["val"]


def compare(
    kind: str,
    name: str,
    store: featcache.FeatureStore,
    references: dict[str, torch.Tensor],
    prefix: int,
    nhwc: Collection[str],
    started: float,
) -> Outcome:
    outcome = Outcome(kind, name, layers=len(references))
    for module, reference in references.items():
        raw = as_reference(store.read(f"{module}@raw"), reference, prefix, module in nhwc)
        outcome.raw = max(outcome.raw, relative(raw, reference))
        pooled = pooled_reference(reference, prefix)
        outcome.pooled = max(outcome.pooled, relative(store.read(f"{module}@avg"), pooled))
    outcome.seconds = time.perf_counter() - started
    return outcome


def stored_nhwc(store: featcache.FeatureStore, modules: Sequence[str]) -> list[str]:
    """The modules whose raw outputs featcache stored channels last, as it recorded."""
    return [m for m in modules if store.layer_attrs(f"{m}@raw").get("channel_layout") == "nhwc"]


def photo_files(folder: Path) -> list[Path]:
    return sorted((folder / "val" / "photos").glob("*.jpg"))


def load_photos(folder: Path) -> list[Image.Image]:
    """The photos decoded in full, as the zoos' own pipelines are given them."""
    images = []
    for path in photo_files(folder):
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return images


def sweep_torchvision(photos: Path, out: Path, settings: Settings) -> Iterator[Outcome]:
    import torchvision
    from torchvision.models.feature_extraction import create_feature_extractor

    images = load_photos(photos)
    for name, modules, channels_last in TORCHVISION:
        if not settings.wants(name):
            continue
        started = time.perf_counter()
        try:
            store = run_featcache({"name": name}, modules, photos, out / name, settings)
            torch.manual_seed(0)  # as featcache builds it: model.seed 0, runtime.seed 0
            model = torchvision.models.get_model(name).eval()
            transform = torchvision.models.get_model_weights(name).DEFAULT.transforms()
            batch = torch.stack([transform(image) for image in images])
            with torch.no_grad():
                outputs = create_feature_extractor(model, list(modules))(batch)
        except Exception as exc:  # one architecture's failure is a line, not the end
            yield Outcome("torchvision", name, skipped=f"{type(exc).__name__}: {exc}"[:120])
            continue

        nhwc = [m for m in modules if any(m == p or m.startswith(f"{p}.") for p in channels_last)]
        references = {
            m: (outputs[m].permute(0, 3, 1, 2) if m in nhwc else outputs[m]) for m in modules
        }
        prefix = 1 if name.startswith("vit") else 0
        yield compare("torchvision", name, store, references, prefix, nhwc, started)


def sweep_timm(photos: Path, out: Path, settings: Settings) -> Iterator[Outcome]:
    import timm

    images = load_photos(photos)
    for name in TIMM:
        if not settings.wants(name):
            continue
        started = time.perf_counter()
        try:
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False).eval()
            info = [entry["module"] for entry in model.feature_info]
            positions = sorted({round(i * (len(info) - 1) / 3) for i in range(4)})
            modules = [info[i] for i in positions]
            store = run_featcache({"name": f"timm:{name}"}, modules, photos, out / name, settings)
            config = timm.data.resolve_model_data_config(model)
            transform = timm.data.create_transform(**config, is_training=False)
            batch = torch.stack([transform(image) for image in images])
            with torch.no_grad():
                maps = model.forward_intermediates(
                    batch, indices=positions, intermediates_only=True
                )
        except Exception as exc:
            yield Outcome("timm", name, skipped=f"{type(exc).__name__}: {exc}"[:120])
            continue
        references = dict(zip(modules, maps, strict=True))
        prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
        yield compare("timm", name, store, references, prefix, stored_nhwc(store, modules), started)


def sweep_hf(photos: Path, out: Path, settings: Settings) -> Iterator[Outcome]:
    import transformers

    transformers.logging.set_verbosity_error()
    images = load_photos(photos)
    for name, make_config, make_processor in _hf_models():
        if not settings.wants(name):
            continue
        started = time.perf_counter()
        folder = out / f"hf-{name}"
        try:
            torch.manual_seed(0)
            saved = transformers.AutoModel.from_config(make_config(transformers)).eval()
            processor = make_processor(transformers)
            saved.save_pretrained(folder)
            processor.save_pretrained(folder)
            tower = getattr(saved, "vision_model", saved)
            blocks = _hf_blocks(tower)
            modules = [blocks[i] for i in sorted({0, len(blocks) // 2, len(blocks) - 1})]
            model = {"name": f"hf:{folder}", "weights": "pretrained"}
            store = run_featcache(model, modules, photos, out / name, settings)
            pixels = processor(images, return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                hidden = tower(pixels, output_hidden_states=True)
            states = getattr(hidden, "reshaped_hidden_states", None) or hidden.hidden_states
            first = len(states) - len(blocks)  # 1: the embeddings' state comes first
            if first not in (0, 1):
                raise ValueError(f"{len(states)} hidden states for {len(blocks)} blocks")
            references = {m: states[blocks.index(m) + first] for m in modules}
        except Exception as exc:
            yield Outcome("hf", name, skipped=f"{type(exc).__name__}: {exc}"[:120])
            continue
        prefix = _hf_prefix(tower)
        yield compare("hf", name, store, references, prefix, stored_nhwc(store, modules), started)


def _hf_blocks(tower: torch.nn.Module) -> list[str]:
    """The module names whose outputs are the last ``hidden_states``: the encoder's
    blocks or stages, in order."""
    for container in ("encoder.layer", "encoder.layers", "layers", "encoder.stages"):
        module = dict(tower.named_modules()).get(container)
        if isinstance(module, torch.nn.ModuleList):
            return [f"{container}.{i}" for i in range(len(module))]
    raise ValueError("no encoder blocks found")


def _hf_prefix(tower: torch.nn.Module) -> int:
    from featcache.models.hf import prefix_tokens

    return prefix_tokens(tower) or 0


KINDS = {"torchvision": sweep_torchvision, "timm": sweep_timm, "hf": sweep_hf}


@contextlib.contextmanager
def photo_folder(count: int, photo_dir: Path | None) -> Iterator[Path]:
    """An ImageFolder root ``<tmp>/val/photos/*.jpg`` of ``count`` real photos."""
    with tempfile.TemporaryDirectory(prefix="zoo-sweep-") as tmp:
        root = Path(tmp)
        target = root / "photos" / "val" / "photos"
        target.mkdir(parents=True)
        if photo_dir is None:
            if not PHOTOS_TAR.exists():
                raise SystemExit(f"no photos: {PHOTOS_TAR} is absent; pass --photo-dir")
            with tarfile.open(PHOTOS_TAR) as tar:
                members = [m for m in tar.getmembers() if m.name.endswith(".jpg")]
                members = sorted(members, key=lambda m: m.name)
                for member in members[:: max(1, len(members) // count)][:count]:
                    member.name = Path(member.name).name
                    tar.extract(member, target, filter="data")
        else:
            for path in sorted(photo_dir.glob("*.jpg"))[:count]:
                shutil.copy(path, target / path.name)
        yield root / "photos"


TOLERANCE = 1e-4


def sweep(
    kinds: Sequence[str],
    count: int = 6,
    settings: Settings = Settings(),
    photo_dir: Path | None = None,
    tolerance: float = TOLERANCE,
) -> list[Outcome]:
    """Run the sweep over ``kinds``; the outcome of each architecture, each printed as
    it comes."""
    outcomes = []
    with photo_folder(count, photo_dir) as photos, tempfile.TemporaryDirectory() as out:
        for kind in kinds:
            for outcome in KINDS[kind](photos, Path(out), settings):
                outcomes.append(outcome)
                print(outcome.line(tolerance), flush=True)
    return outcomes


def summary(outcomes: Sequence[Outcome], tolerance: float) -> str:
    lines = []
    for kind in dict.fromkeys(o.kind for o in outcomes):
        mine = [o for o in outcomes if o.kind == kind]
        passed = sum(o.passed(tolerance) for o in mine)
        skipped = sum(bool(o.skipped) for o in mine)
        differs = [o.name for o in mine if not o.skipped and not o.passed(tolerance)]
        line = f"{kind}: {passed}/{len(mine)} equal within {tolerance:g}"
        if skipped:
            line += f", {skipped} skipped"
        if differs:
            line += f", differ: {', '.join(differs)}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="torchvision,timm,hf")
    parser.add_argument("--models", default="", help="comma-separated architecture names")
    parser.add_argument("--photos", type=int, default=6, help="photos per architecture")
    parser.add_argument("--photo-dir", type=Path, default=None)
    parser.add_argument("--decode", choices=["exact", "fast"], default="exact")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument(
        "--channels-last", choices=["false", "auto"], default="false", help="featcache's layout"
    )
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kind {unknown[0]!r}; choose from {', '.join(KINDS)}")
    settings = Settings(
        decode=args.decode,
        channels_last=False if args.channels_last == "false" else "auto",
        only=frozenset(m for m in args.models.split(",") if m) or None,
    )
    outcomes = sweep(kinds, args.photos, settings, args.photo_dir, args.tolerance)
    print()
    print(summary(outcomes, args.tolerance))
    return 0 if all(o.passed(args.tolerance) or o.skipped for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
