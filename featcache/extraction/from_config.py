"""``extract_from_config``: the extraction a YAML config describes, one store per split."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from featcache.config.spec import Spec, load_config, override_list, to_dict
from featcache.errors import ConfigError, FeatcacheWarning
from featcache.extraction.api import run_plan
from featcache.extraction.distributed import Rank, current_rank, launch_words, parse_shard
from featcache.extraction.estimate import check_free_space, estimate_store
from featcache.extraction.many import Decoded, ModelRun, estimate_runs, run_models
from featcache.extraction.plan import RunOptions, make_plan
from featcache.extraction.sharding import extract_shard
from featcache.store import FeatureStore, check_output_path
from featcache.store.lock import writer_lock
from featcache.store.paths import shards_of
from featcache.store.provenance import config_fingerprint
from featcache.store.state import StoreState, store_state

if TYPE_CHECKING:
    from featcache.models import Backbone
    from featcache.sources import SourceDataset


def extract_from_config(
    config: str | os.PathLike | Mapping[str, Any] | Spec,
    overrides: Iterable[str] = (),
    *,
    check_space: bool = True,
    update: bool = False,
    shard: str | None = None,
) -> dict[str, FeatureStore]:
    """Run the extraction a config describes; one complete store per split.

    ``shard="I/N"`` (``--shard I/N``) runs this process as job I of N independent ones
    (a Slurm array, a Kubernetes indexed job): it computes the rows of block I of N that
    no shard holds yet, as shards beside the stores, and the job that finds every row
    held combines a store (see `featcache.extraction.sharding`); the stores it
    returns are those complete so far. Under torchrun the ranks share the rows the
    same way, and meet to combine.

    ``update=True`` (the config's ``output.update``, ``--update``) brings stores that
    exist up to date: only new or changed samples and new layers are computed, the rest
    is copied (`featcache.extraction.update`).

    ``config`` is a YAML path, a mapping, or a loaded [`Spec`][featcache.config.spec.Spec];
    ``overrides`` are ``key.sub=value`` strings applied first. Every split's output path
    is checked, and locked against other writers (`featcache.store.lock`), before
    any work starts. So is the free space: a run whose stores (every split's, together)
    the output filesystem cannot hold is refused in one line before the first batch,
    unless ``check_space=False`` (under torchrun each rank checks its own shards).
    """
    overrides = override_list(overrides)
    if isinstance(config, Spec) and overrides:
        raise ConfigError(
            "overrides apply to a config file or mapping, not to a loaded Spec; pass the "
            "config itself, or apply them with featcache.config.spec.load_config(config, overrides)"
        )
    spec = config if isinstance(config, Spec) else load_config(config, overrides)
    if update and not spec.output.update:
        spec = dataclasses.replace(spec, output=dataclasses.replace(spec.output, update=True))
        spec.validate("")
    rank = current_rank()
    if shard is not None:
        if rank is not None:
            raise ConfigError(
                "--shard I/N runs one of N independent processes; under torchrun the ranks "
                "share the rows themselves, so drop --shard (or run without torchrun)"
            )
        if spec.output.overwrite:
            raise ConfigError(
                "--overwrite with --shard would let each job delete the others' rows; "
                "delete the store and its shards first, or run one job without --shard"
            )
        rank = parse_shard(shard)
    with contextlib.ExitStack() as held:
        # Other ranks lock only their own shards, as do --shard jobs (the one that
        # combines a store locks it then).
        if rank is None or rank.group and rank.is_main:
            for one in spec.per_model().values() if spec.models else [spec]:
                for split in spec.data.splits:
                    held.enter_context(writer_lock(one.store_path(split)))
        command = resume_command(config, overrides, rank)
        if spec.models:
            return _extract_models(spec, rank, command, check_space)
        return _extract_splits(spec, rank, command, check_space)


def check_same_classes(class_names: Mapping[str, Sequence[str] | None]) -> None:
    """Refuse splits whose class names differ (those that name none aside).

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
    given as data rather than a file), launched as ``rank`` says the run was."""
    if not isinstance(config, (str, os.PathLike)):
        return None
    words = [*launch_words(rank), "extract", os.path.abspath(config)]
    for override in overrides:
        if override.replace(" ", "") != "output.overwrite=true":  # would start over
            words += ["--set", override]
    if rank is not None and not rank.group:
        words += ["--shard", f"{rank.rank}/{rank.world_size}"]
    return shlex.join(words)


def build_backbone_for(spec: Spec) -> Backbone:
    """The backbone ``spec.model`` names, built for what the data holds (images or text)."""
    from featcache.models import build_backbone

    return build_backbone(
        spec.model, spec.preprocess, seed=spec.runtime.seed, inputs=spec.data.inputs
    )


def build_source_for(spec: Spec, split: str, backbone: Backbone) -> SourceDataset:
    """The source of ``split``, decoded by ``backbone``'s transform or its tokenizer."""
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


def run_options(spec: Spec) -> RunOptions:
    """The run options the config's loader, store, runtime and output sections set."""
    return RunOptions(
        loader=spec.loader,
        store=spec.store,
        runtime=spec.runtime,
        overwrite=spec.output.overwrite,
        update=spec.output.update,
    )


def split_arguments(
    spec: Spec,
    split: str,
    source: SourceDataset,
    backbone: Backbone,
    command: str | None,
    fingerprint: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of :func:`~featcache.extraction.plan.make_plan` for one split
    of ``spec`` besides the model, source, layers and options: provenance, the dataset
    fingerprint (when ``fingerprint``) and the model's token layout."""
    text = spec.data.inputs == "text"
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
    return dict(
        provenance=provenance,
        dataset_fingerprint=source.fingerprint(content=spec.data.content_hash)
        if fingerprint
        else None,
        prefix_tokens=backbone.prefix_tokens,
        sequence_first=backbone.sequence_first,
    )


def complete_already(spec: Spec, split: str) -> bool:
    """Whether ``split``'s store is complete, from the same config, and not to be
    overwritten: a run then leaves it as it is."""
    state = store_state(spec.store_path(split))
    if spec.output.overwrite or not state.complete or state.key is None:
        return False
    return state.key.get("config_fingerprint") == config_fingerprint(spec)


def _extract_models(
    spec: Spec, rank: Rank | None, command: str | None, check_space: bool
) -> dict[str, FeatureStore]:
    """The stores of every model of ``spec.models``, keyed ``<model key>/<split>``: over
    one pass of each split's samples (:mod:`featcache.extraction.many`); under torchrun,
    ``--update`` or over shards, one model after the other."""
    from featcache.sources import build_source

    specs = spec.per_model()
    sharded = any(
        shards_of(one.store_path(split)) for one in specs.values() for split in spec.data.splits
    )
    if rank is not None or spec.output.update or sharded and not spec.output.overwrite:
        return {
            f"{key}/{split}": store
            for key, one in specs.items()
            for split, store in _extract_splits(one, rank, command, check_space).items()
        }
    if spec.data.inputs == "text":
        raise ConfigError(
            "models: several models share one pass over images; each text model tokenizes "
            "the text its own way, so give each its own config"
        )
    if spec.loader.decode == "fast":
        raise ConfigError(
            "loader.decode: fast decodes JPEGs at each model's own size, but several models "
            "share one decoding; set loader.decode: exact (the default)"
        )
    states = {key: _check_outputs(one) for key, one in specs.items()}
    backbones = {key: build_backbone_for(one) for key, one in specs.items()}
    sources = {split: build_source(spec.data, split, None) for split in spec.data.splits}
    # Decoded once: each model's checks before the pass read the same first rows.
    decoded = {split: Decoded(source) for split, source in sources.items()}
    check_same_classes({split: source.class_names for split, source in sources.items()})
    runs: dict[str, list[ModelRun]] = {}
    fingerprints = {}
    for split, source in sources.items():
        fingerprints[split] = source.fingerprint(content=spec.data.content_hash)
        runs[split] = []
        for key, one in specs.items():
            backbone = backbones[key]
            arguments = split_arguments(one, split, source, backbone, command, fingerprint=False)
            own = {k: arguments[k] for k in ("provenance", "prefix_tokens", "sequence_first")}
            path = one.store_path(split)
            runs[split].append(ModelRun(backbone.model, one.layers, path, backbone.transform, own))
    options = run_options(spec)
    if check_space:  # every model's and split's store, before any work
        estimates = []
        for split in sources:
            todo = [
                r
                for key, r in zip(specs, runs[split], strict=True)
                if not complete_already(specs[key], split)
            ]
            estimates += estimate_runs(
                todo, decoded[split], options, dataset_fingerprint=fingerprints[split]
            )
        check_free_space(estimates, spec.output.overwrite)
    stores = {}
    for split, source in sources.items():
        made = run_models(
            runs[split],
            decoded[split],
            options,
            dataset_fingerprint=fingerprints[split],
            check_space=False,
        )
        for key, store in zip(specs, made, strict=True):
            stores[f"{key}/{split}"] = store
            for shard in states[key][split].shards:  # --overwrite: replaced now
                shard.unlink(missing_ok=True)
        report_retries(split, source)
    return stores


def _check_outputs(spec: Spec) -> dict[str, StoreState]:
    """Refuse a split whose store exists and was made differently (unless overwritten or
    updated); returns the state of each split's store path."""
    states = {}
    fingerprint = config_fingerprint(spec)
    for split in spec.data.splits:
        path = spec.store_path(split)
        state = states[split] = store_state(path)
        if state.key is None or state.key.get("config_fingerprint") != fingerprint:
            resumes = state.interrupted_overwrite({"config_fingerprint": fingerprint})
            check_output_path(path, spec.output.overwrite or spec.output.update or resumes)
    return states


def _extract_splits(
    spec: Spec, rank: Rank | None, command: str | None, check_space: bool
) -> dict[str, FeatureStore]:
    if spec.output.update and rank is not None:
        raise ConfigError(
            "--update runs in one process; run `featcache extract CONFIG --update` without "
            "torchrun (the copied rows are I/O, the computed ones usually few)"
        )
    states = _check_outputs(spec)  # fail before any work on a store made differently
    backbone = build_backbone_for(spec)
    sources = {split: build_source_for(spec, split, backbone) for split in spec.data.splits}
    check_same_classes({split: source.class_names for split, source in sources.items()})
    options = run_options(spec)
    plans = {}
    if rank is None:
        for split, source in sources.items():
            arguments = split_arguments(spec, split, source, backbone, command)
            plans[split] = make_plan(backbone.model, source, spec.layers, options, **arguments)
    if check_space and rank is None:  # every split's store, before any work
        estimates = [
            estimate_store(plan, spec.store_path(split))
            for split, plan in plans.items()
            if not complete_already(spec, split)
        ]
        check_free_space(estimates, spec.output.overwrite)
    stores = {}
    for split, source in sources.items():
        path = spec.store_path(split)
        # One process over the shards of a run of several goes on from them, as one rank;
        # with --overwrite they are deleted once its store is in place.
        shards = states[split].shards
        sharded = shards and not spec.output.overwrite
        runner = Rank(0, 1, 0, 1, group=False) if rank is None and sharded else rank
        if runner is None:
            stores[split] = run_plan(plans[split], path, check_space=False)
            for shard in shards if spec.output.overwrite else ():
                shard.unlink(missing_ok=True)
        else:
            arguments = split_arguments(spec, split, source, backbone, command)
            store = extract_shard(
                backbone.model, source, spec.layers, path, runner, options, arguments, check_space
            )
            if store is not None:  # None: other --shard jobs' rows remain
                stores[split] = store
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
