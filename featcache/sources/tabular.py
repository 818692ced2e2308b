"""Helpers shared by the column and shard sources (hf, parquet, webdataset).

Image bytes are decoded like image files (:func:`~featcache.sources.decode.load_rgb`):
JPEGs in draft mode down to ``decode_size``, everything to 8-bit RGB. Labels given as
class names become indices into their sorted names. Split values name files relative to
``data.root``, with ``{a,b}`` / ``{000..099}`` brace patterns and globs.
"""

from __future__ import annotations

import glob
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.sources.base import SourceDataset, Transform
from featcache.sources.decode import _draft_size, _to_rgb, load_rgb
from featcache.sources.remote import Remote
from featcache.util.urls import check_url, is_url, join, relative

if TYPE_CHECKING:
    from featcache.sources.tokenizer import Tokenizer


class EncodedImageSource(SourceDataset):
    """A source whose images are encoded bytes (or paths) it decodes itself.

    ``decode_size`` plays the part it plays for image files (set by
    :func:`~featcache.sources.build_source`): the shorter side the transform resizes to
    first, so that JPEGs decode at a reduced scale still covering it.
    """

    decode_size: int | None = None
    remote: Remote | None = None  # reads the paths that are URLs

    def decode(self, value: Any, where: str, root: str | None = None) -> Image.Image:
        """``value`` (encoded bytes, a ``{"bytes", "path"}`` mapping, a path or a PIL
        image) as an RGB PIL image; ``where`` names the sample in errors."""
        return decode_image(value, where, self.decode_size, root, self.remote)


def decode_image(
    value: Any,
    where: str,
    min_side: int | None = None,
    root: str | None = None,
    remote: Remote | None = None,
) -> Image.Image:
    """An image cell as an 8-bit RGB PIL image.

    ``value`` is encoded bytes, a mapping with ``bytes`` (or, when that is empty,
    ``path``), a path (relative to ``root``, a folder or a URL; a URL is read through
    ``remote``), or a PIL image.

    Raises:
        FeatcacheError: ``cannot decode image {where}: {reason}``.
    """
    if isinstance(value, Image.Image):
        return _to_rgb(value)
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if data else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode_bytes(bytes(value), where, min_side)
    if isinstance(value, str) and value:
        if is_url(value) or (is_url(root) and not os.path.isabs(value)):
            url = join(str(root), value)
            return decode_bytes((remote or Remote()).read(url), url, min_side)
        path = value if root is None or os.path.isabs(value) else os.path.join(root, value)
        return load_rgb(path, min_side)
    raise FeatcacheError(
        f"cannot decode image {where}: the cell holds {type(value).__name__} {value!r:.40}, "
        "not image bytes or a path"
    )


def decode_bytes(data: bytes, where: str, min_side: int | None = None) -> Image.Image:
    """Encoded image bytes as an 8-bit RGB PIL image, JPEGs in draft mode (see
    :func:`~featcache.sources.decode.load_rgb`)."""
    if not data:
        raise FeatcacheError(f"cannot decode image {where}: no bytes (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if min_side and image.format == "JPEG" and min(image.size) >= 2 * min_side:
                image.draft(image.mode, _draft_size(image.size, min_side))
            image.load()
            return _to_rgb(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise FeatcacheError(f"cannot decode image {where}: {first_line(exc)}") from exc


def class_indices(values: Sequence[Any], where: str) -> tuple[np.ndarray, list[str] | None]:
    """Labels as int64 class indices, and class names when they were given as names.

    Integers stay as they are (class names unknown); strings become indices into their
    sorted set. ``where`` names the column in errors.
    """
    kinds = {type(v) for v in values}
    if kinds <= {int, np.int64, np.int32, np.int16, np.int8} or not values:
        return np.asarray(values, dtype=np.int64), None
    if kinds <= {str}:
        names = sorted(set(values))
        index = {name: i for i, name in enumerate(names)}
        return np.asarray([index[v] for v in values], dtype=np.int64), names
    bad = next(v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool))
    raise ConfigError(
        f"{where}: label {bad!r} is a {type(bad).__name__}; labels must be all integers "
        "or all strings (class names)"
    )


def missing_column(option: str, column: str, what: str, columns: Sequence[str]) -> ConfigError:
    """``data.<option> 'x' is not a column of <what>; its columns: a, b``."""
    return ConfigError(
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
    """A text source over ``texts``, tokenised by the model's ``tokenizer`` (see
    :func:`featcache.sources.text.texts_source`); ``identity`` names the data and its
    version."""
    from featcache.sources.text import texts_source

    if tokenizer is None:
        raise ConfigError(
            "data.text_column is set but the model has no tokenizer; use a text model (an "
            "hf: text model or dual encoder, or open_clip:), or unset data.text_column"
        )
    limit = max_length if max_length is not None else tokenizer.max_length
    return texts_source(
        list(texts),
        None if labels is None else labels.tolist(),
        ids,
        class_names,
        tokenizer,
        limit,
        identity,
    )


def check_columns(data: DataSpec) -> None:
    """Text and image columns are exclusive: a text column makes a text source."""
    if data.text_column and data.image_column:
        raise ConfigError(
            f"data.text_column ({data.text_column}) and data.image_column "
            f"({data.image_column}) are both set; set the one the model reads"
        )


_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def brace_expand(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> ``a-000.tar a-001.tar a-002.tar``; ``{x,y}`` -> each.

    As in bash, a range whose bounds are written with leading zeros (``{00..10}``) is
    zero-padded to the wider bound; ``{0..10}`` is not. Patterns expand left to right.
    """
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


def split_patterns(split: str, value: Any, what: str) -> list[str]:
    """A split value as a list of paths or patterns.

    Raises:
        ConfigError: not a non-empty string or list of them.
    """
    patterns = [value] if isinstance(value, str) else value
    if (
        not isinstance(patterns, list)
        or not patterns
        or not all(isinstance(p, str) and p for p in patterns)
    ):
        raise ConfigError(
            f"data.splits.{split} must be {what} (a path, a pattern, or a list of them), "
            f"got {value!r}"
        )
    return patterns


def is_remote(data: DataSpec, value: Any) -> bool:
    """Whether the split value ``value`` names URLs: ``data.root`` is one, or it does."""
    values = value if isinstance(value, list) else [value]
    return is_url(data.root) or any(is_url(v) for v in values)


def split_files(data: DataSpec, split: str, value: Any, what: str) -> list[Path]:
    """The files a split value names: a path, a glob or brace pattern, or a list of them,
    relative to ``data.root`` (the working directory when unset), in the order given
    (globs sorted), each once.

    Raises:
        ConfigError: a bad value, a pattern that matches nothing, a missing file.
    """
    patterns = split_patterns(split, value, what)
    root = Path(data.root).expanduser() if data.root else Path()
    if data.root and not root.is_dir():
        raise ConfigError(
            f"data root not found: {root}; set data.root to the folder the split paths are in"
        )
    files: list[Path] = []
    for pattern in patterns:
        for name in brace_expand(pattern):
            full = root / Path(name).expanduser()
            if glob.has_magic(name):
                found = sorted(Path(p) for p in glob.glob(str(full)))
                if not found:
                    raise ConfigError(
                        f"data.splits.{split}: {full} matches no file; check the pattern"
                    )
                files.extend(found)
            else:
                if not full.is_file():
                    raise ConfigError(
                        f"data.splits.{split}: file not found: {full}; paths are relative "
                        "to data.root"
                    )
                files.append(full)
    unique = list(dict.fromkeys(files))
    return unique


def split_urls(
    data: DataSpec, split: str, value: Any, what: str, remote: Remote
) -> list[tuple[str, dict[str, Any]]]:
    """:func:`split_files` for URLs: ``(url, info)`` of every object the split value
    names under the URL ``data.root`` (or as URLs itself), globs listed once, every
    object's size and ETag from one listing per folder.

    Raises:
        ConfigError: a bad value, a local path among URLs, a pattern that matches nothing.
        RemoteError: an object that does not exist, or cannot be listed.
    """
    urls: list[str] = []
    for pattern in split_patterns(split, value, what):
        for name in brace_expand(pattern):
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
    unique = list(dict.fromkeys(urls))
    return list(zip(unique, remote.stat(unique), strict=True))


def display_name(path: Path | str, data: DataSpec) -> str:
    """``path`` relative to ``data.root`` (as the config names it), for ids and fingerprints."""
    if isinstance(path, str):
        return relative(path, data.root)
    if data.root:
        try:
            return path.relative_to(Path(data.root).expanduser()).as_posix()
        except ValueError:
            pass
    return path.as_posix()


__all__ = [
    "EncodedImageSource",
    "Transform",
    "brace_expand",
    "check_columns",
    "class_indices",
    "decode_bytes",
    "decode_image",
    "display_name",
    "missing_column",
    "is_remote",
    "split_files",
    "split_urls",
    "text_rows",
]
