"""The alert rules: small pure objects over the node's history (docs/alerts.md explains each one).

A rule answers one question each tick: on which GPUs does my condition hold now? It returns a
``Condition`` (the evidence) per such GPU and carries no timers: the engine's state machine owns
``for`` and ``clear_for``. ``active`` (the GPUs where the rule is pending or firing) lets a rule
apply hysteresis: it starts on the threshold and stops only past threshold +/- hysteresis, so a
value hovering at the threshold does not flap. Labels are constant per rule (they are part of an
alert's identity downstream); the details that change go to ``values`` and ``summary``.

Windows that the history covers for less than 80 % are not judged (the agent's first seconds),
and a GPU counts as running a job over a window only when it had a compute process during at
least 80 % of it (so a job's first minutes, or the minutes after it ended, are not "low").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from gpuscope.alerts.history import MIN_COVERAGE, NodeHistory, Window
from gpuscope.alerts.model import Condition, Severity
from gpuscope.common.durations import format_duration

BUSY_FRACTION = 0.8  # a window "has a job" when a compute process ran during this much of it
_LAGGARD = {"laggard": "true"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """Base of every rule. ``window_seconds`` is None for rules that read only the latest tick."""

    name: ClassVar[str]
    include_down: ClassVar[bool] = False  # evaluated on GPUs that are down this tick (Xid only)

    severity: Severity = "warning"
    for_seconds: float = 0.0
    clear_for_seconds: float = 0.0
    window_seconds: float | None = None

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        raise NotImplementedError

    def _windows(self, history: NodeHistory) -> Iterable[tuple[int, Window]]:
        """(gpu, window) for the GPUs up now whose window is covered by history."""
        assert self.window_seconds is not None
        for gpu in sorted(history.up):
            window = history.window(gpu, self.window_seconds)
            if window is not None:
                yield gpu, window

    def _busy_means(self, history: NodeHistory) -> Iterable[tuple[int, Window, float]]:
        """(gpu, window, mean utilization) for the GPUs that ran a job throughout the window."""
        for gpu, window in self._windows(history):
            fraction, mean = window.busy_utilization()
            if mean is not None and fraction >= BUSY_FRACTION:
                yield gpu, window, mean

    @property
    def _over(self) -> str:
        return format_duration(self.window_seconds or 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class LowUtilization(Rule):
    name: ClassVar[str] = "GpuLowUtilization"
    threshold: float = 0.80
    hysteresis: float = 0.05

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu, _, mean in self._busy_means(history):
            limit = self.threshold + (self.hysteresis if gpu in active else 0.0)
            if mean < limit:
                out[gpu] = Condition(
                    gpu, {"mean_utilization": mean, "threshold": self.threshold},
                    f"GPU {gpu} runs a job but its mean utilization is {mean:.1%} "
                    f"(< {self.threshold:.0%}) over {self._over}")
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedByProcesses(Rule):
    name: ClassVar[str] = "GpuSharedByProcesses"
    max_processes: int = 1
    allow: frozenset[str] = frozenset({"nvidia-cuda-mps-server", "nvidia-cuda-mps-control"})

    def allowed(self, name: str | None) -> bool:
        """In the allow-list; a 15-character name also matches as Linux's truncated comm name."""
        if name is None:
            return False
        return name in self.allow or (len(name) == 15 and any(a.startswith(name) for a in self.allow))

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu in sorted(history.up):
            point = history.latest(gpu)
            if point is None or len(point.compute_processes) <= self.max_processes:
                continue
            names = [n for n in point.compute_processes if not self.allowed(n)]
            if len(names) > self.max_processes:
                shown = ", ".join(sorted(n or "?" for n in names))
                out[gpu] = Condition(
                    gpu, {"compute_processes": float(len(names)), "max_processes": float(self.max_processes)},
                    f"GPU {gpu} is shared by {len(names)} compute processes ({shown})")
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class FrequentIdleDips(Rule):
    name: ClassVar[str] = "GpuFrequentIdleDips"
    max_per_minute: float = 6.0
    hysteresis: float = 1.0  # dips per minute
    min_utilization: float = 0.30  # "mostly busy": the job is working, not idle

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu, window, mean in self._busy_means(history):
            counted = window.idle_dips()
            if mean < self.min_utilization or counted is None or counted[1] <= 0:
                continue
            dips, seconds = counted
            rate = dips / seconds * 60.0
            limit = self.max_per_minute - (self.hysteresis if gpu in active else 0.0)
            if rate > limit:
                out[gpu] = Condition(
                    gpu, {"dips_per_minute": rate, "mean_utilization": mean,
                          "max_per_minute": self.max_per_minute},
                    f"GPU {gpu} dips to idle {rate:.0f} times a minute (> {self.max_per_minute:g}) at "
                    f"{mean:.0%} mean utilization over {self._over}: the job waits for its input")
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilizationSkew(Rule):
    name: ClassVar[str] = "GpuUtilizationSkew"
    max_spread: float = 0.20
    hysteresis: float = 0.05
    min_gpus: int = 2

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        means = {gpu: mean for gpu, _, mean in self._busy_means(history)}
        if len(means) < self.min_gpus:
            return {}
        leader = max(means, key=lambda g: (means[g], -g))
        top = means[leader]
        spread = top - min(means.values())
        out = {}
        for gpu, mean in means.items():
            gap = top - mean
            limit = self.max_spread - (self.hysteresis if gpu in active else 0.0)
            if gpu != leader and gap > limit:
                out[gpu] = Condition(
                    gpu, {"mean_utilization": mean, "leader_gpu": float(leader), "leader_utilization": top,
                          "gap": gap, "spread": spread, "max_spread": self.max_spread},
                    f"GPU {gpu} lags its peers: {mean:.1%} mean utilization against {top:.1%} on GPU "
                    f"{leader} over {self._over} (gap {gap:.1%} > {self.max_spread:.0%})",
                    _LAGGARD)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class BusyButStalled(Rule):
    name: ClassVar[str] = "GpuBusyButStalled"
    min_utilization: float = 0.80
    max_sm_active: float = 0.30
    hysteresis: float = 0.05

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu, window in self._windows(history):
            fraction, util, sm = window.sm_activity()
            if util is None or sm is None or fraction < MIN_COVERAGE:
                continue  # no GPM here (pre-Hopper, MIG) or not for most of the window
            slack = self.hysteresis if gpu in active else 0.0
            if util >= self.min_utilization - slack and sm < self.max_sm_active + slack:
                out[gpu] = Condition(
                    gpu, {"mean_utilization": util, "mean_sm_active": sm,
                          "min_utilization": self.min_utilization, "max_sm_active": self.max_sm_active},
                    f"GPU {gpu} is {util:.1%} busy but its SMs are only {sm:.1%} active over "
                    f"{self._over}: kernels wait (host syncs, tiny launches)")
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Throttled(Rule):
    name: ClassVar[str] = "GpuThrottled"
    min_fraction: float = 0.5
    hysteresis: float = 0.1
    reasons: frozenset[str] = frozenset({"sw_power_cap", "hw_power_brake_slowdown", "hw_slowdown",
                                         "sw_thermal_slowdown", "hw_thermal_slowdown"})

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu, window in self._windows(history):
            known, throttled = window.clock_events(self.reasons)
            if not throttled or known < MIN_COVERAGE * window.n:
                continue
            fraction = throttled / known
            if fraction >= self.min_fraction - (self.hysteresis if gpu in active else 0.0):
                seen: set[str] = set()
                for p in window.points:
                    if p.clock_event_reasons:
                        seen |= p.clock_event_reasons & self.reasons
                names = ",".join(sorted(seen))
                out[gpu] = Condition(
                    gpu, {"throttled_fraction": fraction, "min_fraction": self.min_fraction},
                    f"GPU {gpu} clocks were held down ({names}) {fraction:.0%} of the last {self._over}")
        return out


# Xid codes people ask about; the summary names them (NVIDIA's Xid catalogue has the full list).
XID_MEANINGS = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt", 63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class XidError(Rule):
    name: ClassVar[str] = "GpuXidError"
    include_down: ClassVar[bool] = True  # Xid 79 and friends arrive as the GPU goes down
    benign: frozenset[int] = frozenset({13, 31, 43, 45})

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        assert self.window_seconds is not None
        out = {}
        for gpu in sorted(history.present):
            latest = history.latest(gpu)
            if latest is None or not latest.xid_errors:
                continue  # the common case: no Xid since the agent started
            window = history.window(gpu, self.window_seconds, min_coverage=0.0)
            if window is None:
                continue
            new = {code: n for code, n in window.new_xids().items() if code not in self.benign}
            if new:
                codes = sorted(new)
                described = ", ".join(f"{c} ({XID_MEANINGS[c]})" if c in XID_MEANINGS else str(c)
                                      for c in codes)
                out[gpu] = Condition(
                    gpu, {f"xid_{c}": float(new[c]) for c in codes},
                    f"GPU {gpu} reported Xid {described} in the last {self._over}")
        return out


RULE_TYPES: dict[str, type[Rule]] = {r.name: r for r in (
    LowUtilization, SharedByProcesses, FrequentIdleDips, UtilizationSkew, BusyButStalled, Throttled,
    XidError)}
