"""A store's metadata checks: checksummed HDF5 headers and a digest of every attribute.

Version-2 object headers carry their own checksum, but an attribute over 64 KiB lies
outside any, so :func:`seal` records a SHA-256 over every attribute (:data:`DIGEST_ATTR`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import h5py
import numpy as np

from featcache import __version__
from featcache.errors import first_line
from featcache.store import codec
from featcache.store.provenance import FORMAT_VERSION

DIGEST_ATTR = "attrs_sha256"

# What h5py raises on metadata it cannot make sense of: a header failing its checksum,
# text that is not UTF-8, a number out of range, JSON that no longer parses.
UNREADABLE_METADATA = (OSError, KeyError, RuntimeError, ValueError, OverflowError, TypeError)


def attrs_digest(file: h5py.File) -> str:
    """SHA-256 (hex) over the names and values of the attributes of ``file`` and of every
    group and dataset in it, in sorted order; :data:`DIGEST_ATTR` itself left out."""
    digest = hashlib.sha256()
    names: list[str] = []
    file.visit(names.append)
    for name in ["", *sorted(names)]:
        attrs = file[name].attrs if name else file.attrs
        for key in sorted(attrs.keys()):
            if name or key != DIGEST_ATTR:
                for part in (name.encode(), key.encode(), _value_bytes(attrs[key])):
                    digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def seal(file: h5py.File) -> None:
    """Record the digest of the attributes as they are now: call it after the last write."""
    codec.set_attr(file, DIGEST_ATTR, attrs_digest(file))


def is_sealed(file: h5py.File) -> bool:
    """Whether ``file`` records an attribute digest (stores made before featcache recorded
    one, and stores still being written, do not)."""
    return DIGEST_ATTR in file.attrs


def metadata_problem(file: h5py.File, sealed: bool = True) -> str:
    """Why the metadata of ``file`` cannot be trusted ("" when it can): a header, attribute
    or recorded JSON that cannot be read, or (``sealed``) attributes that differ from the
    recorded digest."""
    try:
        codec.read_attrs(file)  # the recorded JSON still parses
        recorded = codec.attr(file, DIGEST_ATTR) if sealed else None
        if recorded is not None and recorded != attrs_digest(file):
            return "its attributes differ from the digest recorded when it was written"
    except UNREADABLE_METADATA as exc:
        return f"its metadata cannot be read ({first_line(exc)})"
    return ""


def newer_format(file: h5py.File) -> str:
    """Why this featcache cannot read ``file`` ("" when it can): its recorded store format
    is newer than :data:`~featcache.store.provenance.FORMAT_VERSION`."""
    found = codec.attr(file, "featcache_format")
    if not isinstance(found, (int, np.integer)) or found <= FORMAT_VERSION:
        return ""  # a damaged number is the digest's to find
    return (
        f"it is in store format {found}, newer than featcache {__version__} reads (formats "
        f"1 to {FORMAT_VERSION}); upgrade featcache (pip install -U featcache) to read it"
    )


def _value_bytes(value: Any) -> bytes:
    """An attribute value as bytes that differ whenever the value or its type does."""
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    array = np.asarray(value)
    if array.dtype.kind == "O":  # variable-length strings
        items = [
            v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)
            for v in array.ravel()
        ]
        return b"o" + json.dumps([list(array.shape), items]).encode()
    return b"a" + f"{array.dtype.str}{list(array.shape)}".encode() + array.tobytes()
