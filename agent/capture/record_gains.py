"""What fixing a capture's findings would buy, in words, read from its record.

A capture record's ``analysis`` (``analysis_worker.summarise``) keeps each finding's ``gain`` as a dict:
``{"before_s", "after_s", "share", "assumptions"}`` (the step time before and after the finding's fix,
from a replay of the trace, and what that assumes), ``{"not_estimated": why}``, or None for a record
analysed before gains were estimated; and the analysis may hold ``gain_together``, all the estimated
fixes at once. The command line, the status page, the alerts' annotations and the event log all say it
with these functions, in the words ``gpuscope explain`` uses (``analysis.gains.Gain.text``).

Records are read from disk and over the API: a gain of another shape reads as no gain, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

NOT_ESTIMATED = "gain not estimated"


def verdict_finding(analysis: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The finding that made the analysis's verdict (the first of its kind), or None: a healthy,
    inconclusive or skipped analysis has none."""
    if not isinstance(analysis, Mapping) or not analysis.get("verdict"):
        return None
    verdict = analysis["verdict"]
    findings = analysis.get("findings")
    if not isinstance(findings, (list, tuple)):
        return None
    return next((f for f in findings if isinstance(f, Mapping) and f.get("kind") == verdict), None)


def estimated(gain: Any) -> tuple[float, float, float, list[str]] | None:
    """(before_s, after_s, share, assumptions) of an estimated gain; None for any other gain."""
    if not isinstance(gain, Mapping) or "not_estimated" in gain:
        return None
    try:
        before, after, share = float(gain["before_s"]), float(gain["after_s"]), float(gain["share"])
    except (KeyError, TypeError, ValueError):
        return None
    if not all(math.isfinite(v) for v in (before, after, share)):
        return None
    assumptions = gain.get("assumptions")
    listed = [str(a) for a in assumptions] if isinstance(assumptions, (list, tuple)) else []
    return before, after, share, listed


def not_estimated_reason(gain: Any) -> str | None:
    """Why a gain was not estimated; None for an estimated gain or no gain."""
    if isinstance(gain, Mapping) and "not_estimated" in gain:
        return str(gain["not_estimated"])
    return None


def gain_text(gain: Any, *, assumptions: bool = True) -> str | None:
    """One line: "72.0 -> 54.4 ms a step (25% less), assuming ...", or "gain not estimated: why";
    None for a record without a gain."""
    reason = not_estimated_reason(gain)
    if reason is not None:
        return f"{NOT_ESTIMATED}: {reason}"
    found = estimated(gain)
    if found is None:
        return None
    before, after, share, assumed = found
    text = f"{before * 1e3:.1f} -> {after * 1e3:.1f} ms a step ({share * 100:.0f}% less)"
    if assumptions and assumed:
        text += f", assuming {'; '.join(assumed)}"
    return text


def gain_short(gain: Any) -> str:
    """A few characters for a table cell: "-25% step" (the step time saved), "n/e" (not estimated) or
    "-" (no gain); "0% step" when the fix would save nothing, "+3% step" should it cost time."""
    if not_estimated_reason(gain) is not None:
        return "n/e"
    found = estimated(gain)
    if found is None:
        return "-"
    percent = round(found[2] * 100)
    return f"-{percent}% step" if percent > 0 else f"+{-percent}% step" if percent < 0 else "0% step"


def verdict_gain_text(analysis: Mapping[str, Any] | None, *, assumptions: bool = True) -> str | None:
    """What fixing the verdict's finding would buy: "fixing input_bound: 72.0 -> 54.4 ms a step (25%
    less), ..."; None when the verdict names no finding or the record has no gain."""
    finding = verdict_finding(analysis)
    text = gain_text(finding.get("gain"), assumptions=assumptions) if finding is not None else None
    return None if finding is None or text is None else f"fixing {finding['kind']}: {text}"
