"""The ``featcache`` command line. Thin: every command calls the library."""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from featcache.errors import ConfigError, FeatcacheError

app = typer.Typer(
    name="featcache",
    help="Build activation caches from pretrained backbones into chunked HDF5 stores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_state = {"debug": False}


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the full traceback on errors.")
    ] = False,
) -> None:
    _state["debug"] = debug


def _friendly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn errors into one line on stderr: exit 2 for usage/config, 1 for runtime."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            typer.echo("featcache: interrupted", err=True)
            raise typer.Exit(130) from None
        except Exception as exc:
            if _state["debug"]:
                traceback.print_exc()
            code = exc.exit_code if isinstance(exc, FeatcacheError) else 1
            message = str(exc) if isinstance(exc, FeatcacheError) else _unexpected(exc)
            typer.echo(f"featcache: error: {message}", err=True)
            raise typer.Exit(code) from None

    return wrapper


def _unexpected(exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first} (rerun with --debug for the traceback)"


@app.command()
@_friendly
def extract(
    config: Annotated[Path, typer.Argument(help="YAML config file.")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a config key: --set loader.batch_size=32."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace stores that already exist.")
    ] = False,
) -> None:
    """Extract the configured layers for every split into HDF5 stores."""
    from featcache.pipeline import extract_from_config

    overrides = list(set_ or [])
    if overwrite:
        overrides.append("output.overwrite=true")
    stores = extract_from_config(config, overrides)
    for store in stores.values():
        typer.echo(_summary(store))


@app.command()
@_friendly
def layers(
    model_or_config: Annotated[
        str, typer.Argument(help="A torchvision model name (e.g. resnet50) or a YAML config.")
    ],
    input_size: Annotated[
        int | None,
        typer.Option("--input-size", help="Side of the square probe image (default: 224)."),
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Also list modules that forward() never calls.")
    ] = False,
) -> None:
    """List module names, types and per-sample output shapes, to choose layers from."""
    from featcache.backbones import build_backbone
    from featcache.layers import describe_layers
    from featcache.spec import ModelSpec, PreprocessSpec, load_config

    if model_or_config.endswith((".yaml", ".yml")) or Path(model_or_config).is_file():
        spec = load_config(model_or_config)
        model_spec, preprocess = spec.model, spec.preprocess
        size = input_size or preprocess.crop or preprocess.resize or 224
    else:
        model_spec, preprocess = ModelSpec(name=model_or_config), PreprocessSpec()
        size = input_size or 224
    if size < 1:
        raise ConfigError("--input-size must be at least 1")
    backbone = build_backbone(model_spec, preprocess)
    rows = [
        info
        for info in describe_layers(backbone.model, input_size=size)
        if all_ or info.output != "-"
    ]
    width = max(len(info.name) for info in rows)
    type_width = max(len(info.type) for info in rows)
    typer.echo(f"{'name':<{width}}  {'type':<{type_width}}  output (per sample, input {size}px)")
    for info in rows:
        typer.echo(f"{info.name:<{width}}  {info.type:<{type_width}}  {info.output}")


@app.command()
@_friendly
def info(
    store: Annotated[Path, typer.Argument(help="A store written by featcache (.h5).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print all attributes as JSON.")] = False,
) -> None:
    """Show a store's rows, layers, completeness and provenance."""
    from featcache.store import FeatureStore

    with FeatureStore(store, allow_incomplete=True) as fs:
        if as_json:
            typer.echo(json.dumps(store_info(fs), indent=2, default=str))
            return
        typer.echo(_describe_store(fs))


@app.command()
@_friendly
def demo(
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Folder for the demo stores.")
    ] = Path("featcache_demo"),
) -> None:
    """Run the embedded demo config (offline, synthetic images) and show its stores."""
    from featcache.demo import run_demo

    stores = run_demo(output)
    for store in stores.values():
        typer.echo(_summary(store))
    typer.echo("")
    typer.echo(_describe_store(stores["train"]))


def store_info(fs: Any) -> dict[str, Any]:
    """Everything ``featcache info`` reports, as plain data."""
    return {
        "path": str(fs.path),
        "bytes": fs.path.stat().st_size,
        "layers": {
            layer: {"shape": list(fs.shape(layer)), **fs.layer_attrs(layer)} for layer in fs.layers
        },
        **fs.attrs,
    }


def _summary(fs: Any) -> str:
    attrs = fs.attrs
    shapes = ", ".join(f"{layer} {list(fs.shape(layer))}" for layer in fs.layers)
    return (
        f"{fs.path}: {len(fs)} rows; {shapes}; {_bytes(fs.path.stat().st_size)}; "
        f"{attrs.get('seconds', 0):.1f} s, {attrs.get('images_per_second', 0):.0f} images/s"
    )


def _describe_store(fs: Any) -> str:
    attrs = fs.attrs
    state = "complete" if fs.complete else f"INCOMPLETE ({fs.rows_written} rows durable)"
    lines = [
        f"store      {fs.path} ({_bytes(fs.path.stat().st_size)})",
        f"status     {state}, {len(fs)} rows, format {attrs.get('featcache_format')}",
        "layers",
    ]
    for layer in fs.layers:
        la = fs.layer_attrs(layer)
        detail = f"{la.get('module')} {la.get('capture')}, reduce={la.get('reduce')}"
        lines.append(f"  {layer:<24} {list(fs.shape(layer))!s:<18} {la.get('dtype'):<9} {detail}")
    classes = fs.class_names
    labels = "none" if not fs.has_labels else f"{len(classes) if classes else '?'} classes"
    if classes:
        shown = ", ".join(classes[:8]) + (" ..." if len(classes) > 8 else "")
        labels += f" ({shown})"
    lines.append(f"labels     {labels}")
    weights = attrs.get("weights")
    if weights:
        lines.append(f"weights    {json.dumps(weights, sort_keys=True)}")
    for key, label in (
        ("split", "split"),
        ("config_fingerprint", "config"),
        ("dataset_fingerprint", "dataset"),
        ("device", "device"),
        ("created", "created"),
    ):
        if key in attrs:
            lines.append(f"{label:<10} {attrs[key]}")
    versions = attrs.get("versions") or {}
    lines.append("versions   " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if "seconds" in attrs:
        lines.append(
            f"run        {attrs['seconds']:.1f} s, {attrs['images_per_second']:.0f} images/s"
        )
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def main() -> None:
    """Console-script entry point."""
    app(prog_name="featcache")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
