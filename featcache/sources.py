"""The image dataset of one split, built from a config's ``data`` section.

Every source is a :class:`SourceDataset`: ``ds[i] -> (image, label)``, where ``image`` is
``transform`` applied to a PIL RGB image and ``label`` an int class index (-1 when the source
has no labels). Each row also has a stable string id (``ds.ids[i]``) that identifies it in a
store. Sources hold only plain data (paths, labels, options), so they pickle into DataLoader
workers under both fork and spawn.
"""

from __future__ import annotations

import colorsys
import csv
import dataclasses
import difflib
import inspect
import json
import math
import operator
import os
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision  # safe: importing featcache first made it importable
from PIL import Image
from torch.utils.data import Dataset

from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.fingerprints import file_sha256, lines_sha256
from featcache.spec import SOURCES, DataSpec
from featcache.validation import build, option

IMAGE_EXTENSIONS: tuple[str, ...] = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".gif",
    ".tif",
    ".tiff",
    ".webp",
    ".ppm",
    ".pgm",
)

Transform = Callable[[Image.Image], Any]


class SourceDataset(Dataset):
    """Base of all sources: ``ds[i] -> (image, label)``.

    ``image`` is ``transform(pil_rgb_image)``: with featcache's preprocessing a float32 tensor
    [3, H, W]; the PIL RGB image itself when ``transform`` is None. ``label`` is an int class
    index, or -1 when the source has no labels (``has_labels`` False).

    Attributes:
        ids: stable sample id per row, ``len(ids) == len(ds)``.
        class_names: ``class_names[label]`` names a class; None when unknown or unlabeled.
        has_labels: whether labels are real class indices.
    """

    ids: list[str]
    class_names: list[str] | None
    has_labels: bool

    def __init__(
        self,
        ids: list[str],
        class_names: list[str] | None,
        has_labels: bool,
        transform: Transform | None,
    ) -> None:
        self.ids = ids
        self.class_names = class_names
        self.has_labels = has_labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        i = operator.index(index)
        n = len(self.ids)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for a source of {n} rows")
        image, label = self._load(i)
        if self.transform is not None:
            image = self.transform(image)
        return image, label

    def _load(self, i: int) -> tuple[Image.Image, int]:
        """Row ``i`` (already in range) as a PIL RGB image and its label."""
        raise NotImplementedError

    def fingerprint(self, content: bool = False) -> str:
        """sha256 identifying the samples: their sorted ids (file sources add sizes, and
        with ``content=True`` the bytes of every file)."""
        return lines_sha256(sorted(self.ids))

    def __repr__(self) -> str:
        classes = "unlabeled" if not self.has_labels else f"classes={len(self.class_names or [])}"
        return f"{type(self).__name__}(rows={len(self)}, {classes})"


def load_rgb(path: str | os.PathLike, min_side: int | None = None) -> Image.Image:
    """Open and fully decode an image file as an 8-bit RGB PIL image.

    Alpha is dropped (palette transparency included); 16-bit and 32-bit integer grey
    images are scaled from the 16-bit range to 8 bits, not clipped. With ``min_side``, a
    JPEG is decoded at the smallest of its 1/2, 1/4 or 1/8 scales (Pillow's draft mode)
    whose shorter side is still at least ``min_side``: much faster for photos that are
    resized down afterwards, which then resize exactly to their final size.

    Raises:
        FeatcacheError: ``cannot decode image {path}: {reason}`` for missing, empty,
            truncated or unrecognised files.
    """
    try:
        with Image.open(path) as image:
            if min_side and image.format == "JPEG" and min(image.size) >= 2 * min_side:
                image.draft(image.mode, _draft_size(image.size, min_side))
            image.load()
            return _to_rgb(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        if isinstance(exc, FileNotFoundError):
            reason = "file not found"
        elif os.path.isfile(path) and os.path.getsize(path) == 0:
            reason = "the file is empty (0 bytes)"
        else:
            reason = first_line(exc)
        raise FeatcacheError(f"cannot decode image {path}: {reason}") from exc


def _draft_size(size: tuple[int, int], min_side: int) -> tuple[int, int]:
    """The (w, h) a draft must cover so that the shorter side stays >= ``min_side``."""
    width, height = size
    shorter = min(width, height)
    return (math.ceil(width * min_side / shorter), math.ceil(height * min_side / shorter))


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image.copy()
    if image.mode.startswith("I"):  # "I", "I;16", "I;16B", ...: 16-bit range -> 8 bits
        values = np.asarray(image.convert("I"), dtype=np.float32)
        grey = np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    if image.mode == "PA" or (image.mode == "P" and "transparency" in image.info):
        # Palette transparency must go through RGBA; a direct P -> RGB conversion warns.
        image = image.convert("RGBA")
    try:
        return image.convert("RGB")
    except ValueError as exc:
        raise ValueError(f"unsupported image mode {image.mode}") from exc


def _array_to_rgb(image: Any, where: str) -> Image.Image:
    """A PIL image of any mode, or a uint8/uint16 tensor or array (HxW, HxWxC; CxHxW tensor)."""
    if isinstance(image, Image.Image):
        return _to_rgb(image)
    if isinstance(image, torch.Tensor):
        array = image.detach().cpu().numpy()
        if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
            array = array.transpose(1, 2, 0)  # torchvision tensors are CxHxW
    else:
        array = np.asarray(image)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    shape_ok = array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (3, 4))
    if not shape_ok or array.dtype not in (np.uint8, np.uint16):
        raise FeatcacheError(
            f"{where}: cannot make an RGB image from a {array.dtype} array of shape "
            f"{tuple(array.shape)}; expected a PIL image or uint8 HxW / HxWxC"
        )
    if array.dtype == np.uint16:
        array = np.rint(array / 257.0).astype(np.uint8)
    return _to_rgb(Image.fromarray(np.ascontiguousarray(array)))


class _FileSource(SourceDataset):
    """Image files with optional labels: the imagefolder and manifest sources."""

    def __init__(
        self,
        paths: list[str],
        labels: list[int] | None,
        ids: list[str],
        class_names: list[str] | None,
        transform: Transform | None,
    ) -> None:
        super().__init__(ids, class_names, labels is not None, transform)
        self.paths = paths
        self.labels = labels
        self.decode_size: int | None = None  # see build_source

    def _load(self, i: int) -> tuple[Image.Image, int]:
        label = -1 if self.labels is None else self.labels[i]
        return load_rgb(self.paths[i], self.decode_size), label

    def fingerprint(self, content: bool = False) -> str:
        entries = []
        for sample_id, path in sorted(zip(self.ids, self.paths, strict=True)):
            size = os.path.getsize(path) if os.path.exists(path) else -1
            entry = f"{sample_id}\t{size}"
            if content and size >= 0:
                entry += "\t" + file_sha256(path)
            entries.append(entry)
        return lines_sha256(entries)


class _TorchvisionSource(SourceDataset):
    """Wraps a torchvision dataset built without a transform; its targets become int labels."""

    def __init__(self, dataset: Dataset, name: str, transform: Transform | None) -> None:
        classes = getattr(dataset, "classes", None)
        # ImageNet's classes are tuples of synonyms; keep the first.
        names = [c[0] if isinstance(c, tuple) and c else str(c) for c in classes or []]
        ids = [f"{name}:{i}" for i in range(len(dataset))]  # type: ignore[arg-type]
        super().__init__(ids, names or None, True, transform)
        self.dataset = dataset
        self.name = name

    def _load(self, i: int) -> tuple[Image.Image, int]:
        image, target = self.dataset[i]
        where = f"torchvision dataset {self.name} row {i}"
        try:
            label = int(target)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise FeatcacheError(
                f"{where}: target {type(target).__name__} is not a single class index; "
                "featcache stores one int label per image"
            ) from exc
        return _array_to_rgb(image, where), label


class _SyntheticSource(SourceDataset):
    """Deterministic class-dependent gratings: no files, for demos and tests.

    Class k is a sinusoidal grating at orientation ``pi * k / num_classes`` (jittered by up
    to a quarter step) with a class hue as tint, random frequency and phase, and pixel noise.
    Row i depends only on (seed, split, i), never on access order or worker count.
    """

    def __init__(
        self,
        split: str,
        size: int,
        image_size: int,
        num_classes: int,
        seed: int,
        transform: Transform | None,
    ) -> None:
        ids = [f"synthetic:{i}" for i in range(size)]
        names = [f"class_{k}" for k in range(num_classes)]
        super().__init__(ids, names, True, transform)
        self.image_size = image_size
        self.num_classes = num_classes
        self.entropy = (seed, zlib.crc32(split.encode()))  # each split its own stream

    def _load(self, i: int) -> tuple[Image.Image, int]:
        state = np.random.SeedSequence(self.entropy, spawn_key=(i,)).generate_state(1, np.uint64)
        gen = torch.Generator().manual_seed(int(state[0]))
        k = i % self.num_classes
        n = self.image_size
        jitter, freq, phase, contrast = torch.rand(4, generator=gen).tolist()
        theta = math.pi * (k + (jitter - 0.5) / 2) / self.num_classes
        coords = torch.linspace(-1.0, 1.0, n)
        y, x = torch.meshgrid(coords, coords, indexing="ij")
        along = x * math.cos(theta) + y * math.sin(theta)
        # 2 to 4 cycles across the image.
        wave = torch.sin(math.pi * (2 + 2 * freq) * along + 2 * math.pi * phase)
        tint = torch.tensor(colorsys.hsv_to_rgb(k / self.num_classes, 0.6, 1.0))
        image = (0.5 + (0.2 + 0.15 * contrast) * wave) * (0.5 + 0.5 * tint)[:, None, None]
        image = image + 0.05 * torch.randn(3, n, n, generator=gen)
        pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
        return Image.fromarray(pixels.numpy()), k


def build_source(
    data: DataSpec, split: str, transform: Transform | None, decode_size: int | None = None
) -> SourceDataset:
    """The dataset of split ``split`` of ``data``; rows yield ``(transform(rgb), label)``.

    ``decode_size`` is the shorter side ``transform`` resizes to first, if it does: JPEG
    files are then decoded at a reduced scale that still covers it (see :func:`load_rgb`).

    Raises:
        ConfigError: unknown split or source, missing root/folder/manifest, an empty split,
            a bad manifest row, or a torchvision dataset that is unknown or not on disk.
    """
    if split not in data.splits:
        known = ", ".join(map(str, data.splits)) or "none"
        raise ConfigError(f"unknown split {split!r}; data.splits has: {known}")
    builders = {
        "imagefolder": _imagefolder,
        "manifest": _manifest,
        "torchvision": _torchvision,
        "synthetic": _synthetic,
    }
    if data.source not in builders:
        raise ConfigError(f"data.source is {data.source!r}; choose one of: {', '.join(SOURCES)}")
    source = builders[data.source](data, split, data.splits[split], transform)
    if isinstance(source, _FileSource):
        source.decode_size = decode_size
    return source


def _imagefolder(
    data: DataSpec, split: str, value: Any, transform: Transform | None
) -> _FileSource:
    _no_kwargs(data)
    folder = _under_root(data, split, value, "a subfolder of data.root")
    if not folder.is_dir():
        raise ConfigError(_not_found(folder))
    # Hidden entries (.ipynb_checkpoints, ._IMG.jpg from macOS) are never classes or images.
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir() and e.name[0] != ".")
    paths: list[str] = []
    labels: list[int] = []
    ids: list[str] = []
    for label, name in enumerate(classes):
        # The same walk and order as torchvision.datasets.ImageFolder.
        for root, _, files in sorted(os.walk(folder / name, followlinks=True)):
            rel_root = Path(root).relative_to(folder)
            if any(part.startswith(".") for part in rel_root.parts):
                continue
            for file in sorted(files):
                if file.startswith(".") or not file.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                paths.append(os.path.join(root, file))
                labels.append(label)
                ids.append((rel_root / file).as_posix())
    if not paths:
        where = f"its {len(classes)} class folders" if classes else "class subfolders (none found)"
        raise ConfigError(
            f"no images in split {split!r} folder {folder}: looked for "
            f"{' '.join(IMAGE_EXTENSIONS)} files (any case) in {where}; "
            "put the images in one subfolder per class"
        )
    return _FileSource(paths, labels, ids, classes, transform)


def _manifest(data: DataSpec, split: str, value: Any, transform: Transform | None) -> _FileSource:
    _no_kwargs(data)
    file = _under_root(data, split, value, "a .csv or .jsonl manifest under data.root")
    if not file.is_file():
        raise ConfigError(
            f"manifest not found: {file}; set data.splits.{split} to a .csv or .jsonl file "
            "(relative to data.root)"
        )
    suffix = file.suffix.lower()
    if suffix == ".csv":
        rows = _csv_rows(file)
    elif suffix == ".jsonl":
        rows = _jsonl_rows(file)
    else:
        raise ConfigError(f"manifest {file} must be a .csv or .jsonl file, not {suffix or '?'}")
    if not rows:
        raise ConfigError(f"manifest {file} has no rows; list one image per row")

    paths = []
    for line, path, _ in rows:
        full = Path(path).expanduser()
        full = full if full.is_absolute() else file.parent / full
        if not full.is_file():
            raise ConfigError(f"manifest {file} line {line}: image not found: {full}")
        paths.append(str(full))
    ids = [path for _, path, _ in rows]

    labelled = [(line, label) for line, _, label in rows if label is not None]
    if not labelled:
        return _FileSource(paths, None, ids, None, transform)
    if len(labelled) < len(rows):
        line = next(line for line, _, label in rows if label is None)
        raise ConfigError(
            f"manifest {file} line {line}: no label, but other rows have one; "
            "label every row or none"
        )
    kind = type(labelled[0][1])
    for line, label in labelled:
        if type(label) is not kind:
            raise ConfigError(
                f"manifest {file} line {line}: label {label!r} is a {type(label).__name__} but "
                f"line {labelled[0][0]}'s is a {kind.__name__}; use all integers or all strings"
            )
    if kind is int:
        int_labels = [int(label) for _, label in labelled]
        return _FileSource(paths, int_labels, ids, None, transform)
    class_names = sorted({str(label) for _, label in labelled})
    index = {name: i for i, name in enumerate(class_names)}
    labels = [index[str(label)] for _, label in labelled]
    return _FileSource(paths, labels, ids, class_names, transform)


_Row = tuple[int, str, "int | str | None"]  # (line number, path as written, label)


def _csv_rows(file: Path) -> list[_Row]:
    with open(file, newline="", encoding="utf-8-sig") as f:  # -sig: Excel writes a BOM
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader, [])]
        if "path" not in header:
            found = ", ".join(header) or "nothing"
            raise ConfigError(
                f"manifest {file} line 1: no 'path' column (header has {found}); "
                "the first row must name the columns, e.g. path,label"
            )
        path_col = header.index("path")
        label_col = header.index("label") if "label" in header else None
        rows: list[_Row] = []
        for cells in reader:
            line = reader.line_num
            if not any(cell.strip() for cell in cells):
                continue
            if len(cells) != len(header):
                raise ConfigError(
                    f"manifest {file} line {line}: {len(cells)} cells but the header has "
                    f"{len(header)}; quote values that contain commas"
                )
            label: int | str | None = None
            if label_col is not None and cells[label_col].strip():
                text = cells[label_col].strip()
                label = int(text) if re.fullmatch(r"[+-]?\d+", text) else text
            rows.append((line, _check_row(file, line, cells[path_col].strip(), label), label))
    return rows


def _jsonl_rows(file: Path) -> list[_Row]:
    rows: list[_Row] = []
    with open(file, encoding="utf-8-sig") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"manifest {file} line {line}: not valid JSON ({exc.msg}); "
                    "write one JSON object per line"
                ) from None
            if not isinstance(obj, dict) or "path" not in obj:
                raise ConfigError(
                    f"manifest {file} line {line}: no 'path' key; "
                    'write objects like {"path": "img/1.jpg", "label": 3}'
                )
            label = obj.get("label")
            if isinstance(label, bool) or not isinstance(label, (int, str, type(None))):
                raise ConfigError(
                    f"manifest {file} line {line}: label {label!r} must be an integer or a string"
                )
            rows.append((line, _check_row(file, line, obj["path"], label), label))
    return rows


def _check_row(file: Path, line: int, path: Any, label: int | str | None) -> str:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"manifest {file} line {line}: path must be a non-empty string")
    if isinstance(label, int) and label < 0:
        raise ConfigError(f"manifest {file} line {line}: label {label} must be >= 0")
    return path


def _torchvision(
    data: DataSpec, split: str, value: Any, transform: Transform | None
) -> _TorchvisionSource:
    name = data.dataset
    if not name:
        raise ConfigError("data.dataset must name a torchvision dataset class, e.g. CIFAR10")
    cls = getattr(torchvision.datasets, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        known = {
            n.lower(): n
            for n, v in vars(torchvision.datasets).items()
            if isinstance(v, type) and issubclass(v, Dataset)
        }
        close = [known[n] for n in difflib.get_close_matches(name.lower(), known, n=3)]
        hint = f"did you mean {' or '.join(close)}?" if close else "see torchvision.datasets"
        raise ConfigError(f"unknown torchvision dataset {name!r} in data.dataset; {hint}")

    params = inspect.signature(cls).parameters
    root = str(Path(data.root).expanduser()) if data.root else None
    args: dict[str, Any] = {}
    if root is not None and "root" in params:
        args["root"] = root
    elif "root" in params and params["root"].default is inspect.Parameter.empty:
        raise ConfigError(f"torchvision dataset {name} needs data.root: the folder it is in")
    if "download" in params:
        args["download"] = False
    for key, val in {**data.kwargs, **_split_args(params, split, value)}.items():
        if key == "download" and val:
            raise ConfigError(
                "data.kwargs.download: featcache never downloads; fetch the dataset first "
                "(e.g. torchvision with download=True) and point data.root at it"
            )
        if key in ("transform", "target_transform", "transforms"):
            raise ConfigError(
                f"data.kwargs.{key}: featcache applies its own preprocessing "
                "(the preprocess section); remove it"
            )
        args[key] = val

    try:
        dataset = cls(**args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"cannot open torchvision dataset {name}: {first_line(exc)}; "
            f"check data.kwargs and data.splits.{split}"
        ) from exc
    except Exception as exc:  # "Dataset not found" (RuntimeError), missing files, bad archives
        reason = re.sub(r"\s*You can use download=True to download it\.?", "", first_line(exc))
        raise ConfigError(
            f"cannot open torchvision dataset {name} at {root}: {reason}; "
            "it must already be on disk (featcache never downloads)"
        ) from exc
    return _TorchvisionSource(dataset, name, transform)


def _split_args(params: Mapping[str, inspect.Parameter], split: str, value: Any) -> dict:
    """Constructor arguments that select one split of a torchvision dataset."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        # A split given by name (``splits: [train, test]``).
        if "split" in params:
            return {"split": value}
        if "train" in params:
            if value not in ("train", "test"):
                raise ConfigError(
                    f"data.splits.{split}: {value!r} is neither train nor test; give the "
                    "dataset's arguments instead, e.g. {train: false}"
                )
            return {"train": value == "train"}
        return {}  # a dataset with a single split (FakeData)
    raise ConfigError(
        f"data.splits.{split} must be a mapping of dataset arguments, e.g. {{train: false}}"
    )


@dataclasses.dataclass
class SyntheticOptions:
    """The options of ``data.source: synthetic`` (from data.kwargs or a split's mapping)."""

    size: int = option(256, ge=1)  # images in the split
    image_size: int = option(64, ge=1)  # side of the square images, in pixels
    num_classes: int = option(10, ge=1)
    seed: int = option(0, ge=0)


def _synthetic(
    data: DataSpec, split: str, value: Any, transform: Transform | None
) -> _SyntheticSource:
    given = {**data.kwargs, **(value if isinstance(value, Mapping) else {})}
    options = build(
        SyntheticOptions,
        given,
        "data.kwargs",
        unknown=(
            f"unknown synthetic option {{key!r}} (data.kwargs or data.splits.{split}); "
            "known options: {known}"
        ),
    )
    return _SyntheticSource(split, transform=transform, **dataclasses.asdict(options))


def _under_root(data: DataSpec, split: str, value: Any, what: str) -> Path:
    if not data.root:
        raise ConfigError(f"data.root is required for data.source={data.source}")
    root = Path(data.root).expanduser()
    if not root.is_dir():
        raise ConfigError(_not_found(root))
    if not isinstance(value, str):
        raise ConfigError(f"data.splits.{split} must be {what}, got {value!r}")
    return root / value


def _not_found(path: Path) -> str:
    return (
        f"data root not found: {path}; set data.root (or the split's folder) to an existing folder"
    )


def _no_kwargs(data: DataSpec) -> None:
    if data.kwargs:
        keys = ", ".join(map(str, data.kwargs))
        raise ConfigError(
            f"data.kwargs ({keys}) is not used by data.source={data.source}; remove it"
        )
