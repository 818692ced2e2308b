"""List a model's modules with their output shapes, to choose layers to capture."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from featcache.capture.channels import AMBIGUOUS, channel_layout, declared_layouts
from featcache.capture.reduce import layer_prefix
from featcache.errors import ConfigError, first_line

PROBE_BATCH = 2  # samples in the probe batch
# How a 4-d output's channel layout is shown; channels first goes without a note.
LAYOUT_NOTES = {"nhwc": " channels last", AMBIGUOUS: " channels first or last (set layout)"}


@dataclass(frozen=True)
class LayerInfo:
    """One named module of a model, as ``featcache layers`` prints it."""

    name: str  # module name, as used in a layer selector
    type: str  # module class name, as used in "type:<name>"
    output: str  # output shape per sample, e.g. "[256, 14, 14]"; "-" if never called
    params: int  # parameters owned by the module and its children


def describe_layers(
    model: nn.Module,
    input_size: int | tuple[int, int] = 224,
    channels: int = 3,
    device: str = "cpu",
    *,
    prefix_tokens: int | None = None,
    sequence_first: bool = False,
    example: Mapping[str, torch.Tensor] | None = None,
) -> list[LayerInfo]:
    """Run float32 zeros ``[2, channels, H, W]``, or a text model's ``example`` (int64
    ``[2, T]`` keywords), and record each module's per-sample output at its first call
    (``"[C, H, W]"``, ``"[T, D] tokens (1 prefix)"``, ``"[14, 14, 384] channels last"``),
    in ``named_modules()`` order without the root; the train/eval flag is restored.

    Raises:
        ConfigError: the probe batch fails in the model, with the model's own reason.
    """
    shapes: dict[str, str] = {}
    tokens = None if example is None else int(example["input_ids"].shape[1])
    handles: list[RemovableHandle] = []

    height, width = input_size if isinstance(input_size, tuple) else (input_size, input_size)
    image = None if example is not None else (height, width)
    declared = declared_layouts(model)
    modules = [(name, module) for name, module in model.named_modules() if name]

    def record(name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if name in shapes:
            return
        shapes[name] = _describe(output, prefix_tokens, sequence_first, tokens)
        if isinstance(output, torch.Tensor) and output.dim() == 4:
            layout = channel_layout(tuple(output.shape[1:]), declared.get(name), image)
            shapes[name] += LAYOUT_NOTES.get(layout, "")

    was_training = model.training
    try:
        for name, module in modules:
            handles.append(module.register_forward_hook(functools.partial(record, name)))
        model.eval()
        with torch.inference_mode():
            if example is not None:
                model(**{key: value.to(device) for key, value in example.items()})
            else:
                model(torch.zeros(PROBE_BATCH, channels, height, width, device=device))
    except Exception as exc:  # the model's own complaint, about the probe input
        side = f"{height}" if height == width else f"{height}x{width}"
        probe = "text" if example is not None else f"batch of {side}px images"
        fix = "" if example is not None else "; give an input size the model takes (--input-size)"
        raise ConfigError(
            f"the probe {probe} does not run through the model "
            f"({first_line(exc, with_type=True).rstrip('.')}){fix}"
        ) from exc
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return [
        LayerInfo(n, type(m).__name__, shapes.get(n, "-"), sum(p.numel() for p in m.parameters()))
        for n, m in modules
    ]


def text_example(tokenizer: Any, text: str = "a short text to look inside the model") -> dict:
    """``text`` twice through a featcache tokenizer: int64 ``[2, T]`` ids and attention mask."""
    ids = torch.tensor(tokenizer([text] * PROBE_BATCH, None).ids, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _describe(
    output: Any, prefix: int | None = None, sequence_first: bool = False, tokens: int | None = None
) -> str:
    if isinstance(output, torch.Tensor):
        shape = list(output.shape)
        if tokens is not None and output.dim() >= 3 and shape[1] == tokens:
            return f"[T, {', '.join(map(str, shape[2:]))}] tokens"
        if prefix is not None and output.dim() == 3:
            if sequence_first and shape[1] == PROBE_BATCH and shape[0] != PROBE_BATCH:
                shape = [shape[1], shape[0], shape[2]]
            return f"{shape[1:]} tokens ({layer_prefix(shape[1], prefix)} prefix)"
        return str(shape[1:])
    if isinstance(output, (tuple, list)):
        parts = (_describe(item, prefix, sequence_first, tokens) for item in output)
        return "(" + ", ".join(parts) + ")"
    if isinstance(output, dict):
        items = (f"{k}: {_describe(v, prefix, sequence_first, tokens)}" for k, v in output.items())
        return "{" + ", ".join(items) + "}"
    return type(output).__name__
