"""Sizes as people write them in configuration and scenario files, and as messages show them."""

from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_p}b"] = 1000**_i  # SI: 1 GB = 10^9 bytes
    _SIZE_UNITS[f"{_p}ib"] = 1024**_i  # IEC: 1 GiB = 2^30 bytes
_EXPECTED = "expected a size such as 1024, '512MiB' or '80GiB'"


def parse_size(value: object) -> int:
    """Bytes from an integer or a string such as ``"80GiB"``, ``"512MiB"``, ``"1.5GB"``; ValueError
    names the value."""
    if isinstance(value, bool):
        raise ValueError(f"{_EXPECTED}, got {value!r}")
    if isinstance(value, (int, float)):
        try:
            size = float(value)
        except OverflowError:  # an int beyond any float (YAML reads 1000 digits as one): not a size
            size = math.inf
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise ValueError(f"{_EXPECTED}, got {value!r}")
        size = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    else:
        raise ValueError(f"{_EXPECTED}, got {value!r}")
    if not math.isfinite(size) or size < 0:
        raise ValueError(f"a size must be a finite number of bytes >= 0, got {value!r}")
    return round(size)


def format_size(size: int) -> str:
    """Bytes for people: 512 B, 1.5 MiB."""
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} PiB"
