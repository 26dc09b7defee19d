"""Refused capture triggers: the newest ones, in memory, for the listings, the event log and the page.

A trigger the agent refuses (the alert cooldown, the hourly budget, the store's quota, a full queue,
the agent stopping, a MIG device that is gone, another capture in flight) stores no capture, so
without this record it would show only in the agent's log and a counter. ``RefusalLog`` keeps the
last ``limit`` of them (older ones are dropped; ``total`` still counts them) and tells its listeners
(the alert event log) of each one as it happens.

Refusals are kept in memory only: the capture store holds captures that reached a profiler, one
directory each, and a refusal has nothing to store there; the event log is their lasting record.
Alerts whose rule does not ask for captures (``capture.rules``) are not refusals of a capture and
are not kept: every firing alert of such a rule would otherwise push the real refusals out.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from gpuscope.capture.model import Trigger
from gpuscope.common.durations import format_wait

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 100  # refused triggers kept; a storm of them keeps the newest
MAX_LIMIT = 10_000

# Why a trigger was refused. The policy's codes (duration, busy, cooldown, budget, disabled), and the
# capture service's: quota (the trace alone exceeds the store's quota), queue_full (too many triggers
# waiting), stopping (the agent stopped before its turn), device_gone (the MIG device it named is gone
# or runs nothing).
RefusalReason = Literal["disabled", "duration", "busy", "cooldown", "budget", "quota", "queue_full",
                        "stopping", "device_gone"]


@dataclass(frozen=True, slots=True)
class RefusedTrigger:
    """One refused trigger. ``allowed_at``: when a trigger like it would next be allowed (wall clock:
    the end of the GPU's alert cooldown, the time the hourly budget frees a slot); None where that is
    not known (a busy node, a full queue, the quota)."""

    at: float  # wall clock, Unix seconds
    trigger: Trigger
    gpu: int | None
    reason: RefusalReason
    message: str  # the sentence the agent logged and answered
    allowed_at: float | None = None
    pid: int | None = None
    mig_uuid: str | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.at):
            raise ValueError(f"a refusal's time must be finite, got {self.at!r}")
        if self.allowed_at is not None and not math.isfinite(self.allowed_at):
            raise ValueError(f"a refusal's allowed_at must be finite or None, got {self.allowed_at!r}")

    def allowed_in(self, now: float) -> float | None:
        """Seconds from ``now`` until a trigger like this one is allowed (0: it is now); None: unknown."""
        return None if self.allowed_at is None else max(0.0, self.allowed_at - now)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def next_allowed(allowed_at: float | None, now: float | None = None) -> str:
    """When a refused trigger's kind is allowed again, in the one wording every place that says it uses
    (the refusal's sentence, ``captures ls --all``'s NEXT ALLOWED): 'at 14:07:12 UTC (in 53m10s)' as of
    ``now``; without ``now``, 'at 14:07:12 UTC' (a sentence that stays true however late it is read);
    'now' once that time has passed; '-' when not known."""
    if allowed_at is None:
        return "-"
    if now is not None and allowed_at <= now:
        return "now"
    at = f"at {time.strftime('%H:%M:%S', time.gmtime(math.ceil(allowed_at)))} UTC"
    return at if now is None else f"{at} (in {format_wait(allowed_at - now)})"


class RefusalLog:
    """The newest ``limit`` refused triggers, newest last; thread-safe (the capture worker, the threads
    that submit triggers and the API's readers use it at once)."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"the refusal log's limit must be a whole number from 1 to {MAX_LIMIT}, "
                             f"got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._kept: deque[RefusedTrigger] = deque(maxlen=limit)
        self._total = 0
        self._listeners: list[Callable[[RefusedTrigger], None]] = []

    def add_listener(self, callback: Callable[[RefusedTrigger], None]) -> None:
        """Called with each refusal, on the thread that refused it: it must not block."""
        self._listeners.append(callback)

    def add(self, refused: RefusedTrigger) -> None:
        with self._lock:
            self._kept.append(refused)
            self._total += 1
        for listener in self._listeners:
            try:
                listener(refused)
            except Exception:  # a listener's bug must not turn a refusal into a failed capture
                log.exception("refusal listener %r failed", listener)

    def recent(self, limit: int | None = None) -> list[RefusedTrigger]:
        """The kept refusals, newest first; at most ``limit`` of them."""
        with self._lock:
            newest_first = list(reversed(self._kept))
        return newest_first if limit is None else newest_first[:limit]

    @property
    def total(self) -> int:
        """Refusals since the agent started, the dropped ones included."""
        with self._lock:
            return self._total
