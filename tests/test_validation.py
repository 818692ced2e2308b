"""The one option checker: types, choices, bounds, shorthand, cross-field rules, key paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from featcache.config.validation import build, check, choices, option, update
from featcache.errors import ConfigError


@dataclass
class Inner:
    mode: Literal["a", "b"] = "a"
    count: int = option(1, ge=1)


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    ratio: float | None = option(None, gt=0, lt=1)
    workers: int | Literal["auto"] = option("auto", ge=0)
    flag: bool = False
    names: list[str] = option(
        default_factory=list, convert=lambda v, at: [v] if isinstance(v, str) else v
    )
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, at: str) -> None:
        if self.flag and not self.names:
            raise ConfigError(f"{at or 'outer'}.flag needs names")


def test_build_converts_and_defaults():
    obj = build(Outer, {"inner": {"count": 3}, "ratio": 0.5, "names": "x", "workers": 2})
    assert obj.inner == Inner("a", 3) and obj.ratio == 0.5 and obj.names == ["x"]
    assert obj.workers == 2 and build(Outer, None) == Outer()


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"inner": {"mode": "c"}}, "inner.mode is 'c'; choose one of: a, b"),
        ({"inner": {"count": 0}}, "inner.count must be a whole number >= 1, got 0"),
        ({"inner": {"count": "x"}}, "inner.count must be a whole number >= 1, got a string 'x'"),
        ({"inner": {"cuont": 1}}, "unknown config key inner.cuont; known keys here: count, mode"),
        ({"ratio": 1.0}, "ratio must be a number between 0 and 1 (exclusive) or null, got 1.0"),
        ({"workers": -1}, "workers must be a whole number >= 0 or 'auto', got -1"),
        ({"workers": "many"}, "workers must be a whole number >= 0 or 'auto', got a string"),
        ({"flag": "yes"}, "flag must be true or false, got a string 'yes'"),
        ({"flag": True}, "outer.flag needs names"),
        ({"inner": 3}, "inner must be a mapping, got int 3"),
        ({"names": [1]}, "names[0] must be a string, got int 1"),
    ],
)
def test_errors_name_the_key_the_allowed_values_and_the_value(raw, message):
    with pytest.raises(ConfigError) as err:
        build(Outer, raw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_update_and_check_use_the_same_rules():
    obj = update(Outer(), {"workers": 3}, "opts")
    assert obj.workers == 3
    with pytest.raises(ConfigError, match="unknown thing 'bogus'; known: "):
        update(Outer(), {"bogus": 1}, unknown="unknown thing {key!r}; known: {known}")
    bad = Outer(inner=Inner(count=0))
    with pytest.raises(ConfigError, match=r"^opts.inner.count must be a whole number >= 1"):
        check(bad, "opts")


def test_choices_lists_literal_values_and_null():
    assert choices(Literal["x", "y"] | None) == ("x", "y", None)
