"""Sources over image files, local or fsspec URLs: class folders (imagefolder) and CSV/JSONL
manifests (see docs/guides/image-folders.md)."""

from __future__ import annotations

import csv
import hashlib
import os
import posixpath
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources.base import (
    IMAGE_EXTENSIONS,
    SourceDataset,
    SourceRequest,
    Transform,
    jsonl_objects,
    label_indices,
    open_text,
)
from featcache.sources.decode import decode_bytes, load_rgb
from featcache.sources.remote import Remote, object_version
from featcache.sources.stamps import file_stamp, object_stamp
from featcache.util.fingerprints import file_line, file_sha256, lines_sha256
from featcache.util.urls import check_url, is_url, join, parent, relative


class FileSource(SourceDataset):
    """Image files with optional labels: the imagefolder and manifest sources.

    ``listed`` when a manifest decides the row order and the labels. URLs are read through
    ``remote`` (``versions``: each one's size and ETag as listed, None for a local file);
    ``hash_content`` (``data.content_hash``) records each file's sha256.
    """

    def __init__(
        self,
        paths: list[str],
        labels: list[int] | None,
        ids: list[str],
        class_names: list[str] | None,
        transform: Transform | None,
        decode_size: int | None = None,
        hash_content: bool = False,
        listed: bool = False,
        remote: Remote | None = None,
        versions: Sequence[str | None] | None = None,
    ) -> None:
        super().__init__(ids, class_names, labels is not None, transform)
        self.paths, self.labels, self.listed = paths, labels, listed
        self.decode_size, self.hash_content = decode_size, hash_content
        self.remote, self.versions = remote, versions or [None] * len(paths)
        self._fetched: dict[int, bytes | Exception] = {}
        self._hashes: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fetched": {}}

    def prefetch(self, rows: list[int]) -> None:
        """Fetch the remote images of ``rows`` (a batch) concurrently, keeping each row's
        bytes (or error) until the next batch."""
        if self.remote is None:
            return
        remote_rows = [r for r in rows if is_url(self.paths[r])]
        got = self.remote.read_many([self.paths[r] for r in remote_rows])
        self._fetched = dict(zip(remote_rows, got, strict=True))

    def _load(self, i: int) -> tuple[Image.Image, int]:
        path = self.paths[i]
        if not is_url(path):
            return load_rgb(path, self.decode_size), self.label(i)
        data = self._fetched.get(i)
        if data is None:
            data = (self.remote or Remote()).read(path)
        if isinstance(data, Exception):
            raise FeatcacheError(f"cannot decode image {path}: {data}")
        return decode_bytes(data, path, self.decode_size), self.label(i)

    @property
    def row_columns(self) -> dict[str, np.ndarray]:
        """Per-row arrays to record beside the features: ``content_hash`` (with
        :attr:`hash_content`), by which an update tells a sample whose bytes changed."""
        return {"content_hash": self.content_hashes()} if self.hash_content else {}

    def content_hashes(self) -> np.ndarray:
        """``[rows]`` ``S64``: the hex sha256 of each row's file (read once, then kept)."""
        if self._hashes is None:
            self._hashes = np.array([self._sha256(path) for path in self.paths], dtype="S64")
        return self._hashes

    def _sha256(self, path: str) -> str:
        if not is_url(path):
            return file_sha256(path)
        return hashlib.sha256((self.remote or Remote()).read(path)).hexdigest()

    def change_stamps(self) -> list[str]:
        """Each row's stamp: a local file's size and mtime, a URL's size and ETag as listed
        when the source was built."""
        return [
            object_stamp(version) if is_url(path) else file_stamp(path)
            for path, version in zip(self.paths, self.versions, strict=True)
        ]

    def fingerprint(self, content: bool = False) -> str:
        """sha256 over each file's id and size (a URL's: and ETag; with ``content``, the
        bytes), in id order; for a manifest also its rows, labels and class names, so that
        rows reordered or relabelled between a run and its resume are seen."""
        files = sorted(zip(self.ids, self.paths, self.versions, strict=True))
        entries = [
            file_line(sample_id, path, content)
            if version is None
            else f"{sample_id}\t{path}\t{version}" + (f"\t{self._sha256(path)}" if content else "")
            for sample_id, path, version in files
        ]
        if self.listed:
            labels: list[int | None] = [*self.labels] if self.labels else [None] * len(self.ids)
            rows = (f"{i}\t{label}" for i, label in zip(self.ids, labels, strict=True))
            entries.append(f"rows\t{lines_sha256(rows)}\tclasses\t{self.class_names}")
        return lines_sha256(entries)


def imagefolder_source(request: SourceRequest) -> FileSource:
    """The images of the class folders under ``data.root/<split value>`` (a folder or a
    URL): label i is the i-th class folder by name, ids are paths relative to the value."""
    data, split, value, transform = request.args
    if is_url(data.root):
        return _remote_imagefolder(request)
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
        raise _no_images(split, folder, classes)
    return FileSource(
        paths, labels, ids, classes, transform, request.decode_size, data.content_hash
    )


def _remote_imagefolder(request: SourceRequest) -> FileSource:
    """:func:`imagefolder_source` under a URL: the folder listed once, its classes,
    files, order and ids as a local copy of it gives them."""
    data, split, value, transform = request.args
    if not isinstance(value, str):
        raise ConfigError(f"data.splits.{split} must be a subfolder of data.root, got {value!r}")
    folder = join(str(data.root), value).rstrip("/")
    check_url(folder, f"data.splits.{split}")
    remote = Remote(data.storage_options)
    folders: dict[str, list[tuple[str, str, str, str]]] = {}  # class -> (dir, file, url, version)
    for url, info in remote.find(folder):
        parts = relative(url, folder).strip("/").split("/")
        if url.rstrip("/") == folder or parts[0].startswith("."):
            continue
        is_folder = info.get("type") == "directory"
        if len(parts) == 1 and not is_folder:
            continue  # a file beside the class folders
        members = folders.setdefault(parts[0], [])
        if is_folder or any(part.startswith(".") for part in parts[1:-1]):
            continue
        file = parts[-1]
        if file.startswith(".") or not file.lower().endswith(IMAGE_EXTENSIONS):
            continue
        members.append(("/".join(parts[:-1]), file, url, object_version(info)))
    classes = sorted(folders)
    # torchvision's order, as for a local folder: by folder, then by file name.
    rows = [(k, *member) for k, name in enumerate(classes) for member in sorted(folders[name])]
    if not rows:
        raise _no_images(split, folder, classes)
    return FileSource(
        [url for *_, url, _ in rows],
        [k for k, *_ in rows],
        [f"{directory}/{file}" for _, directory, file, *_ in rows],
        classes,
        transform,
        request.decode_size,
        data.content_hash,
        remote=remote,
        versions=[version for *_, version in rows],
    )


def _no_images(split: str, folder: Path | str, classes: list[str]) -> ConfigError:
    where = f"its {len(classes)} class folders" if classes else "class subfolders (none found)"
    return ConfigError(
        f"no images in split {split!r} folder {folder}: looked for "
        f"{' '.join(IMAGE_EXTENSIONS)} files (any case) in {where}; "
        "put the images in one subfolder per class"
    )


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
    gives them, not following a link to a folder that holds it (a cycle)."""
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


def manifest_source(request: SourceRequest) -> FileSource:
    """The images a CSV or JSONL manifest lists (``path`` and optional ``label`` per row),
    in its row order; ids are the paths as written.

    Raises:
        ConfigError: a missing manifest or image, a bad row or label (naming its line).
    """
    data, split, value, transform = request.args
    remote = None
    file: Path | str
    if is_url(data.root) or is_url(value):
        file = _manifest_url(data, split, value)
        remote = Remote(data.storage_options)
        suffix = posixpath.splitext(urlsplit(file).path)[1].lower()
    else:
        file = _under_root(data, split, value, "a .csv or .jsonl manifest under data.root")
        if not file.is_file():
            raise ConfigError(
                f"manifest not found: {file}; set data.splits.{split} to a .csv or .jsonl "
                "file (relative to data.root)"
            )
        suffix = file.suffix.lower()
    if suffix == ".csv":
        rows = _csv_rows(file, remote)
    elif suffix == ".jsonl":
        rows = _jsonl_rows(file, remote)
    else:
        raise ConfigError(f"manifest {file} must be a .csv or .jsonl file, not {suffix or '?'}")
    if not rows:
        raise ConfigError(f"manifest {file} has no rows; list one image per row")

    paths, versions = _manifest_images(file, rows, remote or Remote(data.storage_options))
    ids = [path for _, path, _ in rows]
    if remote is None and any(versions):
        remote = Remote(data.storage_options)

    labels, class_names = None, None
    labelled = [(line, label) for line, _, label in rows if label is not None]
    if labelled and len(labelled) < len(rows):
        line = next(line for line, _, label in rows if label is None)
        raise ConfigError(
            f"manifest {file} line {line}: no label, but other rows have one; "
            "label every row or none"
        )
    if labelled:
        labels, class_names = label_indices(
            [(f"line {line}", label) for line, label in labelled], f"manifest {file}"
        )
    return FileSource(
        paths,
        labels,
        ids,
        class_names,
        transform,
        request.decode_size,
        data.content_hash,
        listed=True,
        remote=remote,
        versions=versions if remote else None,
    )


def _manifest_url(data: DataSpec, split: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"data.splits.{split} must be a .csv or .jsonl manifest under data.root, got {value!r}"
        )
    file = join(data.root, value) if data.root else value
    check_url(file, f"data.splits.{split}")
    return file


def _manifest_images(
    file: Path | str, rows: list[_Row], remote: Remote
) -> tuple[list[str], list[str | None]]:
    """The image of each manifest row (a local path or a URL) and each URL's size and
    ETag (None for a local file); ConfigError naming the line of a missing image."""
    paths: list[str] = []
    for line, path, _ in rows:
        if is_url(path) or (is_url(file) and not path.startswith(("/", "~"))):
            full = join(parent(str(file)), path)
            check_url(full, f"manifest {file} line {line}")
            paths.append(full)
            continue
        local = Path(path).expanduser()
        local = local if local.is_absolute() else Path(file).parent / local
        if not local.is_file():
            raise ConfigError(f"manifest {file} line {line}: image not found: {local}")
        paths.append(str(local))
    urls = [p for p in paths if is_url(p)]
    infos = dict(zip(urls, remote.stat(urls, missing_ok=True), strict=True))
    versions: list[str | None] = []
    for (line, _, _), path in zip(rows, paths, strict=True):
        info = infos.get(path)
        if info is not None and not info:
            raise ConfigError(f"manifest {file} line {line}: image not found: {path}")
        versions.append(None if info is None else object_version(info))
    return paths, versions


_Row = tuple[int, str, "int | str | None"]  # (line number, path as written, label)


def _csv_rows(file: Path | str, remote: Remote | None) -> list[_Row]:
    with open_text(file, remote, newline="") as f:  # -sig: Excel writes a BOM
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


def _jsonl_rows(file: Path | str, remote: Remote | None) -> list[_Row]:
    rows: list[_Row] = []
    example = '{"path": "img/1.jpg", "label": 3}'
    for line, obj in jsonl_objects(file, f"manifest {file}", example, remote):
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


def _check_row(file: Path | str, line: int, path: Any, label: int | str | None) -> str:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"manifest {file} line {line}: path must be a non-empty string")
    if isinstance(label, int) and label < 0:
        raise ConfigError(f"manifest {file} line {line}: label {label} must be >= 0")
    return path


def _under_root(data: DataSpec, split: str, value: Any, what: str) -> Path:
    root = Path(str(data.root)).expanduser()
    if not root.is_dir():
        raise ConfigError(_not_found(root))
    if not isinstance(value, str):
        raise ConfigError(f"data.splits.{split} must be {what}, got {value!r}")
    return root / value


def _not_found(path: Path) -> str:
    return (
        f"data root not found: {path}; set data.root (or the split's folder) to an existing folder"
    )
