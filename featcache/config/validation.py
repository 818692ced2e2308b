"""One checker for every option surface: config sections, keyword options, probe and source options.

Options are dataclasses whose type hints say what each field takes; :func:`option` adds
bounds and a ``convert`` step for shorthand, and a ``validate(self, at)`` method checks
rules across fields once every field has passed. Every failure is one
:class:`~featcache.errors.ConfigError` line naming the full key path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from featcache.errors import ConfigError

T = TypeVar("T")

UNKNOWN_CONFIG_KEY = "unknown config key {where}; known keys here: {known}"


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Numeric limits of a field; ``None`` means no limit on that side."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self, noun: str) -> str:
        """``"a whole number >= 1"``, ``"a number between 0 and 1 (exclusive)"``."""
        if self.gt is not None and self.lt is not None:
            return f"{noun} between {_num(self.gt)} and {_num(self.lt)} (exclusive)"
        if self.ge is not None and self.le is not None:
            return f"{noun} from {_num(self.ge)} to {_num(self.le)}"
        limits = [
            f"{op} {_num(bound)}"
            for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if bound is not None
        ]
        return " ".join([noun, *limits])


def option(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    convert: Callable[[Any, str], Any] | None = None,
) -> Any:
    """A dataclass field with declared bounds and an optional ``convert(value, path)`` step."""
    metadata: dict[str, Any] = {}
    if any(b is not None for b in (ge, gt, le, lt)):
        metadata["bounds"] = Bounds(ge=ge, gt=gt, le=le, lt=lt)
    if convert is not None:
        metadata["convert"] = convert
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def build(cls: type[T], raw: Any, at: str = "", *, unknown: str = UNKNOWN_CONFIG_KEY) -> T:
    """Make dataclass ``cls`` from plain data (a mapping; ``None`` means all defaults).

    ``at`` is the key path of ``raw`` (``"loader"``); ``unknown`` formats the error for a
    key ``cls`` does not have, from ``{where}`` (its path), ``{key}`` and ``{known}``.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{at or 'config'} must be a mapping, got {_kind(raw)}")
    values = _field_values(cls, raw, at, unknown)
    missing = [
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{at or 'config'} is missing required key {missing[0]}")
    obj = cls(**values)
    _validate(obj, at)
    return obj


def update(
    obj: T, changes: Mapping[str, Any], at: str = "", *, unknown: str = UNKNOWN_CONFIG_KEY
) -> T:
    """A copy of dataclass ``obj`` with ``changes`` applied, checked like :func:`build`."""
    values = _field_values(type(obj), changes, at, unknown)
    new = dataclasses.replace(obj, **values)  # type: ignore[type-var]
    check(new, at)
    return new


def check(obj: Any, at: str = "") -> None:
    """Check every field of a dataclass made in Python, then its ``validate`` rules."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        _check_value(hints[f.name], f, getattr(obj, f.name), _join(at, f.name))
    _validate(obj, at)


def allowed_values(hint: Any, bounds: Bounds | None = None) -> str:
    """What a field of type ``hint`` takes, in the words of its errors: ``"a whole number
    >= 1"``, ``"'fail' or 'skip'"``, ``"a string or null"``."""
    return _expected(_alternatives(hint), bounds)


def choices(hint: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` hint (or a union holding one) allows, ``None`` included."""
    out: list[Any] = []
    for alt in _alternatives(hint):
        if typing.get_origin(alt) is typing.Literal:
            out.extend(typing.get_args(alt))
        elif alt is type(None):
            out.append(None)
    return tuple(out)


# ----------------------------------------------------------------------------- internals


def _field_values(cls: type, raw: Mapping[str, Any], at: str, unknown: str) -> dict[str, Any]:
    """The values of ``raw`` checked as the fields of ``cls``; an unknown key is refused."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(str(k) for k in set(raw) - set(fields))
    if extra:
        raise ConfigError(
            unknown.format(where=_join(at, extra[0]), key=extra[0], known=", ".join(sorted(fields)))
        )
    hints = _hints(cls)
    values = {}
    for name, value in raw.items():
        metadata = fields[name].metadata
        if "convert" in metadata:
            value = metadata["convert"](value, _join(at, name))
        values[name] = _convert(hints[name], metadata.get("bounds"), value, _join(at, name))
    return values


def _check_value(hint: Any, f: dataclasses.Field, value: Any, at: str) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        check(value, at)
        return
    if isinstance(value, list) and typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v):
                    check(v, f"{at}[{i}]")
                else:
                    raise ConfigError(f"{at}[{i}] must be a mapping, got {_kind(v)}")
            return
    _convert(hint, f.metadata.get("bounds"), value, at)


def _convert(hint: Any, bounds: Bounds | None, value: Any, at: str) -> Any:
    """``value`` checked against ``hint`` (and ``bounds``), with ints widened to floats."""
    alternatives = _alternatives(hint)
    for alt in alternatives:
        matched, converted = _match(alt, value, at)
        if matched:
            if bounds is not None and _is_number(converted) and not bounds.holds(converted):
                raise ConfigError(f"{at} must be {_expected(alternatives, bounds)}, got {value!r}")
            return converted
    if all(typing.get_origin(a) is typing.Literal or a is type(None) for a in alternatives):
        if value is None:
            raise ConfigError(f"{at} must not be null; choose one of: {_names(choices(hint))}")
        raise ConfigError(f"{at} is {value!r}; choose one of: {_names(choices(hint))}")
    if value is None:
        raise ConfigError(f"{at} must not be null")
    hint_text = ""
    if isinstance(value, str) and float in alternatives and _parses_as_float(value):
        # YAML 1.1 reads 1e-6 (no dot) as text
        hint_text = f" (YAML reads {value} as text; write it with a dot, e.g. 1.0e-6)"
    raise ConfigError(
        f"{at} must be {_expected(alternatives, bounds)}, got {_kind(value)} {value!r}" + hint_text
    )


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _match(kind: Any, value: Any, at: str) -> tuple[bool, Any]:
    origin = typing.get_origin(kind)
    if kind is Any:
        return True, value
    if kind is type(None):
        return value is None, value
    if origin is typing.Literal:
        return any(value == c and type(value) is type(c) for c in typing.get_args(kind)), value
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        if isinstance(value, kind):
            check(value, at)
            return True, value
        if value is None or isinstance(value, Mapping):
            return True, build(kind, value, at)
        return False, value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = typing.get_args(kind)
        item = args[0] if args else Any
        items = [_convert(item, None, v, f"{at}[{i}]") for i, v in enumerate(value)]
        return True, (items if origin is list else tuple(items))
    if origin is dict or kind is dict:
        return isinstance(value, Mapping), (dict(value) if isinstance(value, Mapping) else value)
    if kind is bool:
        return isinstance(value, bool), value
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind is float:
        return (True, float(value)) if _is_number(value) else (False, value)
    if isinstance(kind, type):
        return isinstance(value, kind), value
    return False, value


def _expected(alternatives: tuple[Any, ...], bounds: Bounds | None) -> str:
    words: list[str] = []
    for alt in alternatives:
        origin = typing.get_origin(alt)
        if alt is bool:
            words += ["true", "false"]
        elif origin is typing.Literal:
            words += [repr(c) for c in typing.get_args(alt)]
        elif alt is type(None):
            words.append("null")
        elif alt in (int, float):
            noun = "a whole number" if alt is int else "a number"
            plain = "an integer" if alt is int else "a number"
            words.append(bounds.describe(noun) if bounds is not None else plain)
        elif origin in (list, tuple):
            words.append("a list")
        elif origin is dict or alt is dict or dataclasses.is_dataclass(alt):
            words.append("a mapping")
        elif alt is str:
            words.append("a string")
        else:
            words.append(getattr(alt, "__name__", str(alt)))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _validate(obj: Any, at: str) -> None:
    rule = getattr(obj, "validate", None)
    if callable(rule):
        rule(at)


_hints: Callable[[type], dict[str, Any]] = functools.cache(typing.get_type_hints)


def _alternatives(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else str(x)


def _names(values: tuple[Any, ...]) -> str:
    return ", ".join("null" if v is None else str(v) for v in values)


def _join(at: str, key: str) -> str:
    return f"{at}.{key}" if at else str(key)


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )
