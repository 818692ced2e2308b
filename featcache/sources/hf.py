"""The hf source: a split of a Hugging Face ``datasets`` dataset, a ``save_to_disk``
folder or a hub name read from the local cache (see docs/guides/sources.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.sources.base import SourceDataset, SourceRequest, Transform
from featcache.sources.tabular import (
    EncodedImageSource,
    check_columns,
    class_indices,
    require_columns,
    text_rows,
)
from featcache.util.extras import require
from featcache.util.fingerprints import lines_sha256


class HFSource(EncodedImageSource):
    """Images (and labels) of one split of a ``datasets.Dataset``, narrowed to its image
    column with images left encoded (an Arrow-backed dataset pickles as its file paths)."""

    def __init__(
        self,
        dataset: Any,
        column: str,
        ids: list[str],
        labels: np.ndarray | None,
        class_names: list[str] | None,
        identity: str,
        root: str | None,
        transform: Transform | None,
        decode_size: int | None,
    ) -> None:
        super().__init__(ids, labels, class_names, transform, decode_size)
        self.dataset, self.column, self.identity, self.root = dataset, column, identity, root

    def _load(self, i: int) -> tuple[Image.Image, int]:
        try:
            value = self.dataset[i][self.column]
        except Exception as exc:
            raise FeatcacheError(f"cannot read row {self.ids[i]}: {first_line(exc)}") from exc
        return self.decode(value, self.ids[i], self.root), self.label(i)

    def fingerprint(self, content: bool = False) -> str:
        # datasets derives its fingerprint from the Arrow files or transforms: content is covered.
        return lines_sha256([self.identity, f"{len(self)} rows", self.column])


def hf_source(request: SourceRequest) -> SourceDataset:
    """The split ``data.splits[split]`` names of the dataset ``data.dataset``.

    Raises:
        ConfigError: a folder that is not a saved dataset, an unknown split, a hub dataset
            not in the cache, a missing column.
    """
    data, split, value, transform = request.args
    datasets = require("datasets", "data.source hf")
    check_columns(data)
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"data.splits.{split} must name a split of the dataset (e.g. train), got {value!r}"
        )
    name = str(data.dataset)
    dataset, label = _open(datasets, data, name, value)
    features = dataset.features
    columns = list(features)
    what = f"{label} split {value}"

    label_column = data.label_column or next(
        (c for c in columns if isinstance(features[c], datasets.ClassLabel)), None
    )
    require_columns(data, label_column, columns, what)
    if not len(dataset):
        raise ConfigError(f"{what} has no rows")

    if data.id_column:
        ids = [str(v) for v in _column(dataset, data.id_column)]
        if len(set(ids)) < len(ids):
            raise ConfigError(
                f"data.id_column {data.id_column!r} of {what} repeats ids; ids must be unique"
            )
    else:
        ids = [f"{label}/{value}/{i}" for i in range(len(dataset))]
    labels, class_names = (
        _labels(datasets, dataset, label_column, what) if label_column else (None, None)
    )
    fingerprint, version = getattr(dataset, "_fingerprint", ""), dataset.info.version or ""
    identity = f"hf:{label}\t{fingerprint}\t{version}\t{value}\t{','.join(columns)}"

    if data.text_column:
        texts = [v or "" for v in _column(dataset, data.text_column)]
        where = f"{what} ({lines_sha256([identity])[:16]})"
        return text_rows(texts, labels, ids, class_names, request.tokenizer, data.max_length, where)

    column = data.image_column or next(
        (c for c in columns if isinstance(features[c], datasets.Image)), None
    )
    if column is None:
        kinds = ", ".join(f"{c} ({type(features[c]).__name__})" for c in columns)
        raise ConfigError(
            f"no column of {what} is an Image feature; set data.image_column; its columns: {kinds}"
        )
    narrowed = dataset.select_columns([column])
    if isinstance(features[column], datasets.Image):
        narrowed = narrowed.cast_column(column, datasets.Image(decode=False))
    root = str(Path(data.root).expanduser()) if data.root else None
    return HFSource(
        narrowed, column, ids, labels, class_names, identity, root, transform, request.decode_size
    )


def _open(datasets: Any, data: DataSpec, name: str, split: str) -> tuple[Any, str]:
    """The split's ``Dataset``, and the name its ids start with."""
    folder = Path(data.root).expanduser() / name if data.root else Path(name).expanduser()
    if folder.is_dir():
        try:
            saved = datasets.load_from_disk(str(folder))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ConfigError(
                f"data.dataset {folder} is not a folder written by save_to_disk "
                f"({first_line(exc)}); point it at one, or name a hub dataset"
            ) from None
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise ConfigError(
                    f"{folder} has no split {split!r}; its splits: {', '.join(saved)}"
                )
            return saved[split], folder.name
        if saved.split is not None and str(saved.split) != split:
            raise ConfigError(
                f"{folder} holds only split {saved.split!r}, not {split!r}; set "
                f"data.splits to {{<name>: {saved.split}}}"
            )
        return saved, folder.name
    if data.root and not Path(data.root).expanduser().is_dir():
        raise ConfigError(f"data root not found: {data.root}; set data.root to an existing folder")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not a hub name
        raise ConfigError(f"data.dataset folder not found: {folder}; check the path")
    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:  # offline misses, unknown names and splits come as many types
        command = f"python -c \"import datasets; datasets.load_dataset('{name}')\""
        raise ConfigError(
            f"cannot load Hugging Face dataset {name!r} split {split!r} from the local cache "
            f"({first_line(exc, with_type=True)}); if it is not downloaded yet, run on a "
            f"machine with internet: {command}"
        ) from None
    if not isinstance(loaded, datasets.Dataset):
        raise ConfigError(
            f"Hugging Face dataset {name!r} split {split!r} did not load as one Dataset "
            f"(got {type(loaded).__name__}); name a single split"
        )
    return loaded, name


def _column(dataset: Any, column: str) -> list[Any]:
    """All values of one column as Python objects (respecting any indices mapping)."""
    return list(dataset.with_format("arrow")[column].to_pylist())


def _labels(
    datasets: Any, dataset: Any, column: str, what: str
) -> tuple[np.ndarray | None, list[str] | None]:
    feature = dataset.features[column]
    values = _column(dataset, column)
    where = f"data.label_column {column!r} of {what}"
    if any(v is None for v in values):
        raise ConfigError(
            f"{where}: row {values.index(None)} has no label; label every row or none"
        )
    labels, class_names = class_indices(values, where)
    if isinstance(feature, datasets.ClassLabel):
        # -1 is ClassLabel's "no label": the store's own marker for it
        return (labels, list(feature.names)) if (labels >= 0).any() else (None, None)
    if class_names is None and len(labels) and labels.min() < 0:
        raise ConfigError(f"{where}: label {labels.min()} must be >= 0")
    return labels, class_names
