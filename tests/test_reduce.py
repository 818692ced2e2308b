"""Reductions of captured batches, and the batch context they receive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from featcache.errors import ConfigError
from featcache.reduce import ReduceContext, reduce_tensor
from featcache.taps import Tap


@pytest.mark.parametrize(
    "reduce, size, shape, expected",
    [
        ("none", None, (2, 4, 3, 3), lambda x: x),
        ("avg", None, (2, 4, 3, 3), lambda x: x.mean((2, 3))),
        ("max", None, (2, 4, 3, 3), lambda x: x.amax((2, 3))),
        ("adaptive_avg", 2, (2, 4, 6, 6), lambda x: F.adaptive_avg_pool2d(x, 2)),
        ("flatten", None, (2, 4, 3, 3), lambda x: x.reshape(2, -1)),
        ("cls", None, (2, 5, 8), lambda x: x[:, 0]),
        ("mean", None, (2, 5, 8), lambda x: x.mean(1)),
    ],
)
def test_reductions(reduce, size, shape, expected):
    x = torch.randn(*shape)
    out = reduce_tensor(x, Tap("k", "m", reduce=reduce, size=size))
    torch.testing.assert_close(out, expected(x), rtol=0, atol=0)


def test_reduction_shape_errors_name_the_layer():
    with pytest.raises(ConfigError, match="layer 'k': reduce=cls needs a .B, T, D. tokens"):
        reduce_tensor(torch.randn(2, 3, 4, 4), Tap("k", "m", reduce="cls"))
    with pytest.raises(ConfigError, match="reduce=avg"):
        reduce_tensor(torch.randn(2, 3), Tap("k", "m", reduce="avg"))


def test_reductions_receive_the_batch_context_without_changing_todays_values():
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    context = ReduceContext(attention_mask=mask, prefix_tokens=1)
    tap = Tap("k", "m", reduce="mean")
    torch.testing.assert_close(reduce_tensor(x, tap, context), x.mean(1), rtol=0, atol=0)
