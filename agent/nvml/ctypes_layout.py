"""Reading ctypes structures in one go: a ``struct.Struct`` for chosen fields of a ctypes type.

pynvml's structures read field by field through Python attribute access; for the arrays the sampler
reads every tick (utilization samples, process samples) unpacking the raw bytes at the offsets ctypes
reports is several times cheaper. Every function returns None when the type is not laid out as
expected, and the caller then reads the fields one by one.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

_STRUCT_INT = {1: "b", 2: "h", 4: "i", 8: "q"}


def _field_code(ctype: Any) -> str | None:
    kind = getattr(ctype, "_type_", None)
    if kind in ("f", "d"):
        return str(kind)
    size = ctypes.sizeof(ctype)
    if not isinstance(kind, str) or kind not in "bBhHiIlLqQ" or size not in _STRUCT_INT:
        return None
    return _STRUCT_INT[size] if kind.islower() else _STRUCT_INT[size].upper()


def element_format(ctype: Any, *paths: str) -> str | None:
    """struct codes (no byte-order prefix) for the fields ``paths`` of one ``ctype``, padded to its
    whole size; the paths must be in increasing offset order. None if that cannot be done."""
    try:
        fmt, at = "", 0
        for path in paths:
            offset, ftype = 0, ctype
            for name in path.split("."):
                offset += getattr(ftype, name).offset
                ftype = dict((f[0], f[1]) for f in ftype._fields_)[name]
            code = _field_code(ftype)
            if code is None or offset < at:
                return None
            fmt += f"{offset - at}x" * (offset > at) + code
            at = offset + ctypes.sizeof(ftype)
        size = ctypes.sizeof(ctype)
        if at > size:
            return None
        return fmt + f"{size - at}x" * (size > at)
    except (AttributeError, KeyError, TypeError):
        return None


def layout(ctype: Any, *paths: str) -> struct.Struct | None:
    fmt = element_format(ctype, *paths)
    return None if fmt is None else struct.Struct("=" + fmt)


def unpack(layout: struct.Struct | None, ctype: Any, items: list[Any]) -> list[tuple[Any, ...]] | None:
    """The fields of each of ``items`` (instances of ``ctype``), or None to read them one by one."""
    if layout is None or (items and set(map(type, items)) != {ctype}):
        return None
    return list(layout.iter_unpack(b"".join(map(bytes, items))))


def unpack_array(layout: struct.Struct | None, ctype: Any, array: Any) -> list[tuple[Any, ...]] | None:
    """The fields of each element of a ctypes array of ``ctype``, or None to read them one by one."""
    if layout is None or getattr(type(array), "_type_", None) is not ctype:
        return None
    return list(layout.iter_unpack(array))


def fields(layout: struct.Struct | None, ctype: Any, item: Any) -> tuple[Any, ...] | None:
    """The fields of one ``ctype`` structure, or None to read them one by one."""
    if layout is None or type(item) is not ctype:
        return None
    return layout.unpack_from(item)
