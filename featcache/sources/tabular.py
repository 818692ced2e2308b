"""Helpers shared by the column and shard sources (hf, parquet, webdataset): image cells,
labels, columns, and the files a split names."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources.base import SourceDataset, Transform
from featcache.sources.decode import _to_rgb, decode_bytes, load_rgb
from featcache.sources.remote import Remote, object_version
from featcache.sources.tokenizer import Tokenizer
from featcache.util.fingerprints import lines_sha256
from featcache.util.urls import check_url, is_url, join, relative


class EncodedImageSource(SourceDataset):
    """A source whose images are encoded bytes (or paths) it decodes itself; ``labels``
    are int64 [N] class indices or None, ``remote`` reads the paths that are URLs."""

    def __init__(
        self,
        ids: list[str],
        labels: np.ndarray | None,
        class_names: list[str] | None,
        transform: Transform | None,
        decode_size: int | None,
        remote: Remote | None = None,
    ) -> None:
        super().__init__(ids, class_names, labels is not None, transform)
        self.labels, self.decode_size, self.remote = labels, decode_size, remote

    def decode(self, value: Any, where: str, root: str | None = None) -> Image.Image:
        """An image cell (encoded bytes, a mapping with ``bytes`` or ``path``, a path
        relative to ``root``, a folder or URL, or a PIL image) as an 8-bit RGB PIL image.

        Raises:
            FeatcacheError: ``cannot decode image {where}: {reason}``.
        """
        if isinstance(value, Image.Image):
            return _to_rgb(value)
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        if isinstance(value, (bytes, bytearray, memoryview)):
            return decode_bytes(bytes(value), where, self.decode_size)
        if isinstance(value, str) and value:
            if is_url(value) or (is_url(root) and not os.path.isabs(value)):
                url = join(str(root), value)
                return decode_bytes((self.remote or Remote()).read(url), url, self.decode_size)
            path = value if root is None or os.path.isabs(value) else os.path.join(root, value)
            return load_rgb(path, self.decode_size)
        raise FeatcacheError(
            f"cannot decode image {where}: the cell holds {type(value).__name__} "
            f"{value!r:.40}, not image bytes or a path"
        )


def class_indices(values: Sequence[Any], where: str) -> tuple[np.ndarray, list[str] | None]:
    """Labels as int64 class indices, and class names when they were given as names
    (strings, indexed in sorted order).

    Raises:
        ConfigError: labels that are not all integers or all strings.
    """
    kinds = {type(v) for v in values}
    if kinds <= {int, np.int64, np.int32, np.int16, np.int8} or not values:
        return np.asarray(values, dtype=np.int64), None
    if kinds <= {str}:
        names = sorted(set(values))
        index = {name: i for i, name in enumerate(names)}
        return np.asarray([index[v] for v in values], dtype=np.int64), names
    rule = "labels must be all integers or all strings (class names)"
    bad = next((v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool)), None)
    if bad is None:  # integers beside strings
        number = next(v for v in values if not isinstance(v, str))
        name = next(v for v in values if isinstance(v, str))
        raise ConfigError(
            f"{where}: labels mix integers ({number!r}) and strings ({name!r}); {rule}"
        )
    raise ConfigError(f"{where}: label {bad!r} is a {type(bad).__name__}; {rule}")


def check_columns(data: DataSpec) -> None:
    """Text and image columns are exclusive: a text column makes a text source."""
    if data.text_column and data.image_column:
        raise ConfigError(
            f"data.text_column ({data.text_column}) and data.image_column "
            f"({data.image_column}) are both set; set the one the model reads"
        )


def require_columns(
    data: DataSpec, label_column: str | None, columns: Sequence[str], what: str
) -> None:
    """Raise ConfigError unless every column the config names, and ``label_column``, is
    in ``columns``."""
    named = {
        "label_column": label_column,
        "id_column": data.id_column,
        "text_column": data.text_column,
        "image_column": data.image_column,
    }
    for option, column in named.items():
        if column is not None and column not in columns:
            raise ConfigError(
                f"data.{option} {column!r} is not a column of {what}; its columns: "
                + (", ".join(columns) or "none")
            )


def text_rows(
    texts: Sequence[str],
    labels: np.ndarray | None,
    ids: list[str],
    class_names: list[str] | None,
    tokenizer: Tokenizer | None,
    max_length: int | None,
    identity: str,
) -> SourceDataset:
    """The rows of a ``data.text_column``, tokenised by the model's ``tokenizer``
    (:func:`featcache.sources.text.texts_source`)."""
    from featcache.sources.text import texts_source

    if tokenizer is None:
        raise ConfigError(
            "data.text_column is set but the model has no tokenizer; use a text model (an "
            "hf: text model or dual encoder, or open_clip:), or unset data.text_column"
        )
    return texts_source(texts, labels, ids, class_names, tokenizer, max_length, identity)


_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def brace_expand(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> ``a-000.tar a-001.tar a-002.tar``; ``{x,y}`` -> each. As in
    bash, a range with leading zeros (``{00..10}``) is zero-padded to the wider bound."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end() :]
    numbers = _RANGE.match(body)
    if numbers:
        first, last = numbers.groups()
        width = max(len(first), len(last)) if _zero_padded(first) or _zero_padded(last) else 0
        lo, hi = int(first), int(last)
        step = 1 if hi >= lo else -1
        choices = [str(n).zfill(width) for n in range(lo, hi + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:  # not a pattern: keep the braces literally
        return [head + "{" + body + "}" + p for p in brace_expand(tail)]
    return [head + choice + rest for choice in choices for rest in brace_expand(tail)]


def _zero_padded(bound: str) -> bool:
    """Whether a range bound is written with a leading zero (``"007"``; not ``"0"``)."""
    digits = bound.lstrip("-")
    return len(digits) > 1 and digits[0] == "0"


@dataclass
class SplitFiles:
    """The files of one split of a file-backed source (Parquet files, tar shards):
    absolute local ``paths`` or URLs read through ``remote``, ``names`` as the config gives
    them, ``versions`` as listed (a local file's size, a URL's :func:`object_version`)."""

    paths: list[str]
    names: list[str]
    versions: list[str]
    remote: Remote | None = None

    def open(self, i: int) -> Any:
        """File ``i`` to read: a local path, or a URL as a seekable file whose every read
        is one range request."""
        if self.remote is None:
            return self.paths[i]
        size = int(self.versions[i].split("\t")[0])
        return self.remote.open(self.paths[i], size, buffer_size=0)

    def identity(self) -> str:
        """sha256 over each file's name and version, in order."""
        return lines_sha256(f"{n}\t{v}" for n, v in zip(self.names, self.versions, strict=True))


def split_paths(data: DataSpec, split: str, value: Any, what: str) -> SplitFiles:
    """The files the split value ``value`` names (a path, a glob or brace pattern, or a
    list of them, relative to ``data.root``), in the order given (globs sorted), each once.

    Raises:
        ConfigError: a bad value, a pattern that matches nothing, a missing file, a local
            path among URLs.
        RemoteError: an object that does not exist, or cannot be listed.
    """
    patterns = [value] if isinstance(value, str) else value
    if not (
        isinstance(patterns, list) and patterns and all(isinstance(p, str) and p for p in patterns)
    ):
        raise ConfigError(
            f"data.splits.{split} must be {what} (a path, a pattern, or a list of them), "
            f"got {value!r}"
        )
    names = [name for pattern in patterns for name in brace_expand(pattern)]
    if not (is_url(data.root) or any(is_url(p) for p in patterns)):
        files = _local_files(data, split, names)
        root = Path(data.root).expanduser() if data.root else None
        shown = [_name_under(file, root) for file in files]
        sizes = [str(file.stat().st_size) for file in files]
        return SplitFiles([str(file.resolve()) for file in files], shown, sizes)
    remote = Remote(data.storage_options)
    urls = _urls(data, split, names, remote)
    versions = [object_version(info) for info in remote.stat(urls)]
    return SplitFiles(urls, [relative(url, data.root) for url in urls], versions, remote)


def _local_files(data: DataSpec, split: str, names: list[str]) -> list[Path]:
    root = Path(data.root).expanduser() if data.root else Path()
    if data.root and not root.is_dir():
        raise ConfigError(
            f"data root not found: {root}; set data.root to the folder the split paths are in"
        )
    files: list[Path] = []
    for name in names:
        full = root / Path(name).expanduser()
        if glob.has_magic(name):
            found = sorted(Path(p) for p in glob.glob(str(full)))
            if not found:
                raise ConfigError(f"data.splits.{split}: {full} matches no file; check the pattern")
            files.extend(found)
        elif full.is_file():
            files.append(full)
        else:
            raise ConfigError(
                f"data.splits.{split}: file not found: {full}; paths are relative to data.root"
            )
    return list(dict.fromkeys(files))


def _urls(data: DataSpec, split: str, names: list[str], remote: Remote) -> list[str]:
    urls: list[str] = []
    for name in names:
        full = join(data.root, name) if data.root else name
        if not is_url(full):
            raise ConfigError(
                f"data.splits.{split}: {name} is a local path among URLs; give the files "
                "of a split all under data.root, or all as URLs"
            )
        check_url(full, f"data.splits.{split}")
        if glob.has_magic(urlsplit(full).path):
            found = remote.glob(full)
            if not found:
                raise ConfigError(
                    f"data.splits.{split}: {full} matches no object; check the pattern"
                )
            urls.extend(found)
        else:
            urls.append(full)
    return list(dict.fromkeys(urls))


def _name_under(file: Path, root: Path | None) -> str:
    """``file`` relative to ``root`` when it is under it, as a POSIX path."""
    if root is not None and file.is_relative_to(root):
        return file.relative_to(root).as_posix()
    return file.as_posix()
