"""The status page's captures: the recent captures with their verdict (coloured by kind) and the
explanation the agent stored, what triggered each one in words a person reads, the alert a capture
was taken for and what became of it (firing now, or resolved and when); and under them, the triggers
refused lately.

Each capture's row is the link target of its id (``#capture-<id>``): the alerts table links the
capture an alert took to it. The traces themselves are downloaded from ``/api/v1/captures/<id>``
where the web configuration authenticates every client, or fetched with ``gpuscope captures get``;
``gpuscope captures explain <id>`` prints the whole diagnosis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuscope.alerts.capture_verdicts import CAPTURE_EARLY_SECONDS
from gpuscope.alerts.model import Alert, Transition
from gpuscope.analysis.findings import HEALTHY, INCONCLUSIVE, UNREADABLE
from gpuscope.capture.alert_context import alert_context
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.capture.record_gains import estimated, gain_text, not_estimated_reason, verdict_finding
from gpuscope.capture.refusals import RefusedTrigger
from gpuscope.common.sizes import format_size
from gpuscope.documents import CAPTURES_PATH
from gpuscope.web.status_format import NONE, clock, duration, escape, section, table

RECENT_CAPTURES = 10  # rows of the captures table
RECENT_REFUSALS = 10  # rows of the refused triggers' table, under it
MAX_TEXT_CHARS = 160  # a capture's error or headline on the page (the JSON listing has it whole)
# Verdicts that make no claim either way: the trace showed too little (grey on the page).
UNSURE_VERDICTS = frozenset({INCONCLUSIVE, UNREADABLE, "partial"})
# Who asked for a capture on demand (Trigger.user): the control API's transports.
_ASKED_OVER = {"unix": "control socket", "token": "control API over TCP"}


def capture_anchor(capture_id: str) -> str:
    """The id of a capture's row: the target of the links to it."""
    return f"capture-{escape(capture_id)}"


def shown_captures(captures: Sequence[CaptureRecord] | None) -> Sequence[CaptureRecord]:
    """The captures the table lists (the newest)."""
    return (captures or ())[:RECENT_CAPTURES]


def captures_section(captures: Sequence[CaptureRecord] | None, refusals: Sequence[RefusedTrigger], *,
                     downloads: bool, now: float, alerts: Sequence[Alert] | None,
                     resolved: Sequence[Transition]) -> str:
    if captures is None:
        return section("Recent captures", '<p class="note muted">Captures are off on this agent '
                                          "(<code>capture.enabled</code>).</p>")
    listing = f'<a href="{CAPTURES_PATH}">all as JSON</a>'
    if not captures:
        return section("Recent captures", f'<p class="note muted">No capture is stored. ({listing})</p>'
                       + _refusals_table(refusals, now), "captures")
    rows = []
    for record in shown_captures(captures):
        capture_id = escape(record.id)
        if downloads:
            capture_id = (f'<a href="{CAPTURES_PATH}/{capture_id}" download="{capture_id}.tar" '
                          f'title="download its traces">{capture_id}</a>')
        else:
            capture_id = f'<span title="gpuscope captures explain {capture_id}">{capture_id}</span>'
        error = ""
        if record.error:
            error = f'<div class="muted small">{escape(_clipped(record.error))}</div>'
        rows.append(
            f'<tr class="capture" id="{capture_anchor(record.id)}"><td class="mono id">{capture_id}</td>'
            f'<td class="num">{NONE if record.gpu is None else record.gpu}</td>'
            f"<td>{trigger_text(record.trigger)}{_alert_fate(record, alerts, resolved)}</td>"
            f'<td><span class="outcome {escape(record.outcome)}">{escape(record.outcome)}</span>{error}</td>'
            f'<td class="when">{clock(record.start)}</td>'
            f'<td class="num">{duration(record.duration_s)}</td>'
            f'<td class="num">{format_size(record.bytes)}</td>'
            f"<td>{finding(record)}</td></tr>")
    note = "" if downloads else (
        '<p class="note muted small">Downloads over HTTP need authentication (<code>basic_auth_users</code> '
        "or required client certificates in the web configuration file); "
        "<code>gpuscope captures get ID</code> fetches a capture over the control API, "
        "<code>gpuscope captures explain ID</code> prints its diagnosis.</p>")
    shown = min(len(captures), RECENT_CAPTURES)
    title = f"Recent captures (newest {shown} of {len(captures)}; {listing})"
    headings = ("ID", "GPU", "Trigger", "Outcome", "Started", "Length", "Size", "Verdict")
    return section(title, table(headings, rows) + note + _refusals_table(refusals, now), "captures")


def trigger_text(trigger: Trigger) -> str:
    """What asked for a capture, as a person says it: "alert GpuLowUtilization", "Alertmanager's
    webhook: GpuLowUtilization", "on demand (control socket)", "fleet capture (control API over TCP)"."""
    if trigger.kind in ("alert", "webhook"):
        name = f"<b>{escape(trigger.alertname or '?')}</b>"
        return f"alert {name}" if trigger.kind == "alert" else f"Alertmanager's webhook: {name}"
    what = "on demand" if trigger.kind == "user" else f"{escape(trigger.kind)} capture"
    if not trigger.user:
        return what
    over = _ASKED_OVER.get(trigger.user)
    return f'{what} <span class="muted">({escape(over or trigger.user)})</span>'


def _alert_fate(record: CaptureRecord, alerts: Sequence[Alert] | None,
                resolved: Sequence[Transition]) -> str:
    """Under an alert's capture: on which GPU the alert was, when it fired, and whether it fires still
    or resolved (and when); nothing for other captures."""
    trigger = record.trigger
    if trigger.kind not in ("alert", "webhook") or not trigger.alertname:
        return ""
    where = f"on GPU {record.gpu}" if record.gpu is not None else "on the node"
    fired = f", fired {clock(trigger.judged_until)}" if trigger.judged_until is not None else ""
    early = record.start + CAPTURE_EARLY_SECONDS
    active = next((a for a in alerts or () if a.name == trigger.alertname and a.gpu == record.gpu
                   and a.active_since <= early), None)
    if active is not None:
        fate = f'<span class="fate firing">{escape(active.state)} now</span>'
    else:
        end = next((t for t in resolved if t.name == trigger.alertname and t.gpu == record.gpu
                    and t.active_since <= early and t.at >= record.start - CAPTURE_EARLY_SECONDS), None)
        fate = (f'<span class="fate resolved">resolved {clock(end.at)}</span>' if end is not None
                else '<span class="fate resolved">no longer active</span>')
    return f'<div class="small muted">{where}{fired}; {fate}</div>'


def finding(record: CaptureRecord) -> str:
    """The capture's verdict, coloured by kind, with the explanation the agent stored (its headline)
    under it, and where the capture was an alert's, whether the verdict accounts for the alert."""
    analysis = record.analysis
    if analysis is None:
        return NONE
    verdict = analysis.get("verdict")
    if not verdict:
        return (f'<span class="verdict unsure" title="{escape(str(analysis.get("skipped") or ""))}">'
                "not analysed</span>")
    kind = verdict_kind(analysis)
    headline = str(analysis.get("headline") or "")
    shown = f'<span class="verdict {kind}">{escape(str(verdict))}</span>'
    if headline:
        shown += f'<div class="small headline" title="{escape(headline)}">{escape(_clipped(headline))}</div>'
    shown += _gain(analysis)
    context = alert_context(record.to_json())
    if context is not None and context.accounts is False:
        shown += (f'<div class="small muted" title="{escape(context.text)}">saw other minutes than the alert '
                  "judged: does not explain it</div>")
    return shown


def _gain(analysis: dict[str, Any]) -> str:
    """Under the headline, what fixing the verdict's finding would buy: "fixing it: 72.0 -> 54.4 ms a
    step (25% less)", the assumptions on hover; "fixing it: not estimated", the reason on hover. Nothing
    for a verdict without a finding, or a record analysed before gains were estimated."""
    finding = verdict_finding(analysis)
    gain = finding.get("gain") if finding is not None else None
    reason = not_estimated_reason(gain)
    if reason is not None:
        return (f'<div class="small muted gain" title="{escape(reason)}">fixing it: '
                "not estimated</div>")
    if estimated(gain) is None:
        return ""
    brief, whole = gain_text(gain, assumptions=False) or "", gain_text(gain) or ""
    return f'<div class="small gain" title="{escape(whole)}">fixing it: {escape(brief)}</div>'


def verdict_kind(analysis: dict[str, Any]) -> str:
    """healthy (green), high or moderate (a finding: red or amber, by the top finding's severity), or
    unsure (grey: the trace showed too little, or could not be read)."""
    verdict = analysis.get("verdict")
    if verdict == HEALTHY:
        return "healthy"
    if verdict in UNSURE_VERDICTS:
        return "unsure"
    findings = analysis.get("findings") or ()
    top = next((f for f in findings if isinstance(f, dict) and f.get("kind") == verdict), None)
    return "high" if top is not None and top.get("severity") == "high" else "moderate"


def _refusals_table(refusals: Sequence[RefusedTrigger], now: float) -> str:
    """The capture triggers refused lately: when, the GPU, the trigger, the reason (the agent's message
    under it) and when a trigger like it is allowed again. Nothing when none was refused."""
    if not refusals:
        return ""
    rows = []
    for refused in refusals[:RECENT_REFUSALS]:
        rows.append(
            f'<tr class="refusal"><td class="when">{clock(refused.at)}</td>'
            f'<td class="num">{NONE if refused.gpu is None else refused.gpu}</td>'
            f"<td>{trigger_text(refused.trigger)}</td>"
            f'<td><span class="outcome refused">{escape(refused.reason)}</span>'
            f'<div class="muted small">{escape(_clipped(refused.message))}</div></td>'
            f'<td class="nowrap">{_next_allowed(refused, now)}</td></tr>')
    shown = min(len(refusals), RECENT_REFUSALS)
    title = (f'<h3 class="refusals">Refused triggers (newest {shown} of {len(refusals)} kept; '
             f'<a href="{CAPTURES_PATH}?include_refused=1">all as JSON</a>)</h3>\n')
    return title + table(("Refused", "GPU", "Trigger", "Reason", "Next allowed"), rows)


def _next_allowed(refused: RefusedTrigger, now: float) -> str:
    """When a trigger like the refused one may capture: "next alert capture allowed in 12 min 5 s"."""
    wait = refused.allowed_in(now)
    if wait is None:
        return NONE
    what = "alert capture" if refused.trigger.kind in ("alert", "webhook") else "capture"
    return f"next {what} allowed now" if wait == 0 else f"next {what} allowed in {duration(wait)}"


def _clipped(text: str) -> str:
    return text[:MAX_TEXT_CHARS] + ("…" if len(text) > MAX_TEXT_CHARS else "")
