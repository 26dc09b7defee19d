"""Waiting for a PyTorch job's trace once it has taken a trace config: how long, and why.

What a job does with the config (measured with PyTorch 2.13 on the CPU):

1. It starts recording within about a second of the poll that took it (its profiler's loop wakes
   once a second) and creates ``trace_<pid>.json.tmp`` right away, empty.
2. It records for the warm-up and the duration.
3. It converts what it recorded, the file still empty. This is the long part and it grows with the
   number of events: a 2 s capture of a busy loop of small CPU ops (about 1.4 million events, 200 to
   450 MiB of JSON) spends 6 to 20 s here on a 2-core VM.
4. It writes the JSON (1 to 8 s for those), then renames it ``trace_<pid>.json``:
   the rename marks a complete trace.

No fixed deadline fits every job, so the agent waits as long as the job shows it is still at work,
and gives up on one that is not:

* no ``.json.tmp`` at all ``margin_s`` after the recording's end (``capture.deadline_margin``): the job
  cannot write into the trace directory (``unreachable``);
* a ``.json.tmp`` that holds data but has not grown for ``stall_s``: the job stopped writing
  (``failed``). An empty one is not a stall: the job is converting its events (step 3);
* no complete trace ``write_timeout_s`` after the recording's end, however it grows
  (``capture.kineto.write_timeout``; ``failed``);
* a ``.json.tmp`` that is already larger than ``capture.kineto.max_trace_bytes``: it would not be read
  (``failed`` at once);
* the job exits first (``exited``), or the agent stops (the daemon marks the request ``finished``;
  ``unreachable``), which ends the wait within one poll.

The capture worker is one thread: a long wait only delays the captures queued behind it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuscope.capture.kineto.daemon import PendingTrace
from gpuscope.capture.kineto.trace_copy import over_cap_error
from gpuscope.capture.model import BackendResult
from gpuscope.common.durations import format_duration
from gpuscope.common.sizes import format_size

WRITE_TIMEOUT_SETTING = "capture.kineto.write_timeout"
# Kineto writes one file per capture: a folder with more entries is not a trace being written, and the
# agent does not scan an unbounded folder of the job's making every poll.
MAX_ENTRIES = 64
_ALIVE_CHECK_S = 0.5  # how often the job's process is looked for in /proc
_FAST_POLL_S = 2.0  # polls at the backend's interval this long after the recording; 4 a second after


@dataclass(frozen=True, slots=True)
class WriteBounds:
    """How long a job that took a trace config may take over its trace (see the module's docstring)."""

    margin_s: float  # after the recording's end, for its .json.tmp to appear
    write_timeout_s: float  # after the recording's end, for the trace to be complete
    stall_s: float  # once the .json.tmp holds data, the longest it may stay the same


@dataclass(frozen=True, slots=True)
class TraceFiles:
    """What a capture's folder holds: the finished trace, if any, and the files still being written
    (``(name, size, mtime_ns)`` of each ``*.json.tmp``)."""

    done: Path | None
    writing: tuple[tuple[str, int, int], ...]

    @property
    def written(self) -> int:
        return sum(size for _, size, _ in self.writing)

    def describe(self) -> str:
        names = ", ".join(name for name, _, _ in self.writing)
        return f"{names} held {format_size(self.written)}"


class TooManyEntries(Exception):
    """A capture's folder with more than MAX_ENTRIES entries: not one trace being written."""


def scan_trace_dir(directory: Path) -> TraceFiles:
    """The finished trace in a capture's folder (``*.json``, a plain file) and the ``*.json.tmp``
    files being written; TooManyEntries past MAX_ENTRIES entries. A missing folder is empty."""
    writing: list[tuple[str, int, int]] = []
    try:
        with os.scandir(directory) as entries:
            for count, entry in enumerate(entries, start=1):
                if count > MAX_ENTRIES:
                    raise TooManyEntries
                if entry.name.endswith(".json.tmp"):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # renamed since the listing: the next scan finds it
                        continue
                    writing.append((entry.name, st.st_size, st.st_mtime_ns))
                elif entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
                    return TraceFiles(Path(entry.path), tuple(writing))
    except FileNotFoundError:
        pass
    return TraceFiles(None, tuple(sorted(writing)))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096)
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # there, but unreadable: count it as running
    state = text.rpartition(b")")[2].split(maxsplit=1)[:1]  # after the command name, which may hold ")"
    return state not in ([b"Z"], [b"X"])


def wait_for_trace(trace: PendingTrace, *, delivered: float, recording_ends: float, bounds: WriteBounds,
                   max_bytes: int, poll_s: float, alive: Callable[[int], bool] = process_alive,
                   clock: Callable[[], float] = time.monotonic) -> Path | BackendResult:
    """The job's finished trace file, or the outcome of a wait given up. ``delivered`` and
    ``recording_ends`` are on ``clock`` (monotonic): when the job took the config, and when its
    recording should end (then warm-up and duration)."""
    pid = trace.pid
    last: tuple[tuple[str, int, int], ...] = ()
    changed = clock()  # when the .json.tmp files last changed (size or mtime)
    last_alive_check = 0.0
    while True:
        try:
            files = scan_trace_dir(trace.directory)
        except TooManyEntries:
            return BackendResult("failed", error=f"pid {pid}'s trace folder holds more than {MAX_ENTRIES} "
                                                 "entries: not a Kineto trace being written")
        if files.done is not None:
            return files.done
        if trace.finished:
            return BackendResult("unreachable", error="the Kineto daemon stopped")
        now = clock()
        if files.writing != last:
            last, changed = files.writing, now
        if files.written > max_bytes:
            return BackendResult("failed", error=over_cap_error(files.written, max_bytes, written=False))
        if now - last_alive_check >= _ALIVE_CHECK_S:
            last_alive_check = now
            if not alive(pid):
                files = scan_trace_dir(trace.directory)  # it may have finished, then exited
                if files.done is not None:
                    return files.done
                return BackendResult("exited", error=_exited(pid, now, delivered, recording_ends, files))
        after = now - recording_ends  # seconds since the recording's end; negative while it records
        if after >= 0:
            given_up = _given_up(pid, after, now - changed, files, bounds)
            if given_up is not None:
                return given_up
        pause = poll_s if after < _FAST_POLL_S else max(poll_s, 0.25)
        time.sleep(pause)


def _given_up(pid: int, after: float, unchanged: float, files: TraceFiles,
              bounds: WriteBounds) -> BackendResult | None:
    if not files.writing and after >= bounds.margin_s:
        return BackendResult("unreachable", error=(
            f"pid {pid} took the trace config but wrote no trace: no trace_<pid>.json.tmp appeared within "
            f"{format_duration(bounds.margin_s)} of the recording's end. The job must be able to write "
            "in the trace directory, at the same path as the agent (capture.kineto.trace_dir)"))
    if files.written > 0 and unchanged >= bounds.stall_s:
        return BackendResult("failed", error=(
            f"pid {pid} stopped writing its trace: {files.describe()} and had not grown for "
            f"{format_duration(bounds.stall_s)}"))
    if after >= bounds.write_timeout_s:
        state = files.describe() if files.written else "its trace file was still empty (the job was " \
                                                       "still converting what it recorded)"
        return BackendResult("failed", error=(
            f"pid {pid} had not finished its trace {format_duration(bounds.write_timeout_s)} after the "
            f"recording ended ({WRITE_TIMEOUT_SETTING}): {state}"))
    return None


def _exited(pid: int, now: float, delivered: float, recording_ends: float, files: TraceFiles) -> str:
    if now < recording_ends:
        return (f"pid {pid} exited during the capture, {now - delivered:.1f} s after it took the trace "
                "config, before writing its trace")
    state = f"{files.describe()}" if files.written else "nothing written yet"
    return (f"pid {pid} exited before its trace was complete, {now - recording_ends:.1f} s after the "
            f"recording ended ({state})")
