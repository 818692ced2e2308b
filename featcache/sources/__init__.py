"""The image dataset of one split, built from a config's ``data`` section.

Every source is a :class:`SourceDataset`: ``ds[i] -> (image, label)``, where ``image`` is
``transform`` applied to a PIL RGB image and ``label`` an int class index (-1 when the source
has no labels). Each row also has a stable string id (``ds.ids[i]``) that identifies it in a
store. Sources hold only plain data (paths, labels, options), so they pickle into DataLoader
workers under both fork and spawn.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcache.config.spec import SOURCES, DataSpec
from featcache.errors import ConfigError
from featcache.sources.base import IMAGE_EXTENSIONS, SourceDataset, Transform
from featcache.sources.decode import load_rgb
from featcache.sources.remote import Remote
from featcache.sources.synthetic import SyntheticOptions
from featcache.util.urls import is_url

if TYPE_CHECKING:
    from featcache.sources.tokenizer import Tokenizer

__all__ = [
    "IMAGE_EXTENSIONS",
    "SourceDataset",
    "SyntheticOptions",
    "Transform",
    "build_source",
    "load_rgb",
]


# source kind -> "module:function" building it; imported only when used, so that an
# optional extra (datasets, pyarrow) is needed only by the configs that name its source.
BUILDERS: dict[str, str] = {
    "imagefolder": "featcache.sources.files:imagefolder_source",
    "manifest": "featcache.sources.files:manifest_source",
    "torchvision": "featcache.sources.torchvision_datasets:torchvision_source",
    "synthetic": "featcache.sources.synthetic:synthetic_source",
    "text": "featcache.sources.text:text_source",
    "hf": "featcache.sources.hf:hf_source",
    "webdataset": "featcache.sources.webdataset:webdataset_source",
    "parquet": "featcache.sources.parquet:parquet_source",
}


def build_source(
    data: DataSpec,
    split: str,
    transform: Transform | None,
    decode_size: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> SourceDataset:
    """The dataset of split ``split`` of ``data``.

    Image rows yield ``(transform(rgb), label)``; text rows (``source: text``, or a
    ``text_column``) yield ``({"input_ids": int64 [T], "attention_mask": int64 [T]},
    label)``, tokenised by ``tokenizer`` (the model's). ``decode_size`` is the shorter
    side ``transform`` resizes to first, if it does: JPEG files are then decoded at a
    reduced scale that still covers it (see :func:`load_rgb`). With ``data.limit``, the
    split's rows are that many spread evenly over it (:mod:`featcache.sources.selection`).

    Raises:
        ConfigError: unknown split or source, missing root/folder/manifest, an empty split,
            a bad manifest row, a torchvision dataset that is unknown or not on disk, or
            text data for a model without a tokenizer.
    """
    if split not in data.splits:
        known = ", ".join(map(str, data.splits)) or "none"
        raise ConfigError(f"unknown split {split!r}; data.splits has: {known}")
    if data.source not in BUILDERS:
        raise ConfigError(f"data.source is {data.source!r}; choose one of: {', '.join(SOURCES)}")
    data.refuse_unused()
    module, _, name = BUILDERS[data.source].partition(":")
    builder = getattr(importlib.import_module(module), name)
    if data.source in ("text", "hf", "webdataset", "parquet"):
        source = builder(data, split, data.splits[split], transform, tokenizer)
    else:
        source = builder(data, split, data.splits[split], transform)
    if hasattr(source, "decode_size"):  # image sources that decode JPEGs in draft mode
        source.decode_size = decode_size
    if hasattr(source, "hash_content"):  # sources that can record each row's bytes' hash
        source.hash_content = data.content_hash
    if data.class_names is not None:
        source.class_names = given_class_names(data.class_names, source, data.storage_options)
    if data.limit is not None:  # a trial: rows spread over the split, every class among them
        from featcache.sources.selection import limit_source

        source = limit_source(source, data.limit)
    return source


def given_class_names(
    given: list[str] | str,
    source: SourceDataset,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """``data.class_names`` (a list, or a file or URL of one name per line) for ``source``.

    Raises:
        ConfigError: the file cannot be read or names nothing; the source names its
            classes otherwise (folder names, string labels); or it has labels past the
            names given.
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
