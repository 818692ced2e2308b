"""The hf model kind: ``"hf:<repo id>[@<revision>]"`` or ``"hf:<folder>"`` through
``AutoModel`` (float32 unless ``model.kwargs`` sets ``dtype``); a dual encoder gives its
image tower, or on text data its text side (:mod:`featcache.models.text`).

Weights identity: ``{"source": "hf", "repo", "revision": <commit of the cached snapshot,
null for a folder>, "files": {<weight file>: <sha256>}}``, or ``{"source": "random",
"seed": seed, "config_sha256": <sha256 of config.json>}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcache.config.spec import ModelSpec, PreprocessSpec
from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.models.hf_processor import processor_preprocessing
from featcache.models.hub import (
    Source,
    check_reachable,
    not_cached,
    quiet_loading,
    remote_kwargs,
    snapshot,
)
from featcache.models.preprocess import Preprocessing, spec_preprocessing
from featcache.models.registry import BuiltModel, Inputs, ModelKind, random_weights
from featcache.models.text import hf_text_model
from featcache.util.extras import require
from featcache.util.fingerprints import file_sha256

PRETRAINED = "pretrained"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")
# Parameters that hold tokens placed before the patch tokens: ViT/BEiT/DeiT/Dinov2
# ``cls_token``, CLIP ``class_embedding``, DeiT ``distillation_token``, Dinov2 registers.
_PREFIX_PARAMETERS = ("cls_token", "class_embedding", "distillation_token", "register_tokens")


class HFKind(ModelKind):
    """``AutoModel.from_config`` / ``AutoModel.from_pretrained`` of a repository or folder."""

    name = "hf"
    refused_kwargs = {
        "trust_remote_code": "set model.trust_remote_code: true instead (verify and cam "
        "never take it from a store without --trust-factory)",
        "ignore_mismatched_sizes": "it leaves the weights that do not fit at random, which "
        "the recorded weights identity would not show; give weights that fit the model",
    }

    def preprocessing(
        self, ref: str, model: ModelSpec, preprocess: PreprocessSpec
    ) -> Preprocessing:
        source = parse_ref(ref)
        check_weights(model)
        if preprocess.is_set():
            return spec_preprocessing(preprocess)
        transformers = require("transformers", f"model.name {model.name!r}")
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
        transformers = require("transformers", f"model.name {model.name!r}")
        kwargs = {"dtype": torch.float32, **model.kwargs}
        # Weights the files lack (a pooler, say) start at random, seeded so that a rerun
        # gives the same values.
        torch.manual_seed(seed)
        if model.weights is None:
            config = _load_config(transformers, source, model, local_only=False)
            kwargs["trust_remote_code"] = model.trust_remote_code
            module = _call(transformers.AutoModel.from_config, source, model, config, **kwargs)
            folder = snapshot(source)
            weights = {**random_weights(seed), "config_sha256": file_sha256(folder / "config.json")}
        else:
            module, loading = _call(
                transformers.AutoModel.from_pretrained,
                source,
                model,
                source.location,
                output_loading_info=True,
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
            missing = sorted(loading.get("missing_keys") or [])
            if missing:  # recorded, so that the identity says which weights are not the files'
                weights["random"] = {"seed": seed, "keys": missing}
        if inputs == "text":
            tower, tokenizer = hf_text_model(transformers, module, source, model)
            return BuiltModel(tower, weights, tokenizer)
        module = image_tower(module, source)
        return BuiltModel(module, weights, None, prefix_tokens(module), False)


def parse_ref(ref: str) -> Source:
    """``"owner/name@rev"`` -> a hub :class:`Source`; an existing folder (with ``config.json``)
    -> a local one; anything else is a :class:`ConfigError`."""
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
    """Tokens before the patch tokens: 1 per ``[D]`` or ``[1, 1, D]`` token parameter, R per
    ``register_tokens`` ``[1, R, D]`` (ViT 1, DeiT 2, Dinov2 1 + registers, CLIP 1, SigLIP 0)."""
    count = 0
    for name, parameter in module.named_parameters():
        if name.rpartition(".")[2] in _PREFIX_PARAMETERS:
            count += parameter.shape[-2] if parameter.ndim >= 2 else 1
    return count


def weight_files(snapshot: Path, kwargs: dict[str, Any]) -> list[Path]:
    """The weight files ``from_pretrained`` reads from ``snapshot`` with these ``kwargs``."""
    folder = snapshot / str(kwargs.get("subfolder") or "")
    variant = kwargs.get("variant")
    files = [("model", ".safetensors"), ("pytorch_model", ".bin")]
    if kwargs.get("use_safetensors") is False:
        files = files[1:]
    for stem, suffix in files:
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


def _call(load: Callable[..., Any], source: Source, model: ModelSpec, *args: Any, **kw: Any) -> Any:
    """The transformers loader ``load(*args, **kw)``, quietly, once the hub has answered for
    an uncached repository; its failures as one line each."""
    if not kw.get("local_files_only"):
        check_reachable(source)
    try:
        with quiet_loading():
            return load(*args, **kw)
    except TypeError as exc:  # a constructor rejecting model.kwargs
        raise ConfigError(
            f"model.kwargs {model.kwargs} rejected by hf:{source.ref}: {first_line(exc)}"
        ) from exc
    except OSError as exc:  # not cached, offline, or no network
        raise not_cached(source, exc) from exc
    except RuntimeError as exc:  # weights whose shapes do not fit the config
        raise ConfigError(
            f"model.name 'hf:{source.ref}': its weights do not fit its config "
            f"({first_line(exc)}); give a folder whose config.json and weights belong together"
        ) from exc
    except ValueError as exc:  # e.g. custom code without trust_remote_code
        if "trust_remote_code" in str(exc) or "custom code" in str(exc):
            raise ConfigError(
                f"model.name 'hf:{source.ref}': the repository has Python code of its own that "
                "loading it runs; set model.trust_remote_code: true to run it, only for a "
                "repository you trust"
            ) from exc
        raise ConfigError(f"model.name 'hf:{source.ref}': {first_line(exc)}") from exc


def _load_config(transformers: Any, source: Source, model: ModelSpec, *, local_only: bool) -> Any:
    return _call(
        transformers.AutoConfig.from_pretrained,
        source,
        model,
        source.location,
        **remote_kwargs(source, model),
        local_files_only=local_only,
    )


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
