"""The typed configuration of an extraction run: a YAML mapping, ``key=value`` overrides
applied, every key checked (an unknown one named by its full path, ``data.spilts``)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from featcache.config.validation import build, check, choices, option
from featcache.config.yaml_io import RepeatedKeyError, read_yaml
from featcache.errors import ConfigError
from featcache.util.compression import check_compression
from featcache.util.urls import check_storage_options, check_url, is_url

Reduction = Literal[
    "none", "avg", "max", "adaptive_avg", "flatten", "cls", "mean", "cls+mean", "patches", "last"
]
Capture = Literal["output", "input", "grad"]
StoreDtype = Literal["float16", "bfloat16", "float32", "int8"]
SourceKind = Literal[
    "imagefolder", "manifest", "torchvision", "synthetic", "text", "hf", "webdataset", "parquet"
]
AmpDtype = Literal["fp16", "bf16", "auto"] | None
OnError = Literal["fail", "skip"]
OnNonfinite = Literal["fail", "skip", "keep"]
Interpolation = Literal["bilinear", "bicubic", "nearest"]
ChannelLayout = Literal["nchw", "nhwc"]
Decode = Literal["exact", "fast"]
Auto = Literal["auto"]

SOURCES = choices(SourceKind)

ONE_MODEL = "set exactly one of model.name (a torchvision name or zoo reference) and model.factory"


@dataclass
class ModelSpec:
    """Which backbone to build. Exactly one of ``name`` and ``factory`` is set."""

    # A torchvision name ("resnet50", "torchvision:resnet50") or a zoo reference:
    # "timm:<name>[.<tag>]", "hf:<repo id>[@<revision>]" or "hf:<folder>",
    # "open_clip:<architecture>[/<tag>]"
    name: str | None = None
    # null: random weights (seeded). torchvision: a weights enum name ("DEFAULT",
    # "IMAGENET1K_V2"); timm, hf, open_clip: "pretrained" (the zoo's own weights)
    weights: str | None = None
    factory: str | None = None  # "package.module:callable" returning an nn.Module
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the model's builder
    checkpoint: str | None = None  # local state dict file, loaded with weights_only=True
    strip_prefix: str | None = None  # removed from checkpoint keys, e.g. "module."
    # hf only: let transformers run the repository's own Python code (its modelling
    # files). Only for repositories you trust; never taken from a store by verify.
    trust_remote_code: bool = False

    def is_set(self) -> bool:
        return self.name is not None or self.factory is not None

    def validate(self, at: str) -> None:
        at = at or "model"
        if not self.is_set() and at == "model":
            return  # a config of several models names none here (see Spec.validate)
        if (self.name is None) == (self.factory is None):
            raise ConfigError(f"{at}: {ONE_MODEL}")
        if self.factory is not None and ":" not in self.factory:
            raise ConfigError(
                f"{at}.factory {self.factory!r} must look like 'package.module:callable'"
            )
        if self.factory is not None and self.weights is not None:
            raise ConfigError(
                f"{at}.weights names torchvision weights; with a factory use checkpoint"
            )
        if self.trust_remote_code and not (self.name or "").startswith("hf:"):
            raise ConfigError(f"{at}.trust_remote_code applies only to hf: models")


@dataclass
class LayerSpec:
    """One layer selector and how to capture and reduce what it matches."""

    name: str  # exact module name, glob ("layer*.1"), or "type:Conv2d"
    # "output", "input" (the module's first positional input), or "grad": the gradient of
    # the target score with respect to the module's output
    capture: Capture = "output"
    # What a row holds (docs/concepts/reductions.md): "none" (the whole output), "avg" or
    # "max" (pooled over every axis after the channels), "adaptive_avg" (pooled to size x
    # size), "flatten"; of token outputs "cls", "mean", "cls+mean", "patches" (the patch
    # grid) and, for texts, "last" (docs/concepts/tokens.md)
    reduce: Reduction = "none"
    size: int | None = option(None, ge=1)  # k for reduce="adaptive_avg" (k x k)
    select: int | str | None = None  # index or key into a tuple/list/dict output
    key: str | None = None  # name in the store; default: the module name (+"@input"/"@grad")
    # capture=grad only: the score differentiated. "label" (default: the label's logit),
    # "predicted" (the arg-max logit), a class index k, or "output:K" (element K of the
    # model's output, flattened per sample)
    target: str | int | None = None
    # where a 4-d output keeps its channels: "nchw" ([C, H, W]) or "nhwc" ([H, W, C]);
    # null: as the model declares it, else read from the input's grid
    layout: ChannelLayout | None = None

    def validate(self, at: str) -> None:
        if self.reduce == "adaptive_avg" and self.size is None:
            raise ConfigError(f"{at}: reduce=adaptive_avg needs size: k (output k x k)")
        if self.reduce != "adaptive_avg" and self.size is not None:
            raise ConfigError(f"{at}.size applies only to reduce=adaptive_avg")
        if self.target is not None:
            if self.capture != "grad":
                raise ConfigError(f"{at}.target applies only to capture=grad")
            parse_target(self.target, f"{at}.target")
        if self.key is not None and (not self.key or "/" in self.key):
            raise ConfigError(f"{at}.key {self.key!r} must be non-empty and contain no '/'")


def _layer_list(value: Any, at: str) -> Any:
    """``layer1`` and ``[layer1, {name: layer2}]`` shorthand -> a list of mappings."""
    if isinstance(value, (str, Mapping, LayerSpec)):
        value = [value]
    if isinstance(value, list):
        return [{"name": v} if isinstance(v, str) else v for v in value]
    return value


def _split_map(value: Any, at: str) -> Any:
    """A list of split names means ``{name: name}``."""
    if isinstance(value, list):
        return {str(name): str(name) for name in value}
    return value


@dataclass(frozen=True)
class SourceOptions:
    """The data keys one source kind owns: ``reads``, those it reads besides the keys every
    kind reads (set for another kind, one is refused), and ``required``, key -> the rest of
    the error line when that key is unset."""

    reads: tuple[str, ...]
    required: Mapping[str, str] = field(default_factory=dict)

    def require(self, data: DataSpec, at: str = "data") -> None:
        """Raise ConfigError for the first required key that ``data`` leaves unset."""
        for key, rest in self.required.items():
            if not getattr(data, key):
                raise ConfigError(f"{at}.{key} {rest}")


_COLUMNS = ("image_column", "text_column", "label_column", "id_column")

# source kind -> the data keys it owns; the config checks them when it is loaded, and the
# registry of source kinds (featcache.sources.registry) when it builds a source.
SOURCE_OPTIONS: dict[str, SourceOptions] = {
    "imagefolder": SourceOptions(
        ("root", "storage_options"), {"root": "is required for data.source=imagefolder"}
    ),
    "manifest": SourceOptions(
        ("root", "storage_options"), {"root": "is required for data.source=manifest"}
    ),
    "torchvision": SourceOptions(
        ("root", "dataset", "kwargs"),
        {"dataset": "must name a torchvision dataset class, e.g. CIFAR10"},
    ),
    "synthetic": SourceOptions(("kwargs",)),
    "text": SourceOptions(("root", "text_column", "label_column", "id_column", "storage_options")),
    "hf": SourceOptions(
        ("root", "dataset", *_COLUMNS),
        {
            "dataset": "must name a Hugging Face dataset (hub name, or a folder written by "
            "save_to_disk)"
        },
    ),
    "parquet": SourceOptions(("root", *_COLUMNS, "storage_options")),
    # webdataset refuses id_column itself, saying why: its ids are the sample keys.
    "webdataset": SourceOptions(("root", *_COLUMNS, "storage_options")),
}


@dataclass
class DataSpec:
    """Where the images come from; one store is written per split."""

    # What reads the samples: "imagefolder" (class folders), "manifest" (a file listing
    # paths and labels), "torchvision" or "hf" (a dataset by name), "synthetic" (seeded
    # random images), "text" (a file of texts), "webdataset" (tar shards), "parquet"
    source: SourceKind = "imagefolder"
    # folder the split paths are relative to: a local folder or an fsspec URL
    # (s3://bucket/prefix, gs://, az://, https://, hf://)
    root: str | None = None
    dataset: str | None = None  # torchvision dataset class name, for source="torchvision"
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra dataset arguments
    # split name -> subfolder (imagefolder), manifest file (manifest), or a mapping of
    # keyword arguments (torchvision, synthetic). A list of names means {name: name}.
    splits: dict[str, Any] = option(default_factory=lambda: {"train": "train"}, convert=_split_map)
    content_hash: bool = False  # dataset fingerprint hashes file contents, not only sizes
    # Columns of tabular sources (text, hf, parquet). null: the source's default
    # (text: "text", and "label" / "id" when the file has them).
    image_column: str | None = None  # image bytes, a PIL image or a path
    text_column: str | None = None  # text to tokenise with the model's tokenizer
    label_column: str | None = None  # class index or class name
    id_column: str | None = None  # stable sample id; default <dataset>/<split>/<index>
    max_length: int | None = option(None, ge=1)  # tokens per text; null: the model's limit
    # Names of the integer labels (label i is class_names[i]): a list, or the path of a
    # text file with one name per line; null: the names the source gives, if any
    class_names: list[str] | str | None = None
    # Only N samples of each split, spread evenly over it, the same ones every run (a
    # quick trial that sees every class of a class folder); their stores go to
    # <output.dir>/limit-N/, beside the full ones
    limit: int | None = option(None, ge=1)
    # Passed to the fsspec filesystem of URLs (endpoint_url, profile, anon, ...; per
    # protocol as {s3: {...}, https: {...}}). Never credentials: those come from where
    # the storage library reads them (environment, credentials file, the machine's role)
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> Literal["image", "text"]:
        """What the rows hold for the model: texts for its tokenizer (``source: text``, or a
        ``text_column`` of a tabular source), else images."""
        return "text" if self.source == "text" or self.text_column is not None else "image"

    def validate(self, at: str) -> None:
        if not self.splits:
            raise ConfigError(f"{at}.splits is empty; name at least one split, e.g. [train]")
        for split in self.splits:
            if not split or "/" in split or split.startswith("."):
                raise ConfigError(
                    f"{at}.splits: {split!r} is not a usable split name (it names the store "
                    f"file <name>.h5); use a plain name, mapped to a folder: {{all: {split!r}}}"
                )
        SOURCE_OPTIONS[self.source].require(self, at)
        self._check_urls(at)
        names = self.class_names
        if isinstance(names, list) and (not names or len(set(names)) != len(names)):
            raise ConfigError(
                f"{at}.class_names must list each class once (label i names class_names[i]), "
                f"got {names!r}"
            )
        self.refuse_unused(at)

    def _check_urls(self, at: str) -> None:
        """URLs only where a source reads them, and none carrying credentials."""
        check_storage_options(self.storage_options, f"{at}.storage_options")
        named = [("root", self.root), ("dataset", self.dataset), ("class_names", self.class_names)]
        named += [(f"splits.{k}", v) for k, v in self.splits.items()]
        for key, value in named:
            for item in value if isinstance(value, list) else [value]:
                if not is_url(item):
                    continue
                check_url(str(item), f"{at}.{key}")
                if self.source not in URL_SOURCES and key != "class_names":
                    raise ConfigError(
                        f"{at}.{key} is a URL, but data.source={self.source} reads local "
                        f"files only; URLs work with {', '.join(URL_SOURCES)} (a Hugging Face "
                        "dataset's Parquet files: data.source parquet with hf:// URLs)"
                    )

    def refuse_unused(self, at: str = "data") -> None:
        """Refuse a key that this source would ignore (a ``label_column`` for a manifest,
        ``kwargs`` for hf, ``max_length`` for images ...)."""
        for key, sources in _READ_BY.items():
            if getattr(self, key) and self.source not in sources:
                given = f" ({', '.join(map(str, self.kwargs))})" if key == "kwargs" else ""
                raise ConfigError(
                    f"{at}.{key}{given} is not used by data.source={self.source} (only by "
                    f"{', '.join(sources)}); remove it"
                )
        if self.max_length is not None and self.inputs != "text":
            raise ConfigError(
                f"{at}.max_length is not used by image data (it caps the tokens of texts: "
                "data.source text, or a text_column); remove it"
            )


# data key -> the source kinds that read it, for the keys only some kinds read
_READ_BY: dict[str, tuple[str, ...]] = {
    f.name: readers
    for f in dataclasses.fields(DataSpec)
    if (readers := tuple(name for name, kind in SOURCE_OPTIONS.items() if f.name in kind.reads))
}
URL_SOURCES = _READ_BY["storage_options"]  # the kinds whose paths may be fsspec URLs


@dataclass
class PreprocessSpec:
    """Explicit image preprocessing. All null: the weights' own transforms() if any."""

    resize: int | None = option(None, ge=1)  # shorter side, before the crop
    crop: int | None = option(None, ge=1)  # centre crop to crop x crop
    # Per-channel (R, G, B) mean subtracted from pixels in [0, 1]; null: ImageNet's
    mean: list[float] | None = None
    # Per-channel (R, G, B) standard deviation the pixels are divided by, none of them 0;
    # null: ImageNet's
    std: list[float] | None = None
    # Resampling filter of the resize; a filter other than bilinear needs resize set
    interpolation: Interpolation = "bilinear"

    def is_set(self) -> bool:
        return any(v is not None for v in (self.resize, self.crop, self.mean, self.std))

    def validate(self, at: str) -> None:
        at = at or "preprocess"
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None and len(value) != 3:
                raise ConfigError(f"{at}.{name} must list 3 numbers (R, G, B)")
        if self.resize is not None and self.crop is not None and self.crop > self.resize:
            raise ConfigError(
                f"{at}.crop {self.crop} is larger than resize {self.resize}, "
                "so the centre crop would pad every image with black borders; make crop at "
                "most resize"
            )
        if self.interpolation != "bilinear" and self.resize is None:
            raise ConfigError(
                f"{at}.interpolation {self.interpolation} applies to the resize, "
                "and resize is not set (so the weights' own transforms, or no resize, apply); "
                "set resize (and crop) too, or drop interpolation"
            )
        if self.std is not None and not all(self.std):
            raise ConfigError(
                f"{at}.std {self.std} has a zero, and normalising divides by it; "
                "give the per-channel standard deviations, e.g. [0.229, 0.224, 0.225]"
            )


@dataclass
class LoaderSpec:
    batch_size: int = option(64, ge=1)  # samples per forward pass
    # "auto": up to 4, bounded by the CPUs available
    num_workers: int | Auto = option("auto", ge=0)
    pin_memory: bool | Auto = "auto"  # "auto": on when the device is CUDA
    on_error: OnError = "fail"  # a sample that cannot be read: "fail" (stop) or "skip" (record)
    # Token sources: run the rows of each window of 16 batches longest first, so batches
    # pad less; rows are still stored in source order.
    bucket_by_length: bool = False
    # How image files are decoded: "exact" (in full, then the model's own resize: its own
    # pixels) or "fast" (JPEGs at 1/2, 1/4 or 1/8 scale when at least twice the size the
    # resize needs: faster, and slightly other pixels and features)
    decode: Decode = "exact"


@dataclass
class StoreSpec:
    # How the captured values are stored: float16, bfloat16, float32, or int8 (8-bit codes
    # with one float32 scale per row, or per token: about a quarter of float32's bytes)
    dtype: StoreDtype = "float16"
    # Lossless HDF5 filter of the finished store, written as a compressed copy at the end
    # of the run: "gzip" or "gzip:<1-9>", "lzf" (built in), "zstd" or "zstd:<1-22>",
    # "blosc2-lz4" or "blosc2-zstd", a blosc2 one optionally with "-shuffle" (the default)
    # or "-bitshuffle" and ":<0-9>", e.g. "blosc2-zstd-bitshuffle:5" (zstd and blosc2 need
    # pip install 'featcache[codecs]'); null: uncompressed
    compression: str | None = None
    chunk_rows: int | None = option(None, ge=1)  # rows per HDF5 chunk; null: about 1 MiB
    on_nonfinite: OnNonfinite = "fail"  # NaN/Inf in captured features
    checksum: bool = True  # an XXH3 checksum per chunk: a corrupted chunk fails to read

    def validate(self, at: str) -> None:
        if self.dtype == "int8" and self.on_nonfinite == "keep":
            raise ConfigError(
                f"{at}.dtype int8 cannot hold NaN or Inf, so {at}.on_nonfinite: keep has "
                "nothing to keep them in; set on_nonfinite to fail or skip, or use a float dtype"
            )
        check_compression(self.compression, f"{at}.compression")


# The refusal of a run asked both to update and to overwrite its stores.
UPDATE_AND_OVERWRITE = (
    "--update and --overwrite exclude each other (output.update, output.overwrite): "
    "--update keeps what a store holds and computes the rest, --overwrite computes it all "
    "afresh; pass one of them"
)


@dataclass
class OutputSpec:
    dir: str = "features"  # one store per split: <dir>/<split>.h5
    # Compute every store afresh, replacing any in place (a complete store stays until
    # its replacement is complete). false: a partial store resumes, a complete one of
    # this config is kept as it is, and one of another config is refused
    overwrite: bool = False
    # Bring complete stores up to date: compute only new or changed samples and new
    # layers, copy the rest (docs/guides/update.md)
    update: bool = False


@dataclass
class RuntimeSpec:
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", "cuda:1", ...
    channels_last: bool | Auto = "auto"  # see featcache/capture/runtime.py for "auto"
    amp: AmpDtype = None  # autocast dtype for the forward
    compile: bool = False  # torch.compile the forward (pays off on long runs only)
    seed: int = 0  # seeds model initialisation when no weights are loaded
    progress: bool = True  # progress bars on stderr


@dataclass
class ModelEntry:
    """One model of a config that runs several over one pass of the data, in place of the
    top-level model, layers and preprocess; each sample is decoded once for all of them."""

    key: str  # names its stores: <output.dir>/<key>/<split>.h5
    model: ModelSpec = field(default_factory=ModelSpec)  # the model keys
    # the layers to capture, as the top-level layers list
    layers: list[LayerSpec] = option(default_factory=list, convert=_layer_list)
    preprocess: PreprocessSpec = field(default_factory=PreprocessSpec)  # the preprocess keys

    def validate(self, at: str) -> None:
        if not self.key or self.key != Path(self.key).name or self.key.startswith("."):
            raise ConfigError(f"{at}.key {self.key!r} must be a plain folder name, e.g. resnet50")
        self.model.validate(f"{at}.model")
        if not self.layers:
            raise ConfigError(f"{at}.layers: name at least one layer to capture")


def _model_list(value: Any, at: str) -> Any:
    if value is not None and not isinstance(value, list):
        raise ConfigError(f"{at} must be a list of models (key, model, layers, preprocess)")
    return value or []


@dataclass
class Spec:
    model: ModelSpec = field(default_factory=ModelSpec)
    layers: list[LayerSpec] = option(default_factory=list, convert=_layer_list)
    data: DataSpec = field(default_factory=DataSpec)
    preprocess: PreprocessSpec = field(default_factory=PreprocessSpec)
    loader: LoaderSpec = field(default_factory=LoaderSpec)
    store: StoreSpec = field(default_factory=StoreSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    # Several models over one pass of the data, instead of model, layers and preprocess:
    # each entry's key, model, layers and preprocess; its stores in <output.dir>/<key>/
    models: list[ModelEntry] = option(default_factory=list, convert=_model_list)

    def per_model(self) -> dict[str, Spec]:
        """The config of each model of ``models``, as a config of that model alone: its
        model, layers and preprocess, its stores in ``<output.dir>/<key>/``."""
        return {
            entry.key: dataclasses.replace(
                self,
                model=entry.model,
                layers=entry.layers,
                preprocess=entry.preprocess,
                output=dataclasses.replace(self.output, dir=str(Path(self.output.dir) / entry.key)),
                models=[],
            )
            for entry in self.models
        }

    def store_path(self, split: str) -> Path:
        """Where the store of ``split`` goes: ``<output.dir>/<split>.h5``, or for N
        samples spread over it (``data.limit``) ``<output.dir>/limit-N/<split>.h5``."""
        folder = Path(self.output.dir)
        if self.data.limit is not None:
            folder = folder / f"limit-{self.data.limit}"
        return folder / f"{split}.h5"

    def validate(self, at: str) -> None:
        if self.models:
            if self.model.is_set() or self.layers or self.preprocess.is_set():
                raise ConfigError(
                    "models: a config of several models gives each its model, layers and "
                    "preprocess under models; remove the top-level model, layers and preprocess"
                )
            keys = [entry.key for entry in self.models]
            repeated = sorted({key for key in keys if keys.count(key) > 1})
            if repeated:
                raise ConfigError(f"models: key {repeated[0]!r} is used twice; give each its own")
        elif not self.model.is_set():
            raise ConfigError(f"model: {ONE_MODEL}")
        if not self.layers and not self.models:
            raise ConfigError("layers: name at least one layer to capture (see `featcache layers`)")
        if self.output.update and self.output.overwrite:
            raise ConfigError(UPDATE_AND_OVERWRITE)


def load_config(
    config: str | os.PathLike | Mapping[str, Any], overrides: Iterable[str] = ()
) -> Spec:
    """Load a YAML file (or take a mapping), apply ``key.sub=value`` overrides, validate.

    Relative paths in a config (data root, checkpoint, output dir) are relative to the
    current working directory, as with any command-line tool.
    """
    if isinstance(config, Mapping):
        raw: Any = json.loads(json.dumps(config))  # deep copy into plain data
    else:
        path = Path(config)
        if path.is_dir():
            raise ConfigError(f"{path} is a folder, not a config; pass the path of a YAML config")
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}; pass the path of a YAML config")
        try:
            raw = read_yaml(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
            ) from exc
        except RepeatedKeyError as exc:
            raise ConfigError(f"config {path}: {exc}; keep one of them") from exc
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", None)
            where = f" (line {line + 1})" if line is not None else ""
            raise ConfigError(f"config {path} is not valid YAML{where}; fix its syntax") from exc
    if not isinstance(raw, dict):
        raise ConfigError("a config must be a mapping of sections (model, layers, data, ...)")
    for item in override_list(overrides):
        apply_override(raw, item)
    return build(Spec, raw)


def override_list(overrides: Iterable[str]) -> list[str]:
    """``overrides`` as a list, refusing one string (which would be read letter by letter)."""
    if isinstance(overrides, (str, bytes)):
        raise ConfigError(
            f"overrides must be a list of key.sub=value strings, got the string {overrides!r}; "
            f"pass [{overrides!r}]"
        )
    return list(overrides)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    try:
        value = read_yaml(text) if text.strip() else None
    except RepeatedKeyError as exc:
        raise ConfigError(f"override {item!r}: {exc}; keep one of them") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: the value is not valid YAML") from exc
    parts = key.strip().split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {item!r}: {where} is not a mapping")
        node = child
    node[parts[-1]] = value


def parse_target(target: str | int | None, where: str = "target") -> tuple[str, int | None]:
    """Split a gradient target into ``(mode, index)``: ``("label", None)`` for None or
    "label", ``("predicted", None)``, ``("class", k)`` or ``("output", K)``."""
    if target is None:
        return "label", None
    if isinstance(target, int) and not isinstance(target, bool):
        if target < 0:
            raise ConfigError(f"{where} is {target}; a class index must be >= 0")
        return "class", target
    if isinstance(target, str):
        if target in ("label", "predicted"):
            return target, None
        head, sep, tail = target.partition(":")
        if head == "output" and sep and tail.strip().isdigit():
            return "output", int(tail)
    raise ConfigError(
        f"{where} is {target!r}; choose label, predicted, a class index k, or 'output:K'"
    )


def to_dict(spec: Spec) -> dict[str, Any]:
    """The resolved config as plain JSON-able data."""
    return dataclasses.asdict(spec)


def from_dict(data: Mapping[str, Any]) -> Spec:
    """Rebuild a spec from :func:`to_dict` output (e.g. the config stored in a store)."""
    return load_config(data)


def parse_layers(
    layers: Iterable[LayerSpec | str | Mapping[str, Any]] | LayerSpec | str | Mapping[str, Any],
) -> list[LayerSpec]:
    """Normalise layer selectors given as names, mappings or :class:`LayerSpec`."""
    parsed = []
    for i, layer in enumerate(_layer_list(layers, "layers")):
        at = f"layers[{i}]"
        if isinstance(layer, LayerSpec):
            check(layer, at)
        else:
            layer = build(LayerSpec, layer if isinstance(layer, Mapping) else {"name": layer}, at)
        parsed.append(layer)
    return parsed
