"""Value types of scenario files: durations, sizes and fractions as people write them.

Durations and sizes are the configuration's own types (``1.5``, ``"500ms"``, ``"2m"``; ``"80GiB"``),
so that a scenario and a config file accept the same spellings and the same ranges.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BeforeValidator

from gpuscope.common.config_types import Duration


def parse_optional_duration(value: object) -> object:
    """None for ``never`` / null (where "not at all" is a valid answer); anything else is left to
    the Duration type."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "never"):
        return None
    return value


def _fraction(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be between 0 and 1")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be greater than 0")
    return value


PositiveDuration = Annotated[Duration, AfterValidator(_positive)]
OptionalDuration = Annotated[Duration | None, BeforeValidator(parse_optional_duration)]
Fraction = Annotated[float, AfterValidator(_fraction)]
