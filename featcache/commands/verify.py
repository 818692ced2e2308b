"""Prove a store matches the model and data it claims to come from: the file checks
(``--quick``), then a rebuild of the backbone and source that recomputes sampled rows."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.config.recorded import RecordedSpec, recorded_spec
from featcache.config.spec import Spec, load_config
from featcache.errors import ConfigError, CorruptStoreError
from featcache.store import FeatureStore
from featcache.store.checks import has_checksums, scan_chunks
from featcache.store.metadata import is_sealed
from featcache.store.provenance import config_fingerprint as fingerprint
from featcache.store.rows import Known, let_go, rows_of, span_text

if TYPE_CHECKING:  # the file checks (--quick) need no torch: the recomputation imports it
    from featcache.models.backbone import Backbone
    from featcache.sources import SourceDataset

CHUNK_ROWS_FOR_SCAN = 1024


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class VerifyResult:
    path: Path
    checks: list[Check] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # rows recomputed

    @property
    def passed(self) -> bool:
        return all(check.ok for check in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(ok), detail))

    def passed_so_far(self, name: str) -> bool:
        """Whether the check ``name`` ran and passed."""
        return any(check.name == name and check.ok for check in self.checks)


def verify_store(
    path: str | os.PathLike,
    samples: int = 8,
    *,
    seed: int = 0,
    device: str | None = None,
    quick: bool = False,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    trust_factory: bool = False,
) -> VerifyResult:
    """Check the store at ``path``.

    Every run checks what the file alone can prove: completeness, the store key against
    the recorded config, the stored layers, alignment of rows and skips with the source
    rows, unique ids, every chunk's checksum and finiteness. ``quick=True`` stops there
    (it needs neither the weights nor the data). Otherwise the backbone and the source
    are rebuilt, their fingerprints compared, and ``samples`` random rows are recomputed
    besides the first and last (``samples=-1``: every row) on ``device`` (default: the
    config's).

    The rebuild follows the config recorded in the store, or ``config`` (a YAML path or
    a mapping) when given. A store is data: a recorded config that would import and run
    code (``model.factory``) is refused unless ``trust_factory`` is true; see
    [`recorded_code`][featcache.commands.verify.recorded_code].

    Raises:
        ConfigError: a store without a recorded config (and no ``config``), one
            naming code to run without ``trust_factory``, or ``samples`` below -1.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < -1:
        raise ConfigError(
            f"samples must be a number of rows (0 or more) or -1 for every row, got {samples!r}"
        )
    try:
        opened = FeatureStore(path, allow_incomplete=True)
    except CorruptStoreError as exc:  # its metadata cannot be trusted: nothing else can be
        result = VerifyResult(Path(path))
        result.add("metadata", False, str(exc))
        return result
    with opened as store:
        result = VerifyResult(store.path)
        _check_file(result, store)
        if quick or not result.passed_so_far("checksums"):
            return result
        from featcache.capture.selectors import resolve_taps, tap_record
        from featcache.extraction.from_config import build_backbone_for, build_source_for

        rebuilt = _rebuild_spec(store, config, trust_factory)
        spec = rebuilt.spec
        recorded = store.attrs.get("resume_key") or {}
        config_fp = recorded.get("config_fingerprint")
        given = "the given config" if isinstance(config, Mapping) else config
        origin = f"; {rebuilt.where()}" if config is None else f" (rebuilt from {given})"
        detail = f"fingerprint {(config_fp or '?')[:12]}{origin}"
        result.add("config", fingerprint(rebuilt.written) == config_fp, detail)
        backbone = build_backbone_for(spec)
        weights_ok = backbone.weights == recorded.get("weights")
        result.add("weights", weights_ok, _weights_text(backbone.weights))
        taps = [tap_record(tap) for tap in resolve_taps(backbone.model, spec.layers)]
        taps_ok = json.loads(json.dumps(taps)) == recorded.get("taps")
        result.add("taps", taps_ok, ", ".join(tap["key"] for tap in taps))
        split = store.attrs["split"]
        source = build_source_for(spec, split, backbone)
        dataset_fp = source.fingerprint(content=spec.data.content_hash)
        recorded_data = recorded.get("dataset_fingerprint"), recorded.get("source_rows")
        same_data = (dataset_fp, len(source)) == recorded_data
        detail = f"{len(source)} samples, fingerprint {dataset_fp[:12]}"
        result.add("dataset", same_data, detail + ("" if same_data else " (the data changed)"))
        index, ids, labels = store.index, store.ids, store.labels
        _check_matches(result, "ids", index, ids, source.ids)
        source_labels = getattr(source, "labels", None)
        if labels is not None and source_labels is not None:
            _check_matches(result, "labels", index, labels, source_labels)
        if not spec.data.content_hash:  # else the dataset check compares every file's bytes
            _check_stamps(result, store, source, index, ids)
        past = [r for r, i in enumerate(index) if i >= len(source)]  # the data shrank
        if past:
            why = f"rows {_list(past)} are samples past the {len(source)} the source holds now"
            result.add("values", False, f"not recomputed: {why}")
            return result
        runtime = dataclasses.replace(spec.runtime, device=device or spec.runtime.device)
        _recompute(
            result,
            store,
            dataclasses.replace(spec, runtime=runtime),
            backbone,
            source,
            samples=samples,
            seed=seed,
        )
    return result


def _check_matches(
    result: VerifyResult,
    name: str,
    index: np.ndarray,
    stored: Sequence[Any] | np.ndarray,
    current: Sequence[Any] | np.ndarray,
) -> None:
    """Check ``name`` (ids, labels): every row's stored value is the source's at its index."""
    wrong = [r for r, i in enumerate(index) if i >= len(current) or stored[r] != current[i]]
    result.add(name, not wrong, _rows_text(wrong, f"{name} match the source"))


def _check_stamps(
    result: VerifyResult, store: FeatureStore, source: Any, index: np.ndarray, ids: list[str]
) -> None:
    """Compare every row's change stamp with the source's now: one ``stat`` per file."""
    from featcache.extraction.dataset_info import dataset_stamps
    from featcache.sources.stamps import change_report, changed_rows

    stored, current = store.stamps, dataset_stamps(source)
    if current is None:
        return  # the source tells nothing of its rows' bytes (info says so)
    if stored is None:
        result.add("stamps", True, "none recorded (the store predates change stamps)")
        return
    rows = np.array(  # the rows still of their sample (the ids check names the others)
        [r for r, i in enumerate(index) if i < len(source.ids) and source.ids[i] == ids[r]],
        dtype=np.int64,
    )
    now = current[index[rows]]
    changed = changed_rows(stored[rows], now)
    if not len(changed):
        result.add("stamps", True, f"{len(rows)} rows unchanged since extraction")
        return
    at = rows[changed]
    report = change_report(at.tolist(), [ids[r] for r in at], stored[at], now[changed])
    result.add("stamps", False, f"{report}; rerun with --update")


def recorded_code(path: str | os.PathLike) -> str | None:
    """What rebuilding the model of the store at ``path`` from its recorded config would
    import and run, in words; None when nothing but featcache's own libraries."""
    with FeatureStore(path, allow_incomplete=True) as store:
        recorded = store.config
    if recorded is None:
        return None
    from featcache.models import code_named

    return code_named(load_config(recorded).model)


def _rebuild_spec(
    store: FeatureStore, config: str | os.PathLike | Mapping[str, Any] | None, trust: bool
) -> RecordedSpec:
    """The spec to rebuild from: ``config``, or the store's own with its relative paths
    from the folder its run started in."""
    if config is not None:
        given = _of_store(load_config(config), store.path)
        return RecordedSpec(given, None, given)
    recorded = store.config
    if recorded is None:
        raise ConfigError(
            f"{store.path} records no config (it was made from Python); verify needs a store "
            "made by `featcache extract` or extract_from_config, or a config given with --config"
        )
    from featcache.models import refuse_recorded_code

    rebuilt = recorded_spec(recorded, store.attrs)
    fix = ", or --config FILE to rebuild from your own"
    refuse_recorded_code(rebuilt.spec.model, store.path, "verify", trust, fix)
    return rebuilt


def _check_file(result: VerifyResult, store: FeatureStore) -> None:
    """The checks that need only the file: no model, no data."""
    if store.complete:
        result.add("complete", True, f"{len(store)} rows")
        sealed = "attributes match the digest recorded at completion"
        unsealed = "every attribute reads (no digest recorded: written before featcache kept one)"
        result.add("metadata", True, sealed if is_sealed(store.file) else unsealed)
    else:
        resume = f"featcache info {store.path} shows the command that resumes the run"
        result.add("complete", False, f"only {store.rows_written} rows written; {resume}")
    recorded = store.attrs.get("resume_key")
    if not recorded:
        result.add("key", False, "the store records no store key (not made by featcache?)")
        return
    if store.config is not None:
        config_fp = fingerprint(load_config(store.config))
        same = config_fp == recorded.get("config_fingerprint")
        detail = f"the recorded config has fingerprint {config_fp[:12]}"
        result.add("key", same, detail + ("" if same else ", not the key's"))
    keys = [tap["key"] for tap in recorded.get("taps", [])]
    if sorted(keys) == sorted(store.layers):
        plural = "s" if len(keys) != 1 else ""
        result.add("layers", True, f"{len(keys)} layer{plural} as recorded ({', '.join(keys)})")
    else:
        result.add("layers", False, f"stored {', '.join(store.layers)}, recorded {', '.join(keys)}")
    start, stop = recorded.get("rows", (0, recorded.get("source_rows", len(store))))
    bad_chunks = scan_chunks(store)
    corrupted = {bad.key for bad in bad_chunks}  # datasets the next checks cannot read
    if "index" in corrupted:
        result.add("alignment", False, "the row index fails its checksum (see checksums)")
    else:
        _check_alignment(result, store, store.index, range(start, stop))
    if "ids" in corrupted:
        result.add("unique ids", False, "the ids fail their checksum (see checksums)")
    else:
        ids = store.ids
        unique = len(set(ids)) == len(ids)
        result.add("unique ids", unique, f"{len(ids)} ids" + ("" if unique else " with repeats"))
    if bad_chunks:
        detail = "; ".join(
            f"{b.key} {span_text(store.file[b.key], b.start, b.stop)}" for b in bad_chunks[:4]
        )
        more = f" and {len(bad_chunks) - 4} more" if len(bad_chunks) > 4 else ""
        result.add("checksums", False, f"corrupted chunks: {detail}{more}")
        return
    checked = has_checksums(store)
    if not store.complete:  # only durable rows are checked: a resume writes the rest again
        text = (
            "the durable rows match their chunks' checksums" if checked else "the durable rows read"
        )
    else:
        text = "every chunk matches its checksum" if checked else "every chunk reads"
    unchecked = " (written without checksums: store.checksum was false)"
    result.add("checksums", True, text + ("" if checked else unchecked))
    if recorded.get("on_nonfinite") != "keep":
        bad = _nonfinite(store)
        result.add(
            "finite", not bad, f"NaN or Inf in layer {', '.join(bad)}" if bad else "no NaN or Inf"
        )


def _check_alignment(
    result: VerifyResult, store: FeatureStore, index: np.ndarray, rows: range
) -> None:
    """Rows and recorded skips cover the source rows ``rows`` exactly once, in order; in
    an incomplete store, the source rows up to its last row."""
    skipped = [record["index"] for record in store.skipped]
    covered = np.sort(np.concatenate([index, np.asarray(skipped, dtype=np.int64)]))
    ordered = bool(np.all(np.diff(index) > 0))
    n = len(rows)
    if store.complete:
        stop, counted = rows.stop, f"{n} source samples"
    else:  # skips recorded past the last durable row are redone by the resume
        stop = int(index[-1]) + 1 if len(index) else rows.start
        covered = covered[covered < stop]
        counted = f"the first {stop - rows.start} of {n} source samples"
    ok = ordered and np.array_equal(covered, np.arange(rows.start, stop))
    detail = (
        f"{len(index)} rows + {len(covered) - len(index)} skipped = {counted}, in order"
        if ok
        else f"rows and skips do not cover the {n} source samples exactly once, in order"
    )
    result.add("alignment", ok, detail)


def _nonfinite(store: FeatureStore) -> list[str]:
    """The layers holding a NaN or an Inf, read as stored (bfloat16 as its 16 bits, the
    upper half of the float32 of the same value)."""
    bad = []
    known: Known = {}  # each chunk is checked once
    for layer in store.layers:
        reader = rows_of(store.file["features"][layer], known)
        end = len(store)
        if store.is_per_token(layer):
            offsets = store.offsets
            end = int(offsets[-1]) if offsets is not None else 0
        for start in range(0, end, CHUNK_ROWS_FOR_SCAN):
            stop = min(start + CHUNK_ROWS_FOR_SCAN, end)
            block = np.empty((stop - start, *reader.dataset.shape[1:]), reader.dataset.dtype)
            reader.read(start, stop, block)
            if reader.stored == "bfloat16":
                block = (block.astype(np.uint32) << 16).view(np.float32)
            if not np.isfinite(block).all():
                bad.append(layer)
                break
    let_go(known)
    return bad


def _recompute(
    result: VerifyResult,
    store: FeatureStore,
    spec: Spec,
    backbone: Backbone,
    source: SourceDataset,
    *,
    samples: int,
    seed: int,
) -> None:
    """Recompute ``samples`` rows (all with -1; always the first and the last) through the
    run's own loader and hooked forward, and compare them with the stored rows within the
    tolerance of :mod:`featcache.extraction.compare`."""
    from featcache.extraction.compare import relative_differences, token_differences, tolerance_of
    from featcache.extraction.from_config import run_options
    from featcache.extraction.plan import make_plan
    from featcache.extraction.run import recompute

    n = len(store)
    if n == 0:
        return
    if samples < 0 or samples + 2 >= n:
        rows = list(range(n))
    else:
        chosen = random.Random(seed).sample(range(1, n - 1), samples)
        rows = sorted({0, n - 1, *chosen})
    result.rows = rows
    index, labels, dtype = store.index, store.labels, spec.store.dtype
    plan = make_plan(
        backbone.model,
        source,
        spec.layers,
        run_options(spec),
        prefix_tokens=backbone.prefix_tokens,
        sequence_first=backbone.sequence_first,
    )
    tolerance = tolerance_of(dtype, plan.layout.amp)[0]
    row_of = {int(index[r]): r for r in rows}
    positions = sorted(row_of)
    size = spec.loader.batch_size
    batches = [positions[at : at + size] for at in range(0, len(positions), size)]
    mismatches: dict[str, list[int]] = {}
    worst: dict[str, float] = {}
    wrong_labels = []
    for captured in recompute(plan, batches, on_nonfinite="keep"):
        if captured.skipped:
            result.add("values", False, captured.skipped[0]["reason"])
            return
        batch_rows = [row_of[int(p)] for p in captured.index]
        for key in captured.features:
            expected = captured.values(key, dtype).cpu()
            if key in captured.ragged:
                assert captured.lengths is not None
                stored, offsets = store.read_tokens(key, batch_rows)
                relative = token_differences(expected, captured.lengths, stored, offsets)[0]
            else:
                stored = store.read(key, batch_rows)
                if stored.shape != expected.shape:
                    shapes = f"stored {list(stored.shape)}, recomputed {list(expected.shape)}"
                    result.add("shapes", False, f"{key}: {shapes}")
                    return
                relative = relative_differences(expected, stored)
            worst[key] = max(worst.get(key, 0.0), float(relative.max()))
            for j, r in enumerate(batch_rows):
                if not relative[j] <= tolerance:  # NaN counts as a mismatch
                    mismatches.setdefault(key, []).append(r)
        if labels is not None:
            wrong_labels += [
                r for j, r in enumerate(batch_rows) if int(captured.labels[j]) != labels[r]
            ]
    if labels is not None and getattr(source, "labels", None) is None:
        result.add("labels", not wrong_labels, _rows_text(wrong_labels, "labels match"))
    largest = max(worst.values(), default=0.0)
    if mismatches:
        parts = "; ".join(f"{key}: rows {_list(found)}" for key, found in mismatches.items())
        detail = f"{parts} differ (largest relative error {largest:.3g}, tolerance {tolerance:g})"
    else:
        detail = f"{len(rows)} rows recomputed, largest relative error {largest:.2g} "
        detail += f"(tolerance {tolerance:g})"
    result.add("values", not mismatches, detail)


def _weights_text(weights: dict) -> str:
    if "sha256" in weights:
        return f"checkpoint sha256 {weights['sha256'][:12]}"
    if "enum" in weights:
        return weights["enum"]
    return f"{weights.get('source')} (seed {weights.get('seed')})"


def _list(rows: Sequence[int], shown: int = 8) -> str:
    text = ", ".join(str(r) for r in rows[:shown])
    return text + (f" and {len(rows) - shown} more" if len(rows) > shown else "")


def _rows_text(wrong: Sequence[int], good: str) -> str:
    return good if not wrong else f"rows {_list(wrong)} differ from the source"


def _of_store(spec: Spec, path: Path) -> Spec:
    """``spec``, or of a config of several models the one whose store is at ``path``."""
    if not spec.models:
        return spec
    for one in spec.per_model().values():
        if any(one.store_path(split).resolve() == path.resolve() for split in spec.data.splits):
            return one
    raise ConfigError(
        f"none of the models of the given config writes {path}; give the config that made it"
    )
