"""What fixing each finding would buy, in `gpuscope explain`'s report and its JSON document, from the
replay of the H100 fixtures."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from gpuscope.analysis import gains as gains_module
from gpuscope.analysis.diagnose import diagnose
from gpuscope.analysis.gains import estimate_gains
from gpuscope.analysis.sources import read_trace
from gpuscope.capture.explanation import explain_path

FIXTURES = Path(__file__).parent / "fixtures" / "traces" / "h100"


def fixture(name: str) -> Path:
    (path,) = FIXTURES.glob(f"{name}.*")
    return path


@cache
def explained_json(name: str) -> dict[str, Any]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert explain_path(fixture(name), as_json=True) == 0
    (trace,) = json.loads(out.getvalue())["traces"]
    return trace  # type: ignore[no-any-return]


def finding(name: str, kind: str) -> dict[str, Any]:
    (found,) = [f for f in explained_json(name)["findings"] if f["kind"] == kind]
    return found


@pytest.mark.parametrize(("name", "kind"), [("deep_narrow_mlp", "launch_bound"),
                                            ("resnet50_dataloader_no_workers", "input_bound")])
def test_the_json_document_carries_the_gain_of_a_fix_the_replay_models(name: str, kind: str) -> None:
    gain = finding(name, kind)["gain"]
    assert gain["before_s"] > gain["after_s"] > 0
    assert gain["share"] == pytest.approx(1 - gain["after_s"] / gain["before_s"], abs=1e-3)
    assert gain["assumptions"] and all(isinstance(a, str) and a for a in gain["assumptions"])


def test_closing_the_launch_gaps_of_deep_narrow_mlp_wins_back_most_of_its_step() -> None:
    gain = finding("deep_narrow_mlp", "launch_bound")["gain"]
    assert gain["before_s"] == pytest.approx(0.0296, abs=0.001)
    assert gain["share"] > 0.5
    assert any("CUDA graph" in a for a in gain["assumptions"])


def test_a_finding_with_no_fix_to_replay_says_why() -> None:
    gain = finding("seg_masked_loss", "costly_op")["gain"]
    assert set(gain) == {"not_estimated"}
    assert "dense formulation" in gain["not_estimated"]
    assert "tensor cores" in finding("seg_masked_loss", "tensor_cores_idle")["gain"]["not_estimated"]


def test_the_fixes_together_win_at_least_as_much_as_the_best_alone() -> None:
    trace = explained_json("seg_masked_loss")
    together = trace["gain_together"]
    estimated = [f["gain"] for f in trace["findings"] if "share" in f["gain"]]
    assert len(estimated) >= 2
    assert together["share"] >= max(g["share"] for g in estimated) - 1e-3
    assert len(together["assumptions"]) == len(estimated)


def test_the_text_report_prints_the_gain_under_each_finding(capsys: pytest.CaptureFixture[str]) -> None:
    assert explain_path(fixture("deep_narrow_mlp"), as_json=False) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if "fixing it: 29.6 ->" in line)
    assert "% less), assuming " in line
    assert "fixing it: gain not estimated:" in text


def test_a_replay_that_fails_makes_every_gain_not_estimated(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    trace = read_trace(fixture("deep_narrow_mlp"))
    findings = diagnose(trace).findings

    def broken(*args: object) -> None:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(gains_module, "predict", broken)
    with caplog.at_level(logging.DEBUG, logger="gpuscope.analysis.gains"):
        gains = estimate_gains(trace, findings)
    assert gains.together is None
    assert [gains.of(f).not_estimated != "" for f in findings] == [True] * len(findings)
    assert any(gains.of(f).not_estimated == "the replay failed (RuntimeError)" for f in findings)
    assert "replay failed" in caplog.text


CORPUS = Path(__file__).parent / "fixtures" / "corpus"
CORPUS_FILES = [CORPUS / entry["id"] / name
                for entry in json.loads((CORPUS / "corpus.json").read_text(encoding="utf-8"))
                for name in entry["files"]]


def test_every_corpus_trace_gets_a_gain_or_a_reason_for_each_finding(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The corpus's traces (other frameworks, several GPUs, no correlation ids ...) never make the
    estimate fail the report: each finding has a gain or says why not."""
    assert CORPUS_FILES
    findings = 0
    for path in CORPUS_FILES:
        assert explain_path(path, as_json=True) in (0, 1), path
        document = json.loads(capsys.readouterr().out)
        for trace in document["traces"]:
            for found in trace["findings"]:
                gain = found["gain"]
                findings += 1
                assert (gain.get("not_estimated")) or (
                    gain["before_s"] > 0 and gain["after_s"] >= 0), (path, found["kind"], gain)
    assert findings > 10
