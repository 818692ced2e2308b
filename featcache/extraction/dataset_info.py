"""What a Python dataset says of its rows: their ids, change stamps and class names.

torchvision's folder datasets (also inside ``Subset`` and ``ConcatDataset``) are
identified by their files' paths relative to the folder, so two folders whose files
differ give stores with other ids.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import ConcatDataset, Dataset, Subset

from featcache.sources.stamps import file_stamp, stamp_array


def dataset_ids(dataset: Dataset) -> list[str] | None:
    """The ids of ``dataset``'s rows, in order: its ``ids`` attribute, or the relative
    paths of a folder dataset's files; None when it says nothing (or they repeat)."""
    declared = getattr(dataset, "ids", None)
    if declared is not None:
        return [str(i) for i in declared]
    files = _files(dataset)
    if files is None:
        return None
    roots, paths = files
    top = roots[0] if len(set(roots)) == 1 else os.path.commonpath(roots)
    ids = [os.path.relpath(path, top).replace(os.sep, "/") for path in paths]
    return ids if len(set(ids)) == len(ids) else None


def dataset_stamps(dataset: Dataset) -> np.ndarray | None:
    """``[rows]`` change stamps (numpy ``S``) of ``dataset``'s rows, taken now: a featcache
    source's own, or each file's of a folder dataset; None when it can tell nothing."""
    method = getattr(dataset, "change_stamps", None)
    if callable(method):
        stamps = method()
        return None if stamps is None else stamp_array(stamps)
    files = _files(dataset)
    return None if files is None else stamp_array(file_stamp(path) for path in files[1])


def dataset_classes(dataset: Dataset) -> list[str] | None:
    """``dataset``'s class names: its ``class_names`` or ``classes`` attribute, through
    ``Subset`` and ``ConcatDataset`` (whose parts must agree); None when it names none."""
    names = getattr(dataset, "class_names", None) or getattr(dataset, "classes", None)
    if names:
        return [str(name) for name in names]
    if isinstance(dataset, Subset):
        return dataset_classes(dataset.dataset)
    if isinstance(dataset, ConcatDataset) and dataset.datasets:
        parts = [dataset_classes(part) for part in dataset.datasets]
        if parts[0] is not None and all(part == parts[0] for part in parts):
            return parts[0]
    return None


def _files(dataset: Any) -> tuple[list[str], list[str]] | None:
    """The roots and the file path of each row of a folder dataset, or a ``Subset`` or
    ``ConcatDataset`` of them; None for anything else."""
    samples = getattr(dataset, "samples", None)
    root = getattr(dataset, "root", None)
    if isinstance(samples, Sequence) and isinstance(root, (str, os.PathLike)):
        if not all(isinstance(s, (tuple, list)) and s for s in samples):
            return None
        return [os.path.abspath(root)], [os.path.abspath(str(s[0])) for s in samples]
    if isinstance(dataset, Subset):
        inner = _files(dataset.dataset)
        if inner is None:
            return None
        roots, paths = inner
        return roots, [paths[int(i)] for i in dataset.indices]
    if isinstance(dataset, ConcatDataset):
        roots, paths = [], []
        for part in dataset.datasets:
            files = _files(part)
            if files is None:
                return None
            roots += files[0]
            paths += files[1]
        return roots, paths
    return None
