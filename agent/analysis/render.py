"""A Diagnosis as people read it: the verdict first, then each finding with its evidence table, what the
device was busy with, and the checklist as measured.

A finding is named by its kind everywhere (``input_bound``, ``host_sync`` ...): in this report, in
``--json``, in ``captures ls``, on the status page, in metrics and in alert annotations.
"""

from __future__ import annotations

import textwrap
from typing import Any

from gpuscope.analysis.diagnose import Diagnosis, Finding
from gpuscope.analysis.findings import HEALTHY, INCONCLUSIVE, UNREADABLE, Check, verdict_of
from gpuscope.analysis.gains import Gains
from gpuscope.analysis.ranks import RanksReport

WIDTH = 100
MAX_OPS_SHOWN = 5
DETAIL_WIDTH = 90
HEALTHY_TEXT = "no finding over its threshold"
VERDICT_TEXT = {HEALTHY: HEALTHY_TEXT,
                INCONCLUSIVE: "no finding over its threshold, but the trace shows too little to call it "
                              "healthy: see the notes",
                UNREADABLE: "nothing in the trace could be diagnosed: see the note"}
CLASS_NAMES = {"tensor_core": "tensor cores", "fp32_matmul": "fp32 matmul/conv",
               "convolution": "convolutions", "other_matmul": "other matmul", "softmax": "softmax",
               "elementwise": "elementwise", "reduction": "reductions/norms", "layout": "layout conversions",
               "collective": "collectives", "memcpy": "memcpy", "memset": "memset", "other": "unclassified"}


def format_diagnosis(diagnosis: Diagnosis, gains: Gains | None = None) -> str:
    """The report of one diagnosis; with ``gains``, what fixing each finding would buy."""
    d = diagnosis
    verdict = d.verdict
    said = f" ({VERDICT_TEXT[verdict]})" if verdict in VERDICT_TEXT else ""
    lines = [f"{d.source}", f"  verdict: {verdict}{said}"]
    framework = d.framework or "unknown framework"
    where = "with device activity" if d.device else "host only"
    marker = f" from {d.step_marker!r}" if d.step_marker else ""
    lines.append(f"  {d.format} trace, {framework}, {where}; {d.steps} step(s) ({d.step_method}{marker}), "
                 f"mean {d.mean_step_ms:.1f} ms; {d.events} events")
    if d.breakdown:
        parts = ", ".join(f"{name.replace('_', ' ')} {share * 100:.0f}%"
                          for name, share in d.breakdown.items())
        lines.append(f"  step time: {parts}")
    if d.device_profile:
        lines.extend(_profile(d.device_profile, d.steps))
    for finding in d.findings:
        lines.append("")
        lines.extend(_finding(finding))
        if gains is not None:
            lines.extend(textwrap.wrap(f"fixing it: {gains.of(finding).text()}", WIDTH,
                                       initial_indent="    ", subsequent_indent="      "))
    if gains is not None and gains.together is not None:
        lines.append("")
        lines.extend(textwrap.wrap(f"fixing all of them: {gains.together.text()}", WIDTH,
                                   initial_indent="  ", subsequent_indent="    "))
    if d.checks:
        lines.append("")
        lines.extend(textwrap.wrap("checked: " + "; ".join(_check(c) for c in d.checks), WIDTH,
                                   initial_indent="  ", subsequent_indent="    "))
    for limit in d.limits:
        lines.extend(textwrap.wrap(limit, WIDTH, initial_indent="  note: ", subsequent_indent="        "))
    return "\n".join(lines)


def _profile(profile: dict[str, Any], steps: int) -> list[str]:
    classes = ", ".join(f"{CLASS_NAMES.get(name, name)} {share * 100:.0f}%"
                        for name, share in profile["classes"].items()
                        if share >= 0.005 and not (name == "other" and "unmatched" in profile))
    per_step = profile["device_ms"] / max(steps, 1)
    lines = [f"  device time: {per_step:.1f} ms per step; {classes}"
             + (f"; optimizer {profile['optimizer'] * 100:.0f}%" if profile.get("optimizer") else "")]
    unmatched = profile.get("unmatched") or 0.0
    if unmatched >= 0.005:
        named = profile.get("unmatched_kernels") or []
        kernels = ", ".join(f"{k['name']} {k['share'] * 100:.0f}%" for k in named)
        text = f"unclassified {unmatched * 100:.0f}%" + (f": {kernels}" if kernels else "")
        lines.extend(textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="    "))
    ops = profile.get("ops") or []
    if ops:
        lines.append("  device time by operation:")
        width = min(max(len(op["name"]) for op in ops[:MAX_OPS_SHOWN]), 60)
        for op in ops[:MAX_OPS_SHOWN]:
            name = _clip(op["name"], width)
            lines.append(f"    {name:<{width}}  {op['share'] * 100:>4.0f}%  {op['kernels']:>6}  "
                         f"{CLASS_NAMES.get(op['kernel_class'], op['kernel_class'])}")
    return lines


def _finding(f: Finding) -> list[str]:
    lines = [f"  [{f.severity}] {f.kind}: {f.summary}"]
    if f.evidence:
        last = "CALL SITE" if any(e.site for e in f.evidence) or not any(e.detail for e in f.evidence) \
            else "DETAIL"
        rows = [("", "COUNT", "TIME (ms)", last)] + [
            (e.name, str(e.count), f"{e.time_ms:.1f}", _clip(e.site or e.detail or "-", DETAIL_WIDTH))
            for e in f.evidence]
        name_width = min(max(len(r[0]) for r in rows), 60)
        for name, count, time, site in rows:
            lines.append(f"    {_clip(name, name_width):<{name_width}}  {count:>6}  {time:>10}  "
                         f"{site}".rstrip())
    lines.extend(textwrap.wrap(f"fix: {f.remedy}", WIDTH, initial_indent="    ", subsequent_indent="      "))
    return lines


def _check(check: Check) -> str:
    sign = "<" if check.passed else ">="
    if check.unit == "per_step":
        text = f"{check.kind} {check.value:.1f}/step ({sign}{check.threshold:g})"
    else:
        text = f"{check.kind} {check.value * 100:.0f}% ({sign}{check.threshold * 100:.0f}%)"
    return f"{text}, {check.note}" if check.note else text


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def top_finding(diagnoses: list[Diagnosis]) -> str:
    """The verdict of several traces (a capture of several processes): the most severe finding's kind
    that holds a step back; without one, ``healthy`` only when every trace showed enough to say so
    (``unreadable`` when none was read, ``inconclusive`` otherwise)."""
    found = verdict_of([f for d in diagnoses for f in d.findings])
    if found != HEALTHY:
        return found
    verdicts = {d.verdict for d in diagnoses}
    if verdicts == {UNREADABLE}:
        return UNREADABLE
    return INCONCLUSIVE if verdicts & {INCONCLUSIVE, UNREADABLE} else HEALTHY


def format_ranks(report: RanksReport) -> str:
    """The ranks of one job side by side: the job's verdict (its slowest rank's), which rank the others
    wait for, and per rank its time a step."""
    rows = report.rows
    told = (f"world size {report.world_size}, from distributedInfo" if report.world_size is not None
            else "numbered by their file names")
    waited = ": the others wait for it" if report.waiting else ""
    lines = [f"Ranks of one job: {len(rows)} traces ({told})",
             f"  verdict: {report.verdict} (that of rank {report.slowest}, the slowest{waited})"]
    lines.extend(textwrap.wrap(report.headline(), WIDTH, initial_indent="  ", subsequent_indent="    "))
    table = [("RANK", "STEP (ms)", "COMPUTE", "COMM", "IDLE", "PEER WAIT", "HOST BLOCKED", "", "VERDICT",
              "TRACE")]
    for row in rows:
        s = row.summary
        role = "slowest" if row.rank == report.slowest else "waits" if row.waits else ""
        table.append((str(row.rank), f"{s.step_ms:.1f}", f"{s.compute_ms:.1f}", f"{s.communication_ms:.1f}",
                      f"{s.idle_ms:.1f}", f"{row.peer_wait_ms:.1f}", f"{s.host_blocked_ms:.1f}", role,
                      s.verdict, s.source))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    for line in table:
        numbers = "  ".join(f"{cell:>{width}}" for cell, width in zip(line[:7], widths[:7], strict=True))
        words = "  ".join(f"{cell:<{width}}" for cell, width in zip(line[7:9], widths[7:9], strict=True))
        lines.append(f"    {numbers}  {words}  {line[9]}".rstrip())
    lines.extend(textwrap.wrap(
        "(ms a step; COMM: communication no computation hides; PEER WAIT: time in the collectives beyond "
        "the least any rank spent in them; HOST BLOCKED: in synchronising calls)", WIDTH,
        initial_indent="  ", subsequent_indent="   "))
    if report.missing:
        lines.append(f"  note: no trace here of rank(s) {', '.join(str(r) for r in report.missing)}")
    return "\n".join(lines)
