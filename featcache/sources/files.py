"""Sources over image files: class folders (imagefolder) and CSV/JSONL manifests."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Any

from PIL import Image

from featcache.errors import ConfigError
from featcache.fingerprints import file_line, lines_sha256
from featcache.sources.base import (
    IMAGE_EXTENSIONS,
    SourceDataset,
    Transform,
    jsonl_objects,
    label_indices,
)
from featcache.sources.decode import load_rgb
from featcache.spec import DataSpec


class FileSource(SourceDataset):
    """Image files with optional labels: the imagefolder and manifest sources.

    ``listed`` when a manifest decides the row order and the labels; in a class folder
    both follow from the file names (the ids).
    """

    def __init__(
        self,
        paths: list[str],
        labels: list[int] | None,
        ids: list[str],
        class_names: list[str] | None,
        transform: Transform | None,
        listed: bool = False,
    ) -> None:
        super().__init__(ids, class_names, labels is not None, transform)
        self.paths = paths
        self.labels = labels
        self.listed = listed
        self.decode_size: int | None = None  # see build_source

    def _load(self, i: int) -> tuple[Image.Image, int]:
        label = -1 if self.labels is None else self.labels[i]
        return load_rgb(self.paths[i], self.decode_size), label

    def fingerprint(self, content: bool = False) -> str:
        """sha256 over each file's id and size (and bytes with ``content``), in id order;
        for a manifest also its rows in order with their labels and the class names, so
        that rows reordered or relabelled between a run and its resume are seen."""
        files = sorted(zip(self.ids, self.paths, strict=True))
        entries = [file_line(sample_id, path, content) for sample_id, path in files]
        if self.listed:
            labels: list[int | None] = [*self.labels] if self.labels else [None] * len(self.ids)
            rows = (f"{i}\t{label}" for i, label in zip(self.ids, labels, strict=True))
            entries.append(f"rows\t{lines_sha256(rows)}\tclasses\t{self.class_names}")
        return lines_sha256(entries)


def imagefolder_source(
    data: DataSpec, split: str, value: Any, transform: Transform | None
) -> FileSource:
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
        for root, files in _walk(folder / name):
            rel_root = Path(root).relative_to(folder)
            if any(part.startswith(".") for part in rel_root.parts):
                continue
            for file in sorted(files):
                if file.startswith(".") or not file.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                paths.append(_utf8(os.path.join(root, file)))
                labels.append(label)
                ids.append((rel_root / file).as_posix())
    if not paths:
        where = f"its {len(classes)} class folders" if classes else "class subfolders (none found)"
        raise ConfigError(
            f"no images in split {split!r} folder {folder}: looked for "
            f"{' '.join(IMAGE_EXTENSIONS)} files (any case) in {where}; "
            "put the images in one subfolder per class"
        )
    return FileSource(paths, labels, ids, classes, transform)


def _utf8(path: str) -> str:
    """``path``, refused when its name is not UTF-8 (ids are stored as UTF-8 text)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"file name {os.fsencode(path)!r} is not valid UTF-8, and sample ids are stored "
            "as UTF-8; rename the file"
        ) from None
    return path


def _walk(top: Path) -> list[tuple[str, list[str]]]:
    """``(folder, files)`` under ``top`` as ``sorted(os.walk(top, followlinks=True))``
    gives them, but a link to a folder that holds it (a cycle, which would list its
    images again at every depth) is not followed."""
    walked = []
    for root, folders, files in os.walk(top, followlinks=True):
        here = os.path.realpath(root)
        folders[:] = [f for f in folders if not _leads_up(os.path.join(root, f), here)]
        walked.append((root, files))
    return sorted(walked)


def _leads_up(folder: str, here: str) -> bool:
    """Whether ``folder`` is a link to ``here`` or to a folder that holds it."""
    if not os.path.islink(folder):
        return False
    target = os.path.realpath(folder)
    return here == target or here.startswith(target.rstrip(os.sep) + os.sep)


def manifest_source(
    data: DataSpec, split: str, value: Any, transform: Transform | None
) -> FileSource:
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
        return FileSource(paths, None, ids, None, transform, listed=True)
    if len(labelled) < len(rows):
        line = next(line for line, _, label in rows if label is None)
        raise ConfigError(
            f"manifest {file} line {line}: no label, but other rows have one; "
            "label every row or none"
        )
    labels, class_names = label_indices(
        [(f"line {line}", label) for line, label in labelled], f"manifest {file}"
    )
    return FileSource(paths, labels, ids, class_names, transform, listed=True)


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
    example = '{"path": "img/1.jpg", "label": 3}'
    for line, obj in jsonl_objects(file, f"manifest {file}", example):
        if "path" not in obj:
            raise ConfigError(
                f"manifest {file} line {line}: no 'path' key; write objects like {example}"
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
