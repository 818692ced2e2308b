"""A small sample of scripts/fuzz_store.py's sweeps: a changed byte in any stored chunk,
and a partial file cut short or zero-filled, never give a wrong row."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_store.py"
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the trials run in forks")


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    """The fuzzing script as a module, and a folder holding its reference store."""
    spec = importlib.util.spec_from_file_location("fuzz_store", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_store"] = module
    spec.loader.exec_module(module)
    folder = tmp_path_factory.mktemp("fuzz")
    module.extract(folder / "reference.h5")
    return module, folder


@pytest.mark.parametrize("target", ["store", "shard", "partial"])
def test_a_changed_byte_in_a_stored_chunk_gives_true_rows_or_one_line(fuzz, target):
    module, folder = fuzz
    outcomes = module.flips(folder, target, 12, random.Random(target))
    assert not [o for o in outcomes if o.startswith("FAIL")], outcomes
    assert outcomes["refused"] > 0  # the changed bytes were found


def test_a_partial_file_cut_or_zero_filled_resumes_to_the_true_rows_or_is_refused(fuzz):
    module, folder = fuzz
    outcomes = module.torn(folder, 4, random.Random(7))
    assert not [o for o in outcomes if o.startswith("FAIL")], outcomes
    assert sum(outcomes.values()) == 4


def test_the_judge_sees_wrong_rows_and_loose_refusals(fuzz):
    module, _ = fuzz
    expected = {name: module.np.arange(8) for name in module.DATASETS}
    wrong = {"read labels": module.np.arange(8)[::-1]}
    assert module.judge(wrong, expected, 8, None) == "FAIL: read labels gave wrong rows"
    error = module.FeatcacheError("store s.h5 is corrupted: dataset labels rows 4-7 fail")
    assert module.judge({"read labels": error}, expected, 8, ("labels", 5)) == "refused"
    assert module.judge({"read labels": error}, expected, 8, ("labels", 2)).startswith("FAIL")
    assert module.judge({"read index": error}, expected, 8, ("index", 5)).startswith("FAIL")
