"""Layer selectors: which modules a layer list names, resolved into :class:`Tap` s."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from featcache.config.spec import LayerSpec, parse_layers
from featcache.errors import ConfigError


@dataclass(frozen=True)
class Tap:
    """One resolved capture point. ``key`` names its dataset in the store."""

    key: str
    module_name: str
    capture: str = "output"
    reduce: str = "none"
    size: int | None = None
    select: int | str | None = None
    target: str | int | None = None  # capture="grad" only: see LayerSpec.target
    layout: str | None = None  # "nchw" or "nhwc": where a 4-d output keeps its channels


def tap_record(tap: Tap) -> dict[str, Any]:
    """``tap`` as a store key's JSON-able record; ``layout`` only when set, so that older
    stores' records stay the same."""
    record = asdict(tap)
    if record["layout"] is None:
        del record["layout"]
    return record


def resolve_taps(model: nn.Module, layers: Iterable[LayerSpec | str | dict]) -> list[Tap]:
    """Expand layer selectors into taps, in the order given: module names, index or slice
    steps (``blocks[-4:]``), globs (``layer*.1``), ``type:ClassName`` or ``.`` (the model;
    see ``docs/concepts/layers.md``)."""
    modules = {name: module for name, module in model.named_modules() if name}
    taps: list[Tap] = []
    for layer in parse_layers(layers):
        names = [""] if layer.name == MODEL else _match(layer.name, model, modules)
        if layer.key is not None and len(names) > 1:
            raise ConfigError(
                f"layer {layer.name!r} matches {len(names)} modules but sets one key "
                f"{layer.key!r}; drop key or select a single module"
            )
        taps += [_tap(layer, name) for name in names]
    seen: set[str] = set()
    for tap in taps:
        if tap.key in seen:
            raise ConfigError(
                f"layer key {tap.key!r} is selected twice; give one of them a distinct key"
            )
        seen.add(tap.key)
    return taps


def _tap(layer: LayerSpec, name: str) -> Tap:
    suffix = {"input": "@input", "grad": "@grad"}.get(layer.capture, "")
    target = None
    if layer.capture == "grad":
        target = "label" if layer.target is None else layer.target
    settings = (layer.capture, layer.reduce, layer.size, layer.select, target, layer.layout)
    return Tap(layer.key or (name or MODEL_KEY) + suffix, name, *settings)


MODEL = "."  # the selector of the model itself
MODEL_KEY = "output"  # ... and the key its output is stored under by default

# "name[...]" steps: an index ("-1"), or a slice ("-4:", "::2", "1:3")
_SUBSCRIPT = re.compile(r"-?\d+|-?\d*:-?\d*(?::-?\d*)?")
_STEP = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]|(\.)")
# Glob tokens: "**", "*", "?" and a closed "[...]" set (kept as it is, a regex set).
_GLOB_TOKEN = re.compile(r"(\*\*|\*|\?|\[[^\]]*\])")
_GLOB_REGEX = {"**": ".*", "*": "[^.]*", "?": "[^.]"}


def _match(selector: str, model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    indexed = _match_indexed(selector, model, modules)
    if indexed is not None:
        return indexed
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


def _match_indexed(
    selector: str, model: nn.Module, modules: dict[str, nn.Module]
) -> list[str] | None:
    """The names a selector with index or slice steps over containers' children means; None
    when it has none, or reads as a glob (``layer[12]`` where ``layer`` is no module)."""
    matches = list(_STEP.finditer(selector))
    if sum(len(m.group(0)) for m in matches) != len(selector):
        return None  # characters no step reads: not this syntax
    steps = [m.groups() for m in matches]
    if not any(b and _SUBSCRIPT.fullmatch(b) for _, b, _ in steps):
        return None
    current = [""]  # module names reached so far ("" is the model itself)
    for name, subscript, dot in steps:
        if dot:
            continue
        if name:
            current = [f"{c}.{name}" if c else name for c in current]
            missing = [c for c in current if c not in modules]
            if missing:
                if current == [name]:
                    return None  # no such module at the top: a glob like layer[12]
                raise ConfigError(
                    f"layer {selector!r}: {missing[0]!r} is not a module (list them with "
                    "`featcache layers`)"
                )
            continue
        if not _SUBSCRIPT.fullmatch(subscript):
            return None
        picked = []
        for parent in current:
            # Every entry, a module used twice included, so that indices count as the
            # container does (named_children() lists a module once).
            entries = (modules[parent] if parent else model)._modules.items()
            children = [f"{parent}.{c}" if parent else c for c, m in entries if m is not None]
            picked += _subscript(selector, parent or "the model", children, subscript)
        if not picked:
            raise ConfigError(f"layer {selector!r}: [{subscript}] selects no module")
        current = picked
    for name in current:
        if name not in modules:
            _refuse_second_use(selector, name, model, modules)
    return current


def _refuse_second_use(
    selector: str, name: str, model: nn.Module, modules: dict[str, nn.Module]
) -> None:
    """Refuse container entry ``name``, a module that runs first under another name."""
    module = model.get_submodule(name)
    first = next(n for n, m in modules.items() if m is module)
    raise ConfigError(
        f"layer {selector!r}: {name} is the module {first} used again, and a module is "
        f"captured at its first call; capture {first}, or give the model a module of its "
        "own for this use"
    )


def _subscript(selector: str, parent: str, children: list[str], subscript: str) -> list[str]:
    if ":" in subscript:
        parts = [int(p) if p else None for p in subscript.split(":")]
        return children[slice(*parts)]
    index = int(subscript)
    if not -len(children) <= index < len(children):
        span = f"0..{len(children) - 1}" if children else "none"
        raise ConfigError(
            f"layer {selector!r}: index {index} is out of range; {parent} has "
            f"{len(children)} entries ({span})"
        )
    return [children[index]]


def _glob_regex(glob: str) -> re.Pattern[str]:
    """``*`` and ``?`` stay within one dotted part, ``**`` crosses dots."""
    parts = _GLOB_TOKEN.split(glob)  # literal text at even indices, glob tokens at odd ones
    return re.compile(
        "".join(_GLOB_REGEX.get(p, p) if i % 2 else re.escape(p) for i, p in enumerate(parts))
    )
