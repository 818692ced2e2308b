"""The embedded demo: a config that runs offline, anywhere, in well under a minute."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from featcache.pipeline import extract_from_config
from featcache.spec import Spec, load_config
from featcache.store import FeatureStore


def demo_config_path() -> Path:
    """The demo config shipped inside the package (``configs/demo.yaml`` is a copy)."""
    return Path(str(resources.files("featcache").joinpath("demo.yaml")))


def demo_spec(output: str | os.PathLike = "featcache_demo") -> Spec:
    return load_config(demo_config_path(), [f"output.dir={Path(output)}", "output.overwrite=true"])


def run_demo(output: str | os.PathLike = "featcache_demo") -> dict[str, FeatureStore]:
    """Extract the demo stores into ``output`` (replacing earlier demo stores there)."""
    return extract_from_config(demo_spec(output))
