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
   tells whoever asked what their capture cost them (their own hourly budget).
6. The hourly budgets, two of them, each over any rolling 60 minutes: the automatic captures (alert
   and webhook triggers) of the node share ``capture.hourly_budget``; a person's requests (user and
   fleet triggers) count against their requester's own ``capture.user_hourly_budget`` (by
   ``Trigger.user``, who the control API says asked). So an alert storm cannot
   leave an operator without a capture, and an operator's tour of the GPUs cannot leave the next
   incident without one.

``admit`` checks and, when allowed, takes the node's slot and charges the budget (and, for an alert
or webhook trigger, starts the cooldown); ``release`` gives the slot back when the capture is over.
A refusal for the cooldown or a budget says when a trigger like it would be allowed
(``Decision.allowed_in_s``, and in its sentence the wall-clock time) and, for a budget, which setting
raises it. Pure logic with an injectable monotonic clock; thread-safe (the capture worker and the
control API may ask concurrently). With a ledger, the automatic captures' budget and the cooldowns
are written down at each change and restored at start, so a restart (a crash loop, a rollout during
an alert storm) does not hand out a fresh budget. A person's budget lives in memory: their requests
are authenticated and deliberate, and a restart is an operator's deliberate act too.
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
from gpuscope.capture.refusals import next_allowed
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
    # Refused for the cooldown or the budget: seconds until a trigger like this one would be allowed,
    # and that moment on the wall clock (the one value the sentences and the listings show).
    allowed_in_s: float | None = None
    allowed_at: float | None = None
    # The refusal as it stays true when read later (the refusal log): the time of day only, no wait.
    lasting_reason: str = ""
    # Admitted user or fleet request: what it cost whoever asked (their budget), for them ("" otherwise).
    notice: str = ""


@dataclass(frozen=True, slots=True)
class _InFlight:
    ticket: int
    trigger: Trigger
    gpu: int | None
    since: float  # monotonic admission time (also what the budget and the cooldown were charged)
    requester: str | None  # a person's request: whose budget it charged; None: the automatic budget
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
        self._started: deque[float] = deque()  # automatic admission times inside the budget window
        self._requested: dict[str, deque[float]] = {}  # requester -> their admission times in the window
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
            log.info("alert capture budget restored: %d of %d used in the last hour; cooldowns of %d GPU(s)",
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
            requester = None if automatic else _requester(trigger)
            self._in_flight = _InFlight(ticket, trigger, gpu, now, requester, automatic,
                                        self._last_on_gpu.get(gpu))
            self._charged(requester).append(now)
            if automatic:
                self._last_on_gpu[gpu] = now
                self._persist()
            notice = "" if requester is None else self._cost_to(requester, now)
            return Decision(True, "", None, decision.duration_s, ticket, notice=notice)

    def _charged(self, requester: str | None) -> deque[float]:
        """The admission times a capture is charged to (lock held): the automatic captures', or the
        requester's own."""
        if requester is None:
            return self._started
        return self._requested.setdefault(requester, deque())

    def _cost_to(self, requester: str, now: float) -> str:
        """What an admitted user or fleet capture cost whoever asked (lock held): one of their own
        hourly captures. The alert captures keep their budget and cooldown; none starts while it runs."""
        budget = self._config.user_hourly_budget
        started = self._charged(requester)
        left = max(0, budget - len(started))
        text = (f"this capture uses 1 of the {budget} on-demand captures per hour for "
                f"{_requester_name(requester)} (capture.user_hourly_budget): {left} left")
        if left == 0:
            wait = started[0] + BUDGET_WINDOW_SECONDS - now
            wall_now = self._wall_clock()
            text += f"; the next is allowed {next_allowed(wall_now + wait, wall_now)}"
        return text + ("; alert captures have their own budget (capture.hourly_budget) and cooldown, and "
                       "are refused while it runs")

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
                charged = self._charged(flight.requester)
                if flight.since in charged:
                    charged.remove(flight.since)
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
                                           "(capture.cooldown)",
                               allowed_in_s=last + config.cooldown - now, wall_now=self._wall_clock(),
                               lasting=f"GPU {gpu} is cooling down after an alert capture, cooldown "
                                       f"{cooldown} (capture.cooldown)")
        self._expire(now)
        if automatic:
            started, budget, setting = self._started, config.hourly_budget, "capture.hourly_budget"
            what = "alert and webhook captures"
        else:
            requester = _requester(trigger)
            started, budget = self._requested.get(requester, deque()), config.user_hourly_budget
            setting = "capture.user_hourly_budget"
            what = f"on-demand captures by {_requester_name(requester)}"
        if len(started) >= budget:
            wait = started[0] + BUDGET_WINDOW_SECONDS - now
            return _refuse("budget", f"hourly budget used: {len(started)} {what} in the last hour "
                                     f"({setting}: {budget}, raise it to allow more)",
                           allowed_in_s=wait, wall_now=self._wall_clock())
        return Decision(True, "", None, length)

    def _expire(self, now: float) -> None:
        for started in (self._started, *self._requested.values()):
            while started and now - started[0] >= BUDGET_WINDOW_SECONDS:
                started.popleft()
        for requester in [r for r, started in self._requested.items() if not started]:
            del self._requested[requester]

    # -- state, for the API and logs -----------------------------------------------------------------

    def busy(self) -> bool:
        with self._lock:
            return self._in_flight is not None

    def budget_left(self) -> int:
        """Alert and webhook captures still allowed in the rolling hour."""
        with self._lock:
            self._expire(self._clock())
            return max(0, self._config.hourly_budget - len(self._started))

    def user_budget_left(self, user: str | None) -> int:
        """On-demand captures ``user`` (None: requests that name no one) may still start in the rolling
        hour."""
        with self._lock:
            self._expire(self._clock())
            started = self._requested.get(user or "", ())
            return max(0, self._config.user_hourly_budget - len(started))

    def cooldown_left(self, gpu: int | None) -> float:
        """Seconds before an alert or webhook trigger on ``gpu`` may capture again (0: it may now); only
        alert and webhook captures start it."""
        with self._lock:
            last = self._last_on_gpu.get(gpu)
            if last is None:
                return 0.0
            return max(0.0, last + self._config.cooldown - self._clock())


def _refuse(code: RefusalCode, reason: str, *, allowed_in_s: float | None = None, wall_now: float = 0.0,
            lasting: str | None = None) -> Decision:
    """A refusal; with ``allowed_in_s``, its sentences end with when the next is allowed, from one
    wall-clock time: the reply's as of now, the lasting one as a time of day."""
    if allowed_in_s is None:
        return Decision(False, reason, code)
    wait = max(0.0, allowed_in_s)
    allowed_at = wall_now + wait
    return Decision(False, f"{reason}; the next is allowed {next_allowed(allowed_at, wall_now)}", code,
                    allowed_in_s=wait, allowed_at=allowed_at,
                    lasting_reason=f"{lasting or reason}; the next is allowed {next_allowed(allowed_at)}")


def _requester(trigger: Trigger) -> str:
    """Whose budget a person's request is charged to: the user the control API authenticated ("" for
    requests that name no one, which share one budget)."""
    return trigger.user or ""


def _requester_name(requester: str) -> str:
    """The requester as the control API named them: 'unix' (whoever may open the control socket),
    'token' (the TCP listener's token holders)."""
    return f"requester {requester!r}" if requester else "requests that name no requester"


def _automatic(trigger: Trigger) -> bool:
    """An alert's trigger (the agent's rules, Alertmanager's webhook), as opposed to a person's request."""
    return trigger.kind in ("alert", "webhook")
