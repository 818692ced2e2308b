"""Sources over torchvision dataset classes whose files are already on disk."""

from __future__ import annotations

import difflib
import inspect
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.sources.base import SourceDataset, Transform
from featcache.sources.decode import _array_to_rgb
from featcache.util.fingerprints import file_line, lines_sha256


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

    def fingerprint(self, content: bool = False) -> str:
        """For a dataset over listed files (a ``DatasetFolder``'s ``samples``), sha256 over
        each row's file, size (and bytes with ``content``) and label; otherwise over the ids."""
        samples = getattr(self.dataset, "samples", None)
        if not (isinstance(samples, list) and all(_file_sample(s) for s in samples)):
            return super().fingerprint(content)
        root = str(getattr(self.dataset, "root", "") or "")
        lines = [f"{self.name}\t{len(samples)} files"]
        for path, target in samples:
            name = os.path.relpath(path, root) if root else path
            lines.append(f"{file_line(name, path, content)}\t{target}")
        return lines_sha256(lines)


def _file_sample(sample: Any) -> bool:
    """Whether ``sample`` is a ``(path, class index)`` pair, as in ``DatasetFolder.samples``."""
    return (
        isinstance(sample, tuple)
        and len(sample) == 2
        and isinstance(sample[0], (str, os.PathLike))
        and isinstance(sample[1], int)
    )


def torchvision_source(
    data: DataSpec, split: str, value: Any, transform: Transform | None
) -> _TorchvisionSource:
    import torchvision  # safe: importing featcache first made it importable

    name = str(data.dataset)
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
    if "download" in params:
        args["download"] = False
    split_args = _split_args(params, split, value, name, several=len(data.splits) > 1)
    given = {**data.kwargs, **split_args}
    needs_root = "root" in params and params["root"].default is inspect.Parameter.empty
    if needs_root and root is None and "root" not in given:
        raise ConfigError(f"torchvision dataset {name} needs data.root: the folder it is in")
    for key, val in given.items():
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
            f"cannot open torchvision dataset {name} at {args.get('root')}: {reason}; "
            "it must already be on disk (featcache never downloads)"
        ) from exc
    return _TorchvisionSource(dataset, name, transform)


def _split_args(
    params: Mapping[str, inspect.Parameter], split: str, value: Any, name: str, several: bool
) -> dict:
    """Constructor arguments that select one split of torchvision dataset class ``name``;
    ``several`` when the config names more than one split."""
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
        if several:  # each split would hold the same rows
            raise ConfigError(
                f"data.splits.{split}: torchvision dataset {name} takes no split or train "
                "argument, so every split named would hold the same rows; give each split "
                f"its own arguments instead, e.g. {{{split}: {{root: <folder of {split}>}}}}"
            )
        return {}  # a dataset with a single split (FakeData)
    raise ConfigError(
        f"data.splits.{split} must be a mapping of dataset arguments, e.g. {{train: false}}"
    )
