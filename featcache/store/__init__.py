"""The HDF5 store: one file per split, readable by any HDF5 tool (docs/store-format.md)."""

from featcache.store import codec
from featcache.store.checks import BadChunk, has_checksums, scan_chunks
from featcache.store.merge import combine_shards, copy_store, merge_store
from featcache.store.metadata import seal
from featcache.store.paths import check_output_path, partial_path, remove_partial, remove_store
from featcache.store.reader import FeatureStore
from featcache.store.resume import ResumePoint, plan_resume, stored_resume_key
from featcache.store.rows import read_rows, rows_of
from featcache.store.state import StoreState, interrupted_overwrite, store_state
from featcache.store.writer import StorePlan, StoreWriter

__all__ = [
    "BadChunk",
    "FeatureStore",
    "ResumePoint",
    "StorePlan",
    "StoreState",
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
    "store_state",
    "stored_resume_key",
]
