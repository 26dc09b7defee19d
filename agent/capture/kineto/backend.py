"""The capture backend for PyTorch processes registered with the agent's Kineto daemon.

A capture queues a trace config for the process (``KinetoDaemon.request_trace``), waits for the
process to take it at its next poll, then for the trace file: Kineto writes ``trace_<pid>.json.tmp``
and renames it to ``trace_<pid>.json`` when complete, so the rename marks the end. The trace is
streamed into the capture as ``<host>_<pid>.<ms>.pt.trace.json.gz`` (the name TensorBoard's PyTorch
plugin lists), checked on the way: a file that is not a complete Chrome trace is refused, and one
without any event (an idle process) is an empty outcome.
"""

from __future__ import annotations

import gzip
import os
import re
import socket
import stat
import time
from pathlib import Path

from gpuscope.capture.config import DEFAULT_MAX_TRACE_BYTES
from gpuscope.capture.kineto.daemon import KinetoDaemon, PendingTrace
from gpuscope.capture.kineto.errors import KinetoBusyError, KinetoUnreachableError
from gpuscope.capture.model import (
    BackendResult,
    CaptureTarget,
    StagingArea,
    TargetKind,
    clip_error,
    request_problem,
)
from gpuscope.common.sizes import format_size
from gpuscope.common.unixfs import safe_file_name

TRACE_SUFFIX = ".pt.trace.json.gz"
GZIP_LEVEL = 3  # JSON traces: about 11x at over 250 MB/s (level 6: 13x at about 110 MB/s)
# An event of any category but the profiler's own "Trace" span: the trace recorded something.
_EVENT = re.compile(rb'"cat"\s*:\s*"(?!Trace")')
_TRACE_EVENTS = re.compile(rb'"traceEvents"\s*:')
_SCAN_OVERLAP = 64
_CHUNK = 1 << 20


class KinetoBackend:
    """CaptureBackend for PyTorch processes registered with ``daemon``. Thread-safe: concurrent
    captures of different processes are independent; a second one of the same process is ``busy``."""

    kind: TargetKind = "kineto"

    def __init__(self, daemon: KinetoDaemon, *, warmup_s: int = 0,
                 max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES, hostname: str | None = None,
                 poll_interval_s: float = 0.05) -> None:
        self.daemon = daemon
        self.warmup_s = warmup_s
        self.max_trace_bytes = max_trace_bytes
        self.hostname = hostname or socket.gethostname()
        self.poll_interval_s = poll_interval_s

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult:
        """Profiles ``target.pid`` for ``duration_s``; never raises, never blocks past ``deadline_s``.
        The trace is stored at the top of the capture (PyTorch traces are not in a TensorBoard run
        folder)."""
        try:
            return self._capture(target, duration_s, staging, deadline_s=deadline_s)
        except Exception as err:  # the contract: an outcome, never an exception
            return BackendResult("failed", error=clip_error(f"{type(err).__name__}: {err}"))

    def _capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                 deadline_s: float) -> BackendResult:
        problem = request_problem(target, "kineto", duration_s, deadline_s)
        if problem is not None or target.pid is None:
            return BackendResult("failed", error=problem)
        pid = target.pid
        started_wall = time.time()
        deadline = time.monotonic() + deadline_s
        try:
            trace = self.daemon.request_trace(pid, max(1, round(duration_s * 1000)), warmup_s=self.warmup_s)
        except KinetoBusyError as err:
            return BackendResult("busy", error=str(err))
        except KinetoUnreachableError as err:
            return BackendResult("unreachable", error=str(err))
        try:
            while not trace.event.wait(min(self.poll_interval_s * 4, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    return BackendResult("unreachable", error=f"pid {pid} did not poll the Kineto daemon "
                                                              f"within the deadline ({deadline_s:g} s)")
                if not _alive(pid):
                    return BackendResult("unreachable", error=f"pid {pid} exited")
            if trace.busy is not None:
                return BackendResult("busy", error=trace.busy)
            if trace.delivered is None:
                return BackendResult("unreachable", error="the Kineto daemon stopped")
            found = self._wait_for_file(trace, deadline)
            if isinstance(found, BackendResult):
                return found
            return self._store(found, staging, pid, started_wall, deadline)
        finally:
            self.daemon.finish(trace)

    def _wait_for_file(self, trace: PendingTrace, deadline: float) -> Path | BackendResult:
        writing = False
        last_alive_check = 0.0
        while True:
            done, writing_now = _trace_files(trace.directory)
            if done is not None:
                return done
            if trace.finished:
                return BackendResult("unreachable", error="the Kineto daemon stopped")
            writing = writing or writing_now
            now = time.monotonic()
            if now >= deadline:
                state = "its trace was still being written" if writing else "it wrote no trace"
                return BackendResult("unreachable", error=f"pid {trace.pid} took the trace config but "
                                                          f"{state} within the deadline")
            if now - last_alive_check > 0.5:
                last_alive_check = now
                if not _alive(trace.pid):
                    return BackendResult("unreachable", error=f"pid {trace.pid} exited during the capture")
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - now)))

    def _store(self, source: Path, staging: StagingArea, pid: int, started_wall: float,
               deadline: float) -> BackendResult:
        # The trace directory is the job's to write in: the file is opened without following a link
        # and must be a plain file with one name (not a hard link to something else of the node's).
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(source, flags)
        except OSError as err:
            return BackendResult("failed", error=clip_error(f"cannot open the trace {source.name}: {err}"))
        with os.fdopen(fd, "rb") as src:
            st = os.fstat(src.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return BackendResult("failed", error=f"{source.name} is not a plain file")
            if st.st_size > self.max_trace_bytes:
                limit = format_size(self.max_trace_bytes)
                return BackendResult("failed", error=f"the trace is {format_size(st.st_size)}, larger than "
                                                     f"capture.max_trace_bytes ({limit}); it was not read. "
                                                     "Capture for less time, or raise the limit")
            stem = f"{safe_file_name(self.hostname, limit=64)}_{pid}.{round(started_wall * 1000)}"
            with staging.new_file(stem, TRACE_SUFFIX) as new:
                scan = _TraceScan()
                left = st.st_size  # no more than the size checked above, should the job append to it
                with gzip.GzipFile(filename="", mode="wb", fileobj=new.file, mtime=int(started_wall),
                                   compresslevel=GZIP_LEVEL) as out:
                    while left > 0 and (chunk := src.read(min(_CHUNK, left))):
                        left -= len(chunk)
                        if time.monotonic() > deadline:
                            return BackendResult("failed", error=f"the deadline passed while storing the "
                                                                 f"trace ({st.st_size} bytes)")
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


def _trace_files(directory: Path) -> tuple[Path | None, bool]:
    """The finished trace in a capture directory (``*.json``, a plain file), and whether one is
    still being written (``*.json.tmp``)."""
    writing = False
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith(".json.tmp"):
                    writing = True
                elif entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
                    return Path(entry.path), writing
    except FileNotFoundError:
        pass
    return None, writing


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")
