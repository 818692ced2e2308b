"""The timm model kind: ``"timm:<name>[.<tag>]"`` through ``timm.create_model`` and timm's
eval transform; weights files go through timm's own loader (it adapts classifiers).

Weights identity: ``{"source": "timm", "name", "tag", "files": {<file name>: <sha256>}}``
of the file timm read, or ``{"source": "random", "seed": seed}``.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torchvision import transforms as T

from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError, FeatcacheError, did_you_mean, first_line
from featcache.models.preprocess import Preprocessing, single_size, spec_preprocessing
from featcache.models.registry import BuiltModel, Inputs, ModelKind, random_weights, refuse_text
from featcache.util.extras import require
from featcache.util.fingerprints import file_sha256

PRETRAINED = "pretrained"

# The weights file names timm tries on the hub, in order, when a tag names none.
_HUB_FILES = ("model.safetensors", "pytorch_model.safetensors", "pytorch_model.bin")


class TimmKind(ModelKind):
    """``timm.create_model("<name>[.<tag>]", pretrained=..., **model.kwargs)``."""

    name = "timm"
    refused_kwargs = dict.fromkeys(
        ("checkpoint_path", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay"),
        "it chooses weights the recorded weights identity would not show; give them as "
        "model.weights (pretrained, or a local file)",
    )

    def preprocessing(
        self, ref: str, model: ModelSpec, preprocess: PreprocessSpec
    ) -> Preprocessing:
        timm = require("timm", f"model.name {model.name!r}")
        name, tag = parse_ref(timm, ref)
        check_weights(timm, name, tag, model.weights)
        if preprocess.is_set():
            return spec_preprocessing(preprocess)
        return timm_preprocessing(timm, ref, model.kwargs)

    def build(self, ref: str, model: ModelSpec, seed: int, inputs: Inputs = "image") -> BuiltModel:
        if inputs != "image":
            raise refuse_text(model)
        timm = require("timm", f"model.name {model.name!r}")
        name, tag = parse_ref(timm, ref)
        weights = check_weights(timm, name, tag, model.weights)
        if weights is None:
            return _built(_create(timm, ref, model.kwargs, seed), random_weights(seed))
        cfg = timm.models.get_pretrained_cfg(ref)
        if weights == PRETRAINED:
            path = hub_weights_file(timm, ref, cfg)
            custom = getattr(cfg, "custom_load", False) == "hf"  # hub files are native otherwise
        else:
            path = Path(weights)
            custom = bool(getattr(cfg, "custom_load", False)) and path.suffix == ".npz"
        # Reading the file named here, rather than letting timm look it up again, makes
        # the identity below that of the file actually loaded.
        overlay = {"file": str(path), "custom_load": custom}
        module = _create(timm, ref, model.kwargs, seed, overlay, local=weights != PRETRAINED)
        identity = {
            "source": "timm",
            "name": name,
            "tag": getattr(cfg, "tag", None) or tag or None,
            "files": {path.name: file_sha256(path)},
        }
        if weights != PRETRAINED and not custom:
            random = _not_in_file(timm, module, path, cfg, ref)
            if random:  # a new classifier, as timm makes for another num_classes
                identity["random"] = {"seed": seed, "keys": random}
        return _built(module, identity)


def parse_ref(timm: ModuleType, ref: str) -> tuple[str, str]:
    """``"vit_small_patch16_224.augreg_in21k"`` -> ``("vit_small_patch16_224", "augreg_in21k")``
    (tag ``""`` if none); an unknown or deprecated name or tag is a :class:`ConfigError`."""
    name, _, tag = ref.partition(".")
    deprecated = timm.models.get_deprecated_models()
    if name in deprecated:
        current = deprecated[name]
        use = f"; use timm:{current}" if current else ""
        raise ConfigError(f"timm model {name!r} is deprecated{use}")
    names = timm.list_models()
    if name not in names:
        hint = did_you_mean(name, names)
        raise ConfigError(f"unknown timm model {name!r}{hint} (timm.list_models() lists them all)")
    if tag and ref not in timm.models.get_arch_pretrained_cfgs(name):
        tagged = timm.list_pretrained(f"{name}.*")
        hint = did_you_mean(ref, tagged)
        known = f"timm.list_pretrained('{name}.*') lists its tags" if tagged else "it has none"
        raise ConfigError(f"unknown pretrained tag {tag!r} for timm model {name}{hint} ({known})")
    return name, tag


def check_weights(timm: ModuleType, name: str, tag: str, weights: str | None) -> str | None:
    """``model.weights`` checked, downloading nothing: None, ``"pretrained"`` or a file."""
    ref = f"{name}.{tag}" if tag else name
    if weights == PRETRAINED:
        cfg = timm.models.get_pretrained_cfg(ref)
        if cfg is None or not cfg.has_weights:
            tagged = timm.list_pretrained(f"{name}.*")
            listed = f"; tags with weights: {', '.join(tagged[:8])}" if tagged else ""
            raise ConfigError(f"timm has no pretrained weights for {ref}{listed}")
        return PRETRAINED
    if weights is None or os.path.isfile(weights):
        return weights
    missing = "no such file; " if Path(weights).suffix or os.sep in weights else ""
    raise ConfigError(
        f"model.weights {weights!r} for timm:{ref}: {missing}use null (random weights), "
        f"{PRETRAINED!r} (timm's weights for the tag) or the path of an existing weights file"
    )


def timm_preprocessing(timm: ModuleType, ref: str, kwargs: dict[str, Any]) -> Preprocessing:
    """timm's eval transform (PIL RGB -> float32 [3, H, W]) for ``ref`` with ``kwargs``, at
    the input size of a copy built on the meta device (no memory, no download)."""
    config = _data_config(timm, ref, kwargs)
    transform = timm.data.create_transform(**config, is_training=False)
    steps = list(getattr(transform, "transforms", []))
    # Only a plain Resize first resizes the shorter side (squash and border modes do not).
    first = steps[0] if steps else None
    decode_size = single_size(first.size) if isinstance(first, T.Resize) else None
    crops = [s for s in steps if type(s).__name__ in ("CenterCrop", "CenterCropOrPad")]
    crop = crops[0].size if crops else None  # 32, [32] or (32, 32); a rectangle has no side
    if isinstance(crop, (list, tuple)) and len(crop) == 2 and crop[0] == crop[1]:
        crop = crop[0]
    return Preprocessing(transform, decode_size, single_size(crop))


def hub_weights_file(timm: ModuleType, ref: str, cfg: Any) -> Path:
    """The local file of ``ref``'s pretrained weights, under the names timm tries, from the
    hub cache (downloaded unless ``HF_HUB_OFFLINE``) or, off the hub, their URL.

    Raises:
        FeatcacheError: not cached while offline, or the download failed.
    """
    hub_id = getattr(cfg, "hf_hub_id", None)
    try:
        import huggingface_hub
    except ImportError:
        hub_id = None
    if not hub_id:
        return _url_weights_file(timm, ref, cfg)
    from huggingface_hub import constants, errors

    repo, _, revision = hub_id.partition("@")
    names = _hub_file_names(getattr(cfg, "hf_hub_filename", None))
    cache = constants.HF_HUB_CACHE
    fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    remote_missing = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)
    for filename in names:
        cached = huggingface_hub.try_to_load_from_cache(repo, filename, revision=revision or None)
        if isinstance(cached, str):
            return Path(cached)
        if cached is not None or constants.HF_HUB_OFFLINE:  # known absent, or cannot ask
            continue
        try:
            path = huggingface_hub.hf_hub_download(
                repo,
                filename,
                revision=revision or None,
                library_name="timm",
                library_version=timm.__version__,
            )
        except Exception as exc:
            if isinstance(exc, remote_missing) and not isinstance(
                exc, errors.LocalEntryNotFoundError
            ):
                continue
            raise FeatcacheError(
                f"could not download the weights of timm:{ref} from {repo} "
                f"({first_line(exc, with_type=True)}); check the network, or fetch them into "
                f"{cache} with: {fetch}"
            ) from exc
        return Path(path)
    if constants.HF_HUB_OFFLINE:
        raise FeatcacheError(
            f"the weights of timm:{ref} ({repo}) are not in the Hugging Face cache {cache} "
            f"and HF_HUB_OFFLINE is set; fetch them once online with: {fetch}"
        )
    raise FeatcacheError(f"{repo} on the Hugging Face hub has none of {', '.join(names)}")


def _hub_file_names(filename: str | None) -> list[str]:
    """The hub file names timm tries for ``hf_hub_filename``, safetensors first."""
    if not filename or filename == "pytorch_model.bin":
        return list(_HUB_FILES)
    if filename.endswith(".bin"):
        return [filename[: -len(".bin")] + ".safetensors", filename]
    return [filename]


def _url_weights_file(timm: ModuleType, ref: str, cfg: Any) -> Path:
    url = getattr(cfg, "url", None)
    if not url:
        raise FeatcacheError(f"timm names no weights file for {ref}")
    cache = timm.models._hub.get_cache_dir()
    try:
        return Path(timm.models._hub.download_cached_file(url, check_hash=False))
    except OSError as exc:  # urllib's URLError is an OSError
        raise FeatcacheError(
            f"could not download the weights of timm:{ref} from {url} ({first_line(exc)}); "
            f"check the network, or put the file in {cache}"
        ) from exc


def _data_config(timm: ModuleType, ref: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        with torch.device("meta"):
            module = timm.create_model(ref, pretrained=False, **kwargs)
    except TypeError as exc:
        raise _kwargs_error(ref, kwargs, exc) from exc
    except Exception:  # a model that cannot be built on the meta device
        module = None
    if module is not None:
        config: dict[str, Any] = timm.data.resolve_model_data_config(module)
        input_config = getattr(timm.models, "get_model_input_config", None)
        if input_config is not None:
            config["input_size"] = tuple(input_config(module)["input_size"])
        return config
    cfg = timm.models.get_pretrained_cfg(ref)
    args: dict[str, Any] = {}
    size = kwargs.get("img_size")
    if isinstance(size, int):
        args["img_size"] = size
    elif isinstance(size, (list, tuple)) and len(size) == 2:
        args["input_size"] = (kwargs.get("in_chans", 3), *size)
    pretrained_cfg = cfg.to_dict() if cfg is not None else {"architecture": ref}
    return dict(timm.data.resolve_data_config(args, pretrained_cfg=pretrained_cfg))


def _create(
    timm: ModuleType,
    ref: str,
    kwargs: dict[str, Any],
    seed: int,
    overlay: dict[str, Any] | None = None,
    *,
    local: bool = False,
) -> nn.Module:
    extra = {} if overlay is None else {"pretrained_cfg_overlay": overlay}
    torch.manual_seed(seed)
    try:
        module: nn.Module = timm.create_model(
            ref, pretrained=overlay is not None, **extra, **kwargs
        )
    except TypeError as exc:  # timm's constructors reject unknown kwargs with it
        raise _kwargs_error(ref, kwargs, exc) from exc
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        if overlay is None:
            raise
        # A state dict that does not fit the model (missing keys, other shapes).
        error = ConfigError if local else FeatcacheError
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # torch's load_state_dict leads with "Error(s) in loading state_dict for X:".
        reason = lines[1] if len(lines) > 1 and lines[0].endswith(":") else first_line(exc)
        raise error(
            f"timm could not load {overlay['file']} into timm:{ref}"
            f"{f' with kwargs {kwargs}' if kwargs else ''}: {reason}"
        ) from exc
    return module


def _not_in_file(timm: ModuleType, module: nn.Module, path: Path, cfg: Any, ref: str) -> list[str]:
    """The weights of ``module`` that the local file ``path`` lacks: a classifier of another
    size, left random (seeded). timm drops a file's classifier when ``num_classes`` differs
    from its tag's, even where it fits, so one that fits is loaded here; any other missing
    weight is a ConfigError. A file whose keys timm converts is left as timm loaded it."""
    try:
        stored = timm.models.load_state_dict(str(path), weights_only=True)
    except Exception:  # timm has read it already; a form it converts is not compared
        return []
    own = module.state_dict()
    if not any(key in own for key in stored):
        return []
    heads = getattr(cfg, "classifier", None) or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)

    def is_head(key: str) -> bool:
        return any(key == h or key.startswith(f"{h}.") for h in heads)

    fitting = {
        k: v for k, v in stored.items() if is_head(k) and k in own and own[k].shape == v.shape
    }
    module.load_state_dict(fitting, strict=False)
    missing = sorted(k for k in own if k not in stored or (is_head(k) and k not in fitting))
    foreign = [key for key in stored if key not in own and not is_head(key)]
    if foreign:
        raise ConfigError(
            f"model.weights {path} holds {len(foreign)} weights that timm:{ref} does not have "
            f"({_some(foreign)}): it is another model's; give the weights file of this model"
        )
    body = [key for key in missing if not is_head(key)]
    if body:
        raise ConfigError(
            f"model.weights {path} holds no values for {len(body)} weights of timm:{ref} "
            f"({_some(body)}), which would stay random; give the weights file of this model"
        )
    return missing


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _kwargs_error(ref: str, kwargs: dict[str, Any], exc: Exception) -> ConfigError:
    return ConfigError(f"model.kwargs {kwargs} rejected by timm's {ref}: {first_line(exc)}")


def _built(module: nn.Module, weights: dict[str, Any]) -> BuiltModel:
    # Class, distillation and register tokens in timm's ViTs, DeiTs, EVAs...; 0 for CNNs.
    prefix = int(getattr(module, "num_prefix_tokens", 0) or 0)
    return BuiltModel(module, weights, prefix_tokens=prefix, sequence_first=False)
