"""Giving freed memory back to the system after a large, rare allocation (a profiler trace), and
once the agent has started.

glibc keeps freed heap memory for reuse: after a 100 MiB trace was received and stored, the agent's
RSS stayed ~75 MiB higher until the next capture. ``malloc_trim(0)`` returns the free pages at the
top of the heap and in its arenas; it costs about a millisecond and runs once per capture, and once
after start-up (what loading and building the agent freed, about 1 MiB). Other C
libraries (musl) have no such call: nothing is done there.

``tune_allocator`` (once, when the agent starts, before its threads) fixes two of glibc's settings
that otherwise let a series of captures ratchet RSS up, a few MiB per capture, never given back:

* the mmap threshold. By default it adapts: once a block allocated with mmap (128 KiB or more) is
  freed, blocks up to that size come from the heap from then on (up to 32 MiB). After the first
  capture, the buffers that receive and write a trace (MiB each, on gRPC's and the capture's
  threads) are carved from the arenas, where fragments of them stay. A fixed threshold keeps every
  block of 256 KiB or more in a mapping of its own, unmapped when freed. The agent's steady-state
  allocations are smaller (a scrape's body is tens of KiB; on a node with hundreds of processes a
  few hundred KiB: one mapping per scrape, some microseconds).
* the number of arenas. glibc gives each thread that contends for the heap an arena of its own, up
  to eight per core, each keeping its own free memory; the threads that a capture starts (gRPC's,
  the capture's) each left one behind. The GIL serialises nearly all of the agent's allocations, so
  two arenas cost no contention.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameters, from glibc's malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 256 << 10
ARENA_MAX = 2

_trim = None
_mallopt = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = getattr(_libc, "malloc_trim", None)
    _mallopt = getattr(_libc, "mallopt", None)
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


def tune_allocator() -> None:
    """Fix glibc's mmap threshold and cap its arenas (see the module's docstring); nothing elsewhere."""
    if _mallopt is None:
        return
    for parameter, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_ARENA_MAX, ARENA_MAX)):
        if not _mallopt(ctypes.c_int(parameter), ctypes.c_int(value)):  # 0: refused
            log.debug("mallopt(%d, %d) refused", parameter, value)
