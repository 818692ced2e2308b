"""The extraction run loop: DataLoader -> device -> forward with taps -> writer thread.

The main thread only loads batches and runs the backbone. Reductions happen on the
device inside the hooks, and finished batches go through a bounded queue to a writer
thread that appends them to the store, so the forward waits on the disk only when the
queue is full. Nothing accumulates across batches: memory stays flat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from featcache.distributed import (
    Rank,
    block,
    check_other_world_sizes,
    combine_shards,
    current_rank,
    shard_path,
)
from featcache.errors import ConfigError, FeatcacheError
from featcache.fingerprints import ids_fingerprint, module_fingerprint
from featcache.provenance import config_fingerprint as fingerprint
from featcache.provenance import library_versions
from featcache.runtime import Layout, choose_layout
from featcache.spec import (
    LayerSpec,
    LoaderSpec,
    RuntimeSpec,
    Spec,
    StoreSpec,
    load_config,
    to_dict,
)
from featcache.store import (
    FORMAT_VERSION,
    FeatureStore,
    StoreWriter,
    check_output_path,
    plan_resume,
    remove_store,
    stored_resume_key,
    to_store_dtype,
)
from featcache.taps import Tap, TapSet, resolve_taps
from featcache.validation import check

MAX_PENDING_BATCHES = 4  # batches between the forward and the writer thread


@dataclasses.dataclass
class RunOptions:
    """Options of one extraction, grouped as in the config's sections."""

    loader: LoaderSpec = dataclasses.field(default_factory=LoaderSpec)
    store: StoreSpec = dataclasses.field(default_factory=StoreSpec)
    runtime: RuntimeSpec = dataclasses.field(default_factory=RuntimeSpec)
    overwrite: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RunOptions:
        """Build from flat keyword arguments named like the config keys (``batch_size=...``)."""
        options = cls(overwrite=bool(kwargs.pop("overwrite", False)))
        for section in (options.loader, options.store, options.runtime):
            for f in dataclasses.fields(section):
                if f.name in kwargs:
                    setattr(section, f.name, kwargs.pop(f.name))
        if kwargs:
            known = sorted(
                f.name
                for section in (options.loader, options.store, options.runtime)
                for f in dataclasses.fields(section)
            )
            raise ConfigError(
                f"unknown option {sorted(kwargs)[0]!r}; known options: overwrite, "
                + ", ".join(known)
            )
        for section in ("loader", "store", "runtime"):
            check(getattr(options, section), section)
        return options


def extract(
    model: nn.Module,
    dataset: Dataset,
    layers: Iterable[LayerSpec | str | Mapping[str, Any]] | str,
    path: str | os.PathLike,
    *,
    ids: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    provenance: Mapping[str, Any] | None = None,
    dataset_fingerprint: str | None = None,
    rows: range | None = None,
    **options: Any,
) -> FeatureStore:
    """Run ``model`` over ``dataset`` and store the activations of ``layers`` at ``path``.

    ``dataset`` is a map-style dataset yielding ``(image_tensor [3, H, W], label)`` like
    torchvision datasets (a bare tensor, or a label of None, means no labels). Rows keep
    the dataset's order. ``ids`` (default: the dataset's ``ids`` attribute, else
    ``"<DatasetClass>:<index>"``) and ``class_names`` go into the store;
    ``dataset_fingerprint`` defaults to a hash of the sorted ids. ``rows`` (a range of
    source positions, default all) limits the store to a contiguous block: one shard of a
    distributed run. ``options`` are the
    config keys of the loader, store and runtime sections (``batch_size``,
    ``num_workers``, ``on_error``, ``dtype``, ``compression``, ``chunk_rows``,
    ``on_nonfinite``, ``device``, ``amp``, ``channels_last``, ``progress`` ...) plus
    ``overwrite``.

    The store is written to ``<path>.partial`` and moved to ``path`` when complete. If an
    earlier run with the same settings, data and model was interrupted, this one resumes
    it and the result is the same as an uninterrupted run; a partial store made
    differently is refused with the difference named. The model is put in eval mode and
    moved to the device (its train/eval flag is restored afterwards). Returns the
    complete store, opened for reading.
    """
    run = RunOptions.from_kwargs(**options)
    if isinstance(layers, (str, LayerSpec, Mapping)):
        layers = [layers]
    taps = resolve_taps(model, layers)
    num_rows = _length(dataset)
    if ids is None:
        ids = getattr(dataset, "ids", None)
    if ids is None:
        ids = [f"{type(dataset).__name__}:{i}" for i in range(num_rows)]
    if len(ids) != num_rows:
        raise ConfigError(f"{len(ids)} ids given for a dataset of {num_rows} rows")
    rows = range(num_rows) if rows is None else rows
    if rows.step != 1 or not rows or rows.start < 0 or rows.stop > num_rows:
        raise ConfigError(f"rows must be a non-empty range within the {num_rows} source rows")
    if class_names is None:
        class_names = getattr(dataset, "class_names", None) or getattr(dataset, "classes", None)
    has_labels = getattr(dataset, "has_labels", None)
    first = _first_sample(dataset)
    if first is not None:
        if not isinstance(first[0], torch.Tensor) or first[0].dim() != 3:
            raise ConfigError(
                f"dataset items must be image tensors [C, H, W], got {_describe(first[0])}; "
                "give the dataset a transform that ends in a tensor (e.g. weights.transforms())"
            )
        if has_labels is None:
            has_labels = first[1] is not None
    has_labels = True if has_labels is None else bool(has_labels)
    layout = choose_layout(model, run.runtime)
    device = layout.device
    path = Path(path)
    provenance = dict(provenance or {})
    if "weights" not in provenance:  # made from Python: identify the weights by their values
        provenance["weights"] = {"source": "module", "sha256": module_fingerprint(model)}
    resume_key = {
        "featcache_format": FORMAT_VERSION,
        "config_fingerprint": provenance.get("config_fingerprint"),
        "weights": provenance["weights"],
        "dataset_fingerprint": dataset_fingerprint or ids_fingerprint(ids),
        "source_rows": num_rows,
        "rows": [rows.start, rows.stop],
        "taps": [dataclasses.asdict(tap) for tap in taps],
        "store_dtype": run.store.dtype,
        "chunk_rows": run.store.chunk_rows,
        "compression": run.store.compression,
        "batch_size": run.loader.batch_size,
        "on_nonfinite": run.store.on_nonfinite,
        "layout": layout.describe(),
    }
    if run.overwrite:
        remove_store(path)
    elif path.exists() and stored_resume_key(path) == resume_key:
        return FeatureStore(path)  # a rerun after this store completed: nothing left to do
    check_output_path(path, run.overwrite)  # before any work starts
    resume = plan_resume(path, resume_key, run.loader.batch_size, rows.start)
    attrs = {
        **provenance,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "versions": library_versions(),
        "device": str(device),
        "layout": layout.describe(),
        "dataset_fingerprint": resume_key["dataset_fingerprint"],
        "store_dtype": run.store.dtype,
        "taps": resume_key["taps"],
        "resume_key": resume_key,
    }
    if class_names is not None:
        attrs["class_names"] = [str(name) for name in class_names]
    todo = range(resume.position if resume else rows.start, rows.stop)
    pin = device.type == "cuda" if run.loader.pin_memory == "auto" else bool(run.loader.pin_memory)
    loader = DataLoader(
        _Indexed(dataset, todo),
        batch_size=run.loader.batch_size,
        shuffle=False,
        num_workers=_num_workers(run.loader.num_workers, len(todo), run.loader.batch_size),
        pin_memory=pin,
        collate_fn=_collate,
    )
    with _started(loader) as batches:
        writer = StoreWriter(
            path,
            len(rows),
            ids_width=max((len(str(i).encode()) for i in ids), default=1),
            dtype=run.store.dtype,
            compression=run.store.compression,
            chunk_rows=run.store.chunk_rows,
            has_labels=has_labels,
            attrs=attrs,
            resume=resume,
        )
        with writer:
            done = len(rows) - len(todo)
            timing = _run_loop(model, batches, taps, writer, ids, run, layout, pin, done)
            timing["images_per_second"] = len(todo) / max(timing["seconds"], 1e-9)
            writer.close(complete=True, attrs=timing)
    if writer.skipped:
        warnings.warn(
            f"{len(writer.skipped)} of {len(rows)} samples skipped (first: "
            f"{writer.skipped[0]['reason']}); the store lists them under /skipped",
            stacklevel=2,
        )
    return FeatureStore(path)


def extract_from_config(
    config: str | os.PathLike | Mapping[str, Any] | Spec, overrides: Iterable[str] = ()
) -> dict[str, FeatureStore]:
    """Run the extraction a config describes; one complete store per split.

    ``config`` is a YAML path, a mapping, or a loaded :class:`~featcache.spec.Spec`;
    ``overrides`` are ``key.sub=value`` strings applied first. Every split's output path
    is checked before any work starts.
    """
    from featcache.backbones import build_backbone
    from featcache.sources import build_source

    spec = config if isinstance(config, Spec) else load_config(config, overrides)
    for split in spec.data.splits:  # fail before any work on a store made differently
        path = spec.store_path(split)
        key = stored_resume_key(path) if path.exists() else None
        if key is None or key.get("config_fingerprint") != fingerprint(spec):
            check_output_path(path, spec.output.overwrite)
    backbone = build_backbone(spec.model, spec.preprocess, seed=spec.runtime.seed)
    sources = {
        split: build_source(spec.data, split, backbone.transform, backbone.decode_size)
        for split in spec.data.splits
    }
    options = {
        **dataclasses.asdict(spec.loader),
        **dataclasses.asdict(spec.store),
        **dataclasses.asdict(spec.runtime),
        "overwrite": spec.output.overwrite,
    }
    rank = current_rank()
    stores = {}
    for split, source in sources.items():
        provenance = {
            "config": to_dict(spec),
            "config_fingerprint": fingerprint(spec),
            "weights": backbone.weights,
            "split": split,
            "source": {"kind": spec.data.source, "split": spec.data.splits[split]},
        }
        arguments = dict(
            provenance=provenance,
            dataset_fingerprint=source.fingerprint(content=spec.data.content_hash),
            **options,
        )
        path = spec.store_path(split)
        if rank is None:
            stores[split] = extract(backbone.model, source, spec.layers, path, **arguments)
        else:
            stores[split] = _extract_shard(
                backbone.model, source, spec.layers, path, rank, arguments
            )
    return stores


def _extract_shard(
    model: nn.Module,
    source: Dataset,
    layers: Sequence[LayerSpec],
    path: Path,
    rank: Rank,
    arguments: dict[str, Any],
) -> FeatureStore:
    """This rank's block into its shard; then rank 0 writes the store over all shards."""
    world = rank.world_size
    overwrite = arguments["overwrite"]
    done_key = {
        "config_fingerprint": arguments["provenance"]["config_fingerprint"],
        "world_size": world,
    }
    if path.exists() and not overwrite and stored_resume_key(path) == done_key:
        return FeatureStore(path)
    check_other_world_sizes(path, world, overwrite)
    if overwrite and rank.is_main:
        remove_store(path)
    num_rows, batch_size = _length(source), arguments["batch_size"]
    blocks = [block(num_rows, batch_size, r, world) for r in range(world)]
    if blocks[rank.rank]:
        shard_arguments = dict(
            arguments,
            device=rank.device(arguments["device"]),
            progress=arguments["progress"] and rank.is_main,
        )
        extract(
            model,
            source,
            layers,
            shard_path(path, rank.rank, world),
            rows=blocks[rank.rank],
            **shard_arguments,
        )
    rank.barrier()
    if rank.is_main:
        shards = [shard_path(path, r, world) for r in range(world) if blocks[r]]
        combine_shards(path, shards, {"resume_key": done_key})
    rank.barrier()
    return FeatureStore(path)


def _length(dataset: Dataset) -> int:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError("the dataset has no len(); featcache needs a map-style dataset") from None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _split_sample(sample: Any) -> tuple[Any, Any]:
    if isinstance(sample, (tuple, list)):
        return sample[0], (sample[1] if len(sample) > 1 else None)
    return sample, None


def _first_sample(dataset: Dataset) -> tuple[Any, Any] | None:
    """The first item, to check its type; None when it cannot be read (the run reports it)."""
    try:
        return _split_sample(dataset[0])
    except Exception:
        return None


class _Indexed(Dataset):
    """The source rows in ``rows``, as ``(image or None, label, row, error)``.

    A sample that cannot be read comes back with image None and the reason in ``error``
    instead of raising in a worker process, so the policy is applied in one place (the
    run loop) and the message stays one line. ``label`` is -1 when there is none.
    """

    def __init__(self, dataset: Dataset, rows: range):
        self.dataset = dataset
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, j: int) -> tuple[Any, int, int, str]:
        i = self.rows[j]
        try:
            image, label = _split_sample(self.dataset[i])
            return image, -1 if label is None else int(label), i, ""
        except Exception as exc:
            reason = str(exc) if isinstance(exc, FeatcacheError) else _one_line(exc)
            return None, -1, i, reason or type(exc).__name__


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclasses.dataclass
class _Loaded:
    """One batch from the loader: the readable samples stacked, the others listed."""

    images: torch.Tensor | None  # [B, C, H, W], None when no sample of the batch was read
    labels: torch.Tensor  # [B] int64, -1 where there is no label
    rows: torch.Tensor  # [B] int64 source positions
    failed: list[tuple[int, str]]  # (source position, reason)
    error: str = ""  # a problem with the batch as a whole (set in a worker, raised in main)


def _collate(samples: list[tuple[Any, int, int, str]]) -> _Loaded:
    good = [s for s in samples if not s[3]]
    failed = [(s[2], s[3]) for s in samples if s[3]]
    rows = torch.tensor([s[2] for s in good], dtype=torch.long)
    labels = torch.tensor([s[1] for s in good], dtype=torch.long)
    if not good:
        return _Loaded(None, labels, rows, failed)
    shapes = {tuple(s[0].shape) for s in good if isinstance(s[0], torch.Tensor)}
    if len(shapes) > 1:
        a, b = sorted(shapes)[:2]
        return _Loaded(
            None,
            labels,
            rows,
            failed,
            f"images of different sizes in one batch ({list(a)} and {list(b)}); set "
            "preprocess.crop (or give the dataset a transform with a fixed output size)",
        )
    return _Loaded(torch.utils.data.default_collate([s[0] for s in good]), labels, rows, failed)


def _num_workers(setting: int | str, num_rows: int, batch_size: int) -> int:
    if setting != "auto":
        return int(setting)
    if num_rows <= 2 * batch_size:
        return 0  # starting workers costs more than it saves on a couple of batches
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(4, cpus or 1)


@contextlib.contextmanager
def _started(loader: DataLoader) -> Iterator[Iterator[Any]]:
    """The loader's iterator, with its workers started now and always shut down.

    Workers start before the store file is opened, so forked workers never inherit its
    descriptor (which would keep the file locked after a failure).
    """
    batches = iter(loader)
    try:
        yield batches
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)  # multi-process iterators
        if shutdown is not None:
            shutdown()


def _run_loop(
    model: nn.Module,
    batches: Iterator[Any],
    taps: Sequence[Tap],
    writer: StoreWriter,
    ids: Sequence[str],
    run: RunOptions,
    layout: Layout,
    pin: bool,
    done_before: int = 0,
) -> dict[str, float]:
    """Runs every batch (``done_before`` rows were written by an earlier run); returns
    where the time went."""
    runtime = run.runtime
    device, memory_format = layout.device, layout.memory_format
    was_training = model.training
    model.eval()
    model.to(device=device, memory_format=memory_format)
    feature_attrs = {
        tap.key: {"module": tap.module_name, "capture": tap.capture, "reduce": tap.reduce}
        | ({"target": str(tap.target)} if tap.capture == "grad" else {})
        for tap in taps
    }
    bar = tqdm(
        total=writer.capacity,
        initial=done_before,
        unit="img",
        desc=writer.path.name,
        disable=not runtime.progress,
        dynamic_ncols=True,
    )
    # On CUDA, captured batches are copied into reused pinned buffers without blocking.
    host_buffers = (
        _HostBuffers(MAX_PENDING_BATCHES + 2, pin=True) if device.type == "cuda" else None
    )
    timing = {"seconds_waiting_for_data": 0.0, "seconds_in_model": 0.0}
    start = time.perf_counter()
    try:
        convert = functools.partial(to_store_dtype, dtype=run.store.dtype)
        with TapSet(model, taps, convert=convert) as tapset, _WriterThread(writer) as sink:
            if runtime.compile:
                tapset.forward = torch.compile(model)
            waiting_since = time.perf_counter()
            for loaded in batches:
                computing_since = time.perf_counter()
                timing["seconds_waiting_for_data"] += computing_since - waiting_since
                if loaded.error:
                    raise ConfigError(loaded.error)
                skipped = [_skip_record(i, ids[i], reason) for i, reason in loaded.failed]
                if loaded.failed and run.loader.on_error == "fail":
                    i, reason = loaded.failed[0]
                    raise FeatcacheError(
                        f"{reason} (sample {ids[i]}); set loader.on_error=skip to skip "
                        "unreadable samples"
                    )
                batch = _Batch(loaded.rows.numpy(), [], loaded.labels.numpy(), {}, None, skipped)
                if loaded.images is not None:
                    _forward(tapset, loaded, batch, layout, pin, run.store, ids, host_buffers)
                batch.ids = [ids[i] for i in batch.index]
                timing["seconds_in_model"] += time.perf_counter() - computing_since
                sink.put(batch, feature_attrs)
                bar.update(len(batch.index) + len(skipped))
                bar.set_postfix_str(_bar_note(timing, sink.waited, len(writer.skipped)), False)
                waiting_since = time.perf_counter()
    finally:
        bar.close()
        model.train(was_training)
        if layout.channels_last:  # hand the model back in the layout it came in
            model.to(memory_format=torch.contiguous_format)
    timing["seconds_waiting_for_disk"] = sink.waited
    timing["seconds"] = time.perf_counter() - start
    return timing


def _forward(
    tapset: TapSet,
    loaded: _Loaded,
    batch: _Batch,
    layout: Layout,
    pin: bool,
    store: StoreSpec,
    ids: Sequence[str],
    host_buffers: _HostBuffers | None,
) -> None:
    """Run one batch through the taps and fill ``batch`` with what goes to the writer."""
    device, amp = layout.device, layout.amp
    assert loaded.images is not None
    images = loaded.images.to(device, non_blocking=pin, memory_format=layout.memory_format)
    autocast = torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
    # Gradient taps need autograd; everything else runs in inference mode.
    mode = torch.enable_grad() if tapset.needs_grad else torch.inference_mode()
    extra = {"labels": loaded.labels} if tapset.needs_grad else {}
    with mode, autocast:
        captured = tapset.run(images, **extra)
        keep = _check_finite(captured, loaded.rows, ids, store, batch.skipped)
        if keep is not None:
            captured = {k: v[keep.to(v.device)] for k, v in captured.items()}
            batch.index, batch.labels = batch.index[keep.numpy()], batch.labels[keep.numpy()]
    if host_buffers is None:
        batch.features = captured  # already fresh CPU tensors
        return
    batch.features, batch.release = host_buffers.copy(captured)
    batch.ready = torch.cuda.Event()
    batch.ready.record()


def _bar_note(timing: Mapping[str, float], disk_wait: float, skipped: int) -> str:
    """Where the time goes, so users see what bounds them (decoding, the model, the disk)."""
    data, model = timing["seconds_waiting_for_data"], timing["seconds_in_model"]
    total = max(data + model + disk_wait, 1e-9)
    note = f"data {100 * data / total:.0f}% model {100 * model / total:.0f}%"
    if disk_wait > 0.05 * total:
        note += f" disk {100 * disk_wait / total:.0f}% (the disk is the bottleneck)"
    if skipped:
        note += f" skipped {skipped}"
    return note


class _HostBuffers:
    """Reused host buffers (pinned on CUDA) that captured batches are copied into.

    ``copy`` returns views of a free set of buffers and a callable that gives the set
    back; the writer thread calls it once it has staged the rows. At most ``count`` sets
    exist, so host memory for batches in flight stays bounded.
    """

    def __init__(self, count: int, pin: bool):
        self.count = count
        self.pin = pin
        self.made = 0
        self.free: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()

    def copy(
        self, captured: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        buffers = self._take(captured)
        views = {}
        for key, value in captured.items():
            view = buffers[key][: len(value)]
            view.copy_(value, non_blocking=self.pin)
            views[key] = view
        return views, lambda: self.free.put(buffers)

    def _take(self, captured: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            buffers = self.free.get_nowait()
        except queue.Empty:
            if self.made >= self.count:
                buffers = self.free.get()  # every set is in flight: wait for the writer
            else:
                self.made += 1
                return self._allocate(captured)
        fits = all(
            key in buffers
            and buffers[key].shape[1:] == value.shape[1:]
            and len(buffers[key]) >= len(value)
            for key, value in captured.items()
        )
        return buffers if fits else self._allocate(captured)

    def _allocate(self, captured: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            key: torch.empty(value.shape, dtype=value.dtype, pin_memory=self.pin)
            for key, value in captured.items()
        }


def _skip_record(row: int, sample_id: str, reason: str) -> dict[str, Any]:
    return {"index": int(row), "id": str(sample_id), "reason": reason}


def _check_finite(
    captured: Mapping[str, torch.Tensor],
    index: torch.Tensor,
    ids: Sequence[str],
    store: StoreSpec,
    skipped: list[dict[str, Any]],
) -> torch.Tensor | None:
    """Apply ``store.on_nonfinite``; returns a row mask when rows must be dropped."""
    if store.on_nonfinite == "keep":
        return None
    bad_by_layer = {
        key: _nonfinite_rows(value.view(torch.bfloat16) if store.dtype == "bfloat16" else value)
        for key, value in captured.items()
    }
    bad_rows = torch.stack(list(bad_by_layer.values())).any(dim=0)
    if not bad_rows.any():
        return None
    first = int(bad_rows.nonzero()[0])
    layers = [key for key, bad in bad_by_layer.items() if bad[first]]
    if store.on_nonfinite == "fail":
        hint = " (float16 overflows above 65504: bfloat16 or float32 may fit)"
        raise FeatcacheError(
            f"non-finite values (NaN or Inf) in layer {layers[0]} for sample "
            f"{ids[int(index[first])]}{hint if store.dtype == 'float16' else ''}; set "
            "store.on_nonfinite=skip to leave such rows out or keep to store them"
        )
    for j in bad_rows.nonzero().flatten().tolist():
        names = ", ".join(key for key, bad in bad_by_layer.items() if bad[j])
        row = int(index[j])
        skipped.append(_skip_record(row, ids[row], f"non-finite values in layer {names}"))
    return ~bad_rows


def _nonfinite_rows(value: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool on the CPU: rows of ``value`` ``[B, ...]`` holding a NaN or an Inf.

    A row's sum is non-finite whenever the row is, so one reduction pass finds the
    suspects; only those are checked element by element (a finite row whose sum
    overflows is not reported).
    """
    flat = value.flatten(1)
    wide = torch.float64 if flat.dtype in (torch.float32, torch.float64) else torch.float32
    suspect = ~torch.isfinite(flat.sum(dim=1, dtype=wide))
    if not suspect.any():
        return torch.zeros(len(flat), dtype=torch.bool)
    bad = suspect.clone()
    bad[suspect] = ~torch.isfinite(flat[suspect]).all(dim=1)
    return bad.cpu()


@dataclasses.dataclass
class _Batch:
    index: np.ndarray
    ids: list[str]
    labels: np.ndarray
    features: dict[str, torch.Tensor]
    ready: Any  # a CUDA event to wait on before reading ``features``, or None
    skipped: list[dict[str, Any]]  # samples of this batch left out, with the reason
    release: Callable[[], None] | None = None  # hands host buffers back once written


class _WriterThread:
    """A thread that appends queued batches to a :class:`StoreWriter`.

    ``put`` blocks only while :data:`MAX_PENDING_BATCHES` batches are waiting, and
    re-raises in the caller any error the thread hit. Leaving the ``with`` block writes
    what is queued (unless the thread itself failed) and joins the thread.
    """

    def __init__(self, writer: StoreWriter, max_pending: int = MAX_PENDING_BATCHES):
        self.writer = writer
        self.queue: queue.Queue[tuple[_Batch, Any] | None] = queue.Queue(max_pending)
        self.error: BaseException | None = None
        self.waited = 0.0  # seconds the forward spent blocked on a full queue
        self.thread = threading.Thread(target=self._work, name="featcache-writer", daemon=True)

    def __enter__(self) -> _WriterThread:
        self.thread.start()
        return self

    def put(self, batch: _Batch, feature_attrs: Any) -> None:
        self._raise()
        start = time.perf_counter()
        while True:
            try:
                self.queue.put((batch, feature_attrs), timeout=0.5)
                break
            except queue.Full:
                self._raise()
        self.waited += time.perf_counter() - start

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            batch, feature_attrs = item
            try:
                if self.error is None:  # after a failure, only drain
                    self._write(batch, feature_attrs)
            except BaseException as exc:  # handed to the main thread
                self.error = _writer_error(exc, self.writer.path)
            finally:
                if batch.release is not None:
                    batch.release()  # the rows are staged: the host buffers can be reused

    def _write(self, batch: _Batch, feature_attrs: Any) -> None:
        if batch.ready is not None:
            batch.ready.synchronize()
        features = {key: _to_numpy(value) for key, value in batch.features.items()}
        self.writer.append(
            batch.index, batch.ids, batch.labels, features, feature_attrs, skipped=batch.skipped
        )

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # Batches already queued are still written when the forward side fails: they are
        # good rows, and keeping them shortens the resume.
        self.queue.put(None)
        self.thread.join()
        if exc_type is None:
            self._raise()


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.int16:  # bfloat16 bits
        return tensor.numpy().view(np.uint16)
    return tensor.numpy()


def _writer_error(exc: BaseException, path: Path) -> BaseException:
    if isinstance(exc, FeatcacheError):
        return exc
    if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
        return FeatcacheError(f"disk full while writing {path}; free space and rerun")
    error = FeatcacheError(f"writing {path} failed: {exc}")
    error.__cause__ = exc
    return error
