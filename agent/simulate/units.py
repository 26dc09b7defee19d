"""Value types of scenario files: durations, sizes and fractions as people write them.

Durations reuse the agent's own parser (``1.5``, ``"500ms"``, ``"2m"``) so that a scenario and a
config file accept the same spellings.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator

from gpuscope.common.durations import parse_duration

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_p}b"] = 1000**_i  # SI: 1 GB = 10^9 bytes
    _SIZE_UNITS[f"{_p}ib"] = 1024**_i  # IEC: 1 GiB = 2^30 bytes


def parse_size(value: object) -> int:
    """Bytes from an integer or a string such as ``"80GiB"``, ``"512MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 1024, '512MiB' or '80GiB', got {value!r}")
    if isinstance(value, (int, float)):
        size = float(value)
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise ValueError(f"expected a size such as 1024, '512MiB' or '80GiB', got {value!r}")
        size = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    else:
        raise ValueError(f"expected a size such as 1024, '512MiB' or '80GiB', got {value!r}")
    if not math.isfinite(size) or size < 0:
        raise ValueError(f"a size must be a finite number of bytes >= 0, got {value!r}")
    return round(size)


def parse_optional_duration(value: object) -> float | None:
    """A duration, or None for ``never`` / null (used where "not at all" is a valid answer)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "never"):
        return None
    return parse_duration(value)


def _fraction(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be between 0 and 1")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be greater than 0")
    return value


PositiveDuration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_positive)]
OptionalDuration = Annotated[float | None, BeforeValidator(parse_optional_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
Fraction = Annotated[float, AfterValidator(_fraction)]
