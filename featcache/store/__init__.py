"""The HDF5 store: one file per split, readable by any HDF5 tool.

Layout::

    /features/<key>  [N, *shape]  float16 | float32 | bfloat16 (stored as uint16 bits)
    /labels          [N] int64    (absent when the source has no labels)
    /index           [N] int64    position of the row in the source dataset
    /ids             [N] utf-8    stable sample ids
    /skipped/{index,ids,reasons}  samples left out (absent when none were)

File attributes hold the format version, the ``complete`` flag, the durable row count
(``rows_written``) and the provenance (resolved config, fingerprints, weights identity,
library versions, class names, creation time) as JSON strings. No pickles anywhere.
With ``store.checksum`` (the default) every chunk of features, labels, index and ids
carries a Fletcher-32 checksum; a chunk that fails it raises
:class:`~featcache.errors.CorruptStoreError` on read. A complete store is sealed: the
file records a digest of every attribute and each chunked dataset one of its chunk
index, checked whenever the store is opened (:mod:`.metadata`); a store edited with
h5py afterwards reads as damaged until :func:`seal` records the edit.

Modules: :mod:`.codec` (dtypes, bfloat16, attribute JSON), :mod:`.paths` (file names),
:mod:`.chunks` (chunk sizes), :mod:`.writer` (:class:`StoreWriter`), :mod:`.resume`,
:mod:`.skipped`, :mod:`.reader` (:class:`FeatureStore`, row reads), :mod:`.rows` (row
ranges read through :mod:`.raw_chunks`), :mod:`.merge` (shards and copies),
:mod:`.describe` (what ``featcache info`` shows), :mod:`.integrity` (chunk checksums:
:func:`scan_chunks`, :func:`has_checksums`), :mod:`.durable` (what an incomplete
store's last progress mark made durable), :mod:`.metadata` (header checksums, attribute
and chunk index digests: :func:`seal`).
"""

from featcache.store import codec
from featcache.store.describe import StoreDescription, describe
from featcache.store.integrity import BadChunk, has_checksums, scan_chunks
from featcache.store.merge import combine_shards, copy_store, merge_store
from featcache.store.metadata import seal
from featcache.store.paths import check_output_path, partial_path, remove_partial, remove_store
from featcache.store.reader import FeatureStore
from featcache.store.resume import (
    ResumePoint,
    interrupted_overwrite,
    plan_resume,
    stored_resume_key,
)
from featcache.store.rows import read_rows
from featcache.store.writer import StoreWriter

__all__ = [
    "BadChunk",
    "FeatureStore",
    "ResumePoint",
    "StoreDescription",
    "StoreWriter",
    "check_output_path",
    "codec",
    "combine_shards",
    "copy_store",
    "describe",
    "has_checksums",
    "merge_store",
    "partial_path",
    "interrupted_overwrite",
    "plan_resume",
    "read_rows",
    "remove_partial",
    "remove_store",
    "scan_chunks",
    "seal",
    "stored_resume_key",
]
