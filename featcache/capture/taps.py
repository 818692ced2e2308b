"""Layer taps: hook the selected modules, reduce their values on the device, and stop the
forward once every tap has fired, so that later layers are never computed."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from featcache.capture.channels import AMBIGUOUS, channel_layout
from featcache.capture.reduce import NO_CONTEXT, ReduceContext, reduce_tensor
from featcache.capture.selectors import Tap
from featcache.config.spec import parse_target
from featcache.errors import ConfigError, FeatcacheError


class _StopForward(Exception):
    """Raised from a hook once every tap has its value; ends the forward early."""


def _pick(value: Any, tap: Tap) -> torch.Tensor:
    """The tensor a tap captures out of a module's output (or input args tuple)."""
    if isinstance(value, torch.Tensor):
        if tap.select is not None and tap.capture != "input":
            raise ConfigError(
                f"layer {tap.key!r}: select={tap.select!r} given, but the {tap.capture} is a "
                "single tensor; drop select"
            )
        return value
    if isinstance(value, (tuple, list, dict)):
        choices = list(value) if isinstance(value, dict) else list(range(len(value)))
        if tap.select is None:
            if tap.capture == "input" and isinstance(value, tuple) and value:
                return _pick(value[0], tap)
            kind = type(value).__name__
            raise ConfigError(
                f"layer {tap.key!r}: its {tap.capture} is a {kind}; set select to one of {choices}"
            )
        try:
            picked = value[tap.select]  # type: ignore[index]  # a bad key is caught below
        except (IndexError, KeyError, TypeError):
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
    """Forward hooks for a list of taps, as a context manager, removed whatever the exit path.

    :meth:`run` returns ``{tap.key: reduced tensor [B, ...]}`` of a module's first call,
    never aliasing the model's tensors. Grad taps run one backward per target, with only
    the input requiring grad (parameters frozen for the run, their ``.grad`` untouched).
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
        self.needs_grad = any(tap.capture == "grad" for tap in self.taps)
        # A gradient needs the forward to reach the model's output.
        self.stop_early = stop_early and not self.needs_grad
        self.convert = convert  # applied to each reduced value inside the hook
        # The model, or a compiled wrapper of it made after entering the block (torch.compile
        # traces the hooks registered when it first runs).
        self.forward: Callable[..., Any] = model
        self._values: dict[str, torch.Tensor] = {}
        self._hooked: set[str] = set()  # grad taps whose tensor hook is set in this forward
        self._active_target: str | int | None = None  # the target being differentiated
        self._context = NO_CONTEXT  # the batch being run, for the reductions
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # By tap key, as of the first batch: "channel_layout" of a 4-d output ("nchw", "nhwc",
        # "" when it cannot be told) and "select" where a tuple's hidden states were taken.
        self.observed: dict[str, dict[str, str]] = {}
        self._nonzero_grads: set[str] = set()  # grad taps that captured a nonzero value

    def __enter__(self) -> TapSet:
        modules = dict(self.model.named_modules())
        try:
            for tap in self.taps:
                module = modules[tap.module_name]
                if tap.capture == "input":
                    handle = module.register_forward_pre_hook(functools.partial(self._record, tap))
                else:
                    on = self._on_grad if tap.capture == "grad" else self._record
                    handle = module.register_forward_hook(functools.partial(on, tap))
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
        self._hooked = set()

    def _on_grad(self, tap: Tap, module: nn.Module, args: tuple, output: Any) -> None:
        if tap.key in self._hooked:
            return
        raw = _pick(output, self._selected(tap, output, module))
        if not raw.requires_grad:
            raise ConfigError(_no_path(tap))
        self._hooked.add(tap.key)
        # A tensor hook receives the gradient of the value the module returned, even
        # when a later in-place op (ReLU(inplace=True)) changes the tensor.
        raw.register_hook(lambda grad: self._store_grad(tap, grad))

    def _record(self, tap: Tap, module: nn.Module, args: tuple, output: Any = None) -> None:
        if tap.key in self._values:
            return
        value = args if tap.capture == "input" else output
        self._store(tap, _pick(value, self._selected(tap, value, module)))
        if self.stop_early and len(self._values) == len(self.taps):
            raise _StopForward

    def _selected(self, tap: Tap, value: Any, module: nn.Module) -> Tap:
        """``tap``, with ``select=0`` (the hidden states, recorded in :attr:`observed`) for a
        transformers module's tuple output and no ``select``."""
        if (
            tap.select is None
            and tap.capture != "input"
            and isinstance(value, (tuple, list))
            and value
            and isinstance(value[0], torch.Tensor)
            and type(module).__module__.startswith("transformers.")
        ):
            self.observed.setdefault(tap.key, {})["select"] = "0"
            return dataclasses.replace(tap, select=0)
        return tap

    def _store_grad(self, tap: Tap, grad: torch.Tensor) -> None:
        # One backward runs per target; each tap keeps the gradient of its own.
        if tap.target == self._active_target:
            self._store(tap, grad)
            if tap.key not in self._nonzero_grads and bool(self._values[tap.key].any()):
                self._nonzero_grads.add(tap.key)

    def zero_gradients(self) -> list[Tap]:
        """The gradient taps whose every reduced value so far was exactly zero."""
        return [t for t in self.taps if t.capture == "grad" and t.key not in self._nonzero_grads]

    def _store(self, tap: Tap, raw: torch.Tensor) -> None:
        if tap.key in self._values:
            return
        observed = self.observed.setdefault(tap.key, {})
        if raw.dim() == 4 and "channel_layout" not in observed:
            declared = self._context.declared_layout(tap)
            shape, size = tuple(raw.shape[1:]), self._context.image_size
            layout = channel_layout(shape, declared, size)
            observed["channel_layout"] = layout if layout != AMBIGUOUS else ""
        out = reduce_tensor(raw.detach(), tap, self._context)
        if self.convert is not None:
            out = self.convert(out)
        out = out.detach()  # a compiled forward may hand back tensors that require grad
        if out.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
            # Still the module's own tensor (or a view of it): an in-place op later in the
            # forward, such as ReLU(inplace=True), would change the captured values.
            out = out.clone()
        self._values[tap.key] = out

    def run(
        self,
        *inputs: Any,
        labels: torch.Tensor | None = None,
        context: ReduceContext = NO_CONTEXT,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        """One forward of ``inputs`` and ``kwargs``; each tap's reduced value, in tap order.
        ``labels`` (``[B]`` int64, -1 for none) serve grad taps whose target is ``"label"``."""
        if not self._handles:
            raise RuntimeError("TapSet.run is only valid inside its `with` block")
        self._values = {}
        self._hooked = set()
        self._context = context
        try:
            if self.needs_grad:
                self._run_with_grad(inputs, kwargs, labels)
            else:
                self.forward(*inputs, **kwargs)
        except _StopForward:
            pass
        finally:
            self._hooked = set()
            self._active_target = None
            self._context = NO_CONTEXT
        values, self._values = self._values, {}
        _check_ran([tap for tap in self.taps if tap.key not in values])
        return {tap.key: values[tap.key] for tap in self.taps}

    def _run_with_grad(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], labels: torch.Tensor | None
    ) -> None:
        params = list(self.model.parameters())
        flags = [p.requires_grad for p in params]
        try:
            # Inference mode may be on in the caller; a normal autograd forward needs it off.
            with torch.inference_mode(False), torch.enable_grad():
                for p in params:
                    p.requires_grad_(False)
                inputs = tuple(_grad_leaf(x) for x in inputs)
                if labels is not None:
                    labels = labels.clone()  # not an inference tensor: gather saves it
                leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
                if not leaves:
                    raise ConfigError("capture=grad needs a floating-point input tensor")
                output = self.forward(*inputs, **kwargs)
                self._backward(_logits(output), leaves, labels)
        finally:
            for p, flag in zip(params, flags, strict=True):
                p.requires_grad_(flag)

    def _backward(
        self, logits: torch.Tensor, leaves: list[torch.Tensor], labels: torch.Tensor | None
    ) -> None:
        grad_taps = [tap for tap in self.taps if tap.capture == "grad"]
        _check_ran([tap for tap in grad_taps if tap.key not in self._hooked])
        if not logits.requires_grad:
            raise ConfigError(_no_path(grad_taps[0]))
        targets: dict[str | int | None, list[Tap]] = {}
        for tap in grad_taps:
            targets.setdefault(tap.target, []).append(tap)
        for n, (target, group) in enumerate(targets.items()):
            score = target_scores(logits, target, labels)
            self._active_target = target
            # The taps' tensor hooks see the gradients; no .grad is accumulated.
            torch.autograd.grad(
                score.sum(), leaves, retain_graph=n < len(targets) - 1, allow_unused=True
            )
            for tap in group:
                if tap.key not in self._values:
                    raise ConfigError(_no_path(tap))


def zero_gradient_note(tap: Tap, where: str) -> str:
    """Why the gradients ``where`` names (``"its gradient at row 3"``) are all zero."""
    return (
        f"layer {tap.key!r}: {where} is exactly zero: the target score ({tap.target}) does "
        f"not depend on the output of {tap.module_name} (a ViT's last-block patch tokens, "
        "which its head never reads, are one such case), so its Grad-CAM maps are blank; "
        "capture an earlier layer"
    )


def target_scores(
    logits: torch.Tensor, target: str | int | None, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """The score ``[B]`` a gradient target picks from ``logits`` ``[B, D]``: ``"label"``
    ``logits[i, labels[i]]``, ``"predicted"`` the row's max, ``k`` or ``"output:K"`` a column."""
    mode, index = parse_target(target)
    flat = logits.flatten(1)
    if mode == "label":
        if labels is None or (labels < 0).any():
            raise ConfigError(
                "gradient target 'label' needs labelled samples; these have none (set the "
                "layer's target to predicted or a class index)"
            )
        labels = labels.to(flat.device)
        if int(labels.max()) >= flat.shape[1]:
            raise ConfigError(
                f"label {int(labels.max())} is out of range for a model output of "
                f"{flat.shape[1]} values; set the layer's target"
            )
        return flat.gather(1, labels.view(-1, 1)).squeeze(1)
    if mode == "predicted":
        return flat.amax(dim=1)
    assert index is not None
    if index >= flat.shape[1]:
        raise ConfigError(
            f"gradient target {target!r} is out of range for a model output of "
            f"{flat.shape[1]} values per sample"
        )
    return flat[:, index]


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]  # e.g. (logits, aux_logits)
    elif hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        output = output.logits
    if not isinstance(output, torch.Tensor) or output.dim() < 1:
        raise ConfigError(
            f"capture=grad needs a model that returns a tensor of scores [B, ...], got "
            f"{type(output).__name__}"
        )
    return output[:, None] if output.dim() == 1 else output


def _check_ran(missing: list[Tap]) -> None:
    if missing:
        raise FeatcacheError(
            f"layer(s) {', '.join(t.module_name for t in missing)} never ran in the model's "
            "forward; capture a module that forward() actually calls"
        )


def _grad_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().clone().requires_grad_(True)
    return x


def _no_path(tap: Tap) -> str:
    return (
        f"no differentiable path from layer {tap.module_name} to the model output "
        f"(capture=grad of {tap.key!r}); the model detaches it, runs it without grad, or "
        "does not use it for its output"
    )
