"""The HDF5 store: one file per split, readable by any HDF5 tool.

Layout (store format 3; docs/store-format.md is the specification)::

    /features/<key>  [N, *shape]  float16 | float32 | bfloat16 (stored as uint16 bits)
    /labels          [N] int64    (absent when the source has no labels)
    /index           [N] int64    position of the row in the source dataset
    /ids             [N] utf-8    stable sample ids
    /checksums/<dataset>  [chunks] uint64: the XXH3-64 of each chunk of <dataset>
    /progress        durable rows, and durable entries of each dataset while written
    /skipped/{index,ids,reasons}  samples left out (absent when none were)

File attributes hold the format version, the ``complete`` flag, the durable row count
(``rows_written``) and the provenance (resolved config, fingerprints, weights identity,
library versions, class names, creation time) as JSON strings. No pickles anywhere.
featcache's readers check each chunk against its checksum the first time they read it
while the file is open; one that fails raises
:class:`~featcache.errors.CorruptStoreError` naming the layer and its rows. A complete
store is sealed with a digest of every attribute (:mod:`.metadata`).

Modules: :mod:`.codec` (dtypes, bfloat16, attribute JSON), :mod:`.layout` (the format:
allocation, chunk sizes, checksums, progress), :mod:`.paths` (file names), :mod:`.lock`
(one writer per store), :mod:`.writer` (:class:`StorePlan`, :class:`StoreWriter`),
:mod:`.resume`, :mod:`.skipped`, :mod:`.rows` (row reads, each chunk checked once),
:mod:`.checks` (every chunk: :func:`scan_chunks`), :mod:`.reader`
(:class:`FeatureStore`), :mod:`.merge` (shards and copies), :mod:`.describe` (what
``featcache info`` shows), :mod:`.metadata` (the attribute digest: :func:`seal`),
:mod:`.containment` (a store reads only its own bytes).
"""

from featcache.store import codec
from featcache.store.checks import BadChunk, has_checksums, scan_chunks
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
from featcache.store.rows import read_rows, rows_of
from featcache.store.writer import StorePlan, StoreWriter

__all__ = [
    "BadChunk",
    "FeatureStore",
    "ResumePoint",
    "StorePlan",
    "StoreWriter",
    "check_output_path",
    "codec",
    "combine_shards",
    "copy_store",
    "has_checksums",
    "interrupted_overwrite",
    "merge_store",
    "partial_path",
    "plan_resume",
    "read_rows",
    "remove_partial",
    "remove_store",
    "rows_of",
    "scan_chunks",
    "seal",
    "stored_resume_key",
]
