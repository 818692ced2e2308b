"""The dataset of one split, built from a config's ``data`` section by its source kind
(:mod:`featcache.sources.registry`); see docs/guides/sources.md."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError
from featcache.sources.base import IMAGE_EXTENSIONS, SourceDataset, SourceRequest, Transform
from featcache.sources.decode import load_rgb
from featcache.sources.registry import kind_for
from featcache.sources.remote import Remote
from featcache.sources.selection import limit_source
from featcache.sources.synthetic import SyntheticOptions
from featcache.sources.tokenizer import Tokenizer
from featcache.util.urls import is_url

__all__ = [
    "IMAGE_EXTENSIONS",
    "SourceDataset",
    "SyntheticOptions",
    "Transform",
    "build_source",
    "load_rgb",
]


def build_source(
    data: DataSpec,
    split: str,
    transform: Transform | None,
    decode_size: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> SourceDataset:
    """The dataset of split ``split`` of ``data``.

    Image rows yield ``(transform(rgb), label)``, label -1 where the source has none; text
    rows yield ``({"input_ids": int64 [T], "attention_mask": int64 [T]}, label)``.
    ``decode_size`` is the shorter side ``transform`` resizes to first: JPEGs are decoded
    at a reduced scale still covering it (:func:`load_rgb`).

    Raises:
        ConfigError: unknown split or source, a data key the source does not use or needs,
            a split that is missing, empty or malformed, or text data for a model without
            a tokenizer.
    """
    if split not in data.splits:
        known = ", ".join(map(str, data.splits)) or "none"
        raise ConfigError(f"unknown split {split!r}; data.splits has: {known}")
    build = kind_for(data)
    source = build(SourceRequest(data, split, transform, tokenizer, decode_size))
    if data.class_names is not None:
        source.class_names = given_class_names(data.class_names, source, data.storage_options)
    if data.limit is not None:  # a trial: rows spread over the split, every class among them
        source = limit_source(source, data.limit)
    return source


def given_class_names(
    given: list[str] | str, source: SourceDataset, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """``data.class_names`` (a list, or a file or URL of one name per line) for ``source``.

    Raises:
        ConfigError: the file cannot be read or names nothing; the source names its
            classes otherwise; or it has labels past the names given.
    """
    where = "data.class_names"
    if isinstance(given, str):
        try:
            if is_url(given):
                text = Remote(storage_options).read(given).decode("utf-8-sig")
            else:
                text = Path(given).expanduser().read_text(encoding="utf-8-sig")
        except OSError as exc:  # a URL that cannot be read says so itself
            raise ConfigError(
                f"{where} file {given} cannot be read ({exc.strerror or exc}); give a text file "
                "of one class name per line, or the names as a list"
            ) from None
        names = [line.strip() for line in text.splitlines() if line.strip()]
        where = f"{where} file {given}"
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"{where} must name each class once, one per line")
    else:
        names = list(given)
    own = source.class_names
    if own and list(own) != names:
        raise ConfigError(
            f"{where} ({', '.join(names[:4])}...) differs from the classes the source names "
            f"itself ({', '.join(own[:4])}...); drop data.class_names, or give the same names"
        )
    labels = getattr(source, "labels", None)
    if labels is not None and len(labels) and int(max(labels)) >= len(names):
        raise ConfigError(
            f"{where} names {len(names)} classes, but the source has label {int(max(labels))}; "
            "give a name for every label"
        )
    return names
