"""How `gpuscope report --by cause` prints: a table, one JSON document, or CSV rows."""

from __future__ import annotations

import csv
import io
from datetime import datetime, timezone
from typing import Any

from gpuscope.common.durations import format_duration
from gpuscope.report.cause_build import CauseReport, CauseRow, span


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hours(value: float | None, decimals: int = 1) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def _decimals(report: CauseReport) -> int:
    """Tenths of a GPU-hour, or thousandths in a report of less than one (a short range)."""
    return 1 if report.held_gpu_hours >= 1 else 3


def _owner(owner: dict[str, str]) -> str:
    return "/".join(owner.values()) if any(owner.values()) else "(none)"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 3600 else f"{seconds / 3600:.1f}h"


def _ages(row: CauseRow) -> str:
    if row.newest_diagnosis_s is None or row.oldest_diagnosis_s is None:
        return "-"
    return f"{_age(row.newest_diagnosis_s)}-{_age(row.oldest_diagnosis_s)}"


def _diagnosed_share(report: CauseReport) -> float | None:
    held = report.held_gpu_hours
    return None if held <= 0 else max(0.0, 1 - report.not_diagnosed_gpu_hours / held)


def cause_as_json(report: CauseReport) -> dict[str, Any]:
    return {
        "start": _iso(report.start), "end": _iso(report.end), "step_seconds": report.step_s,
        "horizon_seconds": report.horizon_s, "by": ["cause", *([report.owner] if report.owner else [])],
        "owner_labels": list(report.owner_labels), "recorded": report.recorded,
        "rows": [row.as_dict() for row in report.rows],
        "total": {"held_gpu_hours": report.held_gpu_hours,
                  "not_diagnosed_gpu_hours": report.not_diagnosed_gpu_hours,
                  "diagnosed_share": _diagnosed_share(report),
                  "gain_together_gpu_hours": report.gain_together_gpu_hours,
                  "by_owner": [total.as_dict() for total in report.totals] if report.owner else []},
        "notes": report.notes,
    }


_FIGURES = ("held_gpu_hours", "busy_gpu_hours", "attributed_gpu_hours", "gain_gpu_hours",
            "newest_diagnosis_age_seconds", "oldest_diagnosis_age_seconds")


def cause_as_csv(report: CauseReport) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["cause", *report.owner_labels, *_FIGURES])
    for row in report.rows:
        figures = row.as_dict()
        writer.writerow([row.cause, *row.owner.values(),
                         *("" if figures[name] is None else f"{figures[name]:.6g}" for name in _FIGURES)])
    return out.getvalue()


def cause_as_table(report: CauseReport) -> str:
    head = ["cause", *report.owner_labels, "HELD GPU-h", "BUSY GPU-h", "ATTRIBUTED GPU-h",
            "COULD WIN BACK GPU-h", "DIAGNOSIS AGE"]
    decimals = _decimals(report)
    lines = [[row.cause, *(value or "(none)" for value in row.owner.values()),
              *(_hours(value, decimals) for value in (row.held_gpu_hours, row.busy_gpu_hours,
                                                      row.attributed_gpu_hours, row.gain_gpu_hours)),
              _ages(row)] for row in report.rows]
    widths = [max(len(line[i]) for line in [head, *lines]) for i in range(len(head))]
    left = 1 + len(report.owner_labels)

    def render(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left or i == len(cells) - 1 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    by = "cause" + (f" and {report.owner}" if report.owner else "")
    text = [f"GPU-hours by {by}, {_iso(report.start)} to {_iso(report.end)} (step "
            f"{format_duration(report.step_s)}, horizon {span(report.horizon_s)}"
            f"{', recording rules' if report.recorded else ''})",
            render(head), *(render(line) for line in lines), ""]
    share = _diagnosed_share(report)
    text.append(f"Held: {_hours(report.held_gpu_hours, decimals)} GPU-h, "
                + ("none" if share is None else f"{share:.0%}") + " of it diagnosed within the horizon")
    together = report.gain_together_gpu_hours
    line = f"Could be won back (all fixes together): {_hours(together, decimals)} GPU-h"
    if report.owner and together is not None:
        line += " (" + ", ".join(f"{_owner(t.owner)} {_hours(t.gain_together_gpu_hours, decimals)}"
                                 for t in report.totals if t.gain_together_gpu_hours is not None) + ")"
    text.append(line if together is not None else line + " (no fix estimated in the range)")
    text += [f"Note: {note}" for note in report.notes]
    return "\n".join(text) + "\n"
