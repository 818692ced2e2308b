"""``extract_from_config``: the extraction a YAML config describes, one store per split."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcache.distributed import Rank, check_other_world_sizes, current_rank, launch_words
from featcache.errors import ConfigError, FeatcacheWarning
from featcache.extraction.api import extract
from featcache.extraction.sharding import extract_shard
from featcache.provenance import config_fingerprint
from featcache.spec import Spec, load_config, override_list, to_dict
from featcache.store import FeatureStore, check_output_path, stored_resume_key
from featcache.store.lock import writer_lock
from featcache.store.resume import interrupted_overwrite

if TYPE_CHECKING:
    from featcache.models import Backbone
    from featcache.sources import SourceDataset


def extract_from_config(
    config: str | os.PathLike | Mapping[str, Any] | Spec, overrides: Iterable[str] = ()
) -> dict[str, FeatureStore]:
    """Run the extraction a config describes; one complete store per split.

    ``config`` is a YAML path, a mapping, or a loaded :class:`~featcache.spec.Spec`;
    ``overrides`` are ``key.sub=value`` strings applied first. Every split's output path
    is checked, and locked against other writers (:mod:`featcache.store.lock`), before
    any work starts.
    """
    overrides = override_list(overrides)
    if isinstance(config, Spec) and overrides:
        raise ConfigError(
            "overrides apply to a config file or mapping, not to a loaded Spec; pass the "
            "config itself, or apply them with featcache.spec.load_config(config, overrides)"
        )
    spec = config if isinstance(config, Spec) else load_config(config, overrides)
    rank = current_rank()
    with contextlib.ExitStack() as held:
        if rank is None or rank.is_main:  # other ranks lock only their own shards
            for split in spec.data.splits:
                held.enter_context(writer_lock(spec.store_path(split)))
        return _extract_splits(spec, rank, resume_command(config, overrides, rank))


def check_same_classes(class_names: Mapping[str, Sequence[str] | None]) -> None:
    """Refuse splits whose class names differ (those that name none aside): label ``i``
    would stand for one class in one split's store and another in the next.

    Raises:
        ConfigError: naming the first two splits that differ and the classes one lacks.
    """
    named = [(split, list(names)) for split, names in class_names.items() if names]
    if not named:
        return
    first, first_names = named[0]
    for split, names in named[1:]:
        if names != first_names:
            lacking = sorted(set(first_names) ^ set(names)) or first_names[:3]
            raise ConfigError(
                f"splits {first!r} and {split!r} have different classes ({len(first_names)} "
                f"vs {len(names)}; differing: {', '.join(lacking[:5])}), so a label would name "
                "different classes in their stores; give every split the same classes (the "
                "same class folders, where an empty one counts, or integer labels)"
            )


def resume_command(
    config: str | os.PathLike | Mapping[str, Any] | Spec,
    overrides: Iterable[str] = (),
    rank: Rank | None = None,
) -> str | None:
    """The command line that resumes an interrupted run of ``config`` (None for a config
    given as data rather than a file): under torchrun when ``rank`` says the run was, with
    as many processes."""
    if not isinstance(config, (str, os.PathLike)):
        return None
    words = [*launch_words(rank), "extract", os.path.abspath(config)]
    for override in overrides:
        if override.replace(" ", "") != "output.overwrite=true":  # would start over
            words += ["--set", override]
    return shlex.join(words)


def build_backbone_for(spec: Spec) -> Backbone:
    """The backbone ``spec.model`` names, built for what the data holds (images or text)."""
    from featcache.models import build_backbone

    return build_backbone(
        spec.model, spec.preprocess, seed=spec.runtime.seed, inputs=spec.data.inputs
    )


def build_source_for(spec: Spec, split: str, backbone: Backbone) -> SourceDataset:
    """The source of ``split``, decoded by ``backbone``'s transform or its tokenizer
    (JPEGs at reduced scale first only with ``loader.decode: fast``)."""
    from featcache.sources import build_source

    decode_size = backbone.decode_size if spec.loader.decode == "fast" else None
    return build_source(spec.data, split, backbone.transform, decode_size, backbone.tokenizer)


def preprocessing_record(backbone: Backbone, max_length: int | None) -> str:
    """What a text store records as its preprocessing: the tokenizer and the length cap."""
    tokenizer = backbone.tokenizer
    assert tokenizer is not None  # a text backbone always has one
    limit = tokenizer.max_length  # data.max_length caps it, never raises it
    if max_length is not None:
        limit = max_length if limit is None else min(limit, max_length)
    return f"tokenizer {tokenizer.name}, max_length {limit}"


def _extract_splits(spec: Spec, rank: Rank | None, command: str | None) -> dict[str, FeatureStore]:
    stale: dict[str, list[Path]] = {}
    for split in spec.data.splits:  # fail before any work on a store made differently
        path = spec.store_path(split)
        if rank is None:  # a one-process run does not resume a torchrun run's shards
            # Under --overwrite they go once the new store has replaced the one they make
            # up: a run that fails keeps that store whole.
            stale[split] = check_other_world_sizes(path, 1, spec.output.overwrite, delete=False)
        key = stored_resume_key(path) if path.exists() else None
        fingerprint = config_fingerprint(spec)
        if key is None or key.get("config_fingerprint") != fingerprint:
            resumes = interrupted_overwrite(path, {"config_fingerprint": fingerprint})
            check_output_path(path, spec.output.overwrite or resumes)
    text = spec.data.inputs == "text"
    backbone = build_backbone_for(spec)
    sources = {split: build_source_for(spec, split, backbone) for split in spec.data.splits}
    check_same_classes({split: source.class_names for split, source in sources.items()})
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
            "config_fingerprint": config_fingerprint(spec),
            "weights": backbone.weights,
            "split": split,
            "source": {"kind": spec.data.source, "split": spec.data.splits[split]},
            "preprocessing": preprocessing_record(backbone, spec.data.max_length)
            if text
            else repr(backbone.transform),  # as resolved: the zoo's own, or preprocess keys
        }
        provenance["working_folder"] = os.getcwd()  # the config's relative paths start here
        if command is not None:
            provenance["resume_command"] = command
            provenance["resume_folder"] = os.getcwd()
        arguments = dict(
            provenance=provenance,
            dataset_fingerprint=source.fingerprint(content=spec.data.content_hash),
            prefix_tokens=backbone.prefix_tokens,
            sequence_first=backbone.sequence_first,
            **options,
        )
        path = spec.store_path(split)
        limit = spec.data.limit
        rows = None if limit is None else range(min(limit, len(source)))  # the first N
        if rank is None:
            stores[split] = extract(
                backbone.model, source, spec.layers, path, rows=rows, **arguments
            )
            for shard in stale[split]:
                shard.unlink(missing_ok=True)
        else:
            stores[split] = extract_shard(
                backbone.model, source, spec.layers, path, rank, arguments, rows
            )
        report_retries(split, source)
    return stores


def report_retries(split: str, source: SourceDataset) -> None:
    """Warn, with their count by kind, when remote reads of ``split`` were retried."""
    from featcache.sources.remote import retries_of

    retried = retries_of(source)
    if retried:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in retried.items())
        warnings.warn(
            f"split {split}: {sum(retried.values())} remote reads were retried after "
            f"transient failures ({kinds})",
            FeatcacheWarning,
            stacklevel=3,
        )
