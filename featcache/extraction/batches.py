"""The batch type of the run loop and the DataLoader adapters that make it.

:class:`SourceRows` turns an unreadable sample into a recorded failure instead of an
exception in a worker; :class:`Collate` stacks the readable ones into one :class:`Batch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate
from tqdm.auto import tqdm

from featcache.errors import ConfigError, FeatcacheError, first_line

Inputs = torch.Tensor | dict[str, torch.Tensor]


@dataclasses.dataclass
class Batch:
    """One batch, from the loader to the device to the taps.

    ``inputs`` is ``[B, ...]`` (or a mapping of such tensors), None when no sample could
    be read. ``attention_mask`` is int64 ``[B, T]`` (1 for real tokens), ``labels`` int64
    ``[B]`` (-1: none), ``rows`` the int64 ``[B]`` source positions of readable samples.
    """

    inputs: Inputs | None
    labels: torch.Tensor
    rows: torch.Tensor
    failed: list[tuple[int, str]]  # (source position, reason) of unreadable samples
    attention_mask: torch.Tensor | None = None
    error: str = ""  # a problem with the batch as a whole (found in a worker, raised in main)

    def to(
        self,
        device: torch.device,
        *,
        non_blocking: bool = False,
        memory_format: torch.memory_format = torch.preserve_format,
    ) -> Batch:
        """The batch with its inputs and mask on ``device`` (labels and rows stay put);
        ``memory_format`` applies to 4-d inputs (images)."""

        def move(x: torch.Tensor) -> torch.Tensor:
            fmt = memory_format if x.dim() == 4 else torch.preserve_format
            return x.to(device, non_blocking=non_blocking, memory_format=fmt)

        inputs: Inputs | None = self.inputs
        if isinstance(inputs, torch.Tensor):
            inputs = move(inputs)
        elif isinstance(inputs, dict):
            inputs = {key: move(value) for key, value in inputs.items()}
        mask = self.attention_mask
        if mask is not None:
            mask = mask.to(device, non_blocking=non_blocking)
        return dataclasses.replace(self, inputs=inputs, attention_mask=mask)


def split_sample(sample: Any) -> tuple[Any, Any]:
    """``(input, label)`` of a source item; the label is None when the item has none."""
    if isinstance(sample, (tuple, list)):
        return sample[0], (sample[1] if len(sample) > 1 else None)
    return sample, None


FIRST_SAMPLE_TRIES = 32  # rows read to find one whose type tells what the dataset gives


def first_sample(dataset: Dataset, rows: range) -> tuple[Any, Any] | None:
    """The first readable item of ``rows`` (of the first :data:`FIRST_SAMPLE_TRIES`) as
    ``(input, label)``; None when none is (the run reports them, row by row)."""
    for i in rows[:FIRST_SAMPLE_TRIES]:
        try:
            return split_sample(dataset[i])
        except Exception:
            continue
    return None


def source_length(dataset: Dataset) -> int:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError("the dataset has no len(); featcache needs a map-style dataset") from None


def describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


class DatasetProblem(str):
    """The ``error`` of a :class:`SourceRows` item that is the dataset's fault (a label
    that is no class index): it fails the run whatever ``loader.on_error`` says."""


def class_index(label: Any) -> int:
    """A source item's label as a class index (an int, a numpy or one-element torch
    integer, or a whole float).

    Raises:
        ValueError: anything else (a class name, a float such as 1.7, several values).
    """
    if isinstance(label, np.generic) or (isinstance(label, torch.Tensor) and label.numel() == 1):
        label = label.item()
    if isinstance(label, float) and label.is_integer():
        label = int(label)
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    shown = describe_value(label) if isinstance(label, torch.Tensor) else repr(label)
    fix = (
        "map class names to indices and give the names as class_names"
        if isinstance(label, str)
        else "give one whole number per row"
    )
    raise ValueError(
        f"is {shown}, not a class index; featcache stores one int class index per row "
        f"(-1 or None for a row without one): {fix}"
    )


class SourceRows(Dataset):
    """The source rows in ``rows``, as ``(input or None, label, row, error)``.

    An unreadable sample comes back with input None and the reason in ``error`` instead
    of raising in a worker, so the run loop applies the policy; a label that is no class
    index, or one in a dataset that ``has_labels=False``, as a :class:`DatasetProblem`.
    ``label`` is -1 when there is none.
    """

    def __init__(self, dataset: Dataset, rows: range, has_labels: bool | None = None):
        self.dataset = dataset
        self.rows = rows
        self.has_labels = has_labels
        # A TensorDataset of images [N, C, H, W] (and labels [N]) is read in blocks.
        tensors = dataset.tensors if isinstance(dataset, TensorDataset) else ()
        whole = 0 < len(tensors) <= 2 and tensors[0].dim() == 4
        self._blocks = tensors if whole and (len(tensors) == 1 or tensors[1].dim() == 1) else ()
        if len(self._blocks) == 2:
            _check_label_tensor(self._blocks[1])

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def pad_values(self) -> dict[str, int]:
        """What :class:`Collate` pads each mapping input with (the dataset's, or {})."""
        return dict(getattr(self.dataset, "pad_values", None) or {})

    def __getitems__(self, js: list[int]) -> list[tuple[Any, int, int, str]] | Batch:
        """A whole batch at once: consecutive rows of a :class:`TensorDataset` of images
        sliced out as one block; anything else sample by sample, after the dataset's
        ``prefetch(rows)`` hint."""
        tensors = self._blocks
        if tensors and js == list(range(js[0], js[0] + len(js))):
            block = slice(self.rows[js[0]], self.rows[js[-1]] + 1)
            rows = torch.arange(block.start, block.stop, dtype=torch.long)
            labels = tensors[1][block].long() if len(tensors) == 2 else torch.full_like(rows, -1)
            return Batch(tensors[0][block], labels, rows, [])
        prefetch = getattr(self.dataset, "prefetch", None)
        if callable(prefetch):  # a remote source fetches the batch's bytes together
            prefetch([self.rows[j] for j in js])
        return [self[j] for j in js]

    def __getitem__(self, j: int) -> tuple[Any, int, int, str]:
        i = self.rows[j]
        try:
            value, label = split_sample(self.dataset[i])
        except Exception as exc:
            reason = str(exc) if isinstance(exc, FeatcacheError) else ""
            return None, -1, i, reason or first_line(exc, with_type=True)
        if isinstance(value, Mapping) and _no_tokens(value):
            return None, -1, i, "it has no tokens (its token inputs are empty)"
        if label is None:
            return value, -1, i, ""
        try:
            index = class_index(label)
        except ValueError as exc:
            return None, -1, i, DatasetProblem(f"the dataset's label at row {i} {exc}")
        if self.has_labels is False and index != -1:
            problem = (
                f"row {i} of the dataset has the label {index}, but its first row has none, "
                "so the store keeps no labels; give every row a label (-1 for a row without "
                "one) or none"
            )
            return None, -1, i, DatasetProblem(problem)
        return value, index, i, ""


def _no_tokens(value: Mapping[str, Any]) -> bool:
    """Whether a mapping's ``input_ids`` (else its first tensor) is empty."""
    tokens = value.get("input_ids")
    if not isinstance(tokens, torch.Tensor):
        tokens = next((v for v in value.values() if isinstance(v, torch.Tensor)), None)
    return isinstance(tokens, torch.Tensor) and tokens.dim() > 0 and len(tokens) == 0


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check_label_tensor(labels: torch.Tensor) -> None:
    """Refuse a TensorDataset's labels ``[N]`` that are not class indices."""
    if labels.is_floating_point() and not bool((labels == labels.round()).all()):
        bad = int((labels != labels.round()).nonzero()[0, 0])
        raise ConfigError(
            f"the dataset's label at row {bad} is {float(labels[bad])!r}, not a class index; "
            "featcache stores one int class index per row: give integer labels"
        )
    if not (labels.is_floating_point() or labels.dtype in _INTEGER_DTYPES):
        raise ConfigError(f"the dataset's labels are {labels.dtype}; give integer class indices")


class Collate:
    """Stack the readable samples of a :class:`SourceRows` batch into one :class:`Batch`.

    Tensor inputs must share one shape and are stacked to ``[B, ...]``. In mapping
    inputs a tensor whose first axis differs between samples is right-padded to the
    batch's longest with ``pad_values[key]`` (default 0), and an int64 ``[B, T]``
    ``"attention_mask"`` is added if there is none. Pickles into DataLoader workers.
    """

    def __init__(self, pad_values: Mapping[str, int] | None = None) -> None:
        self.pad_values: dict[str, int] = dict(pad_values or {})

    def __call__(self, samples: list[tuple[Any, int, int, str]] | Batch) -> Batch:
        if isinstance(samples, Batch):
            return samples
        bad_dataset = next((s[3] for s in samples if isinstance(s[3], DatasetProblem)), None)
        if bad_dataset is not None:
            nothing = torch.empty(0, dtype=torch.long)
            return Batch(None, nothing, nothing, [], error=str(bad_dataset))
        good = [s for s in samples if not s[3]]
        failed = [(s[2], s[3]) for s in samples if s[3]]
        rows = torch.tensor([s[2] for s in good], dtype=torch.long)
        labels = torch.tensor([s[1] for s in good], dtype=torch.long)
        if not good:
            return Batch(None, labels, rows, failed)
        values = [s[0] for s in good]
        if isinstance(values[0], Mapping):
            inputs, problem = _pad_mappings(values, self.pad_values)
            if problem:
                return Batch(None, labels, rows, failed, error=problem)
            mask = inputs.get("attention_mask")
            return Batch(inputs, labels, rows, failed, attention_mask=mask)
        problem = _shape_problem(values)
        if problem:
            return Batch(None, labels, rows, failed, error=problem)
        return Batch(default_collate(values), labels, rows, failed)

    def __repr__(self) -> str:
        return f"Collate(pad_values={self.pad_values})"


collate = Collate()  # no pad values: pads every mapping input with 0


def _pad_mappings(
    values: list[Any], pad_values: Mapping[str, int]
) -> tuple[dict[str, torch.Tensor], str]:
    """The mappings ``values`` as one mapping of ``[B, ...]`` tensors, padded where
    needed, and why they cannot be ("" when they can)."""
    keys = list(values[0])
    for value in values[1:]:
        if not isinstance(value, Mapping) or list(value) != keys:
            other = list(value) if isinstance(value, Mapping) else describe_value(value)
            return {}, (
                f"input items of one batch differ: {keys} and {other}; every item must be a "
                "mapping with the same keys"
            )
    out: dict[str, torch.Tensor] = {}
    lengths: torch.Tensor | None = None  # of the first padded key
    for key in keys:
        items = [value[key] for value in values]
        if not all(isinstance(x, torch.Tensor) for x in items):
            out[key] = default_collate(items)
            continue
        shapes = {tuple(x.shape) for x in items}
        if len(shapes) == 1:
            out[key] = torch.stack(items)
            continue
        tails = {shape[1:] for shape in shapes}
        if any(len(shape) == 0 for shape in shapes) or len(tails) > 1:
            a, b = sorted(shapes)[:2]
            return {}, (
                f"input {key!r}: items of shapes {list(a)} and {list(b)} in one batch; only "
                "the first axis may differ (it is padded), give the rest one fixed size"
            )
        out[key] = _pad(items, pad_values.get(key, 0))
        if lengths is None:
            lengths = torch.tensor([len(x) for x in items], dtype=torch.long)
    if lengths is not None and "attention_mask" not in out:
        positions = torch.arange(int(lengths.max()), dtype=torch.long)
        out["attention_mask"] = (positions < lengths[:, None]).long()
    return out, ""


def _pad(items: list[torch.Tensor], pad: int) -> torch.Tensor:
    """``items`` (shapes ``[T_i, *rest]``) right-padded with ``pad`` to ``[B, max T_i, *rest]``."""
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in items])
    longest = max(len(x) for x in items)
    out = torch.full((len(items), longest, *items[0].shape[1:]), pad, dtype=dtype)
    for i, x in enumerate(items):
        out[i, : len(x)] = x
    return out


def _shape_problem(values: list[Any]) -> str:
    """Why the tensors ``values`` cannot be stacked into one batch ("" when they can)."""
    shapes = {tuple(v.shape) for v in values if isinstance(v, torch.Tensor)}
    if len(shapes) > 1:
        a, b = sorted(shapes)[:2]
        return (
            f"images of different sizes in one batch ({list(a)} and {list(b)}); set "
            "preprocess.crop (or give the dataset a transform with a fixed output size)"
        )
    return ""


def num_workers(setting: int | str, num_rows: int, batch_size: int) -> int:
    """Loader worker processes: ``setting``, or for ``"auto"`` up to 4 within the CPUs."""
    if setting != "auto":
        return int(setting)
    if num_rows <= 2 * batch_size:
        return 0  # starting workers costs more than it saves on a couple of batches
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(4, cpus or 1)


def pins(setting: bool | str, device: torch.device) -> bool:
    """Whether batches come in pinned memory: ``loader.pin_memory``, "auto" on CUDA."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@contextlib.contextmanager
def started(loader: DataLoader) -> Iterator[Iterator[Batch]]:
    """The loader's iterator, its workers started now (before the store file is opened,
    so they never inherit its descriptor) and always shut down."""
    batches = iter(loader)
    try:
        yield batches
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)  # multi-process iterators
        if shutdown is not None:
            shutdown()


def check_inputs(model: nn.Module, value: Any) -> None:
    """Refuse a source item the run cannot feed to ``model``: neither a tensor nor a
    mapping of tensors, or a mapping key that ``model.forward`` takes no argument for."""
    if isinstance(value, torch.Tensor):
        return
    if not isinstance(value, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in value.values()
    ):
        raise ConfigError(
            f"dataset items must be a tensor (an image [C, H, W], a clip [C, T, H, W], "
            f"audio [L], ...) or a mapping of named tensors, got {describe_value(value)}; "
            "give the dataset a transform that ends in a tensor (e.g. weights.transforms())"
        )
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return
    # Hugging Face models take **kwargs for options (output_attentions, ...) and ignore
    # the rest silently, so only their named inputs count; other modules' **kwargs do.
    hf_model = hasattr(model, "main_input_name")
    if not hf_model and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    accepted = [
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for key in value:
        if key not in accepted:
            raise ConfigError(
                f"input {key!r} of the dataset's items is not an argument of "
                f"{type(model).__name__}.forward, which takes: {', '.join(accepted)}; "
                "rename or drop that key"
            )


def token_lengths(dataset: Dataset) -> np.ndarray:
    """``[N]`` int64 tokens per source row: the dataset's ``token_lengths``, else one
    pass over its items (the ``attention_mask``'s ones, else the first sequence's length)."""
    declared = getattr(dataset, "token_lengths", None)
    if declared is not None:
        return np.asarray(declared, dtype=np.int64)
    count = source_length(dataset)
    lengths = np.zeros(count, dtype=np.int64)
    for i in tqdm(range(count), desc="counting tokens", unit="row", disable=count < 10_000):
        try:
            item, _ = split_sample(dataset[i])
        except Exception:
            continue  # unreadable: the run reports it, and it stores no tokens
        mask = item.get("attention_mask") if isinstance(item, Mapping) else None
        if mask is not None:
            lengths[i] = int((mask != 0).sum())
        elif isinstance(item, Mapping):
            sequences = [v for v in item.values() if isinstance(v, torch.Tensor) and v.dim()]
            lengths[i] = len(sequences[0]) if sequences else 0
    return lengths
