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
import hashlib
import os
import platform
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

import featcache
from featcache.errors import ConfigError, FeatcacheError
from featcache.spec import (
    LayerSpec,
    LoaderSpec,
    RuntimeSpec,
    Spec,
    StoreSpec,
    fingerprint,
    load_config,
    to_dict,
)
from featcache.store import FeatureStore, StoreWriter, check_output_path, to_store_dtype
from featcache.taps import Tap, TapSet, resolve_taps

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
    **options: Any,
) -> FeatureStore:
    """Run ``model`` over ``dataset`` and store the activations of ``layers`` at ``path``.

    ``dataset`` is a map-style dataset yielding ``(image_tensor [3, H, W], label)`` like
    torchvision datasets (a bare tensor, or a label of None, means no labels). Rows keep
    the dataset's order. ``ids`` (default: the dataset's ``ids`` attribute, else
    ``"<DatasetClass>:<index>"``) and ``class_names`` go into the store. ``options`` are
    the config keys of the loader, store and runtime sections (``batch_size``,
    ``num_workers``, ``dtype``, ``compression``, ``chunk_rows``, ``device``, ``amp``,
    ``channels_last``, ``progress`` ...) plus ``overwrite``.

    The model is put in eval mode and moved to the device (its train/eval flag is
    restored afterwards). Returns the complete store, opened for reading.
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
    if class_names is None:
        class_names = getattr(dataset, "class_names", None) or getattr(dataset, "classes", None)
    first_image, first_label = _split_sample(dataset[0])
    if not isinstance(first_image, torch.Tensor) or first_image.dim() != 3:
        raise ConfigError(
            f"dataset items must be image tensors [C, H, W], got {_describe(first_image)}; "
            "give the dataset a transform that ends in a tensor (e.g. weights.transforms())"
        )
    has_labels = getattr(dataset, "has_labels", None)
    if has_labels is None:
        has_labels = first_label is not None
    device = resolve_device(run.runtime.device)
    attrs = dict(provenance or {})
    attrs.update(
        {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": library_versions(),
            "device": str(device),
            "dataset_fingerprint": ids_fingerprint(ids),
            "store_dtype": run.store.dtype,
            "taps": [dataclasses.asdict(tap) for tap in taps],
        }
    )
    if class_names is not None:
        attrs["class_names"] = [str(name) for name in class_names]
    check_output_path(Path(path), run.overwrite)  # before any work starts
    pin = device.type == "cuda" if run.loader.pin_memory == "auto" else bool(run.loader.pin_memory)
    loader = DataLoader(
        _Indexed(dataset),
        batch_size=run.loader.batch_size,
        shuffle=False,
        num_workers=_num_workers(run.loader.num_workers, num_rows, run.loader.batch_size),
        pin_memory=pin,
    )
    with _started(loader) as batches:
        writer = StoreWriter(
            path,
            num_rows,
            dtype=run.store.dtype,
            compression=run.store.compression,
            chunk_rows=run.store.chunk_rows,
            has_labels=has_labels,
            attrs=attrs,
            overwrite=run.overwrite,
        )
        with writer:
            seconds = _run_loop(model, batches, taps, writer, ids, run, device, pin)
            writer.close(
                complete=True,
                attrs={"seconds": seconds, "images_per_second": num_rows / max(seconds, 1e-9)},
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
    for split in spec.data.splits:
        check_output_path(spec.store_path(split), spec.output.overwrite)
    backbone = build_backbone(spec.model, spec.preprocess, seed=spec.runtime.seed)
    sources = {
        split: build_source(spec.data, split, backbone.transform) for split in spec.data.splits
    }
    options = {
        **dataclasses.asdict(spec.loader),
        **dataclasses.asdict(spec.store),
        **dataclasses.asdict(spec.runtime),
        "overwrite": spec.output.overwrite,
    }
    stores = {}
    for split, source in sources.items():
        provenance = {
            "config": to_dict(spec),
            "config_fingerprint": fingerprint(spec),
            "weights": backbone.weights,
            "split": split,
            "source": {"kind": spec.data.source, "split": spec.data.splits[split]},
        }
        stores[split] = extract(
            backbone.model,
            source,
            spec.layers,
            spec.store_path(split),
            provenance=provenance,
            **options,
        )
    return stores


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; anything else is checked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(
            f"runtime.device {name!r} is not a device name (auto, cpu, cuda)"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device is {name!r} but CUDA is not available; use auto or cpu")
    return device


def library_versions() -> dict[str, str]:
    import torchvision

    return {
        "featcache": featcache.__version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def ids_fingerprint(ids: Sequence[str]) -> str:
    """sha256 over the row ids in order: same rows, same order, same fingerprint."""
    digest = hashlib.sha256()
    for sample_id in ids:
        digest.update(str(sample_id).encode())
        digest.update(b"\n")
    return digest.hexdigest()


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


class _Indexed(Dataset):
    """Wraps a dataset so each item carries its row number and an int label (-1: none)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        image, label = _split_sample(self.dataset[i])
        return image, -1 if label is None else int(label), i


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
    device: torch.device,
    pin: bool,
) -> float:
    """Runs every batch; returns the seconds the loop took."""
    runtime = run.runtime
    memory_format = torch.channels_last if runtime.channels_last else torch.contiguous_format
    was_training = model.training
    model.eval()
    model.to(device=device, memory_format=memory_format)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(runtime.amp or "")
    feature_attrs = {
        tap.key: {"module": tap.module_name, "capture": tap.capture, "reduce": tap.reduce}
        for tap in taps
    }
    bar = tqdm(
        total=writer.num_rows,
        unit="img",
        desc=writer.path.name,
        disable=not runtime.progress,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    try:
        convert = functools.partial(to_store_dtype, dtype=run.store.dtype)
        with TapSet(model, taps, convert=convert) as tapset, _WriterThread(writer) as sink:
            for images, labels, index in batches:
                images = images.to(device, non_blocking=pin, memory_format=memory_format)
                autocast = (
                    torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
                )
                with torch.inference_mode(), autocast:
                    captured = tapset.run(images)
                    host = {k: v.to("cpu", non_blocking=True) for k, v in captured.items()}
                ready = None
                if device.type == "cuda":
                    ready = torch.cuda.Event()
                    ready.record()
                rows = index.numpy()
                sink.put(
                    _Batch(rows, [ids[i] for i in rows], labels.numpy(), host, ready),
                    feature_attrs,
                )
                bar.update(len(rows))
                if sink.waited > 1.0:
                    bar.set_postfix_str(f"waiting on disk {sink.waited:.0f}s", refresh=False)
    finally:
        bar.close()
        model.train(was_training)
    return time.perf_counter() - start


@dataclasses.dataclass
class _Batch:
    index: np.ndarray
    ids: list[str]
    labels: np.ndarray
    features: dict[str, torch.Tensor]
    ready: Any  # a CUDA event to wait on before reading ``features``, or None


class _WriterThread:
    """A thread that appends queued batches to a :class:`StoreWriter`.

    ``put`` blocks only while :data:`MAX_PENDING_BATCHES` batches are waiting, and
    re-raises in the caller any error the thread hit. Leaving the ``with`` block
    drains the queue (or, after an error, abandons it) and joins the thread.
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
            if self.error is not None:
                continue  # drain without writing after a failure
            batch, feature_attrs = item
            try:
                if batch.ready is not None:
                    batch.ready.synchronize()
                features = {key: _to_numpy(value) for key, value in batch.features.items()}
                self.writer.append(batch.index, batch.ids, batch.labels, features, feature_attrs)
            except BaseException as exc:  # handed to the main thread
                self.error = _writer_error(exc, self.writer.path)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None and self.error is None:
            self.error = FeatcacheError("stopped")  # tells the thread to drain only
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
