"""Copying a PyTorch job's finished trace into the capture: streamed, compressed as it is copied.

The trace directory is the job's to write in, so the file is opened without following a link and
must be a plain file with one name (not a hard link to something else of the node's). Its size is
checked against ``capture.kineto.max_trace_bytes`` before anything is read, and no more than that
size is ever read from it (should the job still append). The agent holds one chunk at a time: a
1 GiB trace costs the same memory as a 1 MiB one, which is why this cap is a size on disk and not
the in-memory cap of gRPC responses (``capture.max_trace_bytes``).

On the way the bytes are scanned: a file that is not a complete Chrome trace is refused, and one
without any event (an idle process) is an ``empty`` outcome.
"""

from __future__ import annotations

import gzip
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

from gpuscope.capture.model import BackendResult, StagingArea, clip_error
from gpuscope.common.sizes import format_size

TRACE_SUFFIX = ".pt.trace.json.gz"
MAX_TRACE_SETTING = "capture.kineto.max_trace_bytes"
GZIP_LEVEL = 3  # JSON traces: about 11x at over 250 MB/s (level 6: 13x at about 110 MB/s)
# An event of any category but the profiler's own "Trace" span: the trace recorded something.
_EVENT = re.compile(rb'"cat"\s*:\s*"(?!Trace")')
_TRACE_EVENTS = re.compile(rb'"traceEvents"\s*:')
_SCAN_OVERLAP = 64
_CHUNK = 1 << 20


def over_cap_error(size: int, max_bytes: int, *, written: bool = True) -> str:
    """What a trace over ``capture.kineto.max_trace_bytes`` is told (before it is read)."""
    state = "is" if written else "has grown to"
    return (f"the trace {state} {format_size(size)}, larger than {MAX_TRACE_SETTING} "
            f"({format_size(max_bytes)}); it was not read. Capture for less time, or raise the limit")


def copy_trace(source: Path, staging: StagingArea, *, stem: str, mtime: int, max_bytes: int,
               deadline: float, stopped: Callable[[], bool]) -> BackendResult:
    """Streams ``source`` gzip-compressed into ``staging`` as ``<stem>.pt.trace.json.gz``, published
    only when complete and checked. Gives up (``failed``) past ``deadline`` (monotonic) or as soon as
    ``stopped()`` (the agent is stopping); never raises for the file's own faults."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(source, flags)
    except OSError as err:
        return BackendResult("failed", error=clip_error(f"cannot open the trace {source.name}: {err}"))
    with os.fdopen(fd, "rb") as src:
        st = os.fstat(src.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return BackendResult("failed", error=f"{source.name} is not a plain file")
        if st.st_size > max_bytes:
            return BackendResult("failed", error=over_cap_error(st.st_size, max_bytes))
        with staging.new_file(stem, TRACE_SUFFIX) as new:
            scan = _TraceScan()
            left = st.st_size  # no more than the size checked above, should the job append to it
            with gzip.GzipFile(filename="", mode="wb", fileobj=new.file, mtime=mtime,
                               compresslevel=GZIP_LEVEL) as out:
                while left > 0 and (chunk := src.read(min(_CHUNK, left))):
                    left -= len(chunk)
                    if stopped():
                        return BackendResult("failed", error="the agent stopped while storing the trace")
                    if time.monotonic() > deadline:
                        return BackendResult("failed", error=f"the deadline passed while storing the "
                                                             f"trace ({format_size(st.st_size)})")
                    scan.feed(chunk)
                    out.write(chunk)
            if not scan.has_trace_events or not scan.complete:
                return BackendResult("failed", error=f"{source.name} is not a complete Chrome trace")
            if not scan.has_events:
                return BackendResult("empty")
            return BackendResult("captured", files=(new.publish(),))


class _TraceScan:
    """Looks through a Chrome trace as it streams by: does it have ``traceEvents``, any event with a
    category (other than the profiler's own ``Trace`` span; an idle process's trace has only
    metadata), and does it end like a JSON object?"""

    def __init__(self) -> None:
        self.has_trace_events = False
        self.has_events = False
        self._tail = b""
        self._last = b""

    def feed(self, chunk: bytes) -> None:
        window = self._tail + chunk
        if not self.has_trace_events and _TRACE_EVENTS.search(window):
            self.has_trace_events = True
        if not self.has_events and _EVENT.search(window):
            self.has_events = True
        self._tail = window[-_SCAN_OVERLAP:]
        stripped = chunk.rstrip()
        if stripped:
            self._last = stripped[-1:]

    @property
    def complete(self) -> bool:
        return self._last == b"}"
