"""Human byte sizes: "8GiB", "512 MB", "1.5T", "0" <-> integers."""

from __future__ import annotations

import re

from tierd.errors import InvalidArgument

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size; plain integers are bytes. Raises InvalidArgument."""
    if isinstance(text, bool):
        raise InvalidArgument(f"size must be a number of bytes or a string like '8GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise InvalidArgument(f"size must not be negative, got {text}", value=text)
        return text
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(
            f"cannot read size {text!r}: use bytes or a number with a unit such as 512MiB, 8GiB, 1.5TB",
            value=text,
        )
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_size(n: int | float) -> str:
    """Format bytes with a binary unit, e.g. 1536 -> '1.5KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)}B"
            return f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")
