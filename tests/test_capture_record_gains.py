"""What fixing a capture's findings would buy, read from its record (gpuscope.capture.record_gains): the
same words as `gpuscope explain`'s, and no error on a record of another shape."""

from __future__ import annotations

from typing import Any

import pytest

from gpuscope.analysis.gains import Gain
from gpuscope.capture.analysis_worker import bounded_gain, summarise
from gpuscope.capture.record_gains import (
    gain_short,
    gain_text,
    verdict_finding,
    verdict_gain_text,
)

ESTIMATED = {"before_s": 0.072, "after_s": 0.0544, "share": 0.2444,
             "assumptions": ["the loader's next batch is ready when the step asks", "the copy overlaps"]}
NOT_ESTIMATED = {"not_estimated": "the replay does not model how much faster the kernels run on tensor cores"}


def analysis(*findings: dict[str, Any]) -> dict[str, Any]:
    """A record's analysis of one trace with these findings (their gains as the worker keeps them)."""
    shown = [{"kind": "input_bound", "severity": "high", "share": 0.25, "summary": "s", "evidence": [], **f}
             for f in findings]
    return summarise({"traces": [{"source": "t", "findings": shown}]})


@pytest.mark.parametrize("gain", [
    Gain(72.0, 54.4, ("the loader's next batch is ready when the step asks", "the copy overlaps")),
    Gain(137.53, 97.61, ()),
    Gain(not_estimated="the replay failed (ValueError)"),
])
def test_a_records_gain_reads_as_explain_says_it(gain: Gain) -> None:
    """The record keeps the report's JSON (bounded): its text is the in-process Gain's, word for word."""
    assert gain_text(bounded_gain(gain.to_json())) == gain.text()


def test_the_text_the_short_form_and_the_verdicts_gain() -> None:
    assert gain_text(ESTIMATED) == ("72.0 -> 54.4 ms a step (24% less), assuming the loader's next batch is "
                                    "ready when the step asks; the copy overlaps")
    assert gain_text(ESTIMATED, assumptions=False) == "72.0 -> 54.4 ms a step (24% less)"
    assert gain_text(NOT_ESTIMATED) == f"gain not estimated: {NOT_ESTIMATED['not_estimated']}"
    assert (gain_short(ESTIMATED), gain_short(NOT_ESTIMATED), gain_short(None)) == ("-24% step", "n/e", "-")
    assert [gain_short({**ESTIMATED, "share": share}) for share in (0.001, 0.0, -0.03)] == [
        "0% step", "0% step", "+3% step"]
    assert verdict_gain_text(analysis({"gain": ESTIMATED}), assumptions=False) == (
        "fixing input_bound: 72.0 -> 54.4 ms a step (24% less)")
    assert verdict_gain_text(analysis({"kind": "tensor_cores_idle", "gain": NOT_ESTIMATED})) == (
        f"fixing tensor_cores_idle: gain not estimated: {NOT_ESTIMATED['not_estimated']}")


def test_the_verdicts_finding_is_the_one_that_made_it() -> None:
    """A low finding ranked first never makes the verdict: the gain shown is the verdict's finding's."""
    both = analysis({"kind": "small_grids", "severity": "low", "share": 0.9, "gain": NOT_ESTIMATED},
                    {"gain": ESTIMATED})
    assert both["verdict"] == "input_bound"
    found = verdict_finding(both)
    assert found is not None and found["kind"] == "input_bound"
    assert verdict_gain_text(both, assumptions=False) == (
        "fixing input_bound: 72.0 -> 54.4 ms a step (24% less)")
    healthy = summarise({"traces": [{"source": "t", "findings": [], "verdict": "healthy"}]})
    assert verdict_finding(healthy) is None and verdict_gain_text(healthy) is None


@pytest.mark.parametrize("odd", [
    None, {}, {"verdict": None, "skipped": "too large"}, {"verdict": "input_bound"},
    {"verdict": "input_bound", "findings": 3}, {"verdict": "input_bound", "findings": ["x", None]},
    {"verdict": "input_bound", "findings": [{"kind": "input_bound"}]},  # analysed before gains were estimated
    {"verdict": "input_bound", "findings": [{"kind": "input_bound", "gain": {"before_s": "x"}}]},
    {"verdict": "input_bound", "findings": [{"kind": "input_bound", "gain": {
        "before_s": float("nan"), "after_s": 1.0, "share": 0.1}}]},
    {"verdict": "input_bound", "findings": [{"kind": "input_bound", "gain": [1, 2]}]},
])
def test_a_record_of_another_shape_has_no_gain_and_no_error(odd: Any) -> None:
    assert verdict_gain_text(odd) is None
    found = verdict_finding(odd)
    assert gain_short(found.get("gain") if found is not None else None) == "-"
