"""Run the report's queries and assemble one row per owner, with the fleet's totals."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from gpuscope.report.client import PrometheusClient, PrometheusError
from gpuscope.report.promql import GPU, Queries

HOUR_S = 3600.0
KWH_J = 3.6e6
COLUMN_METRICS = {  # what each column reads, for the notes on columns without data
    "held": "gpu_process_info",
    "busy": "gpu_process_busy_seconds_total",
    "held_idle": "gpu_process_info, gpu_busy_seconds_total",
    "energy": "gpu_process_energy_joules_total",
    "alerts": "gpuscope_alert_firing",
}
PER_GPU_METRICS = {"busy": "gpu_busy_seconds_total", "energy": "gpu_energy_joules_total"}


class NoData(Exception):
    """Nothing to report in the range."""


@dataclass
class Row:
    owner: dict[str, str]
    held_gpu_hours: float = 0.0
    busy_gpu_hours: float = 0.0
    held_idle_gpu_hours: float = 0.0
    energy_kwh: float = 0.0
    alerts_fired: int = 0

    @property
    def efficiency(self) -> float | None:
        """Busy over held; None when the owner held no GPU (busy time with no held step)."""
        return self.busy_gpu_hours / self.held_gpu_hours if self.held_gpu_hours > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {"owner": self.owner, "held_gpu_hours": self.held_gpu_hours,
                "busy_gpu_hours": self.busy_gpu_hours, "efficiency": self.efficiency,
                "held_idle_gpu_hours": self.held_idle_gpu_hours, "energy_kwh": self.energy_kwh,
                "alerts_fired": self.alerts_fired}


@dataclass
class Report:
    by: str
    owner_labels: tuple[str, ...]
    start: float
    end: float
    step_s: int
    recorded: bool
    rows: list[Row]
    total: Row
    idle_energy_kwh: float | None
    captures_by_node: dict[str, int]
    notes: list[str] = field(default_factory=list)


def series_value(series: dict[str, Any]) -> float:
    """An instant query's number for ``series`` (NaN and infinities read as 0); PrometheusError when it has
    none."""
    try:
        number = float(series["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        raise PrometheusError(f"a series without a number: {str(series)[:200]}") from None
    return number if math.isfinite(number) else 0.0


def _add(row: Row, column: str, value: float) -> None:
    """Add one query's figure (seconds, joules, a count) to ``row``'s column, in the row's units."""
    if column == "held":
        row.held_gpu_hours += value / HOUR_S
    elif column == "busy":
        row.busy_gpu_hours += value / HOUR_S
    elif column == "held_idle":
        row.held_idle_gpu_hours += value / HOUR_S
    elif column == "energy":
        row.energy_kwh += value / KWH_J
    else:
        row.alerts_fired += round(value)


def _attribute_time_sliced(client: PrometheusClient, queries: Queries, end: float,
                           rows: dict[tuple[str, ...], Row]) -> int:
    """By pod or namespace: move the figures of the processes with no pod on a GPU time-sliced between
    pods (several gpu_pod_info series) from the row of no owner to those pods, in equal shares; an
    alert counts for each pod, as each held the GPU. The number of such GPUs with figures moved."""
    labels = queries.owner_labels
    nobody = ("",) * len(labels)
    if queries.by not in ("pod", "namespace") or nobody not in rows:
        return 0
    pods: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for series in client.query(queries.pods_of_gpus(), end):
        metric = series.get("metric", {})
        pods.setdefault(tuple(str(metric.get(label, "")) for label in GPU), []).append(
            tuple(str(metric.get(label, "")) for label in labels))
    shared = {gpu: owners for gpu, owners in pods.items() if len(owners) > 1}
    if not shared:
        return 0
    unowned, moved = rows[nobody], set()
    for column, promql in replace(queries, by_gpu_too=True).columns().items():
        for series in client.query(promql, end):
            metric = series.get("metric", {})
            gpu = tuple(str(metric.get(label, "")) for label in GPU)
            owners = shared.get(gpu)
            if owners is None or tuple(str(metric.get(label, "")) for label in labels) != nobody:
                continue
            value = series_value(series)
            moved.add(gpu)
            # A share per pod (a namespace gets one per pod of it); an alert once per owner.
            for owner in dict.fromkeys(owners) if column == "alerts" else owners:
                row = rows.setdefault(owner, Row(owner=dict(zip(labels, owner, strict=True))))
                _add(row, column, value if column == "alerts" else value / len(owners))
            _add(unowned, column, -value)
    if max(abs(unowned.held_gpu_hours), abs(unowned.busy_gpu_hours), abs(unowned.held_idle_gpu_hours),
           abs(unowned.energy_kwh)) < 1e-9 and unowned.alerts_fired == 0:
        del rows[nobody]  # everything it held was on time-sliced GPUs
    return len(moved)


def build_report(client: PrometheusClient, queries: Queries, start: float, end: float) -> Report:
    """Query ``client`` for the owners' figures between ``start`` and ``end`` (Unix seconds).

    NoData when no GPU process (nor, by node or GPU, any GPU counter) has a sample in the range.
    """
    labels = queries.owner_labels
    rows: dict[tuple[str, ...], Row] = {}
    empty: list[str] = []
    for column, promql in queries.columns().items():
        result = client.query(promql, end)
        if not result:
            empty.append(column)
        for series in result:
            metric = series.get("metric", {})
            key = tuple(str(metric.get(label, "")) for label in labels)
            row = rows.setdefault(key, Row(owner=dict(zip(labels, key, strict=True))))
            _add(row, column, series_value(series))
    if not rows or all(r.held_gpu_hours == 0 and r.busy_gpu_hours == 0 and r.energy_kwh == 0
                       for r in rows.values()):
        raise NoData("no GPU process data in the range: the server has no samples of gpu_process_info "
                     "or the agents' busy and energy counters between these times")
    idle = client.query(queries.idle_energy_joules(), end)
    captures = {str(s.get("metric", {}).get("instance", "")): round(series_value(s))
                for s in client.query(queries.captures(), end)}
    notes = []
    sliced = _attribute_time_sliced(client, queries, end, rows)
    if sliced:
        notes.append(f"{sliced} GPU(s) time-sliced between pods: their processes carry no pod (the "
                     "kubelet does not say which is whose), so their figures are shared evenly among the "
                     "pods the GPU was allocated to in the range; an alert on such a GPU counts for each "
                     "of its pods")
    for column in empty:
        if column == "held_idle":
            continue  # nobody held an idle GPU: a fact, not missing data
        if column == "alerts":
            notes.append("no alert started firing in the range (or alerting is off: gpuscope_alert_firing "
                         "has no samples)")
            continue
        metric = (PER_GPU_METRICS.get(column) if queries.per_gpu else None) or COLUMN_METRICS[column]
        notes.append(f"{column}: {metric} has no samples in the range (agents too old to export it?); "
                     f"the column reads 0")
    notes.append("capture ids are not exported as metrics: the captures are counted per node from "
                 "gpuscope_captures_total{outcome=\"captured\"}; `gpuscope captures ls` on a node lists them")
    ordered = sorted(rows.values(), key=lambda r: (-r.held_idle_gpu_hours, -r.held_gpu_hours,
                                                    tuple(r.owner.values())))
    total = Row(owner={label: "" for label in labels},
                held_gpu_hours=sum(r.held_gpu_hours for r in ordered),
                busy_gpu_hours=sum(r.busy_gpu_hours for r in ordered),
                held_idle_gpu_hours=sum(r.held_idle_gpu_hours for r in ordered),
                energy_kwh=sum(r.energy_kwh for r in ordered),
                alerts_fired=sum(r.alerts_fired for r in ordered))
    return Report(by=queries.by, owner_labels=labels, start=start, end=end, step_s=queries.step_s,
                  recorded=queries.recorded, rows=ordered, total=total,
                  idle_energy_kwh=series_value(idle[0]) / KWH_J if idle else None,
                  captures_by_node=dict(sorted(captures.items())), notes=notes)
