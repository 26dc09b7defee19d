"""The alert engine: feeds the history, evaluates every rule each tick, and owns the alert states.

One state machine per (rule, GPU)::

    inactive --condition true--> pending --true for `for`--> firing --false for `clear_for`--> resolved
                                    |                           ^   |
                                    +--false--> inactive        +---+ true again: clear timer reset

A rule with ``for: 0`` goes straight from inactive to firing (one transition, ``previous=None``).
Durations are measured on the snapshots' monotonic clock; wall times (``active_since``, ``at``)
are the snapshots' timestamps.

Every transition is logged at INFO, one line each, with its rule, GPU and summary, e.g.
``alert GpuLowUtilization firing: GPU 1 runs a job but its mean utilization is 62.0% over 2m (below
80%)``; nothing is logged on the ticks in between. While a firing alert clears (its condition
false, ``clear_for`` not over yet), its summary in ``alerts()`` says so and quotes the last
evidence, which is no longer current.

GPUs that are down this tick, or missing from the snapshot (NVML itself went away), are not
evaluated: their alerts keep their state (a firing alert stays firing, a pending one pending) until
the GPU is read again. Nothing is known about them, and resolving then re-raising every alert of a
GPU that blinks out would only be noise; the GPU being down is reported on its own (``gpu_up``).
Rules that read data a down GPU still has (Xid counts) are evaluated on down GPUs too.

``observe`` runs in the sampler thread; ``alerts`` and ``transition_counts`` may be called from
any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuscope.alerts.history import NodeHistory, Occupancy
from gpuscope.alerts.model import Alert, AlertState, Condition, Transition, TransitionState
from gpuscope.alerts.rules.base import Rule, slurm_jobs_text
from gpuscope.common.durations import format_duration
from gpuscope.health import SourceHealth
from gpuscope.snapshot import Snapshot

log = logging.getLogger(__name__)

TransitionListener = Callable[[Transition], None]


@dataclass(slots=True)
class _State:
    """One (rule, GPU) alert that is pending or firing."""

    uuid: str
    state: AlertState
    since: float  # monotonic: when pending began
    active_since: float  # wall
    firing_since: float | None
    condition: Condition  # the latest evidence
    false_since: float | None = None  # monotonic: firing, but the condition false since then


class AlertEngine:
    """Implements ``AlertSource``. Feed it with ``observe(snapshot)`` (e.g. as a sampler listener)."""

    def __init__(self, rules: Sequence[Rule[Any]], *, hostname: str,
                 health: SourceHealth | None = None) -> None:
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate rule names: {names}")
        self.rules = tuple(rules)
        self.hostname = hostname
        self._health = health
        windows = [r.window_seconds for r in rules if r.window_seconds is not None and not r.span_window]
        spans = [r.window_seconds for r in rules if r.window_seconds is not None and r.span_window]
        self.history = NodeHistory(max(windows, default=0.0), spans)
        self._states: dict[str, dict[int, _State]] = {r.name: {} for r in rules}
        self._listeners: list[TransitionListener] = []
        self._lock = threading.Lock()
        self._alerts: list[Alert] = []
        self._counts: dict[tuple[str, TransitionState], int] = {}
        self._wall = 0.0  # the current snapshot's timestamp: the transitions' time
        self._failing: set[str] = set()  # rules whose evaluation raised (logged once until it recovers)

    # ------------------------------------------------------------ AlertSource

    def alerts(self) -> list[Alert]:
        """The alerts pending or firing now (a copy; safe from any thread)."""
        with self._lock:
            return list(self._alerts)

    def transition_counts(self) -> Mapping[tuple[str, TransitionState], int]:
        """(alertname, state) -> transitions into that state since start (a copy)."""
        with self._lock:
            return dict(self._counts)

    # ------------------------------------------------------------ feeding

    def add_listener(self, callback: TransitionListener) -> None:
        """Called in the sampler thread with each transition, in order; a raising one is logged."""
        self._listeners.append(callback)

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """``observe`` as a sampler listener (``sampler.add_listener(engine.on_snapshot)``)."""
        self.observe(snapshot)

    def observe(self, snapshot: Snapshot) -> list[Transition]:
        """Record the snapshot, evaluate every rule, advance the states; the transitions made."""
        started = time.perf_counter()
        history = self.history
        history.observe(snapshot)
        now = snapshot.monotonic
        wall = self._wall = snapshot.timestamp
        transitions: list[Transition] = []
        failed = False
        for rule in self.rules:
            states = self._states[rule.name]
            try:
                conditions = rule.evaluate(history, frozenset(states))
            except Exception:
                if rule.name not in self._failing:
                    log.exception("alert rule %s failed; its alerts keep their state", rule.name)
                    self._failing.add(rule.name)
                failed = True
                continue
            self._failing.discard(rule.name)
            evaluated = history.present if rule.include_down else history.up
            for gpu, found in conditions.items():
                if gpu not in evaluated:
                    continue
                condition = _with_slurm_jobs(found, history.occupancy(gpu))
                state = states.get(gpu)
                if state is None:
                    firing = rule.for_seconds <= 0
                    state = states[gpu] = _State(
                        history.uuid(gpu), "firing" if firing else "pending", now, wall,
                        wall if firing else None, condition)
                    transitions.append(self._transition(rule, gpu, state, None, state.state))
                    continue
                # Labels are an alert's identity downstream (Alertmanager): keep the first ones.
                state.condition = (condition if condition.labels == state.condition.labels
                                   else replace(condition, labels=state.condition.labels))
                state.false_since = None
                if state.state == "pending" and now - state.since >= rule.for_seconds - 1e-9:
                    state.state = "firing"
                    state.firing_since = wall
                    transitions.append(self._transition(rule, gpu, state, "pending", "firing"))
            for gpu in [g for g in states if g not in conditions and g in evaluated]:
                state = states[gpu]
                if state.state == "pending":
                    del states[gpu]
                    transitions.append(self._transition(rule, gpu, state, "pending", "inactive"))
                    continue
                if state.false_since is None:
                    state.false_since = now
                if now - state.false_since >= rule.clear_for_seconds - 1e-9:
                    del states[gpu]
                    transitions.append(self._transition(rule, gpu, state, "firing", "resolved"))
        self._publish(transitions, now)
        if self._health is not None:
            self._health.record("alerts", success=not failed, duration_seconds=time.perf_counter() - started)
        for transition in transitions:
            for listener in self._listeners:
                try:
                    listener(transition)
                except Exception:
                    log.exception("alert transition listener %r failed", listener)
        return transitions

    # ------------------------------------------------------------ internals

    def _transition(self, rule: Rule[Any], gpu: int, state: _State, previous: TransitionState | None,
                    to: TransitionState) -> Transition:
        c = state.condition
        _log_transition(rule, gpu, to, c.summary)
        return Transition(
            name=rule.name, gpu=gpu, uuid=state.uuid, severity=rule.severity, hostname=self.hostname,
            previous=previous, state=to, at=self._wall, active_since=state.active_since, values=c.values,
            summary=c.summary, labels=c.labels)

    def _publish(self, transitions: list[Transition], now: float) -> None:
        alerts = []
        for rule in self.rules:
            for gpu, s in sorted(self._states[rule.name].items()):
                c = s.condition
                summary = (c.summary if s.false_since is None
                           else _clearing(rule, now - s.false_since, c.summary))
                alerts.append(Alert(
                    name=rule.name, gpu=gpu, uuid=s.uuid, severity=rule.severity, state=s.state,
                    hostname=self.hostname, active_since=s.active_since, firing_since=s.firing_since,
                    values=c.values, summary=summary, labels=c.labels))
        with self._lock:
            self._alerts = alerts
            for t in transitions:
                key = (t.name, t.state)
                self._counts[key] = self._counts.get(key, 0) + 1


def _with_slurm_jobs(condition: Condition, occupancy: Occupancy | None) -> Condition:
    """The condition with the Slurm job steps on its GPU named at the end of its summary, so that an
    alert on an HPC node says whose job it is about."""
    jobs = slurm_jobs_text(occupancy.processes) if occupancy is not None else ""
    return replace(condition, summary=f"{condition.summary}; {jobs} on it") if jobs else condition


def _log_transition(rule: Rule[Any], gpu: int, to: TransitionState, summary: str) -> None:
    """One INFO line per transition. A summary names its GPU first ("GPU 1 runs a job ..."); one that
    does not gets the GPU in front. Past a pending or firing state, the summary is the last evidence."""
    text = summary if summary.startswith(f"GPU {gpu} ") else f"GPU {gpu}: {summary}"
    if to == "pending":
        log.info("alert %s pending: %s (fires if this holds for %s)", rule.name, text,
                 format_duration(rule.for_seconds))
    elif to == "firing":
        log.info("alert %s firing: %s", rule.name, text)
    elif to == "resolved":
        cleared = (f"its condition has been false for {format_duration(rule.clear_for_seconds)}"
                   if rule.clear_for_seconds > 0 else "its condition no longer holds")
        log.info("alert %s resolved on GPU %d: %s (last evidence: %s)", rule.name, gpu, cleared, summary)
    else:
        log.info("alert %s inactive on GPU %d: its condition stopped holding within the %s it must hold "
                 "to fire (last evidence: %s)", rule.name, gpu, format_duration(rule.for_seconds), summary)


def _clearing(rule: Rule[Any], false_for: float, summary: str) -> str:
    """The summary of a firing alert whose condition is false, until ``clear_for`` resolves it."""
    return (f"clearing: its condition no longer holds ({format_duration(round(false_for, 1))} of the "
            f"{format_duration(rule.clear_for_seconds)} that resolve the alert); last evidence: {summary}")
