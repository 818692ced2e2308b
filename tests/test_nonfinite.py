"""featcache.extraction.nonfinite: which rows hold a NaN or an Inf."""

from __future__ import annotations

import math

import pytest
import torch

import featcache  # noqa: F401  (the compat shim before anything imports torchvision)
from featcache.extraction.nonfinite import nonfinite_rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_is_judged_as_isfinite_judges_it(dtype):
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    rows = values.reshape(-1, 1)  # one value per row
    assert torch.equal(nonfinite_rows(rows), ~torch.isfinite(rows).all(dim=1))
    mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))
    assert int(nonfinite_rows(rows).sum()) == 2 * 2**mantissa_bits  # all-ones exponent, +/-


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rows_with_a_nan_or_an_inf_anywhere_are_found(dtype):
    info = torch.finfo(dtype)
    specials = [float("inf"), -float("inf"), float("nan"), -float("nan")]
    edges = [info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0, info.eps]
    values = torch.randn(len(specials) + len(edges), 3, 5).to(dtype)
    for row, special in enumerate(specials + edges):
        values[row, row % 3, row % 5] = special
    expected = [True] * len(specials) + [False] * len(edges)
    assert nonfinite_rows(values).tolist() == expected


def test_rows_without_values_are_finite():
    assert nonfinite_rows(torch.zeros(3, 0, dtype=torch.float16)).tolist() == [False] * 3
    assert nonfinite_rows(torch.zeros(0, 4, dtype=torch.float32)).tolist() == []
