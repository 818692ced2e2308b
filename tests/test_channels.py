"""4-d outputs that keep their channels last are pooled, shown and listed by channel."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import featcache
from featcache.capture.channels import AMBIGUOUS, channel_layout
from featcache.capture.layers import describe_layers
from featcache.commands.visualize import feature_grid
from featcache.errors import ConfigError

IMAGES = TensorDataset(torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0)))
OPTIONS = {"batch_size": 3, "dtype": "float32", "progress": False, "num_workers": 0}


def _stage_outputs(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Each named module's output over IMAGES, by a plain forward hook."""
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = [
        modules[name].register_forward_hook(
            lambda m, a, out, name=name: outputs.setdefault(name, out.detach())
        )
        for name in names
    ]
    with torch.no_grad():
        model.eval()(IMAGES.tensors[0])
    for handle in handles:
        handle.remove()
    return outputs


def _timm(name: str, **kwargs):
    import timm

    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **kwargs).eval()


@pytest.mark.parametrize(
    ("build", "stages"),
    [
        (lambda: _timm("swin_tiny_patch4_window7_224", img_size=64, window_size=2), "layers"),
        (lambda: _timm("mambaout_femto"), "stages"),
    ],
    ids=["timm-swin", "timm-mambaout"],
)
def test_timm_channels_last_stages_pool_to_their_channels(build, stages, tmp_path):
    """Pooled stages equal the mean (and max) over H and W of timm's own NCHW feature
    maps (forward_intermediates), and their raw maps are stored as the stage gave them."""
    model = build()
    assert model.output_fmt == "NHWC"
    names = [f"{stages}.{i}" for i in range(4)]
    layers = [{"name": f"{stages}[{i}]", "reduce": "avg"} for i in range(4)]
    layers += [
        {"name": f"{stages}.1", "reduce": "max", "key": "max1"},
        {"name": f"{stages}.2", "reduce": "adaptive_avg", "size": 2, "key": "grid2"},
        {"name": f"{stages}.3", "key": "raw3"},
    ]
    store = featcache.extract(model, IMAGES, layers, tmp_path / "s.h5", **OPTIONS)
    with torch.no_grad():
        maps = model.forward_intermediates(IMAGES.tensors[0], intermediates_only=True)
    for name, own in zip(names, maps, strict=True):
        assert store.shape(name) == (own.shape[1],)
        torch.testing.assert_close(store.read(name), own.mean(dim=(2, 3)))
    torch.testing.assert_close(store.read("max1"), maps[1].amax(dim=(2, 3)))
    torch.testing.assert_close(
        store.read("grid2"), torch.nn.functional.adaptive_avg_pool2d(maps[2], 2)
    )
    raw = _stage_outputs(model, [f"{stages}.3"])[f"{stages}.3"]
    torch.testing.assert_close(store.read("raw3"), raw)  # [B, H, W, C], as captured
    assert store.layer_attrs("raw3")["channel_layout"] == "nhwc"
    grid = feature_grid(store, "raw3", 0, max_channels=4, padding=0)
    assert grid.shape[1:] == (2 * raw.shape[1], 2 * raw.shape[2])  # 4 channels of HxW


def test_torchvision_swin_stages_pool_to_their_channels(tmp_path):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.swin_t().eval()
    names = ["features.1", "features.3", "features.5", "features.7", "norm"]
    layers = [{"name": name, "reduce": "avg"} for name in names]
    store = featcache.extract(model, IMAGES, layers, tmp_path / "s.h5", **OPTIONS)
    outputs = _stage_outputs(model, names)
    for name in names:
        assert outputs[name].shape[-1] in (96, 192, 384, 768)  # [B, H, W, C]
        torch.testing.assert_close(store.read(name), outputs[name].mean(dim=(1, 2)))


def test_featcache_layers_shows_which_outputs_keep_their_channels_last():
    import torchvision

    rows = {row.name: row.output for row in describe_layers(torchvision.models.swin_t(), 64)}
    assert rows["features.1"] == "[16, 16, 96] channels last"
    assert rows["features.0.0"] == "[96, 16, 16]"  # the patch embedding's convolution
    assert rows["norm"] == "[2, 2, 768] channels last"
    assert rows["permute"] == "[768, 2, 2]"
    timm_rows = {row.name: row.output for row in describe_layers(_timm("mambaout_femto"), 64)}
    assert timm_rows["stages.0"] == "[16, 16, 48] channels last"


class PermutedConv(torch.nn.Module):
    """A convolution whose output is permuted to ``[B, H, W, C]`` by a plain op."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, 3, stride=8, padding=1)
        self.out = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.conv(x).permute(0, 2, 3, 1))


def test_an_undeclared_layout_is_read_from_the_input_grid(tmp_path):
    model = PermutedConv(channels=5)  # [B, 8, 8, 5] from 64x64 images
    store = featcache.extract(model, IMAGES, {"name": "out", "reduce": "avg"}, tmp_path / "s.h5")
    with torch.no_grad():
        expected = model(IMAGES.tensors[0]).mean(dim=(1, 2))
    torch.testing.assert_close(store.read("out").float(), expected, atol=2e-3, rtol=2e-3)


def test_an_ambiguous_layout_is_refused_naming_the_option_and_obeys_it(tmp_path):
    model = PermutedConv(channels=8)  # [B, 8, 8, 8]: either reading has an 8x8 grid
    with pytest.raises(ConfigError, match=r"channels first or last .*set the layer's layout"):
        featcache.extract(model, IMAGES, {"name": "out", "reduce": "avg"}, tmp_path / "a.h5")
    layers = [{"name": "out", "reduce": "avg", "layout": "nhwc"}]
    store = featcache.extract(model, IMAGES, layers, tmp_path / "b.h5", **OPTIONS)
    with torch.no_grad():
        expected = model(IMAGES.tensors[0]).mean(dim=(1, 2))
    torch.testing.assert_close(store.read("out"), expected)


def test_channel_layout_rules():
    square, wide = (64, 64), (64, 96)
    assert channel_layout((96, 16, 16), None, square) == "nchw"
    assert channel_layout((16, 16, 96), None, square) == "nhwc"
    assert channel_layout((8, 8, 8), None, square) == AMBIGUOUS
    assert channel_layout((8, 8, 8), "nchw", square) == "nchw"
    assert channel_layout((32, 4, 6), None, wide) == "nchw"
    assert channel_layout((4, 6, 6), None, wide) == "nhwc"
    assert channel_layout((12, 197, 197), None, (224, 224)) == "nchw"  # no image grid at all
    assert channel_layout((16, 16, 96), None, None) == "nchw"  # not an image input
