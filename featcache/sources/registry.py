"""The registry of source kinds: which ``data.source`` reads a split, and how. A kind's
optional extra (``datasets``, ``pyarrow``) is imported only when it builds."""

from __future__ import annotations

from collections.abc import Callable

from featcache.config.spec import SOURCE_OPTIONS, SOURCES, DataSpec
from featcache.errors import ConfigError
from featcache.sources.base import SourceDataset, SourceRequest
from featcache.sources.files import imagefolder_source, manifest_source
from featcache.sources.hf import hf_source
from featcache.sources.parquet import parquet_source
from featcache.sources.synthetic import synthetic_source
from featcache.sources.text import text_source
from featcache.sources.torchvision_datasets import torchvision_source
from featcache.sources.webdataset import webdataset_source

Build = Callable[[SourceRequest], SourceDataset]

KINDS: dict[str, Build] = {
    "imagefolder": imagefolder_source,
    "manifest": manifest_source,
    "torchvision": lambda r: torchvision_source(*r.args),
    "synthetic": lambda r: synthetic_source(*r.args),
    "text": lambda r: text_source(*r.args, r.tokenizer),
    "hf": hf_source,
    "parquet": parquet_source,
    "webdataset": webdataset_source,
}


def kind_for(data: DataSpec) -> Build:
    """The build of the kind ``data.source`` names, once the data keys are checked.

    Raises:
        ConfigError: no such kind (``data.source is 'x'; choose one of: ...``), or a data
            key the kind would ignore, or needs and lacks.
    """
    build = KINDS.get(data.source)
    if build is None:
        raise ConfigError(f"data.source is {data.source!r}; choose one of: {', '.join(SOURCES)}")
    data.refuse_unused()
    SOURCE_OPTIONS[data.source].require(data)
    return build
