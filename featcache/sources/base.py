"""The source dataset type: rows of ``(image, label)`` with stable ids and a fingerprint."""

from __future__ import annotations

import io
import json
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from PIL import Image
from torch.utils.data import Dataset

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError
from featcache.sources.remote import Remote
from featcache.sources.tokenizer import Tokenizer
from featcache.util.fingerprints import lines_sha256
from featcache.util.urls import is_url

IMAGE_EXTENSIONS: tuple[str, ...] = (
    ".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm",
)  # fmt: skip

Transform = Callable[[Image.Image], Any]


@dataclass(frozen=True)
class SourceRequest:
    """What every kind's build is given: the arguments of
    :func:`~featcache.sources.build_source`."""

    data: DataSpec
    split: str
    transform: Transform | None = None
    tokenizer: Tokenizer | None = None
    decode_size: int | None = None

    @property
    def args(self) -> tuple[DataSpec, str, Any, Transform | None]:
        """``(data, split, data.splits[split], transform)``."""
        return self.data, self.split, self.data.splits[self.split], self.transform


class SourceDataset(Dataset):
    """Base of all sources: ``ds[i] -> (image, label)``.

    ``image`` is ``transform(pil_rgb_image)``: with featcache's preprocessing a float32 tensor
    [3, H, W]; the PIL RGB image itself when ``transform`` is None. ``label`` is an int class
    index, or -1 when the source has no labels (``has_labels`` False).
    """

    ids: list[str]  # stable sample id per row, len(ids) == len(ds)
    class_names: list[str] | None  # class_names[label] names a class; None when unknown
    has_labels: bool  # whether labels are real class indices
    labels: Any = None  # [N] class indices, where the source lists them before reading rows

    def __init__(
        self,
        ids: list[str],
        class_names: list[str] | None,
        has_labels: bool,
        transform: Transform | None,
    ) -> None:
        self.ids, self.class_names, self.has_labels = ids, class_names, has_labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.ids)

    def position(self, index: int) -> int:
        """``index`` as a row number in range (negative ones count from the end).

        Raises:
            IndexError: outside the source's rows.
        """
        i, n = operator.index(index), len(self.ids)
        if not -n <= i < n:
            raise IndexError(f"index {index} is out of range for a source of {n} rows")
        return i % n

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image, label = self._load(self.position(index))
        if self.transform is not None:
            image = self.transform(image)
        return image, label

    def _load(self, i: int) -> tuple[Image.Image, int]:
        """Row ``i`` (already in range) as a PIL RGB image and its label."""
        raise NotImplementedError

    def label(self, i: int) -> int:
        """Row ``i``'s class index in :attr:`labels`; -1 when the source has none."""
        return -1 if self.labels is None else int(self.labels[i])

    def prefetch(self, rows: list[int]) -> None:
        """A hint that ``rows`` (one batch, in order) are read next, for remote sources."""

    def change_stamps(self) -> list[str] | None:
        """Each row's change stamp (:mod:`featcache.sources.stamps`), taken now; None when
        the source can tell nothing (generated, tokenised or in-memory rows)."""
        return None

    def fingerprint(self, content: bool = False) -> str:
        """sha256 identifying the samples: their sorted ids (file sources add sizes, and
        with ``content=True`` the bytes of every file)."""
        return lines_sha256(sorted(self.ids))

    def __repr__(self) -> str:
        classes = "unlabeled" if not self.has_labels else f"classes={len(self.class_names or [])}"
        return f"{type(self).__name__}(rows={len(self)}, {classes})"


def open_text(file: Path | str, remote: Remote | None, newline: str | None = None) -> TextIO:
    """A text file (UTF-8, a BOM skipped) to read: a local one, or a URL read whole
    through ``remote``."""
    if not is_url(file):
        return open(file, encoding="utf-8-sig", newline=newline)
    data = (remote or Remote()).read(str(file))
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8-sig", newline=newline)


def jsonl_objects(
    file: Path | str, what: str, example: str, remote: Remote | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of a JSONL file or URL; ``what``
    leads the error lines, ``example`` shows a good object in them.

    Raises:
        ConfigError: a line that is not valid JSON, or not a JSON object.
    """
    with open_text(file, remote) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{what} line {line}: not valid JSON ({exc.msg}); write one JSON object "
                    "per line"
                ) from None
            if not isinstance(obj, dict):
                raise ConfigError(
                    f"{what} line {line}: a {type(obj).__name__}, not a JSON object; write "
                    f"objects like {example}"
                )
            yield line, obj


def label_indices(
    labels: Sequence[tuple[str, int | str]], what: str
) -> tuple[list[int], list[str] | None]:
    """Class indices of ``(where, label)`` pairs, and class names when labels are names
    (strings, indexed in sorted order); ``what`` and ``where`` place a label in errors.

    Raises:
        ConfigError: integers mixed with strings, naming the first label of each kind.
    """
    first_where, first = labels[0]
    kind = type(first)
    for where, label in labels:
        if type(label) is not kind:
            raise ConfigError(
                f"{what} {where}: label {label!r} is a {type(label).__name__} but "
                f"{first_where}'s is a {kind.__name__}; use all integers or all strings"
            )
    if kind is int:
        return [int(label) for _, label in labels], None
    class_names = sorted({str(label) for _, label in labels})
    index = {name: i for i, name in enumerate(class_names)}
    return [index[str(label)] for _, label in labels], class_names
