"""Pushes the latest snapshot every ``otlp.interval`` from a thread of its own, so that a receiver that
is slow, away or refusing never holds up sampling, scrapes or anything else.

The sampler publishes each snapshot as it always does (``SnapshotSource.latest``: a reference, no
copy, no wait). Every interval the thread encodes the latest one, unless it is stale or already
pushed, and appends the request to a queue of at most ``otlp.max_queue`` requests; when the queue is
full the oldest request is dropped and counted. It sends the queue's oldest request first:

* accepted: the next one goes at once (a backlog drains as fast as the receiver takes it);
* to be retried (connection failed, timed out, 429/502/503/504, gRPC UNAVAILABLE...): after the
  receiver's ``Retry-After`` where it gave one, else an exponential back-off (``RETRY_INITIAL_SECONDS``
  doubling to ``RETRY_MAX_SECONDS``) with jitter, down to half of it, so that many agents that lost one
  Collector do not return to it in step;
* refused (any other status: a bad request, bad credentials): dropped, counted as failed, and logged
  once per status, since sending it again cannot succeed.

Memory is bounded by ``max_queue`` encoded requests (docs/otlp.md gives their size). ``stop`` pushes
what is queued, and the latest snapshot, within a short deadline; what is left is counted dropped.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable

from gpuscope.health import SourceHealth
from gpuscope.otlp.transport import PushResult, Transport
from gpuscope.snapshot import Snapshot, SnapshotSource
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

RETRY_INITIAL_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
NO_SNAPSHOT_RECHECK_SECONDS = 1.0  # before the first tick: how soon to look again
OUTCOMES = ("sent", "failed", "dropped")


class OtlpExporter:
    """The push thread. ``encode`` turns a snapshot into the request's bytes (None: nothing to push).
    Thread-safe for its readers (``counts``, ``queue_length``, ``last_success``)."""

    def __init__(self, source: SnapshotSource, encode: Callable[[Snapshot], bytes | None],
                 transport: Transport, *, endpoint: str, interval_seconds: float, timeout_seconds: float,
                 max_queue: int, retry_initial_seconds: float = RETRY_INITIAL_SECONDS,
                 retry_max_seconds: float = RETRY_MAX_SECONDS, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, jitter: Callable[[], float] = random.random,
                 health: SourceHealth | None = None) -> None:
        self._source = source
        self._encode = encode
        self._transport = transport
        self.endpoint = endpoint
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self._max_queue = max_queue
        self._retry_initial = retry_initial_seconds
        self._retry_max = max(retry_max_seconds, retry_initial_seconds)
        self._clock = clock
        self._wall_clock = wall_clock
        self._jitter = jitter
        self._health = health
        self._wake = threading.Condition()
        self._queue: deque[bytes] = deque()
        self._stopping = False
        self._flush_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._pushed: Snapshot | None = None  # the last snapshot encoded
        self._failures = 0  # consecutive retryable failures of the queue's head
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._retries = 0
        self._last_success: float | None = None
        self._logged: set[str] = set()  # reasons already logged (refusals, drops), each once
        self._failing = False  # a retryable failure was logged and no push succeeded since

    # -- what the self-metrics read ---------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Requests by outcome since start: sent, failed (refused, not retried), dropped."""
        with self._wake:
            return dict(self._counts)

    @property
    def retries(self) -> int:
        """Push attempts that failed and were (or will be) tried again."""
        return self._retries

    def queue_length(self) -> int:
        with self._wake:
            return len(self._queue)

    def last_success(self) -> float | None:
        """Unix time of the last accepted push; None before one."""
        return self._last_success

    # -- life cycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = start_thread("gpuscope-otlp", self._run, health=self._health, source="otlp")

    def stop(self, timeout: float) -> None:
        """Push what is queued, and the latest snapshot, for at most ``timeout`` seconds; then leave the
        daemon thread (a push in flight ends at its own deadline)."""
        with self._wake:
            self._stopping = True
            self._flush_deadline = self._clock() + timeout
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._transport.close()

    # -- the thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_encode = self._clock()
        retry_at = 0.0
        while True:
            with self._wake:
                if self._stopping:
                    break
                now = self._clock()
                due = [next_encode] + ([retry_at] if self._queue else [])
                wait = min(due) - now
                if wait > 0:
                    self._wake.wait(wait)
                    continue
            if now >= next_encode:
                encoded = self.enqueue_latest()
                next_encode = max(next_encode + self._interval, now) if encoded is not None else (
                    now + min(self._interval, NO_SNAPSHOT_RECHECK_SECONDS))
            if self._queue and self._clock() >= retry_at:
                retry_at = self._clock() + self._send_head()
        self._flush()

    def enqueue_latest(self) -> bool | None:
        """Encode the latest snapshot onto the queue. True: queued; False: nothing new to push (stale,
        or pushed already); None: no snapshot yet."""
        snapshot = self._source.latest()
        if snapshot is None:
            return None
        if snapshot is self._pushed or self._source.snapshot_is_stale():
            return False
        self._pushed = snapshot
        try:
            body = self._encode(snapshot)
        except Exception:  # a bug in the mapping must not end the thread: the next snapshot may encode
            log.exception("OTLP: could not encode the snapshot; skipped")
            return False
        if body is None:
            return False
        with self._wake:
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self._counts["dropped"] += 1
                self._failures = 0  # the head that was failing is gone: the next starts afresh
                self._log_once("queue full", logging.WARNING,
                               "OTLP: the queue of %d pushes is full (the receiver %s is not taking them); "
                               "dropping the oldest (logged once; see gpuscope_otlp_exports_total)",
                               self._max_queue, self.endpoint)
            self._queue.append(body)
        return True

    def _send_head(self, timeout: float | None = None) -> float:
        """Push the queue's oldest request; the delay before the next push (0: at once)."""
        with self._wake:
            if not self._queue:
                return 0.0
            body = self._queue[0]
        started = self._clock()
        result = self._push(body, timeout)
        if self._health is not None:
            self._health.record("otlp", success=result.outcome == "sent",
                                duration_seconds=self._clock() - started)
        with self._wake:
            if self._queue and self._queue[0] is body and result.outcome != "retry":
                self._queue.popleft()
            if result.outcome == "sent":
                self._counts["sent"] += 1
            elif result.outcome == "refused":
                self._counts["failed"] += 1
        if result.outcome == "sent":
            self._last_success = self._wall_clock()
            self._failures = 0
            if self._failing:
                self._failing = False
                log.info("OTLP: pushing to %s again", self.endpoint)
            return 0.0
        if result.outcome == "refused":
            self._log_once(f"refused {result.reason}", logging.ERROR,
                           "OTLP: %s refused a push (%s); such pushes are dropped, not retried (logged once "
                           "per answer)", self.endpoint, result.reason)
            return 0.0
        self._retries += 1
        self._failures += 1
        if not self._failing:
            self._failing = True
            log.warning("OTLP: push to %s failed (%s); retrying with back-off, %d queued at most",
                        self.endpoint, result.reason, self._max_queue)
        return self._delay(result)

    def _push(self, body: bytes, timeout: float | None) -> PushResult:
        try:
            return self._transport.push(body, timeout or self._timeout)
        except Exception as err:  # a transport bug: retried, as a failed connection would be
            log.exception("OTLP: the push failed unexpectedly")
            return PushResult("retry", type(err).__name__)

    def _delay(self, result: PushResult) -> float:
        if result.retry_after is not None:
            return result.retry_after
        backoff = min(self._retry_max, self._retry_initial * 2.0 ** min(self._failures - 1, 30))
        return backoff * (0.5 + 0.5 * self._jitter())  # "equal jitter": half fixed, half random

    def _flush(self) -> None:
        """At stop: the latest snapshot too, then the queue, oldest first, until the deadline."""
        self.enqueue_latest()
        while self._queue:
            remaining = self._flush_deadline - self._clock()
            if remaining <= 0 or self._send_head(timeout=remaining) > 0:
                break
        with self._wake:
            self._counts["dropped"] += len(self._queue)
            self._queue.clear()

    def _log_once(self, key: str, level: int, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, message, *args)
