"""The run loop: batches from the loader, through the hooked forward, to the writer thread.

Reductions happen on the device inside the hooks and finished batches go through a
bounded queue to the writer thread, so the forward waits on the disk only when the
queue is full, and memory stays flat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from featcache.capture.memory import freed_memory_kept
from featcache.capture.runtime import placed
from featcache.capture.taps import Tap, TapSet, zero_gradient_note
from featcache.config.spec import StoreSpec
from featcache.errors import ConfigError, FeatcacheError, FeatcacheWarning, first_line
from featcache.extraction.batches import Batch, pins
from featcache.extraction.bucketing import WindowReorder
from featcache.extraction.nonfinite import check_finite, skip_record
from featcache.extraction.plan import ExtractionPlan, RunOptions
from featcache.extraction.writer_thread import MAX_PENDING_BATCHES, CapturedBatch, HostBuffers
from featcache.store.codec import QUANTIZED, encode, quantize, scales_name


class Sink(Protocol):
    """Where the run loop hands each finished batch: the
    :class:`~featcache.extraction.writer_thread.WriterThread`, or a dry run's recorder."""

    path: Path
    waited: float  # seconds the forward spent blocked on the sink

    @property
    def skipped(self) -> int: ...

    def put(self, batch: CapturedBatch, feature_attrs: Any) -> None: ...


def feature_attrs(
    taps: Sequence[Tap], observed: Mapping[str, Mapping[str, str]] | None = None
) -> dict[str, dict[str, str]]:
    """The attributes of each layer's dataset: what was captured and how it was reduced,
    and what the forward showed of it (``observed``, see :attr:`TapSet.observed`)."""
    attrs = {}
    for tap in taps:
        attrs[tap.key] = {"module": tap.module_name, "capture": tap.capture, "reduce": tap.reduce}
        if tap.capture == "grad":
            attrs[tap.key]["target"] = str(tap.target)
        seen = (observed or {}).get(tap.key, {})
        attrs[tap.key].update({name: value for name, value in seen.items() if value})
    return attrs


def run_rows(
    plan: ExtractionPlan,
    batches: Iterator[Batch],
    sink: Sink,
    *,
    taps: Sequence[Tap] | None = None,
    total: int | None = None,
    done_before: int = 0,
    reorder: WindowReorder | None = None,
    options: RunOptions | None = None,
    warn: bool = True,
) -> dict[str, float]:
    """Run ``batches`` (from `loaded_batches`) through ``plan``'s model, capturing
    ``taps`` (default the plan's), into ``sink``; ``options`` replace the plan's for this
    run (a dry run's batch size). The progress bar counts ``total`` rows (default the
    plan's), ``done_before`` of them already done. ``reorder`` puts length-bucketed
    batches back in source order; ``warn`` warns of gradient layers that stored only
    zeros. Returns where the time went, in seconds."""
    options = options or plan.options
    loader, store, runtime = options.loader, options.store, options.runtime
    taps = plan.taps if taps is None else taps
    model, ids, layout = plan.model, plan.ids, plan.layout
    device = layout.device
    pin = pins(loader.pin_memory, device)
    was_training = model.training
    model.eval()
    attrs: dict[str, dict[str, str]] | None = None  # known once the first batch has run
    bar = tqdm(
        total=len(plan.rows) if total is None else total,
        initial=done_before,
        unit=plan.unit,
        desc=sink.path.name,
        disable=not runtime.progress,
        dynamic_ncols=True,
    )
    # On CUDA, captured batches are copied into reused pinned buffers without blocking.
    # (Bucketed windows are merged first, from the device, so they take no host buffers.)
    cuda = device.type == "cuda" and reorder is None
    host_buffers = HostBuffers(MAX_PENDING_BATCHES + 2, pin=True) if cuda else None
    timing = {"seconds_waiting_for_data": 0.0, "seconds_in_model": 0.0}
    try:
        convert = functools.partial(encode, dtype=store.dtype)
        with (
            freed_memory_kept(device),
            placed(model, layout, lazy=not runtime.compile),
            TapSet(model, taps, convert=convert) as tapset,
        ):
            if runtime.compile:
                tapset.forward = torch.compile(model)
            waiting_since = time.perf_counter()
            for batch in batches:
                computing_since = time.perf_counter()
                timing["seconds_waiting_for_data"] += computing_since - waiting_since
                if batch.error:
                    raise ConfigError(batch.error)
                skipped = [skip_record(i, ids[i], reason) for i, reason in batch.failed]
                if batch.failed and loader.on_error == "fail":
                    i, reason = batch.failed[0]
                    raise FeatcacheError(
                        f"{reason} (sample {ids[i]}); set loader.on_error=skip to skip "
                        "unreadable samples"
                    )
                captured = CapturedBatch(
                    batch.rows.numpy(), [], batch.labels.numpy(), {}, None, skipped
                )
                if batch.inputs is not None:
                    forward(tapset, batch, captured, plan, store, pin, host_buffers)
                rows_done = len(captured.index) + len(captured.skipped)
                timing["seconds_in_model"] += time.perf_counter() - computing_since
                window = captured if reorder is None else reorder.add(captured)
                if window is not None:  # a bucketed window goes to the sink once complete
                    window.ids = [ids[i] for i in window.index]
                    if attrs is None:
                        attrs = feature_attrs(taps, tapset.observed)
                    sink.put(window, attrs)
                bar.update(rows_done)
                bar.set_postfix_str(_bar_note(timing, sink.waited, sink.skipped), False)
                waiting_since = time.perf_counter()
            if warn and attrs is not None:  # a batch ran
                for tap in tapset.zero_gradients():
                    note = zero_gradient_note(tap, "every gradient this run stored")
                    warnings.warn(note, FeatcacheWarning, stacklevel=2)
    finally:
        bar.close()
        model.train(was_training)
    return timing


def forward(
    tapset: TapSet,
    batch: Batch,
    captured: CapturedBatch,
    plan: ExtractionPlan,
    store: StoreSpec,
    pin: bool,
    host_buffers: HostBuffers | None,
) -> None:
    """Run one batch through the taps and fill ``captured`` with what goes to the writer.
    A tensor input is the model's one positional argument, a mapping of tensors its
    keyword arguments."""
    layout = plan.layout
    device, amp = layout.device, layout.amp
    on_device = batch.to(device, non_blocking=pin, memory_format=layout.memory_format)
    inputs = on_device.inputs
    image_size: tuple[int, int] | None = None
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 4:  # [B, C, H, W]
        image_size = (int(inputs.shape[2]), int(inputs.shape[3]))
    input_tokens: int | None = None
    token_ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if isinstance(token_ids, torch.Tensor) and token_ids.dim() == 2:
        input_tokens = int(token_ids.shape[1])
    context = dataclasses.replace(
        plan.tokens,
        attention_mask=on_device.attention_mask,
        batch_size=len(batch.rows),
        image_size=image_size,
        input_tokens=input_tokens,
    )
    autocast = torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
    # Gradient taps need autograd; everything else runs in inference mode.
    mode = torch.enable_grad() if tapset.needs_grad else torch.inference_mode()
    extra: dict[str, Any] = {"labels": batch.labels} if tapset.needs_grad else {}
    with mode, autocast:
        try:
            if isinstance(inputs, dict):
                values = tapset.run(context=context, **extra, **inputs)
            else:
                values = tapset.run(inputs, context=context, **extra)
        except (FeatcacheError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # the model's own complaint about its input
            shapes: object
            if isinstance(inputs, dict):
                shapes = {key: list(value.shape) for key, value in inputs.items()}
                check = "the tokenizer (data.max_length) or the dataset's token inputs"
            else:
                shapes = list(getattr(inputs, "shape", []))
                check = "the preprocessing (preprocess.resize, crop) or the dataset"
            why = first_line(exc, with_type=True)
            raise FeatcacheError(
                f"the model fails on a batch of inputs {shapes} ({why}); check that {check} "
                "gives inputs the model takes"
            ) from exc
        values, captured.ragged, lengths, token_ids = pack_tokens(values, tapset.taps, on_device)
        keep = check_finite(
            values, batch.rows, plan.ids, store, captured.skipped, lengths, captured.ragged
        )
        if keep is not None:  # rows with non-finite values are left out, tokens and all
            token_keep = keep if lengths is None else keep.repeat_interleave(lengths)
            values = {
                k: v[(token_keep if k in captured.ragged else keep).to(v.device)]
                for k, v in values.items()
            }
            captured.index = captured.index[keep.numpy()]
            captured.labels = captured.labels[keep.numpy()]
            lengths = None if lengths is None else lengths[keep]
            token_ids = None if token_ids is None else token_ids[token_keep]
        captured.lengths = None if lengths is None else lengths.numpy()
        captured.token_ids = None if token_ids is None else token_ids.numpy()
        scales: dict[str, torch.Tensor] = {}
        if store.dtype in QUANTIZED:  # rows known finite now: codes and a scale per row
            for key, value in values.items():
                values[key], scales[key] = quantize(value)
    if host_buffers is None:
        captured.features, captured.scales = values, scales  # already fresh CPU tensors
        return
    named = {**values, **{scales_name(key): scale for key, scale in scales.items()}}
    copied, captured.release = host_buffers.copy(named)
    captured.features = {key: copied[key] for key in values}
    captured.scales = {key: copied[scales_name(key)] for key in scales}
    captured.ready = torch.cuda.Event()
    captured.ready.record()


def pack_tokens(
    values: Mapping[str, torch.Tensor], taps: Sequence[Tap], batch: Batch
) -> tuple[dict[str, torch.Tensor], frozenset[str], torch.Tensor | None, torch.Tensor | None]:
    """Per-token rows out of a padded token batch: each ``reduce: none`` value whose
    first two axes are the mask's ``[B, T]`` becomes ``[real tokens, ...]``, row by row.
    Returns the values, the keys so packed, and when there are any, each row's token
    count (int64 ``[B]``) and the tokens' input ids (int64 ``[tokens]``, None without
    ``input_ids``), both on the CPU."""
    packed = dict(values)
    if batch.attention_mask is None:
        return packed, frozenset(), None, None
    real = batch.attention_mask != 0
    ragged = set()
    for tap in taps:
        value = values[tap.key]
        if tap.reduce == "none" and value.dim() >= 3 and value.shape[:2] == real.shape:
            packed[tap.key] = value[real]
            ragged.add(tap.key)
    if not ragged:
        return packed, frozenset(), None, None
    input_ids = batch.inputs.get("input_ids") if isinstance(batch.inputs, dict) else None
    token_ids = None if input_ids is None else input_ids[real].cpu()
    return packed, frozenset(ragged), real.sum(dim=1).cpu(), token_ids


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
