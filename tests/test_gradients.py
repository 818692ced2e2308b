"""capture: grad stores the gradient of a target score with respect to a layer's output."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import featcache
from featcache.capture.selectors import resolve_taps
from featcache.capture.taps import TapSet
from featcache.config.spec import LayerSpec, parse_layers
from featcache.errors import ConfigError


def _direct_grads(model, x, labels, modules, target):
    """torch.autograd.grad of the summed target scores w.r.t. each module's output."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False  # keep each module's output as it was returned
    named = dict(model.named_modules())
    outputs = {}
    handles = [
        named[name].register_forward_hook(lambda m, a, o, name=name: outputs.setdefault(name, o))
        for name in modules
    ]
    logits = model(x)
    for handle in handles:
        handle.remove()
    if target == "label":
        score = logits.gather(1, labels[:, None]).squeeze(1)
    elif target == "predicted":
        score = logits.amax(dim=1)
    else:
        score = logits[:, target]
    grads = torch.autograd.grad(score.sum(), [outputs[name] for name in modules])
    return dict(zip(modules, grads, strict=True))


def test_stored_gradients_equal_autograd(resnet18, images, tmp_path):
    layers = [
        {"name": "layer2", "capture": "grad"},  # target: the label's logit
        {"name": "layer3", "capture": "grad", "target": "predicted"},
        {"name": "bn1", "capture": "grad", "target": 3},  # followed by ReLU(inplace=True)
        {
            "name": "layer3",
            "capture": "grad",
            "target": "predicted",
            "reduce": "avg",
            "key": "layer3_avg",
        },
        {"name": "layer3"},
    ]
    store = featcache.extract(
        resnet18,
        images,
        layers,
        tmp_path / "g.h5",
        dtype="float32",
        batch_size=8,
        num_workers=0,
        progress=False,
    )
    x, y = images.tensors
    assert store.layer_attrs("layer3@grad")["capture"] == "grad"
    assert store.layer_attrs("layer3@grad")["target"] == "predicted"
    ref = {
        "label": _direct_grads(resnet18, x, y, ["layer2"], "label"),
        "predicted": _direct_grads(resnet18, x, y, ["layer3"], "predicted"),
        3: _direct_grads(resnet18, x, y, ["bn1"], 3),
    }
    torch.testing.assert_close(store.read("layer2@grad"), ref["label"]["layer2"])
    torch.testing.assert_close(store.read("layer3@grad"), ref["predicted"]["layer3"])
    torch.testing.assert_close(store.read("bn1@grad"), ref[3]["bn1"])
    torch.testing.assert_close(
        store.read("layer3_avg"), ref["predicted"]["layer3"].mean(dim=(2, 3))
    )
    assert store.read("layer2@grad").abs().sum() > 0
    # Activations beside gradients are unchanged by the gradient run.
    with torch.no_grad():
        act = {}
        h = resnet18.layer3.register_forward_hook(lambda m, a, o: act.setdefault("x", o))
        resnet18(x)
        h.remove()
    torch.testing.assert_close(store.read("layer3"), act["x"])


def test_output_index_target(resnet18):
    x = torch.randn(2, 3, 32, 32)
    taps = resolve_taps(resnet18, [{"name": "layer4", "capture": "grad", "target": "output:7"}])
    with TapSet(resnet18, taps) as tapset:
        got = tapset.run(x)["layer4@grad"]
    torch.testing.assert_close(got, _direct_grads(resnet18, x, None, ["layer4"], 7)["layer4"])


def test_model_left_unchanged(resnet18, images, tmp_path):
    resnet18.fc.weight.requires_grad_(False)
    flags = {name: p.requires_grad for name, p in resnet18.named_parameters()}
    state = copy.deepcopy(resnet18.state_dict())
    featcache.extract(
        resnet18,
        images,
        [{"name": "layer4", "capture": "grad"}],
        tmp_path / "g.h5",
        batch_size=10,
        num_workers=0,
        progress=False,
    )
    assert {name: p.requires_grad for name, p in resnet18.named_parameters()} == flags
    assert all(p.grad is None for p in resnet18.parameters())
    for key, value in resnet18.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert not resnet18.training


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3)
        self.side = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.side(x)  # computed, unused for the output
        return self.head(self.body(x).detach().mean(dim=(2, 3)) + 0 * x.mean())


@pytest.mark.parametrize("layer", ["body", "side"])
def test_no_differentiable_path(layer):
    model = _Detached().eval()
    taps = resolve_taps(model, [{"name": layer, "capture": "grad", "target": 0}])
    with TapSet(model, taps) as tapset, pytest.raises(ConfigError) as info:
        tapset.run(torch.randn(2, 3, 8, 8))
    assert f"no differentiable path from layer {layer}" in str(info.value)
    assert all(p.requires_grad for p in model.parameters())


def test_label_target_needs_labels(resnet18):
    taps = resolve_taps(resnet18, [{"name": "layer4", "capture": "grad"}])
    with TapSet(resnet18, taps) as tapset, pytest.raises(ConfigError, match="labelled"):
        tapset.run(torch.randn(2, 3, 32, 32), labels=torch.tensor([-1, -1]))


def test_target_validation():
    assert parse_layers([{"name": "x", "capture": "grad"}])[0].target is None
    assert (
        resolve_taps(nn.Sequential(nn.Linear(2, 2)), [LayerSpec("0", capture="grad")])[0].key
        == "0@grad"
    )
    with pytest.raises(ConfigError, match="only to capture=grad"):
        parse_layers([{"name": "x", "target": "predicted"}])
    for bad in ("argmax", -1, "output:x"):
        with pytest.raises(ConfigError, match="target"):
            parse_layers([{"name": "x", "capture": "grad", "target": bad}])


class _ClsHead(nn.Module):
    """Tokens through two blocks that mix them (a mean, as attention would); the head
    reads the first token of the last block alone, as a ViT's does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.block0 = nn.Linear(8, 8)
        self.block1 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 3, T] -> [B, 4]
        hidden = torch.tanh(self.block0(self.embed(x.transpose(1, 2))))
        tokens = self.block1(hidden + hidden.mean(dim=1, keepdim=True))
        return self.head(tokens[:, 0])


def test_a_gradient_that_is_exactly_zero_is_named_at_extraction(tmp_path):
    """The last block's patch tokens get a zero gradient (the head reads the class token
    alone): the run warns naming the layer; the first block's patch tokens do not."""
    data = torch.utils.data.TensorDataset(torch.randn(6, 3, 5), torch.arange(6) % 4)
    patches = {"capture": "grad", "reduce": "patches", "target": "predicted"}
    layers = [{"name": "block1", **patches}, {"name": "block0", **patches}]
    with pytest.warns(featcache.errors.FeatcacheWarning) as caught:
        store = featcache.extract(
            _ClsHead(), data, layers, tmp_path / "s.h5", prefix_tokens=1, progress=False
        )
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith("layer 'block1@grad': every gradient this run stored is ")
    assert "exactly zero" in messages[0] and "capture an earlier layer" in messages[0]
    assert store.shape("block1@grad") == (8, 2, 2) and not store.read("block1@grad").any()
    assert store.read("block0@grad").any()


def test_cam_warns_when_the_gradient_row_is_zero(tmp_path):
    from featcache.commands.visualize import store_cam

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 2))
    nn.init.zeros_(model[3].weight)  # the score does not depend on the convolution
    data = torch.utils.data.TensorDataset(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    layers = ["0", {"name": "0", "capture": "grad"}]
    with pytest.warns(featcache.errors.FeatcacheWarning, match="'0@grad'"):
        store = featcache.extract(model, data, layers, tmp_path / "s.h5", progress=False)
    with pytest.warns(featcache.errors.FeatcacheWarning, match="its gradient at row 1 is exactly"):
        cam = store_cam(store, "0", 1)
    assert not cam.any()
