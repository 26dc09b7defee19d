"""The capture policy: whether a trigger may capture now, and for how long.

Checks, in this order (the first that fails is the reason):

1. ``capture.enabled``.
2. The rule: an ``alert`` or ``webhook`` trigger captures only when its alert's rule is set to
   (``capture.rules`` over the rule's own ``captures_by_default``). ``user`` and ``fleet`` triggers
   are deliberate requests and have no rule.
3. The duration: alert and webhook triggers always record ``capture.duration``. A user or fleet
   request may name a length up to ``capture.max_duration``; a longer (or non-positive) one is refused,
   not shortened, so that whoever asked knows.
4. One capture per node: while one is in flight, any other is refused ("busy node").
5. The alert cooldown per GPU, for alert and webhook triggers only: after an alert or webhook
   capture on a GPU started, they are refused on that GPU for ``capture.cooldown`` (one incident,
   one capture). User and fleet requests neither wait for it nor start it: a person asking for a
   trace now should get one, and the alert that fires next on that GPU should still get its own.
   They are bound by 4 and 6 and by the store's quota like every capture; the decision's ``notice``
   tells whoever asked what their capture costs the alert captures (the shared hourly budget).
6. The hourly budget: at most ``capture.hourly_budget`` captures (of any trigger) started in any
   rolling 60 minutes.

``admit`` checks and, when allowed, takes the node's slot and charges the budget (and, for an alert
or webhook trigger, starts the cooldown); ``release`` gives the slot back when the capture is over.
A refusal for the cooldown or the budget says when a trigger like it would be allowed
(``Decision.allowed_in_s``). Pure logic with an injectable monotonic
clock; thread-safe (the capture worker and the control API may ask concurrently). With a ledger,
the budget and the cooldowns are written down at each change and restored at start, so a restart
does not hand out a fresh budget.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.ledger import AdmissionLedger, Admissions
from gpuscope.capture.model import Trigger
from gpuscope.common.durations import format_duration, format_wait

log = logging.getLogger(__name__)

BUDGET_WINDOW_SECONDS = 3600.0
# disabled, rule, duration, busy, cooldown, budget: why a capture was refused; None when allowed.
RefusalCode = Literal["disabled", "rule", "duration", "busy", "cooldown", "budget"]


@dataclass(frozen=True, slots=True)
class Decision:
    """The policy's answer. ``ticket`` identifies an admitted capture for ``release`` (0 when refused)."""

    allowed: bool
    reason: str  # a sentence for logs and API replies; "" when allowed
    code: RefusalCode | None = None
    duration_s: float = 0.0  # the length to record, when allowed
    ticket: int = 0
    # Refused for the cooldown or the budget: seconds until a trigger like this one would be allowed.
    allowed_in_s: float | None = None
    # Admitted user or fleet request: what it costs the alert captures, for whoever asked ("" otherwise).
    notice: str = ""


@dataclass(frozen=True, slots=True)
class _InFlight:
    ticket: int
    trigger: Trigger
    gpu: int | None
    since: float  # monotonic admission time (also what the budget and the cooldown were charged)
    starts_cooldown: bool  # an alert or webhook capture: it started its GPU's cooldown
    previous_on_gpu: float | None  # the GPU's cooldown start before this one, restored by a refund


class CapturePolicy:
    def __init__(self, config: CaptureConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, ledger: AdmissionLedger | None = None,
                 restored: Admissions | None = None) -> None:
        self._config = config
        self._clock = clock
        self._wall_clock = wall_clock
        self._ledger = ledger
        self._lock = threading.Lock()
        self._in_flight: _InFlight | None = None
        self._started: deque[float] = deque()  # admission times inside the budget window
        self._last_on_gpu: dict[int | None, float] = {}  # gpu -> last alert or webhook admission time
        self._next_ticket = 1
        if restored is not None:
            self._restore(restored)

    def _restore(self, admissions: Admissions) -> None:
        """Admissions of an earlier run (wall clock) as this run's monotonic times. A time in the future
        (the clock was set back) counts as now: it still charges the budget, never more than that."""
        now, wall = self._clock(), self._wall_clock()
        for at in sorted(admissions.started):
            if wall - at < BUDGET_WINDOW_SECONDS:
                self._started.append(now - max(0.0, wall - at))
        for gpu, at in admissions.last_on_gpu.items():
            self._last_on_gpu[gpu] = now - max(0.0, wall - at)
        if admissions.started or admissions.last_on_gpu:
            log.info("capture budget restored: %d of %d used in the last hour; cooldowns of %d GPU(s)",
                     len(self._started), self._config.hourly_budget, len(self._last_on_gpu))

    def _persist(self) -> None:
        """Write the budget and cooldowns down (lock held)."""
        if self._ledger is None:
            return
        now, wall = self._clock(), self._wall_clock()
        self._ledger.save([wall - (now - t) for t in self._started],
                          {gpu: wall - (now - t) for gpu, t in self._last_on_gpu.items()})

    # -- deciding ------------------------------------------------------------------------------------

    def check(self, trigger: Trigger, gpu: int | None, *, duration_s: float | None = None) -> Decision:
        """What ``admit`` would answer now, without taking anything."""
        with self._lock:
            return self._decide(trigger, gpu, duration_s, self._clock())

    def admit(self, trigger: Trigger, gpu: int | None, *, duration_s: float | None = None) -> Decision:
        """Decide; when allowed, hold the node's slot (until ``release``), charge the hourly budget and
        start the GPU's cooldown. ``gpu`` None: a capture not tied to a GPU (e.g. a user capture by pid)."""
        with self._lock:
            now = self._clock()
            decision = self._decide(trigger, gpu, duration_s, now)
            if not decision.allowed:
                return decision
            ticket = self._next_ticket
            self._next_ticket += 1
            automatic = _automatic(trigger)
            self._in_flight = _InFlight(ticket, trigger, gpu, now, automatic, self._last_on_gpu.get(gpu))
            self._started.append(now)
            if automatic:
                self._last_on_gpu[gpu] = now
            self._persist()
            notice = "" if automatic else self._cost_to_alert_captures()
            return Decision(True, "", None, decision.duration_s, ticket, notice=notice)

    def _cost_to_alert_captures(self) -> str:
        """What an admitted user or fleet capture takes from the alert captures (lock held): the hourly
        budget is theirs too, and none starts while it runs; their cooldown it leaves alone."""
        budget = self._config.hourly_budget
        left = max(0, budget - len(self._started))
        text = (f"this capture uses 1 of the {budget} captures per hour (capture.hourly_budget) that alert "
                f"captures share: {left} left")
        if left == 0:
            text += (f"; alert captures are refused for the next "
                     f"{format_wait(self._started[0] + BUDGET_WINDOW_SECONDS - self._clock())}")
        return text + ("; alert triggers are refused while it runs; the alert cooldown is not affected")

    def release(self, decision: Decision, *, refund: bool = False) -> None:
        """The admitted capture is over: free the node's slot. ``refund``: nothing was attempted (no
        target was found, or the store refused it before any target was contacted), so the budget
        and the cooldown it charged are given back. Releasing twice, or a refused decision, does nothing."""
        with self._lock:
            flight = self._in_flight
            if flight is None or not decision.allowed or flight.ticket != decision.ticket:
                return
            self._in_flight = None
            if refund:
                if flight.since in self._started:
                    self._started.remove(flight.since)
                if flight.starts_cooldown and self._last_on_gpu.get(flight.gpu) == flight.since:
                    if flight.previous_on_gpu is None:
                        del self._last_on_gpu[flight.gpu]
                    else:
                        self._last_on_gpu[flight.gpu] = flight.previous_on_gpu
                self._persist()

    def _decide(self, trigger: Trigger, gpu: int | None, duration_s: float | None, now: float) -> Decision:
        config = self._config
        if not config.enabled:
            return _refuse("disabled", "captures are disabled (capture.enabled: false)")
        automatic = _automatic(trigger)
        if automatic:
            if not trigger.alertname:
                return _refuse("rule", f"the {trigger.kind} trigger names no alert")
            if not config.rule_captures(trigger.alertname):
                return _refuse("rule", f"alert {trigger.alertname} does not trigger captures "
                                       f"(capture.rules.{trigger.alertname}: false, or not an agent rule)")
            length = config.duration
        elif duration_s is None:
            length = config.duration
        else:
            if not math.isfinite(duration_s) or duration_s <= 0:
                return _refuse("duration", f"a capture duration must be a positive number of seconds, "
                                           f"got {duration_s!r}")
            if duration_s > config.max_duration:
                return _refuse("duration", f"the requested duration {format_duration(duration_s)} is longer "
                                           f"than the maximum {format_duration(config.max_duration)} "
                                           "(capture.max_duration)")
            length = duration_s
        if self._in_flight is not None:
            flight = self._in_flight
            where = f"GPU {flight.gpu}" if flight.gpu is not None else "the node"
            return _refuse("busy", f"busy node: the {flight.trigger.kind} capture on {where} is in flight "
                                   f"(for {format_duration(round(now - flight.since, 1))}); one at a time")
        if automatic:
            last = self._last_on_gpu.get(gpu)
            if last is not None and now - last < config.cooldown:
                cooldown = format_duration(config.cooldown)
                return _refuse("cooldown", f"GPU {gpu} is cooling down: last alert capture "
                                           f"{format_wait(now - last)} ago, cooldown {cooldown} "
                                           "(capture.cooldown); "
                                           f"next possible in {format_wait(last + config.cooldown - now)}",
                               allowed_in_s=last + config.cooldown - now)
        self._expire(now)
        if len(self._started) >= config.hourly_budget:
            free_at = self._started[0] + BUDGET_WINDOW_SECONDS
            return _refuse("budget", f"hourly budget used: {len(self._started)} captures in the last hour "
                                     f"(capture.hourly_budget: {config.hourly_budget}); next possible in "
                                     f"{format_wait(free_at - now)}", allowed_in_s=free_at - now)
        return Decision(True, "", None, length)

    def _expire(self, now: float) -> None:
        while self._started and now - self._started[0] >= BUDGET_WINDOW_SECONDS:
            self._started.popleft()

    # -- state, for the API and logs -----------------------------------------------------------------

    def busy(self) -> bool:
        with self._lock:
            return self._in_flight is not None

    def budget_left(self) -> int:
        """Captures still allowed in the rolling hour."""
        with self._lock:
            self._expire(self._clock())
            return max(0, self._config.hourly_budget - len(self._started))

    def cooldown_left(self, gpu: int | None) -> float:
        """Seconds before an alert or webhook trigger on ``gpu`` may capture again (0: it may now); only
        alert and webhook captures start it."""
        with self._lock:
            last = self._last_on_gpu.get(gpu)
            if last is None:
                return 0.0
            return max(0.0, last + self._config.cooldown - self._clock())


def _refuse(code: RefusalCode, reason: str, *, allowed_in_s: float | None = None) -> Decision:
    wait = None if allowed_in_s is None else max(0.0, allowed_in_s)
    return Decision(False, reason, code, allowed_in_s=wait)


def _automatic(trigger: Trigger) -> bool:
    """An alert's trigger (the agent's rules, Alertmanager's webhook), as opposed to a person's request."""
    return trigger.kind in ("alert", "webhook")
