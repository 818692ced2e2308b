"""describe_layers: module names, types, per-sample output shapes and parameter counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from featcache.capture.layers import LayerInfo, describe_layers
from featcache.errors import ConfigError
from tests.cifar_resnet import resnet20

# isort: split
# After featcache, which makes torchvision importable where its compiled ops cannot load.
import torchvision


class Heads(nn.Module):
    """Outputs of every kind: a tensor, a tuple, a dict, a non-tensor; one unused module."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.split = Split()
        self.named = Named()
        self.count = Count()
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(self.conv(x))
        self.named(a)
        self.count(b)
        self.conv(x[:, :, :4, :4])  # a second call: the first call's shape is reported
        return a


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.flatten(1)


class Named(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"mean": x.mean((2, 3)), "map": x}


class Count(nn.Module):
    def forward(self, x: torch.Tensor) -> int:
        return x.shape[0]


def by_name(rows: list[LayerInfo]) -> dict[str, LayerInfo]:
    return {row.name: row for row in rows}


def test_torchvision_resnet_names_types_shapes_and_params():
    model = torchvision.models.resnet18()
    rows = describe_layers(model, input_size=32)
    assert [row.name for row in rows] == [name for name, _ in model.named_modules() if name]
    info = by_name(rows)
    assert info["layer4"] == LayerInfo(
        "layer4", "Sequential", "[512, 1, 1]", sum(p.numel() for p in model.layer4.parameters())
    )
    assert info["layer2.0.conv1"].type == "Conv2d"
    assert info["layer2.0.conv1"].output == "[128, 4, 4]"
    assert info["layer2.0.conv1"].params == 64 * 128 * 3 * 3
    assert info["fc"] == LayerInfo("fc", "Linear", "[1000]", 512 * 1000 + 1000)
    assert info["relu"].output == "[64, 16, 16]"


def test_input_size_and_channels_set_the_probe_batch():
    model = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.Flatten())
    assert [row.output for row in describe_layers(model, input_size=10, channels=1)] == [
        "[8, 5, 5]",
        "[200]",
    ]
    cifar = by_name(describe_layers(resnet20(), input_size=32))
    assert cifar["layer3"].output == "[64, 8, 8]"
    assert cifar["layer2.0.shortcut"].type == "DownsampleA"
    assert cifar["layer2.0.shortcut"].params == 0


def test_tuple_dict_and_other_outputs_and_unused_modules():
    info = by_name(describe_layers(Heads(), input_size=6))
    assert info["conv"].output == "[4, 6, 6]"
    assert info["split"].output == "([4, 6, 6], [144])"
    assert info["named"].output == "{mean: [4], map: [4, 6, 6]}"
    assert info["count"].output == "int"
    assert info["unused"] == LayerInfo("unused", "Linear", "-", 6)


@pytest.mark.parametrize("training", [True, False])
def test_mode_is_restored_and_hooks_removed(training):
    model = resnet20().train(training)
    seen = []
    model.layer1.register_forward_hook(lambda m, a, o: seen.append(m.training))
    describe_layers(model, input_size=32)
    assert seen == [False]  # run in eval mode
    assert all(m.training is training for m in model.modules())
    assert all(len(m._forward_hooks) == (1 if m is model.layer1 else 0) for m in model.modules())


def test_hooks_are_removed_when_the_forward_fails():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(5, 5)).train()
    with pytest.raises(
        ConfigError,
        match=r"^the probe batch of 8px images does not run .*"
        r"\(RuntimeError: mat1 and mat2 shapes cannot be multiplied.*--input-size",
    ):
        describe_layers(model, input_size=8)
    assert model.training
    assert all(not m._forward_hooks for m in model.modules())


def test_token_outputs_are_listed_with_their_prefix_tokens():
    import torchvision

    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    )
    rows = {info.name: info.output for info in describe_layers(vit, 32, prefix_tokens=1)}
    assert rows["encoder.layers.encoder_layer_1"] == "[17, 16] tokens (1 prefix)"
    assert rows["conv_proj"] == "[16, 4, 4]"
    plain = {info.name: info.output for info in describe_layers(vit, 32)}
    assert plain["encoder.layers.encoder_layer_1"] == "[17, 16]"
