"""The embedded demo: a config that runs offline, anywhere, in well under a minute."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from featcache.config.spec import Spec, load_config
from featcache.extraction import extract_from_config
from featcache.probe import ProbeResult, plot_layers, probe_layers, save_results
from featcache.store import FeatureStore
from featcache.util.plotting import has_matplotlib

# The share of the train store the demo's probes hold out to choose lambda.
VAL_FRACTION = 0.2


def demo_config_path() -> Path:
    """The demo config shipped inside the package (``configs/demo.yaml`` is a copy)."""
    return Path(str(resources.files("featcache").joinpath("demo.yaml")))


def demo_spec(output: str | os.PathLike = "featcache_demo") -> Spec:
    """The demo config, writing into ``output`` (quoted, so that YAML reads ``out #1`` or
    ``123`` as a folder name)."""
    folder = json.dumps(str(Path(output)))
    return load_config(demo_config_path(), [f"output.dir={folder}", "output.overwrite=true"])


def run_demo(output: str | os.PathLike = "featcache_demo") -> dict[str, FeatureStore]:
    """Extract the demo stores into ``output`` (replacing earlier demo stores there)."""
    return extract_from_config(demo_spec(output))


def run_demo_probe(
    stores: dict[str, FeatureStore], output: str | os.PathLike = "featcache_demo"
) -> tuple[list[ProbeResult], Path, Path | None]:
    """Probe every demo layer (lambda chosen on :data:`VAL_FRACTION` of train, top-1 on val);
    returns the results, ``probe-layers.json`` and ``probe-layers.png`` (``None`` without
    matplotlib) written into ``output``."""
    results = probe_layers(
        stores["train"].path,
        "all",
        test=stores["val"].path,
        val_fraction=VAL_FRACTION,
        progress=False,
    )
    path = save_results(results, Path(output) / "probe-layers.json")
    chart = plot_layers(results, path.with_suffix(".png")) if has_matplotlib() else None
    return results, path, chart
