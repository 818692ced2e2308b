"""The hf model kind: Hugging Face transformers image models, their weights and image processors.

``model.name`` is ``"hf:<repo id>[@<revision>]"`` (``hf:facebook/dinov2-small``,
``hf:google/vit-base-patch16-224@main``) or ``"hf:<folder>"``, an existing folder written
by ``save_pretrained`` (absolute or relative). Without ``model.weights`` the architecture
comes from the repository's ``config.json`` (``AutoModel.from_config``, seeded);
``weights: pretrained`` loads its weights (``AutoModel.from_pretrained``), offline from the
local Hugging Face cache when ``HF_HUB_OFFLINE=1``. Both are float32 unless
``model.kwargs`` sets ``dtype``; ``model.kwargs`` go to ``from_config``/``from_pretrained``.
Dual encoders (a config with a ``vision_config``: CLIP, SigLIP) give their image tower:
the whole model is built the same way and its ``vision_model`` (``CLIPVisionModel``,
``SiglipVisionModel``) returned, so layer names are relative to it (``encoder.layers.0``).
On text data (``inputs="text"``) the model is built the same way and its text side is
returned with its tokenizer: see :mod:`featcache.models.text`.
The repository's own Python code runs only with ``model.trust_remote_code: true``.

Weights identity: ``{"source": "hf", "repo": ..., "revision": <commit of the cached
snapshot, null for a folder>, "files": {<weight file>: <sha256>}}``, or
``{"source": "random", "seed": seed, "config_sha256": <sha256 of config.json>}``.

Preprocessing (with no explicit ``preprocess``): the repository's image processor, read
from local files only (or, without one, the model type's default processor sized to the
config's ``image_size``), rebuilt as a torchvision pipeline in the processor's own order:
uint8 tensor -> resize (torchvision v2, antialiased: v1 rounds uint8 differently) -> centre
crop (offsets rounded down) -> fused rescale and normalise. Its output equals the
processor's ``pixel_values`` (measured exactly equal on transformers 5.23).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn
from torchvision import transforms as T
from torchvision.transforms import functional as TF
from torchvision.transforms import v2

from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.extras import require
from featcache.fingerprints import file_sha256
from featcache.models.preprocess import Preprocessing, spec_preprocessing
from featcache.models.registry import BuiltModel, Inputs, ModelKind, random_weights
from featcache.spec import ModelSpec, PreprocessSpec

PRETRAINED = "pretrained"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")
# Parameters that hold tokens placed before the patch tokens: ViT/BEiT/DeiT/Dinov2
# ``cls_token``, CLIP ``class_embedding``, DeiT ``distillation_token``, Dinov2 registers.
_PREFIX_PARAMETERS = ("cls_token", "class_embedding", "distillation_token", "register_tokens")
# PIL resample numbers -> the modes transformers' torchvision backend resizes tensors with;
# LANCZOS needs torchvision 0.27 (transformers falls back to bicubic before, as here).
_LANCZOS_OK = tuple(int(n) for n in re.findall(r"\d+", torchvision.__version__)[:2]) >= (0, 27)
_RESAMPLE = {
    0: T.InterpolationMode.NEAREST_EXACT,
    1: T.InterpolationMode.LANCZOS if _LANCZOS_OK else T.InterpolationMode.BICUBIC,
    2: T.InterpolationMode.BILINEAR,
    3: T.InterpolationMode.BICUBIC,
}


@dataclass(frozen=True)
class Source:
    """Where a ``hf:`` reference points: a hub repository (and revision) or a local folder."""

    ref: str  # as written after "hf:"
    repo: str  # repo id, or the folder as written
    revision: str | None = None
    folder: Path | None = None  # set for a local folder

    @property
    def location(self) -> str:
        """What ``from_pretrained`` is given: the repo id or the folder path."""
        return str(self.folder) if self.folder is not None else self.repo


class HFKind(ModelKind):
    """``AutoModel.from_config`` / ``AutoModel.from_pretrained`` of a repository or folder."""

    name = "hf"
    refused_kwargs = {
        "trust_remote_code": "set model.trust_remote_code: true instead (verify and cam "
        "never take it from a store without --trust-factory)"
    }

    def preprocessing(
        self, ref: str, model: ModelSpec, preprocess: PreprocessSpec
    ) -> Preprocessing:
        source = parse_ref(ref)
        check_weights(model)
        if preprocess.is_set():
            return spec_preprocessing(preprocess)
        transformers = _transformers(model)
        config = _load_config(transformers, source, model, local_only=True)
        return processor_preprocessing(_image_processor(transformers, source, model, config))

    def code_run(self, ref: str, model: ModelSpec) -> str | None:
        if not model.trust_remote_code:
            return None
        return (
            f"run the Python code of the Hugging Face repository {parse_ref(ref).repo} "
            "(model.trust_remote_code)"
        )

    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        source = parse_ref(ref)
        check_weights(model)
        transformers = _transformers(model)
        kwargs = {"dtype": torch.float32, **model.kwargs}
        if model.weights is None:
            config = _load_config(transformers, source, model, local_only=False)
            torch.manual_seed(seed)
            module = _call(
                transformers.AutoModel.from_config, source, model, config, **_trust(model), **kwargs
            )
            folder = snapshot(source)
            weights = random_weights(seed)
            weights["config_sha256"] = file_sha256(folder / "config.json")
        else:
            module = _call(
                transformers.AutoModel.from_pretrained,
                source,
                model,
                source.location,
                **remote_kwargs(source, model),
                **kwargs,
            )
            folder = snapshot(source)
            weights = {
                "source": "hf",
                "repo": source.repo,
                "revision": None if source.folder is not None else folder.name,
                "files": {
                    path.relative_to(folder).as_posix(): file_sha256(path)
                    for path in weight_files(folder, model.kwargs)
                },
            }
        if inputs == "text":
            from featcache.models.text import hf_text_model  # it builds on this module

            tower, tokenizer = hf_text_model(transformers, module, source, model)
            return BuiltModel(tower, weights, tokenizer)
        module = image_tower(module, source)
        return BuiltModel(module, weights, None, prefix_tokens(module), False)


def parse_ref(ref: str) -> Source:
    """``"owner/name@rev"`` -> a hub :class:`Source`; an existing folder -> a local one.

    A folder without ``config.json``, or a reference that is neither an existing folder nor
    a repo id, is one :class:`ConfigError`.
    """
    folder = Path(ref).expanduser()
    if ref and folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"model.name 'hf:{ref}': the folder {folder} has no config.json, so it is not "
                "a transformers model folder (write one with save_pretrained, or name a "
                "Hugging Face repo id)"
            )
        return Source(ref, ref, None, folder.resolve())
    repo, at, revision = ref.partition("@")
    if not _REPO_ID.fullmatch(repo) or (at and not revision.strip()):
        raise ConfigError(
            f"model.name 'hf:{ref}' is neither an existing folder nor a Hugging Face repo id; "
            "write 'hf:<owner>/<name>[@<revision>]' or 'hf:<folder written by save_pretrained>'"
        )
    return Source(ref, repo, revision or None)


def check_weights(model: ModelSpec) -> None:
    """Refuse ``model.weights`` other than null (random) and ``"pretrained"``."""
    if model.weights not in (None, PRETRAINED):
        raise ConfigError(
            f"model.weights {model.weights!r} is not available for hf models; use "
            f"'{PRETRAINED}' (the repository's weights) or null (random weights, seeded)"
        )


def image_tower(module: nn.Module, source: Source) -> nn.Module:
    """The image encoder of a dual encoder (its ``vision_model``); other models as they are."""
    if getattr(module.config, "vision_config", None) is None:
        return module
    tower = getattr(module, "vision_model", None)
    if not isinstance(tower, nn.Module):
        raise ConfigError(
            f"model.name 'hf:{source.ref}': {type(module).__name__} has a vision_config but "
            "no vision_model to take images; use a model.factory that returns its image encoder"
        )
    return tower


def prefix_tokens(module: nn.Module) -> int:
    """Tokens before the patch tokens: class, distillation and register token parameters.

    ``cls_token`` ``[1, 1, D]`` and ``class_embedding`` ``[D]`` count 1 each,
    ``register_tokens`` ``[1, R, D]`` counts R: ViT 1, DeiT 2, Dinov2 1 (+ registers),
    CLIP 1, SigLIP 0.
    """
    count = 0
    for name, parameter in module.named_parameters():
        if name.rpartition(".")[2] in _PREFIX_PARAMETERS:
            count += parameter.shape[-2] if parameter.ndim >= 2 else 1
    return count


def weight_files(snapshot: Path, kwargs: dict[str, Any]) -> list[Path]:
    """The weight files ``from_pretrained`` reads from ``snapshot``, by transformers' names.

    ``model.safetensors`` or the shards its ``.index.json`` lists, else ``pytorch_model.bin``
    or its shards; ``kwargs`` ``subfolder``, ``variant`` and ``use_safetensors=False`` are
    honoured as transformers does.
    """
    folder = snapshot / str(kwargs.get("subfolder") or "")
    variant = kwargs.get("variant")
    stems = ["model", "pytorch_model"]
    if kwargs.get("use_safetensors") is False:
        stems = stems[1:]
    for stem in stems:
        suffix = ".safetensors" if stem == "model" else ".bin"
        name = f"{stem}.{variant}{suffix}" if variant else f"{stem}{suffix}"
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / shard for shard in shards]
    raise FeatcacheError(
        f"no weight files (model.safetensors, pytorch_model.bin or their shards) in {folder}"
    )


def processor_preprocessing(processor: Any) -> Preprocessing:
    """A transformers image processor as a picklable torchvision pipeline and its sizes.

    PIL RGB -> uint8 ``[3, H, W]`` -> resize (``size``: ``shortest_edge`` or
    ``height``/``width``, antialiased, ``resample`` as a torchvision mode) -> centre crop
    (``crop_size``, if ``do_center_crop``) -> float32 rescaled (``rescale_factor``) and
    normalised (``image_mean``/``image_std``): the order and rounding of the processor.
    """
    cls = type(processor)
    _check_standard(processor)
    steps: list[Callable[..., Any]] = [T.PILToTensor()]
    decode_size = crop_size = None
    if getattr(processor, "do_resize", False):
        size = _size(processor, "size")
        resample = getattr(processor, "resample", None)
        if not isinstance(resample, T.InterpolationMode):
            resample = _RESAMPLE.get(2 if resample is None else int(resample))
        if resample is None:
            raise ConfigError(
                f"{cls.__name__} resizes with PIL resample {processor.resample!r}, which "
                "featcache does not reproduce; set preprocess.resize/crop/mean/std explicitly"
            )
        if "shortest_edge" in size:
            steps.append(v2.Resize(size["shortest_edge"], resample, antialias=True))
            decode_size = size["shortest_edge"]
        else:
            steps.append(v2.Resize((size["height"], size["width"]), resample, antialias=True))
            decode_size = size["height"] if size["height"] == size["width"] else None
    if getattr(processor, "do_center_crop", False):
        crop = _size(processor, "crop_size")
        if "height" not in crop:
            raise ConfigError(f"{cls.__name__}.crop_size {crop} has no height and width")
        steps.append(CenterCrop(crop["height"], crop["width"]))
        crop_size = crop["height"] if crop["height"] == crop["width"] else None
    steps.append(
        RescaleNormalize(
            float(processor.rescale_factor) if getattr(processor, "do_rescale", False) else None,
            _triple(processor.image_mean) if getattr(processor, "do_normalize", False) else None,
            _triple(processor.image_std) if getattr(processor, "do_normalize", False) else None,
        )
    )
    return Preprocessing(T.Compose(steps), decode_size, crop_size)


class CenterCrop:
    """Centre crop of a ``[C, H, W]`` tensor with transformers' offsets (rounded down).

    torchvision rounds half offsets to even; a one pixel shift would break equality.
    """

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        h, w = image.shape[-2:]
        if self.height > h or self.width > w:  # padded, as both libraries do
            return TF.center_crop(image, [self.height, self.width])
        top, left = int((h - self.height) / 2.0), int((w - self.width) / 2.0)
        return image[..., top : top + self.height, left : left + self.width]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(height={self.height}, width={self.width})"


class RescaleNormalize:
    """uint8 ``[3, H, W]`` -> float32 ``(x * scale - mean) / std``, fused as transformers does.

    With both, ``(x - mean / scale) / (std / scale)``; ``None`` skips a step.
    """

    def __init__(
        self,
        scale: float | None,
        mean: tuple[float, float, float] | None,
        std: tuple[float, float, float] | None,
    ) -> None:
        self.scale, self.mean, self.std = scale, mean, std

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        x = image.to(torch.float32)
        if self.mean is None or self.std is None:
            return x * self.scale if self.scale is not None else x
        mean, std = torch.tensor(self.mean), torch.tensor(self.std)
        if self.scale is not None:
            mean, std = mean * (1.0 / self.scale), std * (1.0 / self.scale)
        return TF.normalize(x, mean.tolist(), std.tolist())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale}, mean={self.mean}, std={self.std})"


def _transformers(model: ModelSpec) -> Any:
    return require("transformers", f"model.name {model.name!r}")


def remote_kwargs(source: Source, model: ModelSpec) -> dict[str, Any]:
    """The revision, and ``trust_remote_code`` as the config says (an explicit False: left
    unset, transformers asks on a terminal whether to run a repository's code)."""
    if source.revision is not None:
        return {"revision": source.revision, **_trust(model)}
    return _trust(model)


def _trust(model: ModelSpec) -> dict[str, Any]:
    return {"trust_remote_code": model.trust_remote_code}


def _call(load: Callable[..., Any], source: Source, model: ModelSpec, *args: Any, **kw: Any) -> Any:
    try:
        return load(*args, **kw)
    except TypeError as exc:  # a constructor rejecting model.kwargs
        raise ConfigError(
            f"model.kwargs {model.kwargs} rejected by hf:{source.ref}: {first_line(exc)}"
        ) from exc
    except OSError as exc:  # not cached, offline, or no network
        raise not_cached(source, exc) from exc
    except ValueError as exc:  # e.g. custom code without trust_remote_code
        if "trust_remote_code" in str(exc) or "custom code" in str(exc):
            raise ConfigError(
                f"model.name 'hf:{source.ref}': the repository has Python code of its own that "
                "loading it runs; set model.trust_remote_code: true to run it, only for a "
                "repository you trust"
            ) from exc
        raise ConfigError(f"model.name 'hf:{source.ref}': {first_line(exc)}") from exc


def _load_config(transformers: Any, source: Source, model: ModelSpec, *, local_only: bool) -> Any:
    extra = {"local_files_only": True} if local_only else {}
    return _call(
        transformers.AutoConfig.from_pretrained,
        source,
        model,
        source.location,
        **remote_kwargs(source, model),
        **extra,
    )


def not_cached(source: Source, exc: BaseException) -> FeatcacheError:
    if source.folder is not None:
        return FeatcacheError(f"hf:{source.ref}: cannot load {source.folder}: {first_line(exc)}")
    from huggingface_hub import constants

    revision = f" --revision {source.revision}" if source.revision else ""
    return FeatcacheError(
        f"hf:{source.ref} is not in the local Hugging Face cache {constants.HF_HUB_CACHE} "
        f"(or could not be downloaded: {first_line(exc)}); "
        f"download it with: hf download {source.repo}{revision}"
    )


def snapshot(source: Source) -> Path:
    """The folder holding the files just read: the local folder or the cached snapshot."""
    if source.folder is not None:
        return source.folder
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(source.repo, "config.json", revision=source.revision)
    if not isinstance(path, str):
        raise not_cached(source, FileNotFoundError("config.json"))
    return Path(path).parent


def _image_processor(transformers: Any, source: Source, model: ModelSpec, config: Any) -> Any:
    """The repository's image processor from local files, or the model type's default."""
    try:
        return transformers.AutoImageProcessor.from_pretrained(
            source.location, **remote_kwargs(source, model), local_files_only=True
        )
    except OSError:  # no preprocessor_config.json
        pass
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(config.model_type) or {}
    name = names.get("torchvision") if isinstance(names, dict) else None
    image_size = getattr(getattr(config, "vision_config", None) or config, "image_size", None)
    if name is None or not isinstance(image_size, int):
        raise ConfigError(
            f"hf:{source.ref} has no image processor (preprocessor_config.json) and its "
            f"model type {config.model_type!r} has no default one with an image_size; "
            "set preprocess.resize/crop/mean/std explicitly"
        )
    cls = getattr(transformers, name)
    default = cls()
    size = dict(default.size)
    if "shortest_edge" in size and getattr(default, "do_center_crop", False):
        # keep the default resize/crop ratio (e.g. 256/224) at the model's image size
        ratio = size["shortest_edge"] / dict(default.crop_size)["height"]
        crop = {"height": image_size, "width": image_size}
        return cls(size={"shortest_edge": round(image_size * ratio)}, crop_size=crop)
    if "shortest_edge" in size:
        return cls(size={"shortest_edge": image_size})
    return cls(size={"height": image_size, "width": image_size})


def _check_standard(processor: Any) -> None:
    """Refuse processors with steps of their own (ConvNeXt's crop_pct, padding, tiling)."""
    from transformers.image_processing_backends import TorchvisionBackend

    cls = type(processor)
    own = [
        method
        for method in ("_preprocess", "resize", "center_crop", "rescale_and_normalize")
        if getattr(cls, method, None) is not getattr(TorchvisionBackend, method)
    ]
    if not issubclass(cls, TorchvisionBackend):
        own = ["a backend other than torchvision's"]
    elif getattr(processor, "do_pad", False):
        own.append("padding")
    if own:
        raise ConfigError(
            f"{cls.__name__} preprocesses in its own way ({', '.join(own)}), which featcache "
            "does not reproduce; set preprocess.resize/crop/mean/std explicitly"
        )


def _size(processor: Any, attribute: str) -> dict[str, int]:
    size = {k: v for k, v in dict(getattr(processor, attribute)).items() if v is not None}
    if set(size) not in ({"shortest_edge"}, {"height", "width"}):
        raise ConfigError(
            f"{type(processor).__name__}.{attribute} {size} is not a shortest_edge or a "
            "height and width, which featcache reproduces; set preprocess explicitly"
        )
    return size


def _triple(values: Any) -> tuple[float, float, float]:
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    a, b, c = (float(v) for v in values)
    return a, b, c
