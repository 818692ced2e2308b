"""The runtime rule: channels_last for conv nets on the CPU, never a slower autocast dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import featcache
from featcache.capture.runtime import Layout, choose_layout, placed
from featcache.config.spec import RuntimeSpec, load_config
from featcache.errors import ConfigError


def test_auto_layout_on_cpu(resnet18):
    layout = choose_layout(resnet18, RuntimeSpec(device="cpu"))
    assert layout.channels_last and layout.amp is None
    assert layout.memory_format == torch.channels_last
    mlp = nn.Sequential(nn.Linear(4, 4))
    assert not choose_layout(mlp, RuntimeSpec(device="cpu")).channels_last
    assert choose_layout(resnet18, RuntimeSpec(device="cpu", amp="auto")).amp is None


def test_explicit_choices_are_kept(resnet18):
    layout = choose_layout(resnet18, RuntimeSpec(device="cpu", channels_last=False, amp="bf16"))
    assert not layout.channels_last and layout.amp == torch.bfloat16
    assert layout.describe() == {"device": "cpu", "channels_last": False, "amp": "bf16"}


def test_bad_runtime_values_are_config_errors():
    base = {"model": {"name": "resnet18"}, "layers": ["layer1"], "data": {"source": "synthetic"}}
    with pytest.raises(ConfigError, match="runtime.channels_last must be true, false or 'auto'"):
        load_config(base, ["runtime.channels_last=sometimes"])
    with pytest.raises(ConfigError, match="runtime.device 'gpu0' is not a device"):
        choose_layout(nn.Linear(1, 1), RuntimeSpec(device="gpu0"))


def test_layout_is_recorded_and_model_handed_back_contiguous(resnet18, images, tmp_path):
    store = featcache.extract(resnet18, images, ["layer2"], tmp_path / "s.h5", progress=False)
    assert store.attrs["layout"] == {"device": "cpu", "channels_last": True, "amp": None}
    assert resnet18.conv1.weight.is_contiguous()


def test_host_buffers_are_reused_and_bounded():
    from featcache.extraction.writer_thread import HostBuffers as _HostBuffers

    pool = _HostBuffers(2, pin=False)
    first = {"a": torch.arange(12.0).reshape(4, 3)}
    views, release = pool.copy(first)
    assert torch.equal(views["a"], first["a"])
    second, release_second = pool.copy({"a": torch.ones(4, 3)})
    release()
    tail, _ = pool.copy({"a": torch.full((2, 3), 7.0)})  # a short last batch reuses a set
    assert pool.made == 2 and tail["a"].shape == (2, 3)
    assert tail["a"].data_ptr() == views["a"].data_ptr()
    assert torch.equal(tail["a"], torch.full((2, 3), 7.0))
    release_second()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch.compile
# Nothing featcache runs inside the compiled forward makes torch.compile warn (a cached
# function there did: Dynamo traces through the cache and says so).
@pytest.mark.filterwarnings("error::UserWarning")
def test_compiled_forward_matches_eager(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(512, 4),
    ).eval()
    data = torch.utils.data.TensorDataset(torch.randn(10, 3, 12, 12))
    layers = [{"name": "1", "reduce": "avg"}, {"name": "3", "reduce": "flatten"}]
    options = {"batch_size": 5, "dtype": "float32", "progress": False}
    eager = featcache.extract(model, data, layers, tmp_path / "e.h5", **options)
    compiled = featcache.extract(model, data, layers, tmp_path / "c.h5", compile=True, **options)
    for layer in eager.layers:
        torch.testing.assert_close(compiled.read(layer), eager.read(layer), rtol=1e-4, atol=1e-5)


def test_placed_converts_only_the_modules_that_run_and_hands_them_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3)).eval()
    first, second, third = model
    layout = Layout(torch.device("cpu"), channels_last=True, amp=None)
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    cl = torch.channels_last
    with placed(model, layout), torch.inference_mode():
        assert not first.weight.is_contiguous(memory_format=cl)  # nothing ran yet
        second(first(x))  # the third module never runs: an early stop
        assert first.weight.is_contiguous(memory_format=cl)
        assert second.weight.is_contiguous(memory_format=cl)
        assert not third.weight.is_contiguous(memory_format=cl)
    for conv in model:
        assert conv.weight.is_contiguous() and not conv.weight.is_inference()
        assert not conv._forward_pre_hooks
    model(torch.randn(1, 3, 12, 12)).sum().backward()  # still trainable
    with placed(model, layout, lazy=False):
        assert all(conv.weight.is_contiguous(memory_format=cl) for conv in model)
    assert all(conv.weight.is_contiguous() for conv in model)
