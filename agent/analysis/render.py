"""A Diagnosis as people read it: the verdict first, then each finding with its evidence table."""

from __future__ import annotations

import textwrap

from gpuscope.analysis.diagnose import Diagnosis, Finding

WIDTH = 100
VERDICTS = {
    "healthy": "healthy: no finding over its threshold",
    "input_bound": "input-bound",
    "host_sync": "host-sync-bound",
    "launch_bound": "launch-bound",
    "communication_wait": "communication-bound",
    "idle_between_steps": "idle between steps",
}


def format_diagnosis(diagnosis: Diagnosis) -> str:
    d = diagnosis
    lines = [f"{d.source}", f"  verdict: {VERDICTS.get(d.verdict, d.verdict)}"]
    framework = d.framework or "unknown framework"
    where = "with device activity" if d.device else "host only"
    marker = f" from {d.step_marker!r}" if d.step_marker else ""
    lines.append(f"  {d.format} trace, {framework}, {where}; {d.steps} step(s) ({d.step_method}{marker}), "
                 f"mean {d.mean_step_ms:.1f} ms; {d.events} events")
    if d.breakdown:
        parts = ", ".join(f"{name.replace('_', ' ')} {share * 100:.0f}%"
                          for name, share in d.breakdown.items())
        lines.append(f"  step time: {parts}")
    for finding in d.findings:
        lines.append("")
        lines.extend(_finding(finding))
    for limit in d.limits:
        lines.extend(textwrap.wrap(limit, WIDTH, initial_indent="  note: ", subsequent_indent="        "))
    return "\n".join(lines)


def _finding(f: Finding) -> list[str]:
    lines = [f"  [{f.severity}] {f.kind}: {f.summary}"]
    if f.evidence:
        rows = [("", "COUNT", "TIME (ms)", "CALL SITE")] + [
            (e.name, str(e.count), f"{e.time_ms:.1f}", e.site or "-") for e in f.evidence]
        name_width = min(max(len(r[0]) for r in rows), 60)
        for name, count, time, site in rows:
            shown = name if len(name) <= name_width else name[:name_width - 1] + "…"
            lines.append(f"    {shown:<{name_width}}  {count:>6}  {time:>10}  {site}".rstrip())
    lines.extend(textwrap.wrap(f"fix: {f.remedy}", WIDTH, initial_indent="    ", subsequent_indent="      "))
    return lines


def top_finding(diagnoses: list[Diagnosis]) -> str:
    """The verdict of several traces (a capture of several processes): the most severe finding's kind."""
    findings = [f for d in diagnoses for f in d.findings[:1]]
    if not findings:
        return "healthy"
    findings.sort(key=lambda f: (f.severity != "high", -(f.share or 0.0)))
    return findings[0].kind
