"""The alert data model shared by the rule engine and its outputs (metrics, event log, API, Alertmanager).

Times are wall-clock Unix seconds unless named ``*_monotonic``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Severity = Literal["info", "warning", "critical"]
AlertState = Literal["pending", "firing"]
# What a transition leads to: pending (condition became true), firing (true for `for`),
# resolved (a firing alert whose condition was false for `clear_for`), inactive (a pending alert
# whose condition went false before `for` elapsed; never reached firing), inhibited (a pending or
# firing alert muted by a greater alert on its GPU: inhibition.py; its outputs speak of that one
# from then on). From inhibited, an alert goes back to pending or firing when the greater alert
# resolves while its own condition still holds; its own end is not reported.
TransitionState = Literal["pending", "firing", "resolved", "inactive", "inhibited"]


@dataclass(frozen=True, slots=True, order=True)
class InstanceKey:
    """What a rule judges on one MIG device of a GPU in MIG mode rather than on the whole GPU: its
    alerts are the rule's alerts on that MIG device, apart from those on the GPU and its other MIG devices."""

    gpu: int  # the parent GPU's index
    uuid: str  # the MIG device's UUID ("MIG-…"): an instance destroyed and created again is another one


# What one alert of a rule is on: a GPU (its index), or one MIG device of a GPU.
AlertKey = int | InstanceKey


def key_gpu(key: AlertKey) -> int:
    """The GPU an alert is on (the parent GPU of a MIG device)."""
    return key if isinstance(key, int) else key.gpu


# The labels that name the MIG device an alert is on (as the gpu_mig_* series name it).
MIG_LABELS = ("gpu_instance", "compute_instance", "mig_profile", "mig_uuid")


@dataclass(frozen=True, slots=True)
class Condition:
    """A rule's finding on one GPU at one evaluation: the condition holds, with the evidence."""

    gpu: int
    values: Mapping[str, float]  # the numbers that made it true, e.g. {"mean_utilization": 0.55}
    summary: str  # one sentence a person can act on, e.g. "GPU 1 mean utilization 55% < 80% over 2m"
    # Extra labels, e.g. {"laggard": "true"}; an alert on a MIG device names it by MIG_LABELS.
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Alert:
    """An alert that is pending or firing now."""

    name: str  # the rule name, e.g. "GpuLowUtilization" (Prometheus' alertname)
    gpu: int
    uuid: str
    severity: Severity
    state: AlertState
    hostname: str
    active_since: float  # when the condition first held (pending began)
    firing_since: float | None
    values: Mapping[str, float]
    summary: str
    labels: Mapping[str, str] = field(default_factory=dict)
    # Firing, but its condition no longer holds: it resolves once that has lasted the rule's
    # resolve_after (the summary says how long so far).
    clearing: bool = False
    # The rule whose firing alert on the same GPU (or MIG GPU instance) mutes this one (inhibition.py);
    # "" when none does. A muted alert is listed, not notified, exported or captured.
    inhibited_by: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "alertname": self.name, "gpu": self.gpu, "uuid": self.uuid, "severity": self.severity,
            "state": self.state, "hostname": self.hostname, "active_since": self.active_since,
            "firing_since": self.firing_since, "values": dict(self.values), "summary": self.summary,
            "labels": dict(self.labels), "clearing": self.clearing, "inhibited_by": self.inhibited_by,
        }


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of an alert's state, as written to the event log and pushed to Alertmanager."""

    name: str
    gpu: int
    uuid: str
    severity: Severity
    hostname: str
    previous: TransitionState | None  # None: the alert's first transition (to pending, or firing if for=0)
    state: TransitionState
    at: float  # when the transition happened
    active_since: float  # when the condition first held (the alert's start time)
    values: Mapping[str, float]
    summary: str
    labels: Mapping[str, str] = field(default_factory=dict)
    # To "inhibited": the rule whose firing alert mutes this one; "" otherwise.
    inhibited_by: str = ""
    # The length of the window the rule judges (None for rules without one): with ``active_since``,
    # the samples an alert's evidence comes from.
    window_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "alertname": self.name, "gpu": self.gpu, "uuid": self.uuid, "severity": self.severity,
            "hostname": self.hostname, "from": self.previous, "to": self.state, "at": self.at,
            "started_at": self.active_since, "values": dict(self.values), "summary": self.summary,
            "labels": dict(self.labels),
        }
        if self.inhibited_by:
            out["inhibited_by"] = self.inhibited_by
        return out


class AlertSource(Protocol):
    """The rule engine as its outputs see it (metrics, /api/v1/alerts, Alertmanager resends)."""

    def alerts(self) -> list[Alert]:
        """The alerts pending or firing now (a copy; safe from any thread)."""
        ...

    def transition_counts(self) -> Mapping[tuple[str, TransitionState], int]:
        """(alertname, state) -> transitions into that state since start."""
        ...
