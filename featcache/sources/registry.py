"""The registry of source kinds: which ``data.source`` reads a split, and how.

Each kind is a :class:`SourceKind` entry of :data:`KINDS`: its name (the value of
``data.source``), its options (the data keys it reads and requires,
:data:`~featcache.config.spec.SOURCE_OPTIONS`, which the config checks when it is loaded)
and its build, given a :class:`SourceRequest` and passing its kind's function what that
takes. A kind's optional extra (``datasets``, ``pyarrow``) is imported only when it builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from featcache.config.spec import SOURCE_OPTIONS, SOURCES, DataSpec, SourceOptions
from featcache.errors import ConfigError
from featcache.sources.base import SourceDataset, Transform
from featcache.sources.files import imagefolder_source, manifest_source
from featcache.sources.hf import hf_source
from featcache.sources.parquet import parquet_source
from featcache.sources.synthetic import synthetic_source
from featcache.sources.text import text_source
from featcache.sources.tokenizer import Tokenizer
from featcache.sources.torchvision_datasets import torchvision_source
from featcache.sources.webdataset import webdataset_source


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
        """``(data, split, data.splits[split], transform)``: what every kind's function
        takes first."""
        return self.data, self.split, self.data.splits[self.split], self.transform


@dataclass(frozen=True)
class SourceKind:
    """One way of reading a split: ``data.source: <name>``."""

    name: str
    build: Callable[[SourceRequest], SourceDataset]

    @property
    def options(self) -> SourceOptions:
        """The data keys this kind reads and requires."""
        return SOURCE_OPTIONS[self.name]

    def validate(self, data: DataSpec) -> None:
        """Raise ConfigError for a data key this kind would ignore, or needs and lacks."""
        data.refuse_unused()
        self.options.require(data)


KINDS: dict[str, SourceKind] = {
    kind.name: kind
    for kind in (
        SourceKind("imagefolder", lambda r: imagefolder_source(*r.args, r.decode_size)),
        SourceKind("manifest", lambda r: manifest_source(*r.args, r.decode_size)),
        SourceKind("torchvision", lambda r: torchvision_source(*r.args)),
        SourceKind("synthetic", lambda r: synthetic_source(*r.args)),
        SourceKind("text", lambda r: text_source(*r.args, r.tokenizer)),
        SourceKind("hf", lambda r: hf_source(*r.args, r.tokenizer, r.decode_size)),
        SourceKind("parquet", lambda r: parquet_source(*r.args, r.tokenizer, r.decode_size)),
        SourceKind("webdataset", lambda r: webdataset_source(*r.args, r.tokenizer, r.decode_size)),
    )
}


def kind_for(data: DataSpec) -> SourceKind:
    """The kind ``data.source`` names; ConfigError (``data.source is 'x'; choose one of:
    ...``) when there is none."""
    kind = KINDS.get(data.source)
    if kind is None:
        raise ConfigError(f"data.source is {data.source!r}; choose one of: {', '.join(SOURCES)}")
    return kind
