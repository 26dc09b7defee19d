"""What fixing each finding would buy: the step time before and after its fix, from a replay of the
trace's dependency graph (``replay_fixes``), and what the estimate assumes.

Each finding kind maps to the fix its remedy proposes; the fixes of a costly or dominant operation
take the operation the finding names (its first evidence row). A kind with no fix the replay can model
(processes sharing the GPU, small grids ...), or a fix that cannot be modelled on this trace (a GPU
whose tensor-core speed-up is not known, no collective to overlap) gets a reason instead of a number.
The estimate never fails a report: a replay that raises on an unusual trace makes every gain "not
estimated", and says why in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from gpuscope.analysis.findings import Finding
from gpuscope.analysis.model import Trace
from gpuscope.analysis.replay_fixes import (
    Fix,
    NotModelled,
    Prediction,
    close_launch_gaps,
    fuse_attention,
    fuse_op,
    overlap_communication,
    overlap_untraced_host,
    predict,
    prefetch_input,
    remove_host_syncs,
    remove_layout_conversions,
    replace_with_dense,
    use_tensor_cores,
)
from gpuscope.analysis.replay_graph import StepGraph, build_graph

log = logging.getLogger(__name__)

FIXES: dict[str, Fix] = {
    "host_sync": remove_host_syncs,
    "launch_bound": close_launch_gaps,
    "input_bound": prefetch_input,
    "host_bound": overlap_untraced_host,
    "layout_conversion": remove_layout_conversions,
    "tensor_cores_idle": use_tensor_cores,
    "communication_wait": overlap_communication,
}
NOT_MODELLED = {
    "shared_gpu": "the other processes' work on the GPU is not in this trace",
}
# How the summary of a dominant_op finding names unfused attention (busy_findings writes it).
UNFUSED_ATTENTION = "unfused attention"


@dataclass(frozen=True, slots=True)
class Gain:
    """A fix's predicted effect, or why there is none (``not_estimated``)."""

    before_ms: float = 0.0
    after_ms: float = 0.0
    assumptions: tuple[str, ...] = ()
    not_estimated: str = ""

    @property
    def share(self) -> float:
        """The share of the step time won back."""
        return 1 - self.after_ms / self.before_ms if self.before_ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        if self.not_estimated:
            return {"not_estimated": self.not_estimated}
        return {"before_s": round(self.before_ms / 1e3, 6), "after_s": round(self.after_ms / 1e3, 6),
                "share": round(self.share, 4), "assumptions": list(self.assumptions)}

    def text(self) -> str:
        if self.not_estimated:
            return f"gain not estimated: {self.not_estimated}"
        assuming = "; ".join(self.assumptions)
        return (f"{self.before_ms:.1f} -> {self.after_ms:.1f} ms a step ({self.share * 100:.0f}% less)"
                + (f", assuming {assuming}" if assuming else ""))


@dataclass(frozen=True, slots=True)
class Gains:
    """The gain of each finding and of all the estimated fixes together (None when fewer than two
    were estimated)."""

    each: tuple[tuple[Finding, Gain], ...]
    together: Gain | None = None

    def of(self, finding: Finding) -> Gain:
        """A finding's gain; one added after the estimate (another process's on a shared GPU) has none."""
        for known, gain in self.each:
            if known == finding:
                return gain
        return Gain(not_estimated=NOT_MODELLED.get(finding.kind, "not part of the replayed trace"))


def estimate_gains(trace: Trace, findings: Sequence[Finding]) -> Gains:
    """Each finding's gain, and all the estimated fixes' together. Never raises."""
    if not findings:
        return Gains(())
    try:
        graph = build_graph(trace)
    except Exception as err:  # any failure: an estimate is never worth failing the report for
        log.debug("gains of %s: the replay graph could not be built", trace.source, exc_info=True)
        reason = f"the trace could not be replayed ({type(err).__name__})"
        return not_estimated(findings, reason)
    each: list[tuple[Finding, Gain]] = []
    fixes: dict[str, Fix] = {}  # one fix per kind: the first finding's
    for finding in findings:
        fix = fix_for(finding)
        if fix is None:
            reason = NOT_MODELLED.get(finding.kind, f"the replay models no fix for {finding.kind}")
            each.append((finding, Gain(not_estimated=reason)))
            continue
        gain = _gain(graph, [fix], finding.kind)
        each.append((finding, gain))
        if not gain.not_estimated:
            fixes.setdefault(finding.kind, fix)
    together = _gain(graph, list(fixes.values()), "all") if len(fixes) > 1 else None
    return Gains(tuple(each), together)


def fix_for(finding: Finding) -> Fix | None:
    """The fix a finding's remedy proposes, as a change to the graph; None where the replay has none.
    A costly or dominant operation's fix takes the operation the finding names first."""
    op = finding.evidence[0].name if finding.evidence else ""
    if finding.kind == "costly_op" and op:
        return partial(replace_with_dense, op=op)
    if finding.kind == "dominant_op" and op:
        if finding.summary.startswith(UNFUSED_ATTENTION):
            return partial(fuse_attention, ops=tuple(e.name for e in finding.evidence))
        return partial(fuse_op, op=op)
    return FIXES.get(finding.kind)


def not_estimated(findings: Sequence[Finding], reason: str) -> Gains:
    """No finding's gain estimated, for one reason."""
    return Gains(tuple((finding, Gain(not_estimated=reason)) for finding in findings))


def _gain(graph: StepGraph, fixes: list[Fix], what: str) -> Gain:
    try:
        prediction = predict(graph, fixes)
    except NotModelled as err:
        return Gain(not_estimated=str(err))
    except Exception as err:  # any failure: an estimate is never worth failing the report for
        log.debug("gain of %s in %s: the replay failed", what, graph.trace.source, exc_info=True)
        return Gain(not_estimated=f"the replay failed ({type(err).__name__})")
    return _of(prediction)


def _of(prediction: Prediction) -> Gain:
    if prediction.before_us <= 0:
        return Gain(not_estimated="the replay found no step time to shorten")
    return Gain(prediction.before_us / 1e3, prediction.after_us / 1e3,
                tuple(a.text for a in prediction.assumptions))
