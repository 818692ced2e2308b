"""A store's metadata checks: checksummed HDF5 headers, chunk index and attribute digests.

Fletcher-32 covers the chunks; this module covers the rest. Stores are created with
:data:`LIBVER`, so that HDF5 writes version-2 object headers, which carry their own
checksum: a damaged header (a dataset's shape, type, filters or attributes) fails when
it is read instead of being taken at its word. Text attributes are fixed-length strings
(:func:`~featcache.store.codec.set_attr`), kept in those headers or in the checksummed
heap HDF5 keeps a header's many attributes in, and never in HDF5's global heap, which
has no checksum. The index that says which chunk holds which rows is, in a store a run
writes, a B-tree whose nodes have no checksum (files written whole, such as compressed
copies, use :data:`WHOLE_FILE_LIBVER`, whose indexes have checksums): a damaged index
entry can hand back another chunk's rows, each with a valid Fletcher-32; and an
attribute over 64 KiB (the class names of a large label set) is stored outside any
checksum. So :func:`seal` gives each chunked dataset :data:`CHUNKS_ATTR`, a SHA-256 of
its chunk index, and the file :data:`DIGEST_ATTR`, a SHA-256 over every attribute of
every object (those included), and :func:`metadata_problem` checks both whenever a
complete store is opened. A new store records its chunk index digests as well
(:func:`record_chunk_indexes`), which its run never changes: a resume, and a reader of
the incomplete store, check its partial file's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import h5py
import numpy as np

from featcache import __version__
from featcache.errors import first_line
from featcache.provenance import FORMAT_VERSION
from featcache.store import codec

# Oldest format that writes checksummed (version-2) object headers, newest that featcache
# needs (virtual datasets, for combined torchrun shards). Files stay readable by HDF5 1.10.
LIBVER = ("v108", "v110")
# Files written whole and never opened for writing again (copies, compressed stores,
# merged or combined torchrun shards) are in HDF5's 1.10 format, whose chunk indexes
# (fixed and extensible arrays) carry checksums: a damaged entry fails to read, where one
# in the B-tree of :data:`LIBVER` can send HDF5 to no chunk (read as zeros) without an
# error. A store being written cannot use it: that format marks a file as open for
# writing until it is closed, and HDF5 refuses to reopen a store whose writer was killed,
# as a resume must.
WHOLE_FILE_LIBVER = ("v110", "v110")
DIGEST_ATTR = "attrs_sha256"
CHUNKS_ATTR = "chunks_sha256"

# What h5py can raise on metadata it cannot make sense of: a header failing its checksum
# (OSError, KeyError, RuntimeError), a string that is not UTF-8 (UnicodeDecodeError, a
# ValueError), a number out of range (OverflowError), JSON text that no longer parses.
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


def chunk_index_digest(dataset: h5py.Dataset) -> str:
    """SHA-256 (hex) over the chunk index of ``dataset``: for each allocated chunk, sorted
    by position, its offset in the dataset, its address and size in the file and its
    filter mask."""
    records: list[tuple[int, ...]] = []

    def note(info: h5py.h5d.StoreInfo) -> None:
        address = -1 if info.byte_offset is None else info.byte_offset
        records.append((*info.chunk_offset, address, info.size, info.filter_mask))

    try:
        dataset.id.chunk_iter(note)
    except (AttributeError, NotImplementedError):  # HDF5 before 1.12.3 cannot list them
        for i in range(dataset.id.get_num_chunks()):
            note(dataset.id.get_chunk_info(i))
    return hashlib.sha256(np.array(sorted(records), dtype=np.int64).tobytes()).hexdigest()


def seal(file: h5py.File) -> None:
    """Record the digests of the chunk indexes and of the attributes as they are now:
    call it after the last write."""
    record_chunk_indexes(file)
    codec.set_attr(file, DIGEST_ATTR, attrs_digest(file))


def record_chunk_indexes(file: h5py.File) -> None:
    """Give each chunked dataset of ``file`` :data:`CHUNKS_ATTR`, the digest of its chunk
    index as it is now: at completion (:func:`seal`), and when a store is created, whose
    index the run then never changes (its chunks are allocated whole, and rewritten in
    place), so that a resume can tell that the index of its partial file is intact."""
    for dataset in chunked_datasets(file):
        codec.set_attr(dataset, CHUNKS_ATTR, chunk_index_digest(dataset))


def changed_chunk_index(file: h5py.File) -> str:
    """The first chunked dataset of ``file`` whose chunk index differs from the digest
    recorded for it (:func:`record_chunk_indexes`), as "the chunk index of <name>
    differs ..."; "" when none does (datasets without a digest are not compared)."""
    for dataset in chunked_datasets(file):
        index = codec.attr(dataset, CHUNKS_ATTR)
        if index is not None and index != chunk_index_digest(dataset):
            return (
                f"the chunk index of {dataset.name.lstrip('/')} differs from the one "
                "recorded when it was written"
            )
    return ""


def is_sealed(file: h5py.File) -> bool:
    """Whether ``file`` records an attribute digest (stores made before featcache recorded
    one, and stores still being written, do not)."""
    return DIGEST_ATTR in file.attrs


def metadata_problem(file: h5py.File, sealed: bool = True) -> str:
    """Why the metadata of ``file`` cannot be trusted ("" when it can): a header or an
    attribute that cannot be read, recorded JSON that no longer parses, (for a
    ``sealed``, complete store) attributes that differ from the digest recorded when the
    store was written, or a chunk index that differs from the digest recorded for it (a
    store still being written records them when it is created)."""
    try:
        codec.read_attrs(file)  # the recorded JSON still parses
        recorded = codec.attr(file, DIGEST_ATTR) if sealed else None
        if recorded is not None and recorded != attrs_digest(file):
            return "its attributes differ from the digest recorded when it was written"
        return changed_chunk_index(file)
    except UNREADABLE_METADATA as exc:
        return f"its metadata cannot be read ({first_line(exc)})"
    return ""


def newer_format(file: h5py.File) -> str:
    """Why this featcache cannot read ``file`` ("" when it can): its recorded store format
    is newer than :data:`~featcache.provenance.FORMAT_VERSION`."""
    found = codec.attr(file, "featcache_format")
    if not isinstance(found, (int, np.integer)) or found <= FORMAT_VERSION:
        return ""  # a damaged number is the digest's to find
    return (
        f"it is in store format {found}, newer than featcache {__version__} reads (formats "
        f"1 to {FORMAT_VERSION}); upgrade featcache (pip install -U featcache) to read it"
    )


def chunked_datasets(file: h5py.File) -> list[h5py.Dataset]:
    """Every chunked dataset of ``file`` that is stored in it (not a virtual one)."""
    found: list[h5py.Dataset] = []
    file.visititems(
        lambda _, obj: (
            found.append(obj)
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None and not obj.is_virtual
            else None
        )
    )
    return found


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
