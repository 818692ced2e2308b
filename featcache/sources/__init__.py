"""The image dataset of one split, built from a config's ``data`` section.

Every source is a :class:`SourceDataset`: ``ds[i] -> (image, label)``, where ``image`` is
``transform`` applied to a PIL RGB image and ``label`` an int class index (-1 when the source
has no labels). Each row also has a stable string id (``ds.ids[i]``) that identifies it in a
store. Sources hold only plain data (paths, labels, options), so they pickle into DataLoader
workers under both fork and spawn.
"""

from __future__ import annotations

from featcache.errors import ConfigError
from featcache.sources.base import IMAGE_EXTENSIONS, SourceDataset, Transform
from featcache.sources.decode import load_rgb
from featcache.sources.files import FileSource, imagefolder_source, manifest_source
from featcache.sources.synthetic import SyntheticOptions, synthetic_source
from featcache.sources.torchvision_datasets import torchvision_source
from featcache.spec import SOURCES, DataSpec

__all__ = [
    "IMAGE_EXTENSIONS",
    "SourceDataset",
    "SyntheticOptions",
    "Transform",
    "build_source",
    "load_rgb",
]


def build_source(
    data: DataSpec, split: str, transform: Transform | None, decode_size: int | None = None
) -> SourceDataset:
    """The dataset of split ``split`` of ``data``; rows yield ``(transform(rgb), label)``.

    ``decode_size`` is the shorter side ``transform`` resizes to first, if it does: JPEG
    files are then decoded at a reduced scale that still covers it (see :func:`load_rgb`).

    Raises:
        ConfigError: unknown split or source, missing root/folder/manifest, an empty split,
            a bad manifest row, or a torchvision dataset that is unknown or not on disk.
    """
    if split not in data.splits:
        known = ", ".join(map(str, data.splits)) or "none"
        raise ConfigError(f"unknown split {split!r}; data.splits has: {known}")
    builders = {
        "imagefolder": imagefolder_source,
        "manifest": manifest_source,
        "torchvision": torchvision_source,
        "synthetic": synthetic_source,
    }
    if data.source not in builders:
        raise ConfigError(f"data.source is {data.source!r}; choose one of: {', '.join(SOURCES)}")
    source = builders[data.source](data, split, data.splits[split], transform)
    if isinstance(source, FileSource):
        source.decode_size = decode_size
    return source
