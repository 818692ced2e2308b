"""Where and how the backbone runs: device, memory layout and autocast dtype.

``auto`` is a fixed rule, not a timing run, so that a config always runs the same way on the
same hardware (``docs/benchmarks.md``): channels_last for 2-d convolutions on the CPU and
under CUDA autocast; autocast only on CUDA, bf16 where supported, else fp16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcache.config.spec import RuntimeSpec
from featcache.errors import ConfigError

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Layout:
    """The resolved runtime choices for one run."""

    device: torch.device
    channels_last: bool
    amp: torch.dtype | None  # autocast dtype, None for full precision

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def describe(self) -> dict[str, object]:
        """JSON-able summary for provenance."""
        amp = {v: k for k, v in AMP_DTYPES.items()}.get(self.amp) if self.amp else None
        return {"device": str(self.device), "channels_last": self.channels_last, "amp": amp}


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; anything else is checked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"runtime.device {name!r} is not a device (auto, cpu, cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device is {name!r} but CUDA is not available; use auto or cpu")
    return device


def choose_layout(model: nn.Module, runtime: RuntimeSpec) -> Layout:
    """Resolve ``runtime.device``, ``channels_last`` and ``amp`` (``auto`` by the rule above)."""
    device = resolve_device(runtime.device)
    amp = AMP_DTYPES.get(runtime.amp or "")  # None for "auto" too
    if runtime.amp == "auto" and device.type == "cuda":
        amp = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if runtime.channels_last == "auto":
        conv2d = any(isinstance(module, nn.Conv2d) for module in model.modules())
        channels_last = conv2d and (device.type == "cpu" or amp is not None)
    else:
        channels_last = bool(runtime.channels_last)
    return Layout(device, channels_last, amp)


@contextlib.contextmanager
def placed(model: nn.Module, layout: Layout, *, lazy: bool = True) -> Iterator[nn.Module]:
    """Run ``model`` on ``layout.device`` in ``layout.memory_format`` inside the block;
    ``lazy`` converts a module's 4-d weights at its first run (none after an early stop),
    ``lazy=False`` all up front, for ``torch.compile``."""
    # Module.to takes memory_format at run time; its type stub leaves it out.
    move: Any = model.to
    if not layout.channels_last:
        move(device=layout.device)
        yield model
        return
    if not lazy:
        move(device=layout.device, memory_format=torch.channels_last)
        try:
            yield model
        finally:
            move(memory_format=torch.contiguous_format)
        return

    move(device=layout.device)
    converted: list[nn.Module] = []
    hooks: dict[nn.Module, Any] = {}

    def convert(module: nn.Module, args: Any) -> None:
        # Outside inference mode, so that the weights stay ordinary tensors.
        with torch.inference_mode(False):
            module._apply(
                lambda t: t.to(memory_format=torch.channels_last) if t.dim() == 4 else t,
                recurse=False,
            )
        converted.append(module)
        hooks.pop(module).remove()  # once per module

    for module in model.modules():
        if any(t.dim() == 4 for t in module.parameters(recurse=False)):
            hooks[module] = module.register_forward_pre_hook(convert)
    try:
        yield model
    finally:
        for handle in hooks.values():
            handle.remove()
        for module in converted:
            module._apply(lambda t: t.contiguous() if t.dim() == 4 else t, recurse=False)
