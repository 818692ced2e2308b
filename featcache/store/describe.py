"""What ``featcache info`` shows of a store: :func:`describe` -> :class:`StoreDescription`."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from featcache.store.history import history_lines
from featcache.store.layout import STAMPS
from featcache.store.lock import Holder, holder
from featcache.store.paths import store_path_of
from featcache.store.resume import UPDATE_MARK
from featcache.util.units import format_bytes

if TYPE_CHECKING:
    from featcache.store.reader import FeatureStore

# The options torchrun is given before "-m featcache" in a recorded resume command.
_LAUNCH_WORD = re.compile(r"--[a-z][a-z-]*|[0-9]+")

# attrs ``seconds_<key>`` -> its name in the run's time split
TIME_SPLIT = {"waiting_for_data": "data", "in_model": "model", "waiting_for_disk": "disk"}


@dataclass(frozen=True)
class LayerDescription:
    """One stored layer: its row shape (without N) and its dataset's attributes."""

    shape: tuple[int, ...]  # of one token, for per-token rows
    attrs: dict[str, Any]  # dtype, module, capture, reduce (, target, layout)

    @property
    def per_token(self) -> bool:
        """Whether the layer holds per-token rows (row ``i`` is ``[T_i, *shape]``)."""
        return self.attrs.get("layout") == "tokens"

    @property
    def row_shape(self) -> str:
        """A row's shape as text: ``[512]``, or ``[T, 384]`` for per-token rows."""
        shape = ", ".join(map(str, self.shape))
        return f"[T, {shape}]" if self.per_token else f"[{shape}]"


@dataclass(frozen=True)
class StoreDescription:
    """A store's rows, layers, sizes on disk, completeness and provenance: ``str()`` is the
    text ``featcache info`` prints, :meth:`to_dict` the data of ``--json``."""

    path: Path
    bytes: int  # on disk: the file and, for a sharded store, its shard files
    complete: bool
    rows: int  # readable rows: all of them, or the durable ones of an incomplete store
    rows_written: int
    layers: dict[str, LayerDescription]
    has_labels: bool
    class_names: list[str] | None
    skipped: list[dict[str, Any]]  # {"index", "id", "reason"} of each sample left out
    attrs: dict[str, Any]  # file attributes, JSON values decoded
    # The process writing an incomplete store now ({"pid", "host", "started", "output"}).
    writer: dict[str, Any] | None = None
    tokens: int | None = None  # tokens in the per-token rows (None: no per-token layers)
    # The fields of the rows' change stamps ("size, mtime_ns"); "" when none are recorded.
    stamps: str = ""

    @property
    def shards(self) -> list[str]:
        """File names of the shards of a store written under torchrun ([] otherwise)."""
        return self.attrs.get("shards") or []

    @property
    def time_split(self) -> dict[str, float] | None:
        """Seconds the run spent waiting for data, in the model and waiting for the disk
        (``{"data": ..., "model": ..., "disk": ...}``); None when not recorded."""
        if any(self.attrs.get(f"seconds_{key}") is None for key in TIME_SPLIT):
            return None
        return {name: float(self.attrs[f"seconds_{key}"]) for key, name in TIME_SPLIT.items()}

    @property
    def resume_command(self) -> str | None:
        """The command that resumes this store's run (None: not made from a config file, or
        the recorded command is not one: see :func:`shown_command`)."""
        return shown_command(self.attrs.get("resume_command"))

    @property
    def stopped_update(self) -> bool:
        """Whether this incomplete store is an update's (its key carries the update mark):
        a plain rerun refuses it, a rerun with ``--update`` redoes it."""
        key = self.attrs.get("resume_key")
        return not self.complete and isinstance(key, Mapping) and UPDATE_MARK in key

    def to_dict(self) -> dict[str, Any]:
        """Path, bytes, completeness, the writer of an incomplete store, ``layers: {key:
        {"shape", **attrs}}`` and every file attribute."""
        return {
            "path": str(self.path),
            "bytes": self.bytes,
            "complete": self.complete,
            "rows_written": self.rows_written,
            "writer": self.writer,
            "tokens": self.tokens,
            "layers": {
                key: {"shape": list(layer.shape), **layer.attrs}
                for key, layer in self.layers.items()
            },
            **self.attrs,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON (values JSON lacks as their ``str``)."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    def summary(self) -> str:
        """One line: path, rows, layer shapes, size, run time and speed."""
        attrs = self.attrs
        shapes = ", ".join(f"{key} {layer.row_shape}" for key, layer in self.layers.items())
        return (
            f"{self.path}: {self.rows} rows; {shapes}; {format_bytes(self.bytes)}; "
            f"{attrs.get('seconds', 0):.1f} s, {_speed(attrs)}"
        )

    def format(self) -> str:
        """The multi-line text of ``featcache info``."""
        attrs = self.attrs
        state = "complete" if self.complete else f"INCOMPLETE ({self.rows_written} rows durable)"
        lines = [
            f"store      {self.path} ({format_bytes(self.bytes)})",
            f"status     {state}, {self.rows} rows, format {attrs.get('featcache_format')}",
        ]
        if not self.complete:
            lines += self._partial_text()
        lines.append("layers")
        for key, layer in self.layers.items():
            la = layer.attrs
            detail = f"{la.get('module')} {la.get('capture')}, reduce={la.get('reduce')}"
            if la.get("capture") == "grad":
                detail += f", target={la.get('target')}"
            if la.get("channel_layout") == "nhwc":
                detail += ", channels last"
            lines.append(f"  {key:<24} {layer.row_shape:<18} {la.get('dtype'):<9} {detail}")
        if self.tokens is not None:
            lines.append(f"tokens     {self.tokens} in per-token rows (read with TokenDataset)")
        lines.append(f"labels     {self._labels_text()}")
        lines.append(f"changes    {self._changes_text()}")
        if self.skipped:
            shown = "; ".join(f"{r['reason']}" for r in self.skipped[:3])
            more = f"; and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
            lines.append(f"skipped    {len(self.skipped)} samples: {shown}{more}")
        shards = self.shards
        if shards:
            more = f", ... {len(shards)} in all" if len(shards) > 2 else ""
            lines.append(f"shards     {', '.join(shards[:2])}{more} (world size {len(shards)})")
        if attrs.get("weights"):
            lines.append(f"weights    {json.dumps(attrs['weights'], sort_keys=True)}")
        if attrs.get("preprocessing"):
            lines.append(f"preprocess {_one_line(str(attrs['preprocessing']))}")
        decode = ((attrs.get("config") or {}).get("loader") or {}).get("decode")
        if decode:
            lines.append(f"decode     {decode}")
        for key in ("split", "config_fingerprint", "dataset_fingerprint", "device", "created"):
            if key in attrs:
                lines.append(f"{key.removesuffix('_fingerprint'):<10} {attrs[key]}")
        versions = attrs.get("versions") or {}
        lines.append("versions   " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        layout = attrs.get("layout")
        if layout:
            lines.append(
                f"layout     {layout['device']}, channels_last={layout['channels_last']}, "
                f"amp={layout['amp']}"
            )
        if "seconds" in attrs:
            lines.append(self._run_text())
        for at, line in enumerate(history_lines(attrs.get("history") or [])):
            lines.append(f"{'history' if at == 0 else '':<10} {line}")
        return "\n".join(lines)

    __str__ = format

    def _partial_text(self) -> list[str]:
        if self.writer is not None:
            lines = [f"writer     {Holder(**self.writer).describe()} (still running)"]
        elif self.stopped_update:
            lines = [
                "writer     none: the update stopped; rerun it with --update (update=True in "
                "Python) to redo it: a plain rerun refuses it"
            ]
        else:
            lines = ["writer     none: the run stopped; rerun it to resume from the durable rows"]
        command = self.resume_command
        if command and self.stopped_update and not _updates(command):
            command += " --update"
        command = command or (
            "the same extract call (the store records no config file)"
            if self.attrs.get("resume_command") is None
            else "the extraction that made it (the command the store records is not a "
            "featcache extract command, so it is not shown)"
        )
        lines.append(f"resume     {command}")
        folder = self.attrs.get("resume_folder")
        if self.resume_command and isinstance(folder, str):
            lines.append(f"           run it from {folder} (relative paths in the config)")
        code = code_overrides(self.resume_command)
        if code:
            lines.append(
                f"           careful: this command sets {', '.join(code)}, so it runs code "
                "that the store names; read it before you run it"
            )
        return lines

    def _changes_text(self) -> str:
        """How an update or verify tells a sample changed since its row was written."""
        data = (self.attrs.get("config") or {}).get("data") or {}
        if data.get("content_hash"):
            return "each file's sha256 (data.content_hash) and change stamps"
        if self.stamps:
            return f"a change stamp per row ({self.stamps}); --update recomputes changed rows"
        return (
            "none recorded (the source gives no stamps, or the store predates them): "
            "--update cannot see a sample changed under the same id"
        )

    def _labels_text(self) -> str:
        classes = self.class_names
        text = "none" if not self.has_labels else f"{len(classes) if classes else '?'} classes"
        if classes:
            text += " (" + ", ".join(classes[:8]) + (" ..." if len(classes) > 8 else "") + ")"
        return text

    def _run_text(self) -> str:
        attrs = self.attrs
        run = f"run        {attrs['seconds']:.1f} s, {_speed(attrs)}"
        split = self.time_split
        if split is not None:
            total = max(sum(split.values()), 1e-9)
            shares = [f"{name} {100 * sec / total:.0f}%" for name, sec in split.items()]
            run += " (" + ", ".join(shares) + ")"
        return run


def _one_line(text: str) -> str:
    """A multi-line repr (torchvision's transforms print one step per line) on one line."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _speed(attrs: Mapping[str, Any]) -> str:
    """Rows per second in the store's own unit (images, texts, samples)."""
    return f"{attrs.get('images_per_second', 0):.0f} {attrs.get('row_unit', 'images')}/s"


def store_bytes(store: FeatureStore) -> int:
    """Bytes on disk: the file, plus its shard files for a sharded store."""
    shards = store.attrs.get("shards") or []
    folder = store.path.parent
    return store.path.stat().st_size + sum(
        (folder / name).stat().st_size for name in shards if (folder / name).exists()
    )


def describe(store: FeatureStore) -> StoreDescription:
    """Everything ``featcache info`` reports about ``store``, read once."""
    writer = None if store.complete else holder(store_path_of(store.path))
    offsets = store.offsets
    return StoreDescription(
        path=store.path,
        bytes=store_bytes(store),
        complete=store.complete,
        rows=len(store),
        rows_written=store.rows_written,
        layers={
            key: LayerDescription(store.shape(key), store.layer_attrs(key)) for key in store.layers
        },
        has_labels=store.has_labels,
        class_names=store.class_names,
        skipped=store.skipped,
        attrs=store.attrs,
        writer=None if writer is None else asdict(writer),
        tokens=None if offsets is None else int(offsets[-1]),
        stamps=_stamp_fields(store.file.get(STAMPS)),
    )


def _stamp_fields(stamps: Any) -> str:
    """The field names of the first known stamp of the ``/stamps`` dataset (None: absent)
    among its first rows: ``"size, mtime_ns"``; "" for none."""
    known = [] if stamps is None else [s for s in stamps[:1024] if s]
    if not known:
        return ""
    return ", ".join(field.partition(b"=")[0].decode() for field in known[0].split(b"\t"))


def _updates(command: str) -> bool:
    """Whether the shown ``command`` runs an update (``--update``, ``output.update=true``)."""
    words = shlex.split(command)
    return "--update" in words or any(
        w.removeprefix("--set=").replace(" ", "").lower() == "output.update=true" for w in words
    )


def code_overrides(command: str | None) -> list[str]:
    """The config keys that the ``--set`` overrides of a shown resume ``command`` set to
    run code (``model.factory``, ``model.trust_remote_code``): a store may plant them."""
    words = shlex.split(command) if command else []
    found: list[str] = []
    items = [b for a, b in zip(words, words[1:], strict=False) if a == "--set"]
    items += [w.removeprefix("--set=") for w in words if w.startswith("--set=")]
    for item in items:
        key, _, text = item.partition("=")
        key = key.strip()
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        if key == "model" and isinstance(value, dict):  # a whole section: model={...}
            found += [f"model.{k}" for k in ("factory", "trust_remote_code") if value.get(k)]
        elif key in ("model.factory", "model.trust_remote_code") and value:
            found.append(key)
    return found


def shown_command(recorded: Any) -> str | None:
    """A resume command recorded in a store (which may record any text), every word quoted:
    ``featcache extract ...`` or ``torchrun <options> -m featcache extract ...``; None for
    anything else."""
    if not isinstance(recorded, str):
        return None
    try:
        words = shlex.split(recorded)
    except ValueError:  # unbalanced quotes
        return None
    if "extract" not in words:
        return None
    launcher = words[: words.index("extract")]
    torchrun = (
        len(launcher) >= 3
        and launcher[0] == "torchrun"
        and launcher[-2:] == ["-m", "featcache"]
        and all(_LAUNCH_WORD.fullmatch(word) for word in launcher[1:-2])
    )
    if launcher != ["featcache"] and not torchrun:
        return None
    return shlex.join(words)
