"""``store.compression``: h5py's built-in filters and hdf5plugin's lossless codecs (the
``codecs`` extra), parsed in one place into the keyword arguments of ``create_dataset``.
Importing hdf5plugin registers its filters for the whole process (:func:`load_plugins`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from types import ModuleType
from typing import Any

from featcache.errors import ConfigError
from featcache.util.extras import install_command

PLUGIN_INSTALL = install_command("codecs")  # pip install 'featcache[codecs]'
FORMS = (
    "gzip, gzip:<1-9>, lzf, zstd, zstd:<1-22>, blosc2-lz4 or blosc2-zstd (optionally "
    "-shuffle or -bitshuffle, then :<0-9>, e.g. blosc2-zstd-bitshuffle:5), or null"
)
BUILTIN = ("gzip", "lzf")  # built into h5py; the other families need hdf5plugin
# family -> (lowest level, highest level); None: the family takes no level
LEVELS: dict[str, tuple[int, int] | None] = {
    "gzip": (1, 9),
    "lzf": None,
    "zstd": (1, 22),
    "blosc2-lz4": (0, 9),
    "blosc2-zstd": (0, 9),
}
BLOSC2_LEVEL = 5  # hdf5plugin's default
# HDF5 filter id -> the name featcache's errors give it (hdf5plugin's own names)
FILTER_NAMES = {32015: "zstd", 32026: "blosc2", 32001: "blosc", 32004: "lz4", 32008: "bitshuffle"}
_FORM = re.compile(
    r"(?P<family>gzip|lzf|zstd|blosc2-lz4|blosc2-zstd)"
    r"(?:-(?P<shuffle>shuffle|bitshuffle))?(?::(?P<level>[0-9]{1,2}))?"
)


@dataclasses.dataclass(frozen=True)
class Codec:
    """One parsed ``store.compression`` value: ``family`` (a key of :data:`LEVELS`),
    ``level`` (None: the codec's default), and whether blosc2 shuffles bits, not bytes."""

    family: str
    level: int | None = None
    bitshuffle: bool = False

    @property
    def needs_plugin(self) -> bool:
        return self.family not in BUILTIN


def parse_compression(value: Any, at: str = "store.compression") -> Codec:
    """The codec a ``store.compression`` value names.

    Raises:
        ConfigError: not one of the forms, in one line naming them
            (``store.compression is 'zstd:30'; choose gzip, gzip:<1-9>, ...``).
    """
    found = _FORM.fullmatch(value) if isinstance(value, str) else None
    if found is not None:
        family, shuffle, level = found["family"], found["shuffle"], found["level"]
        limits = LEVELS[family]
        shuffle_ok = shuffle is None or family.startswith("blosc2")
        level_ok = level is None or (limits is not None and limits[0] <= int(level) <= limits[1])
        if shuffle_ok and level_ok:
            return Codec(family, None if level is None else int(level), shuffle == "bitshuffle")
    raise ConfigError(f"{at} is {value!r}; choose {FORMS}")


def check_compression(value: Any, at: str = "store.compression") -> None:
    """Refuse a ``store.compression`` value that is malformed, or that needs hdf5plugin
    where it is not installed (``None`` passes).

    Raises:
        ConfigError: one line, naming the forms or the install command.
    """
    if value is not None and parse_compression(value, at).needs_plugin:
        _plugin(value, at)


def filter_options(value: str | None) -> dict[str, Any]:
    """The keyword arguments of h5py's ``create_dataset`` that compress a dataset as
    ``value`` says (``{}`` for None).

    Raises:
        ConfigError: a malformed value, or hdf5plugin missing for one of its codecs.
    """
    if value is None:
        return {}
    codec = parse_compression(value)
    if not codec.needs_plugin:
        opts = {} if codec.level is None else {"compression_opts": codec.level}
        return {"compression": codec.family, **opts}
    plugin = _plugin(value)
    if codec.family == "zstd":
        chosen = plugin.Zstd() if codec.level is None else plugin.Zstd(clevel=codec.level)
    else:
        shuffle = plugin.Blosc2.BITSHUFFLE if codec.bitshuffle else plugin.Blosc2.SHUFFLE
        level = BLOSC2_LEVEL if codec.level is None else codec.level
        chosen = plugin.Blosc2(cname=codec.family.split("-")[1], clevel=level, filters=shuffle)
    return dict(chosen)


def _plugin(value: str, at: str = "store.compression") -> ModuleType:
    """hdf5plugin, for the codec ``value``; a ConfigError naming the extra without it."""
    plugin = load_plugins()
    if plugin is None:
        raise ConfigError(f"{at} {value!r} needs hdf5plugin; install it with: {PLUGIN_INSTALL}")
    return plugin


@functools.cache
def load_plugins() -> ModuleType | None:
    """hdf5plugin, imported once (which registers its filters), or None when not installed."""
    try:
        return importlib.import_module("hdf5plugin")
    except ImportError:
        return None
