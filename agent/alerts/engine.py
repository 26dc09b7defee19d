"""The alert engine: feeds the history each tick, evaluates every rule, and owns the alert states.

The rules judge windows of minutes, so with ``evaluation_interval_seconds`` they are evaluated that
often rather than every tick (the history is fed every tick all the same): a condition is seen at
the first evaluation after it holds (or stops holding), and ``for`` and ``clear_for`` run from that
evaluation to the first one at which they are over, so a transition comes less than two intervals
later than it would at every tick; a firing alert's evidence is refreshed at each evaluation. A
tick at which something the rules answer at once changes (a GPU's Xid count, a GPU down or back,
NVML up or down) is evaluated as it comes.

One state machine per (rule, GPU), and per (rule, MIG device) for the rules that judge the MIG devices
of a GPU in MIG mode (``Rule.evaluate_instances``; keyed by ``InstanceKey``)::

    inactive --condition true--> pending --true for `for`--> firing --false for `clear_for`--> resolved
                                    |                           ^   |
                                    +--false--> inactive        +---+ true again: clear timer reset

A rule with ``for: 0`` goes straight from inactive to firing (one transition, ``previous=None``).
Durations are measured on the snapshots' monotonic clock; wall times (``active_since``, ``at``)
are the snapshots' timestamps.

What the outputs see (listeners, ``alerts()``, the log) passes through inhibition (inhibition.py):
while a greater alert fires on the same GPU, a lesser one keeps its state machine but is reported
no more: one transition to ``inhibited`` if it had been reported, nothing if it was muted from its
start; when the greater alert resolves, it is reported again in the state it has reached.

Every transition is logged at INFO, one line each, with its rule, GPU and summary, e.g.
``alert GpuLowUtilization firing: GPU 1 runs a job but its mean utilization is 62.0% over 2m (below
80%)``; nothing is logged on the ticks in between. While a firing alert clears (its condition
false, ``clear_for`` not over yet), its summary in ``alerts()`` says so and quotes the last
evidence, which is no longer current.

GPUs that are down this tick, or missing from the snapshot (NVML itself went away), are not
evaluated: their alerts keep their state (a firing alert stays firing, a pending one pending) until
the GPU is read again. Nothing is known about them, and resolving then re-raising every alert of a
GPU that blinks out would only be noise; the GPU being down is reported on its own (``gpu_up``).
Rules that read data a down GPU still has (Xid counts) are evaluated on down GPUs too. The alerts on
the MIG devices of a GPU follow their GPU: kept while it is down, and while its MIG devices cannot be
listed (``NodeHistory.mig_unknown``: the rules do not judge them then); resolved (or gone inactive)
once the GPU is read and its devices listed again without their condition, a MIG device destroyed
included.

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

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.inhibition import INHIBITS, Inhibition, target
from gpuscope.alerts.model import (
    Alert,
    AlertKey,
    AlertState,
    Condition,
    InstanceKey,
    Transition,
    TransitionState,
    key_gpu,
)
from gpuscope.alerts.rules.base import Rule, slurm_jobs_text
from gpuscope.common.cadence import Cadence
from gpuscope.common.durations import format_duration
from gpuscope.health import SourceHealth
from gpuscope.snapshot import ProcessReading, Snapshot

log = logging.getLogger(__name__)

TransitionListener = Callable[[Transition], None]


@dataclass(slots=True)
class _State:
    """One (rule, GPU) or (rule, MIG device) alert that is pending or firing."""

    uuid: str
    state: AlertState
    since: float  # monotonic: when pending began
    active_since: float  # wall
    firing_since: float | None
    condition: Condition  # the latest evidence
    false_since: float | None = None  # monotonic: firing, but the condition false since then
    # What the outputs were last told of this alert: None (nothing yet: it was muted from its start),
    # "pending", "firing" or "inhibited".
    reported: TransitionState | None = None
    inhibited_by: str = ""  # the rule whose firing alert mutes this one now; "" when none does


# An alert whose state machine ended this tick: what it was on, its last state, "resolved" or "inactive".
_Ended = tuple[AlertKey, _State, TransitionState]


class AlertEngine:
    """Implements ``AlertSource``. Feed it with ``observe(snapshot)`` (e.g. as a sampler listener)."""

    def __init__(self, rules: Sequence[Rule[Any]], *, hostname: str,
                 health: SourceHealth | None = None, evaluation_interval_seconds: float = 0.0) -> None:
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate rule names: {names}")
        self.rules = tuple(rules)
        self.hostname = hostname
        self._health = health
        windows = [r.window_seconds for r in rules if r.window_seconds is not None and not r.span_window]
        spans = [r.window_seconds for r in rules if r.window_seconds is not None and r.span_window]
        self.history = NodeHistory(max(windows, default=0.0), spans)
        self._states: dict[str, dict[AlertKey, _State]] = {r.name: {} for r in rules}
        self._listeners: list[TransitionListener] = []
        self._lock = threading.Lock()
        self._alerts: list[Alert] = []
        self._counts: dict[tuple[str, TransitionState], int] = {}
        self._wall = 0.0  # the current snapshot's timestamp: the transitions' time
        self._failing: set[str] = set()  # rules whose evaluation raised (logged once until it recovers)
        # The tick is each snapshot's interval, set as it comes.
        self._evaluation = Cadence(evaluation_interval_seconds, 0.0)
        self._evaluated_events: tuple[Any, ...] | None = None  # _events() at the last evaluation

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
        evaluation = self._evaluation
        if not evaluation.every_tick:
            events = _events(snapshot)
            evaluation.tick_seconds = snapshot.interval_seconds
            if not evaluation.due(now) and events == self._evaluated_events:
                return []
            evaluation.done(now)
            self._evaluated_events = events
        wall = self._wall = snapshot.timestamp
        ended: dict[str, list[_Ended]] = {}
        failed = False
        for rule in self.rules:
            states = self._states[rule.name]
            try:
                conditions = _evaluate(rule, history, states)
            except Exception:
                if rule.name not in self._failing:
                    log.exception("alert rule %s failed; its alerts keep their state", rule.name)
                    self._failing.add(rule.name)
                failed = True
                continue
            self._failing.discard(rule.name)
            evaluated = history.present if rule.include_down else history.up
            unknown = history.mig_unknown  # GPUs whose MIG devices' alerts are not judged this tick
            for key, found in conditions.items():
                gpu = key_gpu(key)
                if gpu not in evaluated or (unknown and not isinstance(key, int) and gpu in unknown):
                    continue
                condition = _with_slurm_jobs(found, _processes(history, key))
                state = states.get(key)
                if state is None:
                    firing = rule.for_seconds <= 0
                    states[key] = _State(
                        history.uuid(gpu), "firing" if firing else "pending", now, wall,
                        wall if firing else None, condition)
                    continue
                # Labels are an alert's identity downstream (Alertmanager): keep the first ones.
                state.condition = (condition if condition.labels == state.condition.labels
                                   else replace(condition, labels=state.condition.labels))
                state.false_since = None
                if state.state == "pending" and now - state.since >= rule.for_seconds - 1e-9:
                    state.state = "firing"
                    state.firing_since = wall
            for key in [k for k in states if k not in conditions and key_gpu(k) in evaluated
                        and not (unknown and not isinstance(k, int) and k.gpu in unknown)]:
                state = states[key]
                if state.state == "pending":
                    del states[key]
                    ended.setdefault(rule.name, []).append((key, state, "inactive"))
                    continue
                if state.false_since is None:
                    state.false_since = now
                if now - state.false_since >= rule.clear_for_seconds - 1e-9:
                    del states[key]
                    ended.setdefault(rule.name, []).append((key, state, "resolved"))
        transitions = self._report(ended)
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

    def _report(self, ended: Mapping[str, list[_Ended]]) -> list[Transition]:
        """The transitions the outputs see this tick: each alert's state as reported so far
        (``_State.reported``) moved to its state now, where no firing greater alert inhibits it
        (inhibition.py). A muted alert's own changes are logged at DEBUG and not reported; once the
        greater alert resolves, the muted one is reported again in the state it has reached."""
        inhibition = Inhibition(
            (rule.name, target(key_gpu(key), state.condition.labels))
            for rule in self.rules if rule.name in INHIBITS
            for key, state in self._states[rule.name].items() if state.state == "firing")
        transitions: list[Transition] = []
        for rule in self.rules:
            for key, state, end in ended.get(rule.name, ()):
                if state.reported in ("pending", "firing"):
                    transitions.append(self._transition(rule, key, state, state.reported, end))
                else:
                    _log_unreported(rule, key, end, state)
            for key, state in sorted(self._states[rule.name].items(), key=_order):
                muted = inhibition.inhibited_by(rule.name, target(key_gpu(key), state.condition.labels))
                newly_muted = muted and not state.inhibited_by
                state.inhibited_by = muted
                if muted:
                    if state.reported in ("pending", "firing"):
                        transitions.append(self._transition(rule, key, state, state.reported, "inhibited"))
                        state.reported = "inhibited"
                    elif newly_muted and state.reported is None:
                        _log_unreported(rule, key, state.state, state)
                elif state.reported != state.state:
                    transitions.append(self._transition(rule, key, state, state.reported, state.state))
                    state.reported = state.state
        # A greater alert's firing is told before the alerts it mutes.
        transitions.sort(key=lambda t: t.state == "inhibited")
        return transitions

    def _transition(self, rule: Rule[Any], key: AlertKey, state: _State, previous: TransitionState | None,
                    to: TransitionState) -> Transition:
        c = state.condition
        _log_transition(rule, key, to, c.summary, state.inhibited_by)
        return Transition(
            name=rule.name, gpu=key_gpu(key), uuid=state.uuid, severity=rule.severity, hostname=self.hostname,
            previous=previous, state=to, at=self._wall, active_since=state.active_since, values=c.values,
            summary=c.summary, labels=c.labels, inhibited_by=state.inhibited_by if to == "inhibited" else "",
            window_seconds=rule.window_seconds)

    def _publish(self, transitions: list[Transition], now: float) -> None:
        alerts = []
        for rule in self.rules:
            for key, s in sorted(self._states[rule.name].items(), key=_order):
                c = s.condition
                summary = (c.summary if s.false_since is None
                           else _clearing(rule, now - s.false_since, c.summary))
                alerts.append(Alert(
                    name=rule.name, gpu=key_gpu(key), uuid=s.uuid, severity=rule.severity, state=s.state,
                    hostname=self.hostname, active_since=s.active_since, firing_since=s.firing_since,
                    values=c.values, summary=summary, labels=c.labels,
                    clearing=s.state == "firing" and s.false_since is not None, inhibited_by=s.inhibited_by))
        with self._lock:
            self._alerts = alerts
            for t in transitions:
                counted = (t.name, t.state)
                self._counts[counted] = self._counts.get(counted, 0) + 1


def _evaluate(rule: Rule[Any], history: NodeHistory, states: Mapping[AlertKey, _State]) -> dict[
        AlertKey, Condition]:
    """The rule's conditions this tick, on GPUs and (rules that judge them) on MIG devices."""
    conditions: dict[AlertKey, Condition] = {}
    gpus = frozenset([k for k in states if isinstance(k, int)])
    for gpu, condition in rule.evaluate(history, gpus).items():
        conditions[gpu] = condition
    if rule.judges_instances:
        active = frozenset([k for k in states if isinstance(k, InstanceKey)])
        for device, condition in rule.evaluate_instances(history, active).items():
            conditions[device] = condition
    return conditions


def _events(snapshot: Snapshot) -> tuple[Any, ...]:
    """What an alert answers at the tick it changes at, whatever the evaluation interval: each GPU's
    Xid counts and whether it is up, and whether NVML is."""
    return snapshot.nvml_up, tuple([(g.index, g.up, g.xid_errors) for g in snapshot.gpus])


def _order(item: tuple[AlertKey, _State]) -> tuple[int, str]:
    """Alerts in GPU order, each GPU's own before those on its MIG devices."""
    key = item[0]
    return (key, "") if isinstance(key, int) else (key.gpu, key.uuid)


def _processes(history: NodeHistory, key: AlertKey) -> tuple[ProcessReading, ...]:
    """The latest known processes on what an alert is on: its GPU, or its MIG device."""
    if isinstance(key, int):
        occupancy = history.occupancy(key)
        return occupancy.processes if occupancy is not None else ()
    device = history.instances(key.gpu).get(key.uuid)
    return device.processes if device is not None else ()


def _with_slurm_jobs(condition: Condition, processes: tuple[ProcessReading, ...]) -> Condition:
    """The condition with the Slurm job steps on its GPU (or MIG device) named at the end of its
    summary, so that an alert on an HPC node says whose job it is about."""
    jobs = slurm_jobs_text(processes) if processes else ""
    return replace(condition, summary=f"{condition.summary}; {jobs} on it") if jobs else condition


def _where(key: AlertKey) -> str:
    gpu = key_gpu(key)
    return f"GPU {gpu}" if isinstance(key, int) else f"GPU {gpu} MIG device {key.uuid}"


def _log_transition(rule: Rule[Any], key: AlertKey, to: TransitionState, summary: str,
                    inhibited_by: str = "") -> None:
    """One INFO line per transition. A summary names its GPU first ("GPU 1 runs a job ..."); one that
    does not gets the GPU in front. Past a pending or firing state, the summary is the last evidence."""
    where = _where(key)
    text = summary if summary.startswith(f"GPU {key_gpu(key)} ") else f"{where}: {summary}"
    if to == "pending":
        log.info("alert %s pending: %s (fires if this holds for %s)", rule.name, text,
                 format_duration(rule.for_seconds))
    elif to == "firing":
        log.info("alert %s firing: %s", rule.name, text)
    elif to == "resolved":
        cleared = (f"its condition has been false for {format_duration(rule.clear_for_seconds)}"
                   if rule.clear_for_seconds > 0 else "its condition no longer holds")
        log.info("alert %s resolved on %s: %s (last evidence: %s)", rule.name, where, cleared, summary)
    elif to == "inhibited":
        log.info("alert %s inhibited on %s: %s fires there and explains it; reported no more while it "
                 "does (last evidence: %s)", rule.name, where, inhibited_by, summary)
    else:
        log.info("alert %s inactive on %s: its condition stopped holding within the %s it must hold "
                 "to fire (last evidence: %s)", rule.name, where, format_duration(rule.for_seconds), summary)


def _log_unreported(rule: Rule[Any], key: AlertKey, to: TransitionState, state: _State) -> None:
    """A muted alert's own change: DEBUG only (the greater alert is the one reported)."""
    log.debug("alert %s %s on %s, muted (inhibited by %s): %s", rule.name, to, _where(key),
              state.inhibited_by or "a greater alert", state.condition.summary)


def _clearing(rule: Rule[Any], false_for: float, summary: str) -> str:
    """The summary of a firing alert whose condition is false, until ``clear_for`` resolves it."""
    return (f"clearing: its condition no longer holds ({format_duration(round(false_for, 1))} of the "
            f"{format_duration(rule.clear_for_seconds)} that resolve the alert); last evidence: {summary}")
