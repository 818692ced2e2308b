"""The source dataset type: rows of ``(image, label)`` with stable ids and a fingerprint."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from featcache.fingerprints import lines_sha256

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
