"""Layer selectors: index and slice steps over containers, never dropping what is missing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from featcache.capture.selectors import resolve_taps
from featcache.errors import ConfigError


@pytest.fixture
def model() -> nn.Module:
    """``blocks``: a Sequential of 6, ``stages``: a ModuleList of 3 whose last holds 2 blocks."""
    net = nn.Module()
    net.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(6)])
    net.stages = nn.ModuleList([nn.Module() for _ in range(3)])
    net.stages[2].blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
    return net


@pytest.mark.parametrize(
    ("selector", "keys"),
    [
        ("blocks[-1]", ["blocks.5"]),
        ("blocks[-4:]", ["blocks.2", "blocks.3", "blocks.4", "blocks.5"]),
        ("blocks[::2]", ["blocks.0", "blocks.2", "blocks.4"]),
        ("blocks[1:3].0", ["blocks.1.0", "blocks.2.0"]),
        ("stages[2].blocks[0]", ["stages.2.blocks.0"]),
        ("stages[-1].blocks[-1]", ["stages.2.blocks.1"]),
        ("blocks.1", ["blocks.1"]),
    ],
)
def test_index_and_slice_steps(model, selector, keys):
    assert [tap.key for tap in resolve_taps(model, [selector])] == keys


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("blocks[6]", r"index 6 is out of range; blocks has 6 entries \(0\.\.5\)"),
        ("blocks[-7]", r"index -7 is out of range; blocks has 6 entries"),
        ("blocks[9:]", r"\[9:\] selects no module"),
        ("stages[1].blocks[0]", r"'stages.1.blocks' is not a module"),
    ],
)
def test_bad_steps_are_errors_never_dropped(model, selector, message):
    with pytest.raises(ConfigError, match=message):
        resolve_taps(model, [selector])


def test_indices_count_a_module_used_twice_and_refuse_its_second_use():
    shared = nn.Linear(2, 2)
    net = nn.Module()
    net.blocks = nn.Sequential(shared, nn.ReLU(), shared, nn.Tanh())  # 4 entries
    assert [tap.key for tap in resolve_taps(net, ["blocks[3]"])] == ["blocks.3"]
    assert [tap.key for tap in resolve_taps(net, ["blocks[-3]"])] == ["blocks.1"]
    assert [tap.key for tap in resolve_taps(net, ["blocks[0]"])] == ["blocks.0"]
    for selector in ("blocks[2]", "blocks[-2]", "blocks[1:3]"):
        with pytest.raises(ConfigError, match="blocks.2 is the module blocks.0 used again"):
            resolve_taps(net, [selector])


def test_brackets_on_no_module_stay_a_glob(resnet18):
    assert [tap.key for tap in resolve_taps(resnet18, ["layer[12]"])] == ["layer1", "layer2"]
    assert [tap.key for tap in resolve_taps(resnet18, ["layer4[-1].conv1"])] == ["layer4.1.conv1"]


def test_the_model_itself_is_selected_by_a_dot(tmp_path):
    import featcache

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    ).eval()
    (tap,) = resolve_taps(model, ["."])
    assert (tap.key, tap.module_name) == ("output", "")
    images = torch.utils.data.TensorDataset(torch.randn(10, 3, 8, 8))
    store = featcache.extract(
        model, images, [".", "0"], tmp_path / "s.h5", dtype="float32", progress=False
    )
    with torch.no_grad():
        expected = model(images.tensors[0])
    assert store.layers == ["output", "0"]
    torch.testing.assert_close(store.read("output"), expected, rtol=1e-5, atol=1e-6)
