"""Layer taps: select modules, hook them, reduce what they produce, stop the forward early.

A :class:`Tap` is one resolved capture point: a module, whether its output or its
input is captured, and the reduction applied on the device before anything leaves
it. :class:`TapSet` registers the hooks as a context manager (hooks are removed on
every exit path) and runs batches through the model, stopping the forward as soon
as every tap has fired, so layers after the last one captured are never computed.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from featcache.errors import ConfigError, FeatcacheError
from featcache.spec import LayerSpec, parse_layers


@dataclass(frozen=True)
class Tap:
    """One resolved capture point. ``key`` names its dataset in the store."""

    key: str
    module_name: str
    capture: str = "output"
    reduce: str = "none"
    size: int | None = None
    select: int | str | None = None


class _StopForward(Exception):
    """Raised from a hook once every tap has its value; ends the forward early."""


def resolve_taps(model: nn.Module, layers: Iterable[LayerSpec | str | dict]) -> list[Tap]:
    """Expand layer selectors into taps, in the order given.

    A selector is an exact module name, a glob over module names (``layer*.1``: ``*``
    stays within one dotted part, ``**`` spans several), or ``type:ClassName`` (every
    module of that class, e.g. ``type:Conv2d``).
    """
    modules = {name: module for name, module in model.named_modules() if name}
    taps: list[Tap] = []
    for layer in parse_layers(layers):
        names = _match(layer.name, modules)
        if layer.key is not None and len(names) > 1:
            raise ConfigError(
                f"layer {layer.name!r} matches {len(names)} modules but sets one key "
                f"{layer.key!r}; drop key or select a single module"
            )
        for name in names:
            suffix = "@input" if layer.capture == "input" else ""
            key = layer.key or name + suffix
            taps.append(Tap(key, name, layer.capture, layer.reduce, layer.size, layer.select))
    seen: set[str] = set()
    for tap in taps:
        if tap.key in seen:
            raise ConfigError(
                f"layer key {tap.key!r} is selected twice; give one of them a distinct key"
            )
        seen.add(tap.key)
    return taps


def _match(selector: str, modules: dict[str, nn.Module]) -> list[str]:
    if selector.startswith("type:"):
        type_name = selector[len("type:") :]
        names = [
            name
            for name, module in modules.items()
            if type_name in (type(module).__name__, type(module).__qualname__)
            or type_name == f"{type(module).__module__}.{type(module).__qualname__}"
        ]
        if not names:
            present = sorted({type(m).__name__ for m in modules.values()})
            close = difflib.get_close_matches(type_name, present, n=5)
            hint = f"; did you mean: {', '.join(close)}" if close else ""
            raise ConfigError(f"no module of type {type_name!r} in the model{hint}")
        return names
    if any(ch in selector for ch in "*?["):
        pattern = _glob_regex(selector)
        names = [name for name in modules if pattern.fullmatch(name)]
        if not names:
            raise ConfigError(
                f"layer glob {selector!r} matches no module; list them with `featcache layers`"
            )
        return names
    if selector not in modules:
        close = difflib.get_close_matches(selector, list(modules), n=5, cutoff=0.5)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ConfigError(f"unknown layer {selector!r}{hint} (list all with `featcache layers`)")
    return [selector]


def _glob_regex(glob: str) -> re.Pattern[str]:
    """Module-name glob: ``*`` and ``?`` stay within one dotted part, ``**`` crosses dots."""
    out = []
    i = 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        ch = glob[i]
        if ch == "*":
            out.append("[^.]*")
        elif ch == "?":
            out.append("[^.]")
        elif ch == "[":
            end = glob.find("]", i + 1)
            if end == -1:
                out.append(re.escape(ch))
            else:
                out.append(glob[i : end + 1])
                i = end
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out))


def reduce_tensor(x: torch.Tensor, tap: Tap) -> torch.Tensor:
    """Apply ``tap.reduce`` to a batch ``x`` of shape ``[B, ...]``; returns ``[B, ...]``.

    ``avg``/``max`` pool over every dimension after the channel dimension (``[B, C, ...]``
    -> ``[B, C]``); ``adaptive_avg`` pools ``[B, C, H, W]`` to ``[B, C, k, k]``;
    ``flatten`` gives ``[B, prod(...)]``; ``cls`` and ``mean`` take token 0 or the mean
    over tokens of a ``[B, T, D]`` sequence (-> ``[B, D]``).
    """
    how = tap.reduce
    if how == "none":
        return x
    if how == "flatten":
        return x.flatten(1)
    if how in ("avg", "max"):
        _need_dims(x, tap, minimum=3, shape="[B, C, ...spatial]")
        dims = tuple(range(2, x.dim()))
        return x.mean(dim=dims) if how == "avg" else x.amax(dim=dims)
    if how == "adaptive_avg":
        _need_dims(x, tap, minimum=4, maximum=4, shape="[B, C, H, W]")
        return F.adaptive_avg_pool2d(x, tap.size)
    if how in ("cls", "mean"):
        _need_dims(x, tap, minimum=3, maximum=3, shape="[B, T, D] tokens")
        return x[:, 0] if how == "cls" else x.mean(dim=1)
    raise ConfigError(f"layer {tap.key!r}: unknown reduce {how!r}")


def _need_dims(
    x: torch.Tensor, tap: Tap, minimum: int, shape: str, maximum: int | None = None
) -> None:
    if x.dim() < minimum or (maximum is not None and x.dim() > maximum):
        raise ConfigError(
            f"layer {tap.key!r}: reduce={tap.reduce} needs a {shape} {tap.capture}, got shape "
            f"{list(x.shape)}; choose another reduce (none, flatten, avg, ...)"
        )


def _pick(value: Any, tap: Tap) -> torch.Tensor:
    """The tensor a tap captures out of a module's output (or input args tuple)."""
    if isinstance(value, torch.Tensor):
        if tap.select is not None and tap.capture == "output":
            raise ConfigError(
                f"layer {tap.key!r}: select={tap.select!r} given, but the {tap.capture} is a "
                "single tensor; drop select"
            )
        return value
    if isinstance(value, (tuple, list, dict)):
        if tap.select is None:
            if tap.capture == "input" and isinstance(value, tuple) and value:
                return _pick(value[0], tap)
            kind = type(value).__name__
            choices = list(value) if isinstance(value, dict) else list(range(len(value)))
            raise ConfigError(
                f"layer {tap.key!r}: its {tap.capture} is a {kind}; set select to one of {choices}"
            )
        try:
            picked = value[tap.select]
        except (IndexError, KeyError, TypeError):
            choices = list(value) if isinstance(value, dict) else list(range(len(value)))
            raise ConfigError(
                f"layer {tap.key!r}: select={tap.select!r} is not in its {tap.capture} "
                f"(choose one of {choices})"
            ) from None
        if not isinstance(picked, torch.Tensor):
            raise ConfigError(
                f"layer {tap.key!r}: select={tap.select!r} picks a {type(picked).__name__}, "
                "not a tensor"
            )
        return picked
    raise ConfigError(
        f"layer {tap.key!r}: its {tap.capture} is a {type(value).__name__}, not a tensor"
    )


class TapSet:
    """Forward hooks for a list of taps, as a context manager.

    Inside the ``with`` block, :meth:`run` feeds one batch through the model and
    returns ``{tap.key: reduced tensor [B, ...]}`` (on the model's device), passed
    through ``convert`` (a dtype cast, say) when given. Captured values never alias the
    model's own tensors. The first call of a module in a forward is the one captured.
    Hooks are removed when the block exits, whatever the exit path.
    """

    def __init__(
        self,
        model: nn.Module,
        taps: Sequence[Tap],
        stop_early: bool = True,
        convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if not taps:
            raise ConfigError("no layers to capture; name at least one layer")
        self.model = model
        self.taps = list(taps)
        self.stop_early = stop_early
        self.convert = convert  # applied to each reduced value inside the hook
        # What run() calls: the model, or a compiled wrapper of it. torch.compile traces the
        # hooks registered when it first runs, so compile after entering the block.
        self.forward: Callable[..., Any] = model
        self._values: dict[str, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> TapSet:
        modules = dict(self.model.named_modules())
        try:
            for tap in self.taps:
                module = modules[tap.module_name]
                if tap.capture == "input":
                    handle = module.register_forward_pre_hook(self._input_hook(tap))
                else:
                    handle = module.register_forward_hook(self._output_hook(tap))
                self._handles.append(handle)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook this set registered (safe to call twice)."""
        while self._handles:
            self._handles.pop().remove()
        self._values = {}

    def _input_hook(self, tap: Tap):
        def hook(module: nn.Module, args: tuple) -> None:
            self._record(tap, args)

        return hook

    def _output_hook(self, tap: Tap):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._record(tap, output)

        return hook

    def _record(self, tap: Tap, value: Any) -> None:
        if tap.key in self._values:
            return
        raw = _pick(value, tap)
        out = reduce_tensor(raw, tap)
        if self.convert is not None:
            out = self.convert(out)
        out = out.detach()  # a compiled forward may hand back tensors that require grad
        if out.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
            # Still the module's own tensor (or a view of it): an in-place op later in the
            # forward, such as ReLU(inplace=True), would change the captured values.
            out = out.clone()
        self._values[tap.key] = out
        if self.stop_early and len(self._values) == len(self.taps):
            raise _StopForward

    def run(self, *inputs: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """One forward over a batch; returns each tap's reduced value, in tap order."""
        if not self._handles:
            raise RuntimeError("TapSet.run is only valid inside its `with` block")
        self._values = {}
        try:
            self.forward(*inputs, **kwargs)
        except _StopForward:
            pass
        values, self._values = self._values, {}
        missing = [tap.module_name for tap in self.taps if tap.key not in values]
        if missing:
            raise FeatcacheError(
                f"layer(s) {', '.join(missing)} never ran in the model's forward; "
                "capture a module that forward() actually calls"
            )
        return {tap.key: values[tap.key] for tap in self.taps}
