"""The parameters of the capture listing, read once for both doors.

HTTP hands over the query's text (``?limit=20&include_refused=1``), the control API the request's
fields (``limit``, ``include_refused``); both come here, and a value out of range is an error at both,
never clamped: ``ParameterError`` names the parameter, what it allows and what it got, and HTTP answers
it with 400, the control API with INVALID_ARGUMENT. An absent parameter takes its default (the control
API's ``limit: 0`` is proto3's absent value).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LIST_LIMIT = 100  # captures (and refused triggers) listed when no limit is given
# The most a listing answers: about 2 kB per record, so a few MB at most, within the control API's
# bridge and HTTP alike.
MAX_LIST_LIMIT = 1000
_FLAGS = {"0": False, "1": True, "false": False, "true": True}  # a yes/no parameter given as text
_MAX_SHOWN = 20  # characters of a bad value quoted back


class ParameterError(ValueError):
    """A request parameter out of its range; the message names it and what it allows."""


@dataclass(frozen=True, slots=True)
class ListParameters:
    """What a capture listing was asked for: at most ``limit`` records (and refused triggers, with
    ``include_refused``), newest first."""

    limit: int = DEFAULT_LIST_LIMIT
    include_refused: bool = False


def list_parameters(limit: str | int | None = None,
                    include_refused: str | bool | None = None) -> ListParameters:
    """The listing's parameters from a request's: text (an HTTP query) or values (the control API).
    None: absent (the default). ParameterError for a value out of range."""
    return ListParameters(limit=_limit(limit), include_refused=_flag("include_refused", include_refused))


def _limit(value: str | int | None) -> int:
    if value is None:
        return DEFAULT_LIST_LIMIT
    if isinstance(value, str):
        well_formed = value.isascii() and value.isdigit() and len(value) <= 6
        number = int(value) if well_formed else None
    else:
        number = value if isinstance(value, int) and not isinstance(value, bool) else None
    if number is None or not 1 <= number <= MAX_LIST_LIMIT:
        raise ParameterError(f"limit must be a whole number from 1 to {MAX_LIST_LIMIT} (absent: "
                             f"{DEFAULT_LIST_LIMIT}), not {_shown(value)}")
    return number


def _flag(name: str, value: str | bool | None) -> bool:
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in _FLAGS:
        return _FLAGS[value]
    allowed = ", ".join(sorted(_FLAGS))
    raise ParameterError(f"{name} must be one of {allowed}, not {_shown(value)}")


def _shown(value: object) -> str:
    """A bad value quoted back the same way from either door (the text 1001 and the number alike)."""
    return repr(str(value)[:_MAX_SHOWN])
