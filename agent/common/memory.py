"""Giving freed memory back to the system after a large, rare allocation (a profiler trace), and
once the agent has started.

glibc keeps freed heap memory for reuse: after a 100 MiB trace was received and stored, the agent's
RSS stayed ~75 MiB higher until the next capture. ``malloc_trim(0)`` returns the free pages at the
top of the heap and in its arenas; it costs about a millisecond and runs once per capture, and once
after start-up (what loading and building the agent freed, about 1 MiB). Other C
libraries (musl) have no such call: nothing is done there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = getattr(_libc, "malloc_trim", None)
except OSError:  # no C library to load: nothing to trim
    pass


def release_free_memory() -> None:
    """Return the process's freed heap memory to the system where the C library can."""
    if _trim is None:
        return
    try:
        _trim(0)
    except OSError as err:  # pragma: no cover - a C call that cannot fail in practice
        log.debug("malloc_trim failed: %s", err)
