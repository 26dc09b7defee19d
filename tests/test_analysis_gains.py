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
from gpuscope.analysis.findings import Finding
from gpuscope.analysis.gains import estimate_gains, not_estimated
from gpuscope.analysis.model import Trace
from gpuscope.analysis.render import format_diagnosis
from gpuscope.analysis.sources import read_trace
from gpuscope.analysis.steps import find_steps
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
    trace = read_trace(fixture("seg_masked_loss"))
    shared = Finding("shared_gpu", "high", 0.3, None, "another process", (), "")
    small = Finding("small_grids", "moderate", 0.3, None, "few blocks", (), "")
    gains = estimate_gains(trace, [shared, small])
    assert "other processes' work" in gains.of(shared).not_estimated
    assert gains.of(small).not_estimated == "the replay models no fix for small_grids"
    assert gains.together is None


def test_the_dense_loss_and_no_synchronisations_predict_the_fixed_loss_speedup() -> None:
    """seg_masked_loss runs 72.0 ms a step, the same model with a dense loss (seg_fixed_loss) 48.0:
    1.50x. The masked trace's costly_op and host_sync findings' gains together, as a user reads them,
    predict it within 15%: the loss's forward and backward indexing become elementwise passes, the
    synchronisations no longer wait."""
    masked = read_trace(fixture("seg_masked_loss"))
    fixed = read_trace(fixture("seg_fixed_loss"))
    measured = find_steps(masked).time / len(find_steps(masked).steps)
    measured /= find_steps(fixed).time / len(find_steps(fixed).steps)
    assert measured == pytest.approx(1.50, abs=0.01)
    findings = [f for f in diagnose(masked).findings if f.kind in ("costly_op", "host_sync")]
    assert sorted(f.kind for f in findings) == ["costly_op", "host_sync"]
    together = estimate_gains(masked, findings).together
    assert together is not None and not together.not_estimated
    predicted = together.before_ms / together.after_ms
    assert predicted == pytest.approx(measured, rel=0.15)
    assert predicted < measured  # the slow loss kernels on the gathered rows are not the finding's
    dense = together.assumptions[0]
    assert "aten::index and autograd::engine::evaluate_function: IndexBackward0" in dense
    assert "median elementwise kernel" in dense


def test_the_costly_ops_gain_prices_its_dense_passes() -> None:
    gain = finding("seg_masked_loss", "costly_op")["gain"]
    assert 0.15 < gain["share"] < 0.30  # IndexBackward0 and aten::index: 26% of the step, less the passes
    (text,) = gain["assumptions"]
    assert "one elementwise pass each" in text and "144 us a pass" in text


@pytest.mark.parametrize("name", ["seg_masked_loss", "seg_fixed_loss"])
def test_tensor_cores_speed_up_the_fp32_matrix_kernels_by_the_architectures_factor(name: str) -> None:
    """On the H100 (9.0) the fp32 convolutions run 7.4x faster: half of bf16's 14.8x over fp32."""
    gain = finding(name, "tensor_cores_idle")["gain"]
    (text,) = gain["assumptions"]
    assert "7.4x faster" in text and "Hopper, 9.0" in text
    fp32_share = finding(name, "tensor_cores_idle")["share"]
    # The fp32 kernels' share less what is left of it: never more than that share, nearly all of it.
    assert fp32_share * (1 - 1 / 7.4) * 0.8 < gain["share"] <= fp32_share * (1 - 1 / 7.4) + 0.01


@pytest.mark.parametrize(("capability", "reason"), [
    ((6, 1), "no tensor-core speed-up is known for compute capability 6.1"),
    ((11, 0), "no tensor-core speed-up is known for compute capability 11.0"),
    (None, "the trace does not record the GPU's compute capability")])
def test_tensor_cores_on_an_unknown_architecture_are_not_estimated(
        capability: tuple[int, int] | None, reason: str) -> None:
    trace = read_trace(fixture("seg_fixed_loss"))
    (found,) = [f for f in diagnose(trace).findings if f.kind == "tensor_cores_idle"]
    trace.compute_capability = capability  # as another GPU's trace would record it
    assert estimate_gains(trace, [found]).of(found).not_estimated == reason


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
    trace = read_trace(fixture("deep_narrow_mlp"))
    diagnosis = diagnose(trace)
    unknown = not_estimated(diagnosis.findings, "the trace could not be replayed (KeyError)")
    assert "fixing it: gain not estimated: the trace could not be replayed (KeyError)" in " ".join(
        format_diagnosis(diagnosis, unknown).split())


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


def test_unfused_attentions_gain_moves_its_softmax_into_a_fused_kernel() -> None:
    """timesformer (H100, bf16): 24 attention softmax kernels a trace beside batched matmuls. The step
    waits for its input (the device idles 59% of it): faster attention does not shorten it."""
    (path,) = (CORPUS / "tracelens_h100_timesformer").glob("*.pt.trace.json.gz")
    trace = read_trace(path)
    (found,) = [f for f in diagnose(trace).findings if f.kind == "dominant_op"]
    assert found.summary.startswith("unfused attention")
    gain = estimate_gains(trace, [found]).of(found)
    (text,) = gain.assumptions
    assert text.startswith("24 attention softmax kernels (68.8 ms) run inside a fused attention kernel")
    assert gain.after_ms == pytest.approx(gain.before_ms, rel=0.01)


def test_the_input_bound_gain_of_a_v100_resnet_predicts_the_run_with_workers() -> None:
    """A pair recorded by others (the TensorBoard profiler plugin's ResNet-50 on a V100): the job with
    DataLoader(num_workers=0), 174.8 ms a step, and the same job with num_workers=4, 139.7 ms. The
    input_bound gain from the first trace alone takes out the 34% input wait; the job with workers lost
    part of that to its launch gaps (18% of its step against 9%: the workers' processes share the
    host's CPU), which no trace of the job without them shows. So the estimate is high, by about that."""
    def trace_of(run: str) -> Trace:
        (path,) = (CORPUS / f"kineto_tb_resnet50_v100_{run}").glob("*.pt.trace.json.gz")
        return read_trace(path)

    slow, fast = trace_of("workers0"), trace_of("workers4")
    measured = mean_step(slow) / mean_step(fast)
    assert measured == pytest.approx(1.25, abs=0.01)
    diagnosis = diagnose(slow)
    (found,) = [f for f in diagnosis.findings if f.kind == "input_bound"]
    gain = estimate_gains(slow, [found]).of(found)
    predicted = gain.before_ms / gain.after_ms
    assert measured < predicted < measured * 1.25
    assert gain.after_ms == pytest.approx(mean_step(slow) / 1e3 * (1 - found.share), rel=0.05)


def mean_step(trace: Trace) -> float:
    steps = find_steps(trace).steps
    return sum(step.duration for step in steps) / len(steps)


def test_an_input_wait_before_the_first_launch_of_a_single_step_is_taken_out() -> None:
    """A one-step inference trace (a Hugging Face video pipeline on an H100): its 217 ms `preprocess`
    frame, which the finding measures, runs before the step's first CUDA call. Prefetched by one loader
    the step is the loader's own time, no longer the preprocessing plus the device's work."""
    (path,) = (CORPUS / "tracelens_h100_timesformer").glob("*.pt.trace.json.gz")
    trace = read_trace(path)
    (found,) = [f for f in diagnose(trace).findings if f.kind == "input_bound"]
    gain = estimate_gains(trace, [found]).of(found)
    assert gain.before_ms == pytest.approx(382.5, abs=0.5)
    assert gain.after_ms == pytest.approx(217.5, abs=1.0)
    assert any("217.5 ms of host work taken out" in a for a in gain.assumptions)
