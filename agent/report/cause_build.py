"""Run the queries of a report by cause and assemble one row per cause (and owner), with the totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuscope.report.build import HOUR_S, NoData, series_value
from gpuscope.report.cause_promql import CAUSE, NOT_DIAGNOSED, CauseQueries, is_cause_name
from gpuscope.report.client import PrometheusClient

# Rows without a finding's share: the verdicts of a diagnosis without findings, then no diagnosis.
VERDICT_ORDER = ("healthy", "inconclusive", "unreadable", NOT_DIAGNOSED)


@dataclass
class CauseRow:
    cause: str
    owner: dict[str, str]
    held_gpu_hours: float = 0.0
    busy_gpu_hours: float = 0.0
    attributed_gpu_hours: float | None = None  # None: no finding share (a verdict, or not diagnosed)
    gain_gpu_hours: float | None = None  # None: no fix estimated
    oldest_diagnosis_s: float | None = None  # ages of the captures behind the row, at the steps used
    newest_diagnosis_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "owner": self.owner, "held_gpu_hours": self.held_gpu_hours,
                "busy_gpu_hours": self.busy_gpu_hours, "attributed_gpu_hours": self.attributed_gpu_hours,
                "gain_gpu_hours": self.gain_gpu_hours,
                "oldest_diagnosis_age_seconds": self.oldest_diagnosis_s,
                "newest_diagnosis_age_seconds": self.newest_diagnosis_s}


@dataclass
class OwnerTotal:
    owner: dict[str, str]
    held_gpu_hours: float = 0.0
    gain_together_gpu_hours: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"owner": self.owner, "held_gpu_hours": self.held_gpu_hours,
                "gain_together_gpu_hours": self.gain_together_gpu_hours}


@dataclass
class CauseReport:
    owner: str | None
    owner_labels: tuple[str, ...]
    start: float
    end: float
    step_s: int
    horizon_s: int
    recorded: bool
    rows: list[CauseRow]
    totals: list[OwnerTotal]  # per owner; one with an empty owner by cause alone
    notes: list[str] = field(default_factory=list)

    @property
    def held_gpu_hours(self) -> float:
        return sum(t.held_gpu_hours for t in self.totals)

    @property
    def not_diagnosed_gpu_hours(self) -> float:
        return sum(r.held_gpu_hours for r in self.rows if r.cause == NOT_DIAGNOSED)

    @property
    def gain_together_gpu_hours(self) -> float | None:
        gains = [t.gain_together_gpu_hours for t in self.totals if t.gain_together_gpu_hours is not None]
        return sum(gains) if gains else None


def span(seconds: int) -> str:
    """24h, 36h, 7d, 90m: a horizon as --horizon spells it."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0 and (unit != "d" or seconds >= 2 * size):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _order(row: CauseRow) -> tuple[Any, ...]:
    """Findings first, the most attributed GPU-hours first; then the verdicts, then not diagnosed."""
    rank = VERDICT_ORDER.index(row.cause) + 1 if row.cause in VERDICT_ORDER else 0
    return (tuple(row.owner.values()), rank, -(row.attributed_gpu_hours or 0.0), -row.held_gpu_hours,
            row.cause)


def build_cause_report(client: PrometheusClient, queries: CauseQueries, start: float,
                       end: float) -> CauseReport:
    """Query ``client`` for the GPU-hours per cause between ``start`` and ``end`` (Unix seconds).

    NoData when no GPU was held in the range; a range without any diagnosis is a report whose every
    held GPU-hour is "not diagnosed", with a note saying why.
    """
    labels = queries.owner_labels
    causes: list[str] = []
    if queries.by_owner:
        seen = {str(s.get("metric", {}).get(CAUSE, "")) for s in client.query(queries.causes_seen(), end)}
        causes = [*sorted(c for c in seen if is_cause_name(c) and c != NOT_DIAGNOSED), NOT_DIAGNOSED]
    rows: dict[tuple[str, ...], CauseRow] = {}

    def row_of(series: dict[str, Any]) -> CauseRow:
        metric = series.get("metric", {})
        key = (str(metric.get(CAUSE, "")), *(str(metric.get(label, "")) for label in labels))
        return rows.setdefault(key, CauseRow(cause=key[0], owner=dict(zip(labels, key[1:], strict=True))))

    for column in ("held", "busy", "attributed", "gain"):
        wanted = [c for c in causes if column in ("held", "busy") or c != NOT_DIAGNOSED]
        promql = queries.column(column, wanted)
        for series in client.query(promql, end) if promql else ():
            row, hours = row_of(series), series_value(series) / HOUR_S
            if column == "held":
                row.held_gpu_hours += hours
            elif column == "busy":
                row.busy_gpu_hours += hours
            elif column == "attributed":
                row.attributed_gpu_hours = (row.attributed_gpu_hours or 0.0) + hours
            else:
                row.gain_gpu_hours = (row.gain_gpu_hours or 0.0) + hours
    for oldest in (True, False):
        promql = queries.ages(oldest, [c for c in causes if c != NOT_DIAGNOSED])
        for series in client.query(promql, end) if promql else ():
            row = row_of(series)
            if oldest:
                row.oldest_diagnosis_s = series_value(series)
            else:
                row.newest_diagnosis_s = series_value(series)
    totals: dict[tuple[str, ...], OwnerTotal] = {}
    for name, promql in (("held", queries.held_total()), ("together", queries.together())):
        for series in client.query(promql, end):
            metric = series.get("metric", {})
            key = tuple(str(metric.get(label, "")) for label in labels)
            total = totals.setdefault(key, OwnerTotal(owner=dict(zip(labels, key, strict=True))))
            if name == "held":
                total.held_gpu_hours += series_value(series) / HOUR_S
            else:
                total.gain_together_gpu_hours = series_value(series) / HOUR_S
    # A row seen only in a column that is not held (an age without held time) says nothing.
    kept = [row for row in rows.values() if row.held_gpu_hours > 0]
    if not kept and not any(t.held_gpu_hours > 0 for t in totals.values()):
        raise NoData("no GPU was held in the range: the server has no samples of gpu_process_info "
                     "between these times")
    notes = []
    diagnosed_anywhere = client.query(queries.any_diagnosis(), end)
    if not diagnosed_anywhere or series_value(diagnosed_anywhere[0]) == 0:
        notes.append("no agent exported a diagnosis in the range (gpuscope_diagnosis_timestamp_seconds has "
                      "no samples): every held GPU-hour is \"not diagnosed\". Diagnoses come from analysed "
                      "captures (docs/capture.md)")
    notes.append(f"a GPU counts under a cause only while its latest diagnosis started within the horizon "
                 f"({span(queries.horizon_s)}) before the step; otherwise it counts as \"not diagnosed\"")
    notes.append("causes overlap: one step can wait on input and on a sync both, so a GPU-hour counts "
                 "under every finding of its diagnosis (and a healthy diagnosis may carry low findings);"
                 " rows do not add up to the held total, and the fixes' gains do not add up to what all "
                 "fixes together would win back")
    return CauseReport(owner=queries.owner, owner_labels=labels, start=start, end=end,
                       step_s=60 if queries.recorded else queries.step_s, horizon_s=queries.horizon_s,
                       recorded=queries.recorded, rows=sorted(kept, key=_order),
                       totals=sorted(totals.values(), key=lambda t: tuple(t.owner.values())), notes=notes)
