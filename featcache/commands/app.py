"""The ``featcache`` command line. Thin: every command calls the library."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from featcache.commands.output import friendly, say, state
from featcache.errors import ConfigError

app = typer.Typer(
    name="featcache",
    help="Build activation caches from pretrained backbones into chunked HDF5 stores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click output: a usage error is the usage line and one "Error: ..." line, not
    # a drawn box, as every other featcache error is one line.
    rich_markup_mode=None,
)

# The config of a run, and the --set overrides of its keys (extract, plan).
ConfigFile = Annotated[Path, typer.Argument(help="YAML config file.")]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a config key: --set loader.batch_size=32."),
]

# The one option that lets a command rebuild what a store's recorded config names as code.
TrustFactory = Annotated[
    bool,
    typer.Option(
        "--trust-factory",
        help="Allow the recorded config to run the code it names (a factory, a "
        "repository's own code).",
    ),
]


def _command(function: Callable[..., Any]) -> Callable[..., Any]:
    """A command of the app, its errors printed as one line each (`friendly`)."""
    return app.command()(friendly(function))


def _version(show: bool) -> None:
    if show:
        from featcache import __version__

        say(f"featcache {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the full traceback on errors.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    state["debug"] = debug


@_command
def extract(
    config: ConfigFile,
    set_: Overrides = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace stores that already exist.")
    ] = False,
    update: Annotated[
        bool,
        typer.Option(
            "--update",
            help="Bring stores that exist up to date: compute only new or changed samples "
            "and new layers, copy the rest (output.update).",
        ),
    ] = False,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            min=1,
            help="Only N samples of each split, spread evenly over it (every class of a "
            "class folder), into <output.dir>/limit-N/ (data.limit): a quick trial.",
        ),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard",
            metavar="I/N",
            help="Run as job I of N independent ones (0 <= I < N; a Slurm array, an indexed "
            "job): compute the rows of block I that no shard holds; the job that finds every "
            "row done combines the store.",
        ),
    ] = None,
    ignore_free_space: Annotated[
        bool,
        typer.Option(
            "--ignore-free-space",
            help="Run even when the output filesystem looks too small for the stores.",
        ),
    ] = False,
) -> None:
    """Extract the configured layers for every split into HDF5 stores.

    Before the first batch, the stores are sized (one row through the model) and a run
    the output filesystem cannot hold is refused, unless --ignore-free-space.
    """
    from featcache.extraction import extract_from_config
    from featcache.extraction.distributed import current_rank, parse_shard
    from featcache.extraction.from_config import resume_command
    from featcache.store.history import describe_run

    flags = {"output.overwrite=true": overwrite, "output.update=true": update}
    flags[f"data.limit={limit}"] = limit is not None
    overrides = [*(set_ or []), *(flag for flag, given in flags.items() if given)]
    rank = current_rank()
    main = rank is None or rank.is_main
    started = time.time_ns()
    try:
        stores = extract_from_config(
            config, overrides, check_space=not ignore_free_space, shard=shard
        )
    except KeyboardInterrupt:
        if main:
            job = rank if shard is None else parse_shard(shard)
            again = resume_command(config, overrides, job)
            message = f"featcache: interrupted; what was written is kept, and `{again}` resumes it"
            say(message, err=True)
        raise typer.Exit(130) from None
    if main:
        for store in stores.values():
            done_before = store.path.stat().st_mtime_ns < started  # a rerun found it complete
            say(store.describe().summary() + ("; already complete" if done_before else ""))
            history = store.attrs.get("history") or []
            if update and not done_before and history:
                say(f"{store.path}: {describe_run(history[-1])}")
    if shard is not None:  # the stores other jobs' rows keep from completing yet
        from featcache.config.spec import load_config

        spec = load_config(config, overrides)
        for one in spec.per_model().values() if spec.models else [spec]:
            for split in spec.data.splits:
                path = one.store_path(split)
                if not path.is_file():
                    say(
                        f"{path}: rows of shard {shard} done; other jobs' rows remain "
                        f"(`featcache info {path}` lists them)"
                    )


@_command
def plan(
    config: ConfigFile,
    set_: Overrides = None,
    batches: Annotated[
        int, typer.Option("--batches", min=1, help="Batches timed per batch size.")
    ] = 3,
) -> None:
    """Before a run: rows, bytes per layer and in total, free space, time, a batch size.

    One row runs through the model to size the stores, and a few batches of the first
    split at the config's batch size, half of it and twice it to time the run; nothing
    is written. Of a config of several models (models:), each model is planned alone.
    """
    from featcache.config.spec import load_config
    from featcache.extraction.planning import plan as plan_run

    spec = load_config(config, set_ or [])
    for key, one in spec.per_model().items() if spec.models else [("", spec)]:
        if key:  # a config of several models: each planned as a run of its own
            say(f"model {key}:")
        say(plan_run(one, batches=batches).format())


@_command
def layers(
    model_or_config: Annotated[
        str,
        typer.Argument(
            help="A model name (resnet50, timm:vit_small_patch16_224, hf:<repo or folder>, "
            "open_clip:<architecture>) or a YAML config."
        ),
    ],
    input_size: Annotated[
        int | None,
        typer.Option(
            "--input-size",
            help="Side of the square probe image (default: the size the model's preprocessing "
            "gives, else 224).",
        ),
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Also list modules that forward() never calls.")
    ] = False,
    text: Annotated[
        bool,
        typer.Option(
            "--text",
            help="Probe the model's text side with a short text (a config with "
            "text data does so by itself).",
        ),
    ] = False,
) -> None:
    """List module names, types and per-sample output shapes, to choose layers from."""
    from featcache.models import backbone_layers

    found, shown = backbone_layers(model_or_config, input_size=input_size, text=text)
    rows = [info for info in found if all_ or info.output != "-"]
    if not rows:
        unused = " (--all lists the ones it holds)" if found and not all_ else ""
        raise ConfigError(
            f"{model_or_config}: no submodule runs in the model's forward(){unused}, so the "
            "only layer to capture is the model itself: name it as layers: ['.']"
        )
    width = max(len(info.name) for info in rows)
    type_width = max(len(info.type) for info in rows)
    say(f"{'name':<{width}}  {'type':<{type_width}}  output (per sample, {shown})")
    for info in rows:
        say(f"{info.name:<{width}}  {info.type:<{type_width}}  {info.output}")


@_command
def info(
    store: Annotated[Path, typer.Argument(help="A store written by featcache (.h5).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print all attributes as JSON.")] = False,
) -> None:
    """Show a store's rows, layers, completeness and provenance."""
    from featcache.store import FeatureStore
    from featcache.store.paths import PARTIAL_SUFFIX, store_path_of
    from featcache.store.shards import describe_shards

    if store.name.endswith(PARTIAL_SUFFIX) and not store.is_file():  # not its store instead
        done = store_path_of(store)
        fix = f"for the store, run `featcache info {done}`" if done.is_file() else "check the path"
        raise ConfigError(f"{store} does not exist: no run of {done} is stopped or running; {fix}")
    if not store.exists() and not as_json:  # a store not combined yet: its shards' rows
        lines = describe_shards(store)
        if lines:
            say("\n".join(lines))
            return
    with FeatureStore(store, allow_incomplete=True) as fs:
        description = fs.describe()
    say(description.to_json() if as_json else description.format())


@_command
def verify(
    store: Annotated[Path, typer.Argument(help="A store made by `featcache extract`.")],
    samples: Annotated[
        int,
        typer.Option(
            "--samples",
            "-k",
            help="Random rows to recompute besides the first and last; -1 for every row.",
        ),
    ] = 8,
    seed: Annotated[int, typer.Option("--seed", help="Seed for choosing the rows.")] = 0,
    device: Annotated[
        str | None, typer.Option("--device", help="Device to recompute on (default: the config's).")
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="Check the file alone (key, alignment, checksums); no model or data."
        ),
    ] = False,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="Rebuild from this config instead of the recorded one."),
    ] = None,
    trust_factory: TrustFactory = False,
) -> None:
    """Check a store: recompute rows from its config and compare everything it records.

    A store is data: verify never runs code a recorded config names (model.factory,
    model.trust_remote_code) unless --trust-factory is given. Exit code 0 when every check
    passes, 1 when any fails.
    """
    from featcache.commands.verify import recorded_code, verify_store

    if trust_factory and config is None and not quick:
        code = recorded_code(store)
        if code is not None:
            say(f"--trust-factory: verify will {code}", err=True)
    result = verify_store(
        store,
        samples,
        seed=seed,
        device=device,
        quick=quick,
        config=config,
        trust_factory=trust_factory,
    )
    for check in result.checks:
        say(f"{'ok' if check.ok else 'FAIL':<5} {check.name:<10} {check.detail}")
    failed = [check.name for check in result.checks if not check.ok]
    if failed:
        say(f"verify: FAIL ({', '.join(failed)}): {result.path}")
        raise typer.Exit(1)
    say(f"verify: PASS ({len(result.rows)} rows recomputed): {result.path}")


@_command
def merge(
    store: Annotated[Path, typer.Argument(help="A store, typically one made by torchrun.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The single file to write.")],
    compression: Annotated[
        str | None,
        typer.Option(
            "--compression",
            help="gzip[:1-9], lzf, zstd[:1-22], blosc2-lz4 or blosc2-zstd (with -shuffle or "
            "-bitshuffle, :0-9), as store.compression takes them (default: none).",
        ),
    ] = None,
) -> None:
    """Copy a sharded store into one self-contained file (no shard files needed)."""
    from featcache.store import merge_store
    from featcache.util.compression import check_compression

    check_compression(compression, "--compression")
    merged = merge_store(store, output, compression)
    say(merged.describe().summary())


@_command
def demo(
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Folder for the demo stores.")
    ] = Path("featcache_demo"),
) -> None:
    """Run the embedded demo config (offline, synthetic images), show its stores, and
    probe every layer."""
    from featcache.commands.demo import VAL_FRACTION, run_demo, run_demo_probe
    from featcache.probe import format_table
    from featcache.util.plotting import PLOT_EXTRA

    stores = run_demo(output)
    for store in stores.values():
        say(store.describe().summary())
    say("")
    say(stores["train"].describe().format())
    results, json_path, png_path = run_demo_probe(stores, output)
    say("")
    train, val = stores["train"].path.name, stores["val"].path.name
    held_out = f"{100 * VAL_FRACTION:.0f}% of {train}"
    say(
        f"linear probes: lambda chosen on a held-out {held_out}, refit on all of {train}, "
        f"scored on {val}"
    )
    say(format_table(results, val=held_out, test=val))
    best = max(results, key=lambda result: result.top1)
    chance = best.test["chance_top1"] if best.test else best.val["chance_top1"]
    say(
        f"best layer {best.layer}: {100 * best.top1:.1f}% top-1 on {val} against "
        f"{100 * chance:.1f}% for chance ({best.num_classes} classes)"
    )
    if png_path is None:
        say(f"wrote {json_path} (for the chart too: {PLOT_EXTRA})")
    else:
        say(f"wrote {json_path} and {png_path}")


@_command
def probe(
    train: Annotated[Path, typer.Argument(help="Store to fit the probes on (.h5).")],
    layer: Annotated[
        str, typer.Option("--layer", "-l", help="A stored layer, a comma-separated list, or all.")
    ],
    val: Annotated[
        Path | None, typer.Option("--val", help="Store that chooses the regularisation.")
    ] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option("--val-fraction", help="Share of TRAIN held out instead (default 0.2)."),
    ] = None,
    test: Annotated[
        Path | None, typer.Option("--test", help="Held-out store to report accuracy on.")
    ] = None,
    trainer: Annotated[
        str,
        typer.Option("--trainer", help="auto, full (L-BFGS in memory) or streaming (batches)."),
    ] = "auto",
    max_memory: Annotated[
        str, typer.Option("--max-memory", help="Bigger features stream from disk (auto).")
    ] = "4GiB",
    lambdas: Annotated[
        str | None,
        typer.Option("--lambdas", help="Comma-separated L2 grid (default 1e-6 ... 1e2)."),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, ...")] = "auto",
    epochs: Annotated[
        int | None, typer.Option("--epochs", help="Streaming: passes per fit.")
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Streaming: rows per step.")
    ] = 1024,
    num_workers: Annotated[
        int, typer.Option("--num-workers", help="Streaming: DataLoader workers.")
    ] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the split and batch order.")] = 0,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Results JSON (default: beside TRAIN)."),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="PNG of top-1 per layer (default with several layers)."),
    ] = None,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Progress bars on stderr.")
    ] = True,
    method: Annotated[
        str, typer.Option("--method", help="linear, knn (weighted k-NN), or both: linear,knn.")
    ] = "linear",
    k: Annotated[
        str, typer.Option("--k", help="k-NN: the numbers of neighbours that vote.")
    ] = "10,20,100,200",
    temperature: Annotated[
        float, typer.Option("--temperature", help="k-NN: a neighbour votes exp(cosine / T).")
    ] = 0.07,
    shots: Annotated[
        str | None,
        typer.Option("--shots", help="Few-shot: rows per class drawn from train, e.g. 1,5,10."),
    ] = None,
    draws: Annotated[
        int | None, typer.Option("--draws", help="Few-shot: seeded draws per shot (default 5).")
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option("--recipe", help="A published linear-probe recipe: dinov3 or clip."),
    ] = None,
    normalize: Annotated[
        str | None,
        typer.Option(
            "--normalize",
            help="standardize, l2, l2+standardize or none (default: standardize, the recipe's; "
            "k-NN: l2).",
        ),
    ] = None,
) -> None:
    """Evaluate stored layers: linear probes (lambda chosen on validation), weighted k-NN,
    few-shot probes; accuracy reported on test."""
    from featcache.probe import (
        default_output,
        evaluate,
        format_result,
        format_table,
        plot_layers,
        requested_layers,
        save_results,
    )
    from featcache.util.files import output_file

    # The output names are checked before the fit: a bad one fails now, not after minutes.
    names = requested_layers(train, layer)
    output = output_file(output or default_output(train, names), (".json",), "results file")
    if plot is None and len(names) > 1:  # a layer curve is drawn beside the results
        plot = output.with_suffix(".png")
    if plot is not None:
        plot = output_file(plot, (".png",), "plot")
    grid = None
    if lambdas is not None:
        try:
            grid = [float(value) for value in lambdas.split(",") if value.strip()]
        except ValueError:
            raise ConfigError(f"--lambdas {lambdas!r} is not a list like 1e-4,1e-3,1e-2") from None
    results = evaluate(
        train,
        layer,
        val=val,
        test=test,
        val_fraction=val_fraction,
        trainer=trainer,
        lambdas=grid,
        max_memory=max_memory,
        epochs=epochs,
        batch_size=batch_size,
        num_workers=num_workers,
        device=device,
        seed=seed,
        progress=progress,
        methods=method,
        ks=k,
        temperature=temperature,
        shots=shots,
        draws=draws,
        recipe=recipe,
        normalize=normalize,
    )
    say(format_result(results[0]) if len(results) == 1 else format_table(results))
    say(f"wrote {save_results(results, output)}")
    if plot is not None:
        say(f"wrote {plot_layers(results, plot)}")


@_command
def show(
    store: Annotated[Path, typer.Argument(help="A store written by featcache (.h5).")],
    layer: Annotated[str, typer.Option("--layer", "-l", help="A stored layer key.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The PNG to write.")],
    row: Annotated[int, typer.Option("--row", "-r", help="The store row to show.")] = 0,
    max_channels: Annotated[
        int, typer.Option("--max-channels", help="Show at most this many channels.")
    ] = 64,
    nrow: Annotated[
        int | None, typer.Option("--nrow", help="Channels per grid row (default: square).")
    ] = None,
    scale: Annotated[int, typer.Option("--scale", help="Enlarge each channel this often.")] = 4,
) -> None:
    """Write one row's feature map as a grid of channel images (each scaled on its own)."""
    from featcache.commands.visualize import save_feature_grid

    path = save_feature_grid(
        store, layer, row, output, max_channels=max_channels, nrow=nrow, scale=scale
    )
    say(f"wrote {path}")


@_command
def cam(
    store: Annotated[Path, typer.Argument(help="A store with activations and gradients.")],
    layer: Annotated[
        str, typer.Option("--layer", "-l", help="The activation layer (gradients beside it).")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The PNG to write.")],
    row: Annotated[int, typer.Option("--row", "-r", help="The store row.")] = 0,
    alpha: Annotated[float, typer.Option("--alpha", help="Weight of the CAM colours.")] = 0.5,
    scale: Annotated[int, typer.Option("--scale", help="Enlarge the picture this often.")] = 1,
    trust_factory: TrustFactory = False,
) -> None:
    """Write a Grad-CAM map of one row over its source image.

    A store is data: cam runs no code its recorded config names unless --trust-factory.
    """
    from featcache.commands.visualize import cam_overlay

    path = cam_overlay(
        store, layer, row, output, alpha=alpha, scale=scale, trust_factory=trust_factory
    )
    say(f"wrote {path}")


def main() -> None:
    """Console-script entry point."""
    app(prog_name="featcache")


if __name__ == "__main__":  # pragma: no cover
    main()
