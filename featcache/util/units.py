"""Byte sizes for people: ``4GiB`` in, ``1.3 MiB`` out."""

from __future__ import annotations

import re

from featcache.errors import ConfigError

_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?")


def format_bytes(n: float) -> str:
    """``1363148`` -> ``"1.3 MiB"`` (binary units, one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def parse_bytes(text: str | int) -> int:
    """``4GiB``, ``4GB``, ``512M``, ``1e9`` or a plain number of bytes -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.fullmatch(str(text).strip().lower())
    if not match or (match[3] and not match[2]):  # "i" needs a unit: 4KiB, not 4iB
        raise ConfigError(f"memory size {text!r} is not a size like 4GiB, 512MB or 1e9")
    number, unit, binary = match.groups()
    return int(float(number) * (1024 if binary else 1000) ** "_kmgt".index(unit or "_"))
