"""The typed configuration of an extraction run.

A config is a YAML mapping with the sections below; every key is checked, and an
unknown one is an error that names its full path (``data.spilts``). ``key=value``
overrides (values parsed as YAML) apply before validation. The resolved spec is
plain data: :func:`to_dict` gives the JSON written into every store, and
:func:`fingerprint` hashes the parts that decide what the store contains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from featcache.errors import ConfigError

REDUCTIONS = ("none", "avg", "max", "adaptive_avg", "flatten", "cls", "mean")
CAPTURES = ("output", "input", "grad")
GRAD_TARGETS = ("label", "predicted")  # besides a class index k and "output:K"
STORE_DTYPES = ("float16", "bfloat16", "float32")
COMPRESSIONS = (None, "lzf", "gzip")
SOURCES = ("imagefolder", "manifest", "torchvision", "synthetic")
AMP_DTYPES = (None, "fp16", "bf16", "auto")
ON_ERROR = ("fail", "skip")
ON_NONFINITE = ("fail", "skip", "keep")
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


@dataclass
class ModelSpec:
    """Which backbone to build. Exactly one of ``name`` and ``factory`` is set."""

    name: str | None = None  # torchvision model name, for torchvision.models.get_model
    weights: str | None = None  # weights enum name ("DEFAULT", "IMAGENET1K_V2") or null
    factory: str | None = None  # "package.module:callable" returning an nn.Module
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to get_model / the factory
    checkpoint: str | None = None  # local state dict file, loaded with weights_only=True
    strip_prefix: str | None = None  # removed from checkpoint keys, e.g. "module."


@dataclass
class LayerSpec:
    """One layer selector and how to capture and reduce what it matches."""

    name: str  # exact module name, glob ("layer*.1"), or "type:Conv2d"
    # "output", "input" (the module's first positional input), or "grad": the gradient of
    # the target score with respect to the module's output
    capture: str = "output"
    reduce: str = "none"  # one of REDUCTIONS
    size: int | None = None  # k for reduce="adaptive_avg" (k x k)
    select: int | str | None = None  # index or key into a tuple/list/dict output
    key: str | None = None  # name in the store; default: the module name (+"@input"/"@grad")
    # capture=grad only: the score differentiated. "label" (default: the label's logit),
    # "predicted" (the arg-max logit), a class index k, or "output:K" (element K of the
    # model's output, flattened per sample)
    target: str | int | None = None


@dataclass
class DataSpec:
    """Where the images come from; one store is written per split."""

    source: str = "imagefolder"  # one of SOURCES
    root: str | None = None  # folder the split paths are relative to
    dataset: str | None = None  # torchvision dataset class name, for source="torchvision"
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra dataset arguments
    # split name -> subfolder (imagefolder), manifest file (manifest), or a mapping of
    # keyword arguments (torchvision, synthetic). A list of names means {name: name}.
    splits: dict[str, Any] = field(default_factory=lambda: {"train": "train"})
    content_hash: bool = False  # dataset fingerprint hashes file contents, not only sizes


@dataclass
class PreprocessSpec:
    """Explicit image preprocessing. All null: the weights' own transforms() if any."""

    resize: int | None = None  # shorter side, before the crop
    crop: int | None = None  # centre crop to crop x crop
    mean: list[float] | None = None
    std: list[float] | None = None
    interpolation: str = "bilinear"

    def is_set(self) -> bool:
        return any(v is not None for v in (self.resize, self.crop, self.mean, self.std))


@dataclass
class LoaderSpec:
    batch_size: int = 64
    num_workers: int | str = "auto"  # "auto": up to 4, bounded by the CPUs available
    pin_memory: bool | str = "auto"  # "auto": on when the device is CUDA
    on_error: str = "fail"  # a sample that cannot be read: "fail" (stop) or "skip" (record)


@dataclass
class StoreSpec:
    dtype: str = "float16"  # one of STORE_DTYPES
    compression: str | None = None  # null, "lzf" or "gzip"
    chunk_rows: int | None = None  # rows per HDF5 chunk; null: about 1 MiB per chunk
    on_nonfinite: str = "fail"  # NaN/Inf in captured features: "fail", "skip" or "keep"


@dataclass
class OutputSpec:
    dir: str = "features"  # one store per split: <dir>/<split>.h5
    overwrite: bool = False


@dataclass
class RuntimeSpec:
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", "cuda:1", ...
    channels_last: bool | str = "auto"  # true, false, or "auto" (see featcache/runtime.py)
    amp: str | None = None  # null, "fp16", "bf16" or "auto": autocast dtype for the forward
    compile: bool = False  # torch.compile the forward (pays off on long runs only)
    seed: int = 0  # seeds model initialisation when no weights are loaded
    progress: bool = True


@dataclass
class Spec:
    model: ModelSpec = field(default_factory=ModelSpec)
    layers: list[LayerSpec] = field(default_factory=list)
    data: DataSpec = field(default_factory=DataSpec)
    preprocess: PreprocessSpec = field(default_factory=PreprocessSpec)
    loader: LoaderSpec = field(default_factory=LoaderSpec)
    store: StoreSpec = field(default_factory=StoreSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)

    def store_path(self, split: str) -> Path:
        return Path(self.output.dir) / f"{split}.h5"


# Sections that do not change what a store contains, left out of the fingerprint.
_NOT_FINGERPRINTED = {
    "output": None,
    "runtime": ("progress",),
    # on_error only decides which rows are left out, and the store lists those; so a run
    # stopped by a bad sample can be resumed with on_error=skip.
    "loader": ("num_workers", "pin_memory", "on_error"),
}


def load_config(config: str | Path | Mapping[str, Any], overrides: Iterable[str] = ()) -> Spec:
    """Load a YAML file (or take a mapping), apply ``key.sub=value`` overrides, validate.

    Relative paths in a config (data root, checkpoint, output dir) are relative to the
    current working directory, as with any command-line tool.
    """
    if isinstance(config, Mapping):
        raw: Any = json.loads(json.dumps(config))  # deep copy into plain data
    else:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}; pass the path of a YAML config")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", None)
            where = f" (line {line + 1})" if line is not None else ""
            raise ConfigError(f"config {path} is not valid YAML{where}; fix its syntax") from exc
    if not isinstance(raw, dict):
        raise ConfigError("a config must be a mapping of sections (model, layers, data, ...)")
    for item in overrides:
        apply_override(raw, item)
    spec = _build(Spec, raw, "")
    _validate(spec)
    return spec


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: the value is not valid YAML") from exc
    parts = key.strip().split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part) if isinstance(node, dict) else None
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {item!r}: {where} is not a mapping")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from plain data, naming the path of any bad key."""
    if cls is LayerSpec and isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {_kind(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        where = _join(path, unknown[0])
        known = ", ".join(sorted(fields))
        raise ConfigError(f"unknown config key {where}; known keys here: {known}")
    values = {}
    for name, value in raw.items():
        values[name] = _convert(hints[name], value, _join(path, name))
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        missing = str(exc).rsplit(":", 1)[-1].strip()
        raise ConfigError(f"{path or 'config'} is missing required key {missing}") from exc


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, path)
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if item_type is LayerSpec and isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{path} must be a list, got {_kind(value)}")
        return [_convert(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if path.endswith("splits") and isinstance(value, list):
            value = {str(name): str(name) for name in value}
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {_kind(value)}")
        return value
    allowed = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{path} must not be null")
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    for kind in allowed:
        if kind is Any or (kind is not type(None) and _is_instance(value, kind)):
            return value
    names = " or ".join("null" if k is type(None) else _type_name(k) for k in allowed)
    raise ConfigError(f"{path} must be {names}, got {_kind(value)} {value!r}")


def _is_instance(value: Any, kind: Any) -> bool:
    origin = typing.get_origin(kind)
    if origin is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(_is_instance(v, item) for v in value)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _validate(spec: Spec) -> None:
    validate_model(spec.model)
    if not spec.layers:
        raise ConfigError("layers: name at least one layer to capture (see `featcache layers`)")
    for i, layer in enumerate(spec.layers):
        validate_layer(layer, f"layers[{i}]")
    _choice("data.source", spec.data.source, SOURCES)
    if not spec.data.splits:
        raise ConfigError("data.splits is empty; name at least one split, e.g. [train]")
    for split in spec.data.splits:
        if not split or "/" in split:
            raise ConfigError(f"data.splits: {split!r} is not a usable split name")
    if spec.data.source == "torchvision" and not spec.data.dataset:
        raise ConfigError("data.dataset must name a torchvision dataset class, e.g. CIFAR10")
    if spec.data.source in ("imagefolder", "manifest") and not spec.data.root:
        raise ConfigError(f"data.root is required for data.source={spec.data.source}")
    validate_options(spec.loader, spec.store, spec.runtime)
    p = spec.preprocess
    for name in ("mean", "std"):
        value = getattr(p, name)
        if value is not None and len(value) != 3:
            raise ConfigError(f"preprocess.{name} must list 3 numbers (R, G, B)")
    _choice("preprocess.interpolation", p.interpolation, INTERPOLATIONS)
    _positive("preprocess.resize", p.resize)
    _positive("preprocess.crop", p.crop)


def validate_options(loader: LoaderSpec, store: StoreSpec, runtime: RuntimeSpec) -> None:
    """Check the loader, store and runtime sections (config entries or API keywords)."""
    _choice("loader.on_error", loader.on_error, ON_ERROR)
    _choice("store.on_nonfinite", store.on_nonfinite, ON_NONFINITE)
    _choice("store.dtype", store.dtype, STORE_DTYPES)
    _choice("store.compression", store.compression, COMPRESSIONS)
    _choice("runtime.amp", runtime.amp, AMP_DTYPES)
    if isinstance(runtime.channels_last, str) and runtime.channels_last != "auto":
        raise ConfigError("runtime.channels_last must be true, false or 'auto'")
    _positive("loader.batch_size", loader.batch_size)
    _positive("store.chunk_rows", store.chunk_rows)
    if loader.num_workers != "auto" and (
        isinstance(loader.num_workers, str) or loader.num_workers < 0
    ):
        raise ConfigError("loader.num_workers must be 'auto' or a whole number >= 0")
    if isinstance(loader.pin_memory, str) and loader.pin_memory != "auto":
        raise ConfigError("loader.pin_memory must be true, false or 'auto'")


def validate_model(m: ModelSpec) -> None:
    """Check that a model spec names exactly one way to build the model."""
    if (m.name is None) == (m.factory is None):
        raise ConfigError("model: set exactly one of model.name (torchvision) and model.factory")
    if m.factory is not None and ":" not in m.factory:
        raise ConfigError(f"model.factory {m.factory!r} must look like 'package.module:callable'")
    if m.factory is not None and m.weights is not None:
        raise ConfigError("model.weights names torchvision weights; with a factory use checkpoint")


def validate_layer(layer: LayerSpec, where: str) -> None:
    """Check one layer's options; used for config entries and Python API arguments."""
    _choice(f"{where}.capture", layer.capture, CAPTURES)
    _choice(f"{where}.reduce", layer.reduce, REDUCTIONS)
    if layer.reduce == "adaptive_avg":
        if layer.size is None or layer.size < 1:
            raise ConfigError(f"{where}: reduce=adaptive_avg needs size: k (output k x k)")
    elif layer.size is not None:
        raise ConfigError(f"{where}.size applies only to reduce=adaptive_avg")
    if layer.target is not None:
        if layer.capture != "grad":
            raise ConfigError(f"{where}.target applies only to capture=grad")
        parse_target(layer.target, f"{where}.target")
    if layer.key is not None and (not layer.key or "/" in layer.key):
        raise ConfigError(f"{where}.key {layer.key!r} must be non-empty and contain no '/'")


def parse_target(target: str | int | None, where: str = "target") -> tuple[str, int | None]:
    """Split a gradient target into ``(mode, index)``.

    ``None`` and ``"label"`` give ``("label", None)``, ``"predicted"`` gives
    ``("predicted", None)``, a class index ``k`` gives ``("class", k)`` and ``"output:K"``
    gives ``("output", K)``.
    """
    if target is None:
        return "label", None
    if isinstance(target, int) and not isinstance(target, bool):
        if target < 0:
            raise ConfigError(f"{where} is {target}; a class index must be >= 0")
        return "class", target
    if isinstance(target, str):
        if target in GRAD_TARGETS:
            return target, None
        head, sep, tail = target.partition(":")
        if head == "output" and sep and tail.strip().isdigit():
            return "output", int(tail)
    raise ConfigError(
        f"{where} is {target!r}; choose label, predicted, a class index k, or 'output:K'"
    )


def _choice(path: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        names = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ConfigError(f"{path} is {value!r}; choose one of: {names}")


def _positive(path: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{path} must be a whole number >= 1, got {value!r}")


def to_dict(spec: Spec) -> dict[str, Any]:
    """The resolved config as plain JSON-able data."""
    return dataclasses.asdict(spec)


def from_dict(data: Mapping[str, Any]) -> Spec:
    """Rebuild a spec from :func:`to_dict` output (e.g. the config stored in a store)."""
    return load_config(data)


def fingerprint(spec: Spec) -> str:
    """sha256 of the canonical JSON of everything that decides the stored values."""
    data = to_dict(spec)
    for section, keys in _NOT_FINGERPRINTED.items():
        if keys is None:
            data.pop(section, None)
        else:
            for key in keys:
                data[section].pop(key, None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is list:
        return "a list"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        kind, getattr(kind, "__name__", str(kind))
    )


def parse_layers(layers: Iterable[LayerSpec | str | Mapping[str, Any]]) -> list[LayerSpec]:
    """Normalise layer selectors given as names, mappings or :class:`LayerSpec`."""
    if isinstance(layers, (str, LayerSpec, Mapping)):
        layers = [layers]
    parsed = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, LayerSpec):
            raw = dict(layer) if isinstance(layer, Mapping) else layer
            layer = _build(LayerSpec, raw, f"layers[{i}]")
        validate_layer(layer, f"layers[{i}]")
        parsed.append(layer)
    return parsed
