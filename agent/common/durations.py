"""Durations as people write them in config files and flags: 1.5, "500ms", "2m", "1m30s"."""

from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(value: object) -> float:
    """Seconds from a number (seconds) or a Prometheus/Go-style string; ValueError names the value."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 1.5, '500ms' or '2m', got {value!r}")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float (YAML reads 1000 digits as one): not a duration
            seconds = math.inf
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _PART.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(
                    f"expected a duration such as 1.5, '500ms' or '2m', got {value!r}") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"expected a duration such as 1.5, '500ms' or '2m', got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact spelling, for messages and docs: 0.5 -> '500ms', 120 -> '2m'."""
    if seconds and seconds < 1:
        return f"{seconds * 1000:g}ms"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


def format_wait(seconds: float) -> str:
    """A duration rounded up to whole seconds, for how long something lasts or must be waited for:
    0.2 -> '1s', 61 -> '1m1s', 900 -> '15m'."""
    whole = max(1, math.ceil(seconds - 1e-9))
    minutes, secs = divmod(whole, 60)
    if not minutes:
        return f"{secs}s"
    return f"{minutes}m{secs}s" if secs else f"{minutes}m"
