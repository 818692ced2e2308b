"""Reductions of captured batches, and the batch context they receive."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from featcache.capture.reduce import (
    ReduceContext,
    layer_prefix,
    patch_grid,
    reduce_tensor,
    token_layout,
)
from featcache.capture.taps import Tap
from featcache.errors import ConfigError


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


def test_adaptive_avg_never_upsamples():
    small = torch.randn(2, 4, 3, 5)
    exact = reduce_tensor(small, Tap("k", "m", reduce="adaptive_avg", size=3))
    torch.testing.assert_close(exact, F.adaptive_avg_pool2d(small, 3), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="size 4 is larger than its 3x5 grid.*use size 3"):
        reduce_tensor(small, Tap("k", "m", reduce="adaptive_avg", size=4))
    tokens = torch.randn(2, 1 + 4, 8)  # a class token and a 2x2 grid of patches
    context = ReduceContext(prefix_tokens=1)
    with pytest.raises(ConfigError, match="larger than its 2x2 grid"):
        reduce_tensor(tokens, Tap("k", "m", reduce="adaptive_avg", size=3), context)


# Padded token batches: reductions read the real tokens only.

MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
PADDED = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
PADDED[0, 3:] = float("nan")  # padding that leaks anywhere shows up as NaN


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [
        ("mean", [PADDED[0, :3].mean(0), PADDED[1].mean(0)]),
        ("avg", [PADDED[0, :3].mean(0), PADDED[1].mean(0)]),
        ("max", [PADDED[0, :3].amax(0), PADDED[1].amax(0)]),
        ("cls", [PADDED[0, 0], PADDED[1, 0]]),
        ("last", [PADDED[0, 2], PADDED[1, 4]]),
        (
            "cls+mean",
            [
                torch.cat([PADDED[0, 0], PADDED[0, :3].mean(0)]),
                torch.cat([PADDED[1, 0], PADDED[1].mean(0)]),
            ],
        ),
    ],
)
def test_masked_reductions_read_real_tokens_only(reduce, expected):
    context = ReduceContext(attention_mask=MASK, batch_size=2)
    out = reduce_tensor(PADDED, Tap("k", "m", reduce=reduce), context)
    torch.testing.assert_close(out, torch.stack(expected))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_masked_mean_of_half_values_sums_in_float32(dtype):
    """40 real tokens of 2000 sum to 80,000, past float16's 65,504; bfloat16 holds 8 bits
    of mantissa, so neither a count of 301 nor the sum of 301 values of 1 and 2 fits it."""
    for tokens, value in ((40, 2000.0), (301, 1.0)):
        x = torch.full((2, tokens + 3, 4), value, dtype=dtype)
        x[:, 1::2] *= 2
        mask = torch.ones(2, tokens + 3, dtype=torch.long)
        mask[:, tokens:] = 0
        mean = reduce_tensor(x, Tap("k", "m", reduce="mean"), ReduceContext(attention_mask=mask))
        assert mean.dtype == dtype
        torch.testing.assert_close(mean, x[:, :tokens].float().mean(1).to(dtype), rtol=0, atol=0)


def test_last_finds_the_last_real_token_under_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    context = ReduceContext(attention_mask=mask, batch_size=2)
    out = reduce_tensor(PADDED.nan_to_num(), Tap("k", "m", reduce="last"), context)
    torch.testing.assert_close(out, PADDED.nan_to_num()[:, 4])


def test_masked_reduce_on_an_output_without_a_token_axis_is_refused():
    context = ReduceContext(attention_mask=MASK, batch_size=2)
    with pytest.raises(ConfigError, match="layer 'k': reduce=mean .*no token axis .*mask"):
        reduce_tensor(torch.randn(2, 8), Tap("k", "m", reduce="mean"), context)
    with pytest.raises(ConfigError, match="reduce=flatten would mix padding"):
        reduce_tensor(PADDED, Tap("k", "m", reduce="flatten"), context)


def test_reduce_none_keeps_the_padded_batch_for_the_loop_to_pack():
    context = ReduceContext(attention_mask=MASK, batch_size=2)
    assert reduce_tensor(PADDED, Tap("k", "m"), context) is PADDED


# Token outputs of models that declare their token layout.

TOKENS = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)  # [B=2, T=1+4, D=3]
VIT = ReduceContext(prefix_tokens=1, batch_size=2)


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [
        ("cls", TOKENS[:, 0]),
        ("mean", TOKENS[:, 1:].mean(1)),  # the class token is left out
        ("cls+mean", torch.cat([TOKENS[:, 0], TOKENS[:, 1:].mean(1)], 1)),
        ("avg", TOKENS[:, 1:].mean(1)),  # pools the patch grid, never the feature axis
        ("max", TOKENS[:, 1:].amax(1)),
        ("patches", TOKENS[:, 1:].transpose(1, 2).reshape(2, 3, 2, 2)),
    ],
)
def test_token_reductions_know_the_prefix_tokens(reduce, expected):
    assert torch.equal(reduce_tensor(TOKENS, Tap("k", "m", reduce=reduce), VIT), expected)


@pytest.mark.parametrize("reduce", ["mean", "max", "patches", "last"])
def test_a_layer_before_the_prefix_tokens_are_added_is_all_patches(reduce):
    """A ViT's patch embedding gives the 4 patch tokens alone: a square grid, where 4 - 1
    is not. Its reductions read every token; with the prefix tokens, the first of them."""
    patches = TOKENS[:, 1:]
    expected = reduce_tensor(patches, Tap("k", "m", reduce=reduce), ReduceContext(prefix_tokens=0))
    assert torch.equal(reduce_tensor(patches, Tap("k", "m", reduce=reduce), VIT), expected)
    assert layer_prefix(4, 1) == 0 and layer_prefix(5, 1) == 1 and layer_prefix(16, 5) == 0
    assert layer_prefix(21, 5) == 5 and layer_prefix(7, 1) == 1 and layer_prefix(9, None) is None


def test_the_patch_grid_follows_the_input_shape():
    assert patch_grid(16) == (4, 4) and patch_grid(15) is None and patch_grid(0) is None
    assert patch_grid(24, (64, 96)) == (4, 6) and patch_grid(25, (64, 96)) is None
    assert patch_grid(30, (70, 100)) == (5, 6)  # rounded up: a model that pads its input
    assert patch_grid(16, (64, 64)) == (4, 4) and patch_grid(24, (64, 64)) is None
    # 25 tokens of a 64x96 input are 24 patches and a class token; 24 are patches alone.
    assert layer_prefix(25, 1, (64, 96)) == 1 and layer_prefix(24, 1, (64, 96)) == 0
    tokens = torch.randn(2, 25, 3)
    context = ReduceContext(prefix_tokens=1, batch_size=2, image_size=(64, 96))
    grid = reduce_tensor(tokens, Tap("k", "m", reduce="patches"), context)
    assert torch.equal(grid, tokens[:, 1:].transpose(1, 2).reshape(2, 3, 4, 6))
    assert torch.equal(
        reduce_tensor(tokens, Tap("k", "m", reduce="mean"), context), tokens[:, 1:].mean(1)
    )
    with pytest.raises(ConfigError, match="21 patch tokens do not form the patch grid of a 64x96"):
        reduce_tensor(torch.randn(2, 22, 3), Tap("k", "m", reduce="patches"), context)


def test_patch_grid_pools_like_a_feature_map():
    grid = TOKENS[:, 1:].transpose(1, 2).reshape(2, 3, 2, 2)
    pooled = reduce_tensor(TOKENS, Tap("k", "m", reduce="adaptive_avg", size=1), VIT)
    assert torch.equal(pooled, F.adaptive_avg_pool2d(grid, 1))


def test_sequence_first_outputs_are_transposed():
    sequence_first = TOKENS.transpose(0, 1).contiguous()  # [T=5, B=2, D=3]
    context = ReduceContext(prefix_tokens=1, sequence_first=True, batch_size=2)
    for reduce in ("none", "cls", "mean"):
        tap = Tap("k", "m", reduce=reduce)
        expected = reduce_tensor(TOKENS, tap, VIT)
        assert torch.equal(reduce_tensor(sequence_first, tap, context), expected)
    square = torch.randn(2, 2, 3)  # T == B: the declared layout decides
    assert torch.equal(reduce_tensor(square, Tap("k", "m"), context), square.transpose(0, 1))


def test_a_sequence_first_model_keeps_its_batch_first_outputs():
    """Only token outputs are sequence-first: a conv map or a head whose second axis
    happens to equal the batch size is batch-first all the same."""
    context = ReduceContext(sequence_first=True, batch_size=2)
    conv, head = torch.randn(2, 2, 3, 3), torch.randn(2, 2)  # C == B, classes == B
    assert torch.equal(reduce_tensor(conv, Tap("k", "m", reduce="avg"), context), conv.mean((2, 3)))
    assert torch.equal(reduce_tensor(head, Tap("k", "m"), context), head)
    per_token = torch.randn(5, 2)  # [T, B] with the batch on axis 1 only
    assert torch.equal(reduce_tensor(per_token, Tap("k", "m"), context), per_token.T)


def test_an_undeclared_sequence_first_model_is_refused_when_the_axes_cannot_be_told():
    encoder = torch.nn.TransformerEncoderLayer(4, 2, 8)  # batch_first=False by default
    context = token_layout(encoder, None, sequence_first=False)
    assert context.sequence_first_modules == ("self_attn",)
    ambiguous = dataclasses.replace(context, batch_size=3)
    with pytest.raises(ConfigError, match="batch size 3 on axes 0 and 1.*self_attn"):
        reduce_tensor(torch.randn(3, 3, 4), Tap("k", "m", reduce="mean"), ambiguous)
    conv = torch.randn(3, 3, 2, 2)  # not a token output: batch-first
    assert torch.equal(reduce_tensor(conv, Tap("k", "m"), ambiguous), conv)
    # A batch-first model, or one that declares its layout, is read as it says.
    batch_first = torch.nn.TransformerEncoderLayer(4, 2, 8, batch_first=True)
    assert token_layout(batch_first, None, sequence_first=False).sequence_first_modules == ()
    assert token_layout(encoder, None, sequence_first=True).sequence_first_modules == ()


@pytest.mark.parametrize(
    ("value", "context", "reduce", "message"),
    [
        (TOKENS, ReduceContext(prefix_tokens=0), "cls", "needs a class token"),
        (torch.randn(2, 6, 3), VIT, "patches", "5 patch tokens do not form a square grid"),
        (TOKENS[:, 1:], VIT, "cls", "its 4 tokens are the patch tokens alone .* later layer"),
        (torch.randn(3, 4, 5), VIT, "none", "has no axis of the batch size 2"),
        (torch.randn(5, 2, 3), VIT, "none", r"is sequence-first .* pass sequence_first=True"),
    ],
)
def test_token_reduction_errors(value, context, reduce, message):
    with pytest.raises(ConfigError, match=message):
        reduce_tensor(value, Tap("k", "m", reduce=reduce), context)


def test_undeclared_token_layout_keeps_the_plain_rules():
    plain = ReduceContext()  # a model that declares no token layout: v1 behaviour
    assert torch.equal(reduce_tensor(TOKENS, Tap("k", "m", reduce="cls"), plain), TOKENS[:, 0])
    assert torch.equal(reduce_tensor(TOKENS, Tap("k", "m", reduce="mean"), plain), TOKENS.mean(1))
    assert torch.equal(reduce_tensor(TOKENS, Tap("k", "m", reduce="avg"), plain), TOKENS.mean(2))
