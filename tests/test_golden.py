"""The rows of five runs (the demo, per-token text, many models, an update, torchrun)
are those the golden files keep: byte for byte on the hardware that wrote them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.golden import GOLDEN, SCENARIOS, cpu_capability, golden_rows, rows_of

# Elsewhere a float's last bits may round differently; other data differs by far more.
OTHER_HARDWARE_TOLERANCE = 2.0**-7


def assert_same_rows(name: str, got: dict[str, np.ndarray]) -> None:
    want = golden_rows(name)
    assert sorted(got) == sorted(want), name
    exact = (GOLDEN / "cpu_capability.txt").read_text().strip() == cpu_capability()
    for key, expected in want.items():
        value = got[key]
        assert value.dtype == expected.dtype and value.shape == expected.shape, (name, key)
        if exact or not key.startswith("features/"):
            assert np.array_equal(value, expected), (name, key)
            continue
        # float16 and float32 rows compare as float32; bfloat16 rows are uint16 bits.
        assert value.dtype.kind == "f", (name, key)
        new, old = value.astype(np.float32), expected.astype(np.float32)
        scale = np.abs(old).max() or 1.0
        assert np.abs(new - old).max() <= OTHER_HARDWARE_TOLERANCE * scale, (name, key)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_run_writes_the_golden_rows(scenario: str, tmp_path: Path) -> None:
    stores = SCENARIOS[scenario](tmp_path)
    assert stores
    for name, path in stores.items():
        assert_same_rows(name, rows_of(path))


def test_the_golden_rows_are_not_empty() -> None:
    rows = golden_rows("update")
    assert len(rows["ids"]) == 24 and set(rows) >= {"features/layer3", "labels", "index"}
    assert rows["features/layer2"].std() > 0
