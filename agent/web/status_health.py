"""A GPU's health as the status page shows it: the worst of what its readings say (row remapping, a
GPU that cannot be read: ``GpuReading.health``) and of the hardware alerts on it (the hardware-health
rules and Xid errors), with the reasons.

A GPU whose health is critical never shows a green "up": its state badge takes the colour of its
health. A MIG device has its GPU's health (NVML reads health per physical GPU).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from gpuscope.alerts.model import Alert
from gpuscope.alerts.rules import HARDWARE_RULES
from gpuscope.snapshot import GpuReading

Level = Literal["ok", "warning", "critical"]
# The alerts that speak of the GPU's hardware, not of how it is used.
HEALTH_ALERTS = frozenset({*HARDWARE_RULES, "GpuXidError"})
# A reading's health other than "ok": its badge's text, its level, and what the operator does (tooltip).
READING_HEALTH: dict[str, tuple[str, Level, str]] = {
    "reset_required": ("reset required", "warning",
                       "a remapped memory row waits for a GPU reset: drain the GPU, then reset it"),
    "replace": ("replace", "critical", "a memory row could not be remapped: drain the GPU and replace it"),
    "lost": ("lost", "critical", "the GPU cannot be read"),
}
_RANK: dict[Level, int] = {"ok": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True, slots=True)
class GpuHealth:
    level: Level
    state: str  # the reading's health: ok, reset_required, replace, lost
    reasons: tuple[str, ...]  # the reading's reasons, then "<alert>: <summary>" per health alert
    alerts: tuple[Alert, ...]  # the health alerts on the GPU, pending or firing, not muted


def gpu_health(gpu: GpuReading, alerts: Iterable[Alert]) -> GpuHealth:
    """The GPU's health from its reading and the health alerts among ``alerts`` (those on the GPU)."""
    state = gpu.health
    level: Level = READING_HEALTH[state][1] if state in READING_HEALTH else "ok"
    found = tuple(sorted((a for a in alerts if a.name in HEALTH_ALERTS and not a.inhibited_by),
                         key=lambda a: (a.severity != "critical", a.name)))
    for alert in found:
        # A firing alert counts at its severity; a pending one (not yet sure) as a warning at most.
        seen: Level = "critical" if alert.severity == "critical" and alert.state == "firing" else "warning"
        if alert.severity == "info":
            seen = "ok"
        if _RANK[seen] > _RANK[level]:
            level = seen
    reasons = gpu.health_reasons + tuple(f"{a.name} ({a.state}): {a.summary}" for a in found)
    return GpuHealth(level, state, reasons, found)


def state_badge(gpu: GpuReading, health: GpuHealth) -> str:
    """The State column: "up" (green only while the GPU's health is ok) or "down"."""
    if not gpu.up:
        return '<span class="badge down">down</span>'
    if health.level == "ok":
        return '<span class="badge up">up</span>'
    return (f'<span class="badge up {health.level}" title="up, but its health is {health.level}: see the '
            f'Health column">up</span>')


def health_cell(health: GpuHealth, *, of_gpu: int | None = None) -> str:
    """The Health column: a badge for the worst state, then the alerts' names (their summaries as a
    tooltip). ``of_gpu``: a MIG device's row, which shows its GPU's health."""
    badge = ""
    level: Level = "ok"
    if health.state in READING_HEALTH:
        text, level, meaning = READING_HEALTH[health.state]
        badge = f'<span class="badge health {health.state}" title="{_e(meaning)}">{text}</span>'
    if health.level != level:  # the alerts on it say worse than its readings
        badge += (f'{" " if badge else ""}<span class="badge health {health.level}" '
                  f'title="{_e(_reasons_text(health.reasons))}">{health.level}</span>')
    if not badge:
        badge = '<span class="badge health ok" title="no hardware problem seen">ok</span>'
    names = _alert_names(health.alerts)
    if of_gpu is not None:
        return (f'<span class="small muted" title="MIG devices share their GPU\'s health">as GPU {of_gpu}:'
                f"</span> {badge}{names}")
    return badge + names


def _alert_names(alerts: Sequence[Alert]) -> str:
    if not alerts:
        return ""
    named = ", ".join(f'<span title="{_e(a.summary)}">{_e(a.name)}</span>' for a in alerts)
    return f'<div class="small health-reasons">{named}</div>'


def _reasons_text(reasons: Sequence[str]) -> str:
    return "; ".join(reasons)


def _e(text: str) -> str:
    return html.escape(text, quote=True)
