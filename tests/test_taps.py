"""Layer selection, select, early stop and hook removal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from featcache.capture.selectors import resolve_taps
from featcache.capture.taps import TapSet
from featcache.errors import ConfigError, FeatcacheError


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_exact_glob_and_type_selectors(resnet18):
    assert [t.key for t in resolve_taps(resnet18, ["layer2.1.conv2"])] == ["layer2.1.conv2"]
    assert [t.key for t in resolve_taps(resnet18, ["layer*.1"])] == [
        "layer1.1",
        "layer2.1",
        "layer3.1",
        "layer4.1",
    ]
    assert len(resolve_taps(resnet18, ["layer4.**"])) == len(
        [n for n, _ in resnet18.named_modules() if n.startswith("layer4.")]
    )
    convs = resolve_taps(resnet18, ["type:Conv2d"])
    assert len(convs) == 20 and all("conv" in t.key or "downsample" in t.key for t in convs)
    inputs = resolve_taps(resnet18, [{"name": "fc", "capture": "input"}])
    assert inputs[0].key == "fc@input"


def test_unknown_layer_lists_close_matches(resnet18):
    with pytest.raises(ConfigError) as err:
        resolve_taps(resnet18, ["layer5"])
    assert "unknown layer 'layer5'" in str(err.value)
    assert "layer4" in str(err.value)
    with pytest.raises(ConfigError, match="no module of type 'Conv3d'.*Conv2d"):
        resolve_taps(resnet18, ["type:Conv3d"])
    with pytest.raises(ConfigError, match="matches no module"):
        resolve_taps(resnet18, ["block*"])


def test_duplicate_keys_are_refused(resnet18):
    with pytest.raises(ConfigError, match="selected twice"):
        resolve_taps(resnet18, ["layer1", {"name": "layer1", "reduce": "avg"}])
    taps = resolve_taps(resnet18, ["layer1", {"name": "layer1", "reduce": "avg", "key": "l1avg"}])
    assert [t.key for t in taps] == ["layer1", "l1avg"]
    with pytest.raises(ConfigError, match="matches 4 modules but sets one key"):
        resolve_taps(resnet18, [{"name": "layer*.1", "key": "x"}])


class TwoHeads(nn.Module):
    """Returns a tuple from a submodule, has a dict-returning one and one never called."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.split = Splitter()
        self.named = Namer()
        self.unused = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        a, b = self.split(self.stem(x))
        d = self.named(a + b)
        return self.head(d["pooled"])


class Splitter(nn.Module):
    def forward(self, x):
        return x.relu(), -x


class Namer(nn.Module):
    def forward(self, x):
        return {"map": x, "pooled": x.mean((2, 3))}


def test_tuple_and_dict_outputs_need_select():
    model = TwoHeads().eval()
    x = torch.randn(2, 3, 8, 8)
    with TapSet(model, resolve_taps(model, ["split"])) as taps, pytest.raises(ConfigError) as err:
        taps.run(x)
    assert "its output is a tuple; set select to one of [0, 1]" in str(err.value)
    layers = [
        {"name": "split", "select": 1},
        {"name": "named", "select": "pooled"},
        {"name": "head", "capture": "input"},
    ]
    with TapSet(model, resolve_taps(model, layers)) as taps:
        out = taps.run(x)
    stem = model.stem(x)
    torch.testing.assert_close(out["split"], -stem)
    pooled = (stem.relu() - stem).mean((2, 3))
    torch.testing.assert_close(out["named"], pooled)
    torch.testing.assert_close(out["head@input"], pooled)
    with TapSet(model, resolve_taps(model, [{"name": "named", "select": "nope"}])) as taps:
        with pytest.raises(ConfigError, match="select='nope' is not in its output"):
            taps.run(x)


def test_layer_that_never_runs_is_named():
    model = TwoHeads().eval()
    with TapSet(model, resolve_taps(model, ["stem", "unused"])) as taps:
        with pytest.raises(FeatcacheError, match="unused never ran in the model's forward"):
            taps.run(torch.randn(1, 3, 8, 8))
    assert _hook_count(model) == 0


def test_forward_stops_after_last_tap_in_execution_order(resnet18):
    calls: list[str] = []
    for name in ("layer2", "layer3", "layer4", "fc"):
        getattr(resnet18, name).register_forward_hook(lambda m, a, o, n=name: calls.append(n))
    before = _hook_count(resnet18)
    # listed out of execution order: the stop comes after layer2.0, the later one to run
    with TapSet(resnet18, resolve_taps(resnet18, ["layer2.0", "layer1"])) as taps:
        assert _hook_count(resnet18) == before + 2
        out = taps.run(torch.randn(2, 3, 32, 32))
    assert list(out) == ["layer2.0", "layer1"]
    assert calls == []  # layer2 itself never finished; layer3, layer4 and fc never ran
    assert _hook_count(resnet18) == before
    # capturing the input of layer3 stops before layer3 computes anything
    with TapSet(resnet18, resolve_taps(resnet18, [{"name": "layer3", "capture": "input"}])) as t:
        t.run(torch.randn(2, 3, 32, 32))
    assert calls == ["layer2"]


def test_hooks_removed_when_forward_raises(resnet18):
    resnet18.layer2.register_forward_hook(lambda *a: (_ for _ in ()).throw(ValueError("boom")))
    before = _hook_count(resnet18)
    with pytest.raises(ValueError, match="boom"):  # noqa: SIM117
        with TapSet(resnet18, resolve_taps(resnet18, ["layer1", "layer3"])) as taps:
            taps.run(torch.randn(2, 3, 32, 32))
    assert _hook_count(resnet18) == before


def test_run_outside_with_block_is_an_error(resnet18):
    taps = TapSet(resnet18, resolve_taps(resnet18, ["layer1"]))
    with pytest.raises(RuntimeError, match="inside its `with` block"):
        taps.run(torch.randn(1, 3, 32, 32))


def test_captures_survive_later_inplace_ops(resnet18):
    # torchvision's ResNet applies ReLU(inplace=True) right after bn1: the stored bn1
    # output must be the pre-ReLU values, negatives included.
    x = torch.randn(2, 3, 32, 32)
    with TapSet(resnet18, resolve_taps(resnet18, ["bn1", "layer1"])) as taps:
        out = taps.run(x)
    with torch.no_grad():
        want = resnet18.bn1(resnet18.conv1(x))
    assert (out["bn1"] < 0).any()
    torch.testing.assert_close(out["bn1"], want)
