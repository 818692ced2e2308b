"""A small sample of scripts/zoo_sweep.py: featcache against each zoo's own pipeline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import shared_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "zoo_sweep.py"


@pytest.fixture(scope="module")
def zoo_sweep():
    shared_file("hymenoptera.tar")  # the real photos; skips without them
    spec = importlib.util.spec_from_file_location("zoo_sweep", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["zoo_sweep"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("kind", "name"),
    [("torchvision", "swin_t"), ("timm", "mambaout_femto"), ("hf", "beit")],
)
def test_stored_features_equal_the_zoos_own_pipeline(zoo_sweep, kind, name):
    (outcome,) = zoo_sweep.sweep([kind], 2, zoo_sweep.Settings(only=frozenset({name})))
    assert not outcome.skipped, outcome.skipped
    assert outcome.passed(zoo_sweep.TOLERANCE), outcome.line(zoo_sweep.TOLERANCE)


def test_the_sweep_tells_draft_decoding_from_the_zoos_pixels(zoo_sweep):
    settings = zoo_sweep.Settings(decode="fast", only=frozenset({"resnet18"}))
    (outcome,) = zoo_sweep.sweep(["timm"], 2, settings)
    assert not outcome.skipped and not outcome.passed(zoo_sweep.TOLERANCE)
    assert outcome.raw > 100 * zoo_sweep.TOLERANCE  # other pixels: other features
