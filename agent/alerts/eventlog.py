"""The alert event log: one JSON object per line for every alert transition, rotated by size.

A Transition listener: the sampler thread only encodes the transition and queues its line; a worker
thread of its own writes, so a slow or hung disk never delays sampling. When the file cannot be
opened or written (read-only mount, full disk, missing permissions) the failure is logged once per
outage and counted, the lines stay in a bounded memory buffer, and the file is tried again after
``retry_seconds`` (or at the next transition after that); what the buffer still holds is written
first when it works again. The file is opened for appending and never truncated, so lines written
before an outage stay. Each line is flushed (not fsynced: a crash of the agent loses nothing, a
crash of the kernel may lose the last lines, a trade for not stalling on a slow disk). A file moved
or deleted by someone else (an external logrotate) is noticed at the next write and the path opened
again.

Line format (schema ``version`` 1): ``Transition.to_json()`` plus ``"version": 1``; non-finite
values (NaN, infinity), which JSON cannot represent, are written as null. When a capture an alert
triggered has been analysed, a line with ``"event": "capture_analysis"`` follows (the alert's name
and GPU, the capture id, the verdict, its headline and findings, and under ``alert`` which minutes
the alert judged and which the capture saw, and whether the verdict accounts for the alert);
transition lines have no ``event``. A capture trigger the agent refused writes a line with
``"event": "capture_refused"``: the trigger (its kind, the alert's name), the GPU, the reason
(cooldown, budget, quota, busy, ...), the agent's message, and ``allowed_at`` (Unix seconds: when a
trigger like it would next be allowed; null when not known). Those two kinds of line are written
through ``record_event`` by ``gpuscope.alert_captures.event_lines``, which reads capture records:
the alerts package itself imports nothing of the captures', which import it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from gpuscope.alerts.config import EventLogConfig
from gpuscope.alerts.model import Transition
from gpuscope.health import SourceHealth
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
RETRY_SECONDS = 30.0  # after a failure, the file is not tried again before this (a hung mount stays cheap)
BUFFER_LINES = 10_000  # lines held in memory while the file cannot be written; older ones are dropped
CLOSE_JOIN_SECONDS = 1.0  # close() waits this long for a write in progress (a hung disk), then gives up


class AlertEventLog:
    """Appends alert transitions to ``config.path`` as JSON lines from a worker thread; thread-safe;
    never raises into the caller. ``close`` writes what is left (one try) and stops the worker."""

    def __init__(
        self,
        config: EventLogConfig,
        *,
        retry_seconds: float = RETRY_SECONDS,
        buffer_lines: int = BUFFER_LINES,
        clock: Callable[[], float] = time.monotonic,
        health: SourceHealth | None = None,
    ) -> None:
        if not config.path:
            raise ValueError("the alert event log needs a path (alerting.event_log.path)")
        self.path = Path(config.path)
        self._max_bytes = config.max_bytes
        self._backups = config.backups
        self._retry_seconds = retry_seconds
        self._clock = clock
        self._wake = threading.Condition()
        self._pending: deque[bytes] = deque()
        self._buffer_lines = buffer_lines
        self._retry_at = 0.0  # clock time before which no write is attempted (after a failure)
        self._failing = False  # an outage is under way (its first failure was logged)
        self._closed = False
        self._idle = True  # the worker is waiting, not writing
        # Touched by the worker only (and by close() once the worker is gone).
        self._file: IO[bytes] | None = None
        self._size = 0
        self.lines_written = 0
        self.errors = 0  # failed attempts to open, write or rotate
        self.dropped = 0  # lines lost because the buffer was full during an outage
        self._thread = start_thread("gpuscope-eventlog", self._run, health=health, source="alerts")

    def __call__(self, transition: Transition) -> None:
        """Queue one transition's line (the rule engine's listener signature); never blocks on I/O."""
        try:
            line = _encode({"version": SCHEMA_VERSION, **transition.to_json()})
        except Exception:  # a broken transition must not reach the sampler thread either
            log.exception("cannot encode alert transition %r for the event log", transition)
            return
        with self._wake:
            if self._closed:
                log.debug("event log closed; transition not written: %s", line)
                return
            self._keep([line])
            self._wake.notify()

    def record_event(self, event: str, fields: Mapping[str, Any]) -> None:
        """Queue a line that is not a transition (``"event": event`` and ``fields``, which must not
        name ``version`` or ``event``): what a capture an alert triggered showed, a refused capture
        trigger (``gpuscope.alert_captures.event_lines``). Never blocks on I/O."""
        line = _encode({"version": SCHEMA_VERSION, "event": event, **fields})
        with self._wake:
            if self._closed:
                return
            self._keep([line])
            self._wake.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued line was written, or is waiting for the retry after a failure;
        False if that took longer than ``timeout``."""
        with self._wake:
            return self._wake.wait_for(lambda: self._closed or (self._idle and not self._due()), timeout)

    def close(self, timeout: float = CLOSE_JOIN_SECONDS) -> None:
        """Write what is queued (one try) and close the file; later transitions are ignored. A write
        in progress gets ``timeout`` to finish (a hung disk: then nothing more is written)."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck in a write on a hung disk: leave it to its daemon thread
            log.warning("event log %s: a write is still hanging; closed without writing %d transitions",
                        self.path, len(self._pending))
            return
        with self._wake:
            batch = list(self._pending)
            self._pending.clear()
        if batch:
            self._write_batch(batch)
        if self._pending:
            log.warning("event log %s closed with %d transitions not written", self.path, len(self._pending))
        self._close_file()

    # -- the worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                self._idle = True
                self._wake.notify_all()  # flush() waits for this
                while not self._closed and not self._due():
                    retry_in = self._retry_at - self._clock() if self._pending else None
                    self._wake.wait(None if retry_in is None else max(retry_in, 0.01))
                if self._closed:
                    return  # close() writes what is left
                self._idle = False
                batch = list(self._pending)
                self._pending.clear()
            try:
                self._write_batch(batch)
            except Exception as err:  # a bug must not end the log silently: keep the lines, retry later
                log.exception("alert event log %s: writing failed unexpectedly", self.path)
                with self._wake:
                    self._keep(batch, in_front=True)
                    self._fail(OSError(f"unexpected error: {err!r}"))

    def _due(self) -> bool:
        """Lines wait and the retry delay is over (lock held)."""
        return bool(self._pending) and self._clock() >= self._retry_at

    def _keep(self, lines: list[bytes], *, in_front: bool = False) -> None:
        """Queue lines (lock held); past the buffer's bound the oldest are dropped and counted."""
        if in_front:
            self._pending.extendleft(reversed(lines))
        else:
            self._pending.extend(lines)
        while len(self._pending) > self._buffer_lines:
            self._pending.popleft()
            self.dropped += 1

    def _write_batch(self, batch: list[bytes]) -> None:
        written = 0
        try:
            if self._file is not None and not self._still_at_path(self._file):
                self._close_file()  # moved or deleted by someone else (an external logrotate): reopen
            for line in batch:
                if self._file is None:
                    self._open()
                if self._size and self._size + len(line) > self._max_bytes:
                    self._rotate()
                    self._open()
                file = self._file
                assert file is not None
                file.write(line)
                file.flush()
                self._size += len(line)
                written += 1
                self.lines_written += 1
        except OSError as err:
            with self._wake:
                self._keep(batch[written:], in_front=True)
                self._fail(err)
            return
        if self._failing:
            self._failing = False
            log.info("alert event log %s is writable again", self.path)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Summaries name processes and users: readable by the owner's group, not by everyone.
        file = open(self.path, "ab", opener=lambda path, flags: os.open(path, flags, 0o640))  # noqa: SIM115
        try:
            size = file.seek(0, os.SEEK_END)
            if size and not _ends_with_newline(self.path):
                # A write cut short (full disk, crash) left half a line: end it, so the next line parses.
                file.write(b"\n")
                size += 1
        except OSError:
            file.close()
            raise
        self._file, self._size = file, size

    def _still_at_path(self, file: IO[bytes]) -> bool:
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        opened = os.fstat(file.fileno())
        return (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)

    def _rotate(self) -> None:
        """path -> path.1 -> ... -> path.N; the oldest is removed. With no backups, start afresh."""
        self._close_file()
        if self._backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for index in range(self._backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{index}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._size = 0

    def _fail(self, err: OSError) -> None:
        """A failed write (lock held): retry after the delay; logged once per outage."""
        self.errors += 1
        self._close_file()
        self._retry_at = self._clock() + self._retry_seconds
        if not self._failing:
            self._failing = True
            log.warning(
                "cannot write the alert event log %s: %s; keeping up to %d transitions in memory and "
                "retrying every %g s", self.path, err, self._buffer_lines, self._retry_seconds)
        else:
            log.debug("alert event log %s still not writable: %s", self.path, err)

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as err:  # flushing failed: the line was counted as written already
                log.debug("closing %s: %s", self.path, err)


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"


def _encode(obj: dict[str, Any]) -> bytes:
    try:
        text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))
    return (text + "\n").encode()


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None (JSON has no literal for them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    return obj
