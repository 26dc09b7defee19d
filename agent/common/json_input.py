"""JSON from outside (a webhook body, a file someone could edit), read within bounds.

Python's decoder takes any size and recurses once per nesting level until the interpreter's
recursion limit, so a body of a few KiB of ``[`` ends in a RecursionError. Here the size and the
depth are checked first, and every failure is a ValueError that says what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32  # Alertmanager's payload nests 4 levels; capture.json 4
# Possessive, and an unterminated string runs to the end: every byte is scanned once (a plain
# "(?:[^"\\]|\\.)*" restarts at each escaped quote of an unterminated string: quadratic).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\Z)', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class JsonInputError(ValueError):
    """Input that is not JSON within the bounds; the message says why."""


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in ``data`` (brackets inside strings not counted)."""
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub(b'""', data)):
        if bracket in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def load_json(data: bytes, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """``data`` decoded as UTF-8 JSON; JsonInputError if it is larger than ``max_bytes``, nested
    deeper than ``max_depth``, not UTF-8, not JSON, or holds NaN or Infinity."""
    if len(data) > max_bytes:
        raise JsonInputError(f"{len(data)} bytes exceeds the limit of {max_bytes}")
    depth = nesting_depth(data)
    if depth > max_depth:
        raise JsonInputError(f"nested {depth} levels deep; at most {max_depth}")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise JsonInputError(f"not UTF-8: {err.reason} at byte {err.start}") from None
    except (ValueError, RecursionError) as err:
        raise JsonInputError(f"not JSON: {err}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")
