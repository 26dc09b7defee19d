"""capture.json: a CaptureRecord as JSON and back, with the checks a file read from disk needs.

The file is written by the agent, but it is read back at start-up from a directory anyone with write
access to the store could have edited, so reading validates every field (types, outcome names, ids,
relative file paths) and refuses the file as a whole with a message naming the first problem.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import PurePosixPath
from typing import Any

from pydantic import TypeAdapter, ValidationError

from gpuscope.capture.model import CaptureError, CaptureRecord
from gpuscope.common.json_input import JsonInputError, load_json

RECORD_FILE = "capture.json"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 1 << 20  # a capture.json is a few KiB; anything larger is not ours

# <UTC yyyymmddThhmmssZ>-<gpuN | pidN | node>-<6 hex>: ASCII only, fixed shape, no separators, no dots.
CAPTURE_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-(?:gpu[0-9]{1,4}|pid[0-9]{1,10}|node)-[0-9a-f]{6}")
MAX_ID_LENGTH = 48


class CaptureIdError(CaptureError, ValueError):
    """A capture id from outside (API, URL, file name) that is not one the store generates."""


class CaptureRecordError(CaptureError, ValueError):
    """A capture.json that cannot be read back as a CaptureRecord."""


def check_capture_id(value: object) -> str:
    """``value`` if it is a well-formed capture id; CaptureIdError naming the problem otherwise."""
    if not isinstance(value, str):
        raise CaptureIdError(f"a capture id must be a string, got {type(value).__name__}")
    shown = repr(value if len(value) <= MAX_ID_LENGTH else value[:MAX_ID_LENGTH] + "...")
    if not value:
        raise CaptureIdError("the capture id is empty")
    if len(value) > MAX_ID_LENGTH:
        raise CaptureIdError(f"capture id {shown} is too long ({len(value)} characters, at most "
                             f"{MAX_ID_LENGTH})")
    if "\x00" in value:
        raise CaptureIdError(f"capture id {shown} contains a NUL character")
    if "/" in value or "\\" in value:
        raise CaptureIdError(f"capture id {shown} contains a path separator")
    if ".." in value or value.startswith("."):
        raise CaptureIdError(f"capture id {shown} contains '..' or starts with '.'")
    if not value.isascii() or not value.isprintable():
        raise CaptureIdError(f"capture id {shown} contains non-ASCII or control characters")
    if not CAPTURE_ID.fullmatch(value):
        raise CaptureIdError(f"capture id {shown} is not of the form yyyymmddThhmmssZ-gpuN-xxxxxx "
                             "(or -pidN- / -node-, six lowercase hex digits at the end)")
    return value


def check_relative_path(value: str) -> str:
    """A file path inside a capture directory: relative, POSIX, no '..', no empty or odd parts."""
    if not value or "\x00" in value or "\\" in value or not value.isprintable():
        raise CaptureRecordError(f"file path {value!r} is empty or contains odd characters")
    path = PurePosixPath(value)
    if path.is_absolute() or any(part in ("", ".", "..") for part in value.split("/")):
        raise CaptureRecordError(f"file path {value!r} is not a plain relative path")
    return value


@lru_cache(maxsize=1)
def _adapter() -> TypeAdapter[CaptureRecord]:
    return TypeAdapter(CaptureRecord)


def record_to_bytes(record: CaptureRecord) -> bytes:
    """The capture.json content: indented, keys in field order, with a ``target`` summary for people."""
    return (json.dumps(record.to_json(), indent=2, allow_nan=False) + "\n").encode()


def record_from_bytes(data: bytes) -> CaptureRecord:
    """A CaptureRecord from capture.json content; CaptureRecordError names what is wrong."""
    try:
        raw = load_json(data, max_bytes=MAX_RECORD_BYTES)
    except JsonInputError as err:
        raise CaptureRecordError(f"capture record: {err}") from None
    return record_from_json(raw)


def record_from_json(raw: Any) -> CaptureRecord:
    if not isinstance(raw, dict):
        raise CaptureRecordError(f"expected a JSON object, got {type(raw).__name__}")
    version = raw.get("version")
    if version != RECORD_VERSION:
        raise CaptureRecordError(f"unsupported record version {version!r} "
                                 f"(this agent reads {RECORD_VERSION})")
    fields = {k: v for k, v in raw.items() if k != "target"}  # "target" is derived, for people
    try:
        record = _adapter().validate_python(fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(record)"
        raise CaptureRecordError(f"{where}: {first['msg']}") from None
    try:
        check_capture_id(record.id)
    except CaptureIdError as err:
        raise CaptureRecordError(str(err)) from None
    if record.bytes < 0 or not math.isfinite(record.start) or not math.isfinite(record.duration_s):
        raise CaptureRecordError("bytes, start and duration_s must be finite and bytes not negative")
    for name in record.files:
        check_relative_path(name)
    for target in record.targets:
        for name in target.files:
            check_relative_path(name)
    return record
