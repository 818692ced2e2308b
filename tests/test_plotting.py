"""The optional matplotlib dependency: every chart fails in one line when it is missing."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from featcache.commands.visualize import jet
from featcache.errors import FeatcacheError
from featcache.probe import ProbeResult, plot_layers
from featcache.util.plotting import PLOT_EXTRA, require_matplotlib


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Make ``import matplotlib`` (and its submodules) raise ImportError."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _result(layer: str) -> ProbeResult:
    metrics = {"top1": 0.5, "chance_top1": 0.25}
    return ProbeResult(
        layer, [4], "full", 4, None, 1e-3, [], 8, 2, 0, "", metrics, None, {}, {}, []
    )


def _one_line_naming_the_extra(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message and message.endswith(PLOT_EXTRA)
    return message


def test_require_matplotlib_passes_when_installed():
    require_matplotlib()


def test_missing_matplotlib_is_one_line_naming_the_extra(no_matplotlib, tmp_path):
    with pytest.raises(FeatcacheError) as info:
        require_matplotlib("drawing a test")
    assert _one_line_naming_the_extra(info).startswith("drawing a test needs matplotlib")
    with pytest.raises(FeatcacheError) as info:
        plot_layers([_result("a"), _result("b")], tmp_path / "curve.png")
    _one_line_naming_the_extra(info)
    assert not (tmp_path / "curve.png").exists()
    with pytest.raises(FeatcacheError) as info:
        jet(torch.zeros(2, 2))
    _one_line_naming_the_extra(info)


def test_jet_is_matplotlibs_colour_map():
    rgb = jet(torch.tensor([[0.0, 0.5, 1.0, 2.0]]))
    assert rgb.shape == (3, 1, 4) and rgb.dtype == torch.float32
    # jet runs from dark blue through green-ish cyan/yellow to dark red; values clamp to [0, 1]
    np.testing.assert_allclose(rgb[:, 0, 0], [0.0, 0.0, 0.5], atol=1e-6)
    np.testing.assert_allclose(rgb[:, 0, 2], [0.5, 0.0, 0.0], atol=1e-6)
    assert torch.equal(rgb[:, 0, 3], rgb[:, 0, 2])
    assert rgb[1, 0, 1] > 0.9  # the middle is mostly green
