"""The capture backend for PyTorch processes registered with the agent's Kineto daemon.

A capture queues a trace config for the process (``KinetoDaemon.request_trace``) and waits for the
process to take it at its next poll, within the deadline the capture service gives every backend
(the duration and ``capture.deadline_margin``). From then on the job works at its own pace: it
records, converts what it recorded, writes ``trace_<pid>.json.tmp`` and renames it to
``trace_<pid>.json`` when complete. A busy job takes far longer over that than any fixed margin
allows, so the wait for the file has bounds of its own (``trace_wait``: while the job is alive and
its file keeps growing, up to ``capture.kineto.write_timeout``). The finished trace is streamed into
the capture as ``<host>_<pid>.<ms>.pt.trace.json.gz`` (the name TensorBoard's PyTorch plugin lists),
within ``capture.kineto.max_trace_bytes`` (``trace_copy``).

A job that exits before its trace is complete is ``exited``; the error says at which step.
"""

from __future__ import annotations

import socket
import time

from gpuscope.capture.config import (
    DEFAULT_KINETO_MAX_TRACE_BYTES,
    DEFAULT_KINETO_WRITE_TIMEOUT_S,
    KINETO_STALL_TIMEOUT_S,
)
from gpuscope.capture.kineto.daemon import KinetoDaemon, PendingTrace
from gpuscope.capture.kineto.errors import KinetoBusyError, KinetoUnreachableError
from gpuscope.capture.kineto.trace_copy import copy_trace
from gpuscope.capture.kineto.trace_wait import WriteBounds, process_alive, wait_for_trace
from gpuscope.capture.model import (
    BackendResult,
    CaptureTarget,
    StagingArea,
    TargetKind,
    clip_error,
    request_problem,
)
from gpuscope.common.unixfs import safe_file_name

# How long a capture waits for the daemon to mark a config it was sending as delivered, when the
# process is already gone (the mark follows the send at once; this bounds a thread held up by load).
_DELIVERY_MARK_S = 1.0


class KinetoBackend:
    """CaptureBackend for PyTorch processes registered with ``daemon``. Thread-safe: concurrent
    captures of different processes are independent; a second one of the same process is ``busy``.

    ``max_trace_bytes``: the largest trace file read (``capture.kineto.max_trace_bytes``).
    ``write_timeout_s``: how long after its recording a job may take to complete its trace
    (``capture.kineto.write_timeout``); copying it into the store may take as long again.
    ``stall_timeout_s``: how long a trace file being filled may stay the same size."""

    kind: TargetKind = "kineto"

    def __init__(self, daemon: KinetoDaemon, *, warmup_s: int = 0,
                 max_trace_bytes: int = DEFAULT_KINETO_MAX_TRACE_BYTES,
                 write_timeout_s: float = DEFAULT_KINETO_WRITE_TIMEOUT_S,
                 stall_timeout_s: float = KINETO_STALL_TIMEOUT_S, hostname: str | None = None,
                 poll_interval_s: float = 0.05) -> None:
        self.daemon = daemon
        self.warmup_s = warmup_s
        self.max_trace_bytes = max_trace_bytes
        self.write_timeout_s = write_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.hostname = hostname or socket.gethostname()
        self.poll_interval_s = poll_interval_s

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult:
        """Profiles ``target.pid`` for ``duration_s``; never raises. The process must take the config
        within ``deadline_s``; then its trace is waited for as the module's docstring says. The trace
        is stored at the top of the capture (PyTorch traces are not in a TensorBoard run folder)."""
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
        requested = time.monotonic()
        deadline = requested + deadline_s
        try:
            trace = self.daemon.request_trace(pid, max(1, round(duration_s * 1000)), warmup_s=self.warmup_s)
        except KinetoBusyError as err:
            return BackendResult("busy", error=str(err))
        except KinetoUnreachableError as err:
            return BackendResult("unreachable", error=str(err))
        try:
            taken = self._wait_for_delivery(trace, requested, deadline, deadline_s)
            if taken is not None:
                return taken
            delivered = time.monotonic()
            bounds = WriteBounds(margin_s=deadline_s - duration_s, write_timeout_s=self.write_timeout_s,
                                 stall_s=self.stall_timeout_s)
            found = wait_for_trace(trace, delivered=delivered,
                                   recording_ends=delivered + self.warmup_s + duration_s, bounds=bounds,
                                   max_bytes=self.max_trace_bytes, poll_s=self.poll_interval_s)
            if isinstance(found, BackendResult):
                return found
            stem = f"{safe_file_name(self.hostname, limit=64)}_{pid}.{round(started_wall * 1000)}"
            # Copying is bounded by the file's size (the cap); the timeout is for a file system that
            # stalls, and the agent's stop ends it at once.
            copy_deadline = time.monotonic() + self.write_timeout_s
            return copy_trace(found, staging, stem=stem, mtime=int(started_wall),
                              max_bytes=self.max_trace_bytes, deadline=copy_deadline,
                              stopped=lambda: trace.finished)
        finally:
            self.daemon.finish(trace)

    def _wait_for_delivery(self, trace: PendingTrace, requested: float, deadline: float,
                           deadline_s: float) -> BackendResult | None:
        """None once the process has taken the config; else the outcome of the capture."""
        pid = trace.pid
        while not trace.event.wait(min(self.poll_interval_s * 4, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return BackendResult("unreachable", error=f"pid {pid} did not poll the Kineto daemon "
                                                          f"within the deadline ({deadline_s:g} s)")
            if not process_alive(pid):
                # It may have taken the config and exited while the daemon's thread, its reply sent, had
                # not yet marked the delivery: that thread marks it next, so wait for it briefly.
                if trace.event.is_set() or (trace.sending and trace.event.wait(_DELIVERY_MARK_S)):
                    break  # it took the config, then exited: judged below
                return BackendResult("exited", error=f"pid {pid} exited before it took the trace config, "
                                                     f"{time.monotonic() - requested:.1f} s after the "
                                                     "capture was asked for")
        if trace.busy is not None:
            return BackendResult("busy", error=trace.busy)
        if trace.delivered is None:
            return BackendResult("unreachable", error="the Kineto daemon stopped")
        return None
