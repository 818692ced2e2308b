"""The writer thread and the reused host buffers between the forward and the store.

On CUDA, captured values are copied without blocking into :class:`HostBuffers` (pinned
memory reused batch after batch) and handed back once the writer has staged the rows.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from featcache.errors import FeatcacheError
from featcache.store import StoreWriter
from featcache.store.codec import as_array, dequantize
from featcache.store.codec import values as codec_values

MAX_PENDING_BATCHES = 4  # batches between the forward and the writer thread


@dataclasses.dataclass
class CapturedBatch:
    """What the writer thread appends: rows, ids, labels and the captured values."""

    index: np.ndarray
    ids: list[str]
    labels: np.ndarray
    features: dict[str, torch.Tensor]
    ready: Any  # a CUDA event to wait on before reading ``features``, or None
    skipped: list[dict[str, Any]]  # samples of this batch left out, with the reason
    release: Callable[[], None] | None = None  # hands host buffers back once written
    # Per-token rows: the layers packed as [tokens, ...], each row's token count [rows]
    # and, when the inputs had them, the token ids [tokens].
    ragged: frozenset[str] = frozenset()
    lengths: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    # int8 stores: each layer's float32 scales, one per row [rows] (per token [tokens])
    scales: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def own(self) -> None:
        """Copy the values (codes and scales) out of reused host buffers and hand the
        buffers back: for a sink that keeps the batch after ``put``."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.release is not None:
            self.features = {key: value.clone() for key, value in self.features.items()}
            self.scales = {key: value.clone() for key, value in self.scales.items()}
            self.release()
        self.release = self.ready = None

    def values(self, key: str, dtype: str) -> torch.Tensor:
        """Layer ``key``'s captured values as float32 (int8 codes dequantized)."""
        value = self.features[key]
        if key in self.scales:
            return dequantize(value, self.scales[key])
        return codec_values(value, dtype).float()


class WriterThread:
    """A thread that opens the store (``open_writer``: overlapping the first forwards) and
    appends queued batches to it; ``put`` re-raises any error the thread hit. On leaving
    the ``with`` block a failed store is closed incomplete (kept for a resume), else it
    stays open in :attr:`writer` for the caller to complete."""

    def __init__(
        self,
        open_writer: Callable[[], StoreWriter],
        path: Path,
        max_pending: int = MAX_PENDING_BATCHES,
    ):
        self.open_writer = open_writer
        self.path = path
        self.writer: StoreWriter | None = None
        self.queue: queue.Queue[tuple[CapturedBatch, Any] | None] = queue.Queue(max_pending)
        self.error: BaseException | None = None
        self.waited = 0.0  # seconds the forward spent blocked on a full queue
        self.thread = threading.Thread(target=self._work, name="featcache-writer", daemon=True)

    def __enter__(self) -> WriterThread:
        self.thread.start()
        return self

    @property
    def skipped(self) -> int:
        """Samples left out so far (including those an earlier run recorded)."""
        return len(self.writer.skipped) if self.writer is not None else 0

    def put(self, batch: CapturedBatch, feature_attrs: Any) -> None:
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
        try:
            self.writer = self.open_writer()
        except BaseException as exc:  # handed to the main thread
            self.error = writer_error(exc, self.path)
        while (item := self.queue.get()) is not None:
            batch, feature_attrs = item
            try:
                if self.error is None:  # after a failure, only drain
                    self._write(batch, feature_attrs)
            except BaseException as exc:  # handed to the main thread
                self.error = writer_error(exc, self.path)
            finally:
                if batch.release is not None:
                    batch.release()  # the rows are staged: the host buffers can be reused

    def _write(self, batch: CapturedBatch, feature_attrs: Any) -> None:
        assert self.writer is not None
        if batch.ready is not None:
            batch.ready.synchronize()
        features = {key: as_array(value) for key, value in batch.features.items()}
        self.writer.append(
            batch.index,
            batch.ids,
            batch.labels,
            features,
            feature_attrs,
            skipped=batch.skipped,
            lengths=batch.lengths,
            token_ids=batch.token_ids,
            ragged=batch.ragged,
            scales={key: value.numpy() for key, value in batch.scales.items()},
        )

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # Batches already queued are written even when the forward failed: a shorter resume.
        self.queue.put(None)
        self.thread.join()
        failed = exc_type is not None or self.error is not None
        if failed and self.writer is not None:
            self.writer.close()  # incomplete: progress marked, partial file kept
        if exc_type is None:
            self._raise()


class HostBuffers:
    """At most ``count`` sets of reused host buffers (pinned on CUDA) that captured
    batches are copied into, so host memory for batches in flight stays bounded."""

    def __init__(self, count: int, pin: bool):
        self.count = count
        self.pin = pin
        self.made = 0
        self.free: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()

    def copy(
        self, captured: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        buffers = self._take(captured)
        views = {
            key: buffers[key][: len(value)].copy_(value, non_blocking=self.pin)
            for key, value in captured.items()
        }
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


def writer_error(exc: BaseException, path: Path) -> BaseException:
    if isinstance(exc, FeatcacheError):
        return exc
    if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
        return FeatcacheError(f"disk full while writing {path}; free space and rerun")
    error = FeatcacheError(f"writing {path} failed: {exc}")
    error.__cause__ = exc
    return error
