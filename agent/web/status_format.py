"""The status page's small pieces of HTML and text, shared by its sections (status_page.py,
status_captures.py): escaping, sections and tables, durations and clock times."""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable

NONE = '<span class="muted">&mdash;</span>'  # a cell with nothing to show


def section(title: str, body: str, anchor: str = "") -> str:
    ident = f' id="{anchor}"' if anchor else ""
    return f"<section{ident}><h2>{title}</h2>\n{body}\n</section>\n"


def table(headings: Iterable[str], rows: Iterable[str]) -> str:
    head = "".join(f"<th>{h}</th>" for h in headings)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"


def duration(seconds: float) -> str:
    """A short human duration: 400 ms, 12 s, 3 min 5 s, 2 h 10 min."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 or seconds == int(seconds) else f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def clock(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp)) if math.isfinite(timestamp) else "?"


def escape(text: str) -> str:
    return html.escape(text, quote=True)
