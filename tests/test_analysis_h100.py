"""The diagnosis of real GPU jobs: traces the agent captured from jobs of known bottleneck on an NVIDIA
H100 80GB HBM3 (driver 580, PyTorch 2.11, JAX 0.11), trimmed to a few steps each
(scripts/trim_trace.py). What each job was, and what was measured of it on the same machine:

- healthy_mlp_bf16: 8 x Linear(4096)+GELU, batch 8192, bf16 autocast, AdamW (foreach), no sync in
  the step; 15.3 ms a step, NVML utilization 100%, GPM tensor activity 0.34.
- seg_masked_loss: 12 Conv2d of 10 channels, a loss built on torch.nonzero, torch.unique and
  boolean-mask indexing; 73 ms a step. The same model with a fixed loss (seg_fixed_loss: torch.where,
  ignore_index) runs 48 ms a step: 1.51x faster. GPM tensor activity 0.03 against SM activity 0.89.
- resnet50_dataloader_no_workers: ResNet-50 fed by a DataLoader with num_workers=0; 191 ms a step.
- deep_narrow_mlp: 96 x Linear(128)+ReLU, batch 16: 584 kernels a step, 31 ms a step, SM activity 0.03.
- jax_python_generator: a jitted MLP step fed by a Python generator that makes each batch with NumPy;
  180 ms a step, of which the device works about 12 ms.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from gpuscope.analysis.diagnose import Diagnosis, Finding, diagnose
from gpuscope.analysis.findings import FINDING_KINDS
from gpuscope.analysis.render import format_diagnosis
from gpuscope.analysis.sources import read_trace

FIXTURES = Path(__file__).parent / "fixtures" / "traces" / "h100"


@cache
def diagnosis_of(name: str) -> Diagnosis:
    (path,) = FIXTURES.glob(f"{name}.*")
    diagnosis = diagnose(read_trace(path))
    assert format_diagnosis(diagnosis)
    return diagnosis


def finding(diagnosis: Diagnosis, kind: str) -> Finding:
    (found,) = [f for f in diagnosis.findings if f.kind == kind]
    return found


def kinds(diagnosis: Diagnosis) -> set[str]:
    return {f.kind for f in diagnosis.findings}


def test_the_healthy_bf16_mlp_is_healthy_with_its_checklist_run() -> None:
    diagnosis = diagnosis_of("healthy_mlp_bf16")
    assert diagnosis.verdict == "healthy"
    assert all(f.severity == "low" for f in diagnosis.findings), diagnosis.findings
    # The report says what it checked: every finding of the checklist but the cross-process one.
    checked = {c.kind for c in diagnosis.checks}
    assert checked == set(FINDING_KINDS) - {"shared_gpu"}
    assert all(c.passed for c in diagnosis.checks if c.kind != "optimizer_heavy")
    profile = diagnosis.device_profile
    assert profile is not None and profile["classes"]["tensor_core"] > 0.5  # bf16 GEMMs: nvjet kernels
    # AdamW with foreach: about a quarter of the device's time, an opportunity (fused=True).
    optimizer = finding(diagnosis, "optimizer_heavy")
    assert optimizer.severity == "low" and 0.2 <= (optimizer.share or 0) <= 0.3
    assert "fused=True" in optimizer.remedy
    text = format_diagnosis(diagnosis)
    assert "verdict: healthy (no finding over its threshold)" in text
    assert "checked: input_bound 0% (<5%)" in text


def test_the_masked_loss_names_its_sync_points_and_its_idle_tensor_cores() -> None:
    diagnosis = diagnosis_of("seg_masked_loss")
    assert diagnosis.verdict != "healthy"
    assert diagnosis.breakdown["busy"] > 0.95  # NVML would call it busy: the device never idles
    sync = finding(diagnosis, "host_sync")
    assert sync.severity == "low"  # the device stays busy through them
    # One point per blocking call, as the job measured (6.1 cudaStreamSynchronize a step): the item()
    # that torch.unique makes inside aten::_unique2 is that call's, not a second point.
    assert sync.per_step == pytest.approx(6, abs=0.5)
    assert {"aten::nonzero", "aten::_unique2"} <= {e.name for e in sync.evidence}
    assert "aten::_local_scalar_dense" not in {e.name for e in sync.evidence}
    assert "blocked in them" in sync.summary
    tensor = finding(diagnosis, "tensor_cores_idle")
    assert tensor.severity == "high" and (tensor.share or 0) >= 0.3
    assert any("wgrad_alg0_engine<float" in e.detail for e in tensor.evidence)
    costly = finding(diagnosis, "costly_op")
    assert costly.evidence[0].name == "autograd::engine::evaluate_function: IndexBackward0"
    assert "indexing_backward_kernel" in costly.summary and (costly.share or 0) >= 0.1
    assert finding(diagnosis, "layout_conversion").severity == "moderate"


def test_the_fixed_loss_keeps_its_idle_tensor_cores_and_has_no_sync_points() -> None:
    diagnosis = diagnosis_of("seg_fixed_loss")
    assert diagnosis.verdict == "tensor_cores_idle"
    assert "host_sync" not in kinds(diagnosis) and "costly_op" not in kinds(diagnosis)
    (sync,) = [c for c in diagnosis.checks if c.kind == "host_sync"]
    assert sync.value < 1 and sync.passed
    assert (finding(diagnosis, "tensor_cores_idle").share or 0) > 0.5
    assert "channels_last" in finding(diagnosis, "layout_conversion").remedy


def test_the_fix_shows_as_less_device_time_in_the_masked_ops() -> None:
    masked, fixed = diagnosis_of("seg_masked_loss"), diagnosis_of("seg_fixed_loss")
    assert masked.mean_step_ms / fixed.mean_step_ms == pytest.approx(1.5, abs=0.1)
    masked_costly = next(c for c in masked.checks if c.kind == "costly_op")
    fixed_costly = next(c for c in fixed.checks if c.kind == "costly_op")
    assert masked_costly.value > 5 * fixed_costly.value


def test_resnet_fed_by_a_dataloader_without_workers_is_input_bound() -> None:
    diagnosis = diagnosis_of("resnet50_dataloader_no_workers")
    assert diagnosis.verdict == "input_bound"
    found = finding(diagnosis, "input_bound")
    assert found.severity == "high" and (found.share or 0) > 0.6
    assert found.evidence[0].name == "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
    # What the device does when it runs is not what the step waits for: at most low.
    assert all(f.severity == "low" for f in diagnosis.findings if f.kind != "input_bound")


def test_the_deep_narrow_mlp_is_launch_bound() -> None:
    diagnosis = diagnosis_of("deep_narrow_mlp")
    assert diagnosis.verdict == "launch_bound"
    found = finding(diagnosis, "launch_bound")
    assert found.severity == "high" and (found.share or 0) > 0.6
    assert found.per_step == pytest.approx(584, rel=0.02)
    # Its fp32 kernels would not shorten a step the host's launches hold back.
    assert all(f.severity == "low" for f in diagnosis.findings if f.kind != "launch_bound")


def test_the_jax_job_fed_by_a_python_generator_is_host_bound() -> None:
    diagnosis = diagnosis_of("jax_python_generator")
    assert (diagnosis.framework, diagnosis.step_marker) == ("jax", "PjitFunction(step)")
    assert diagnosis.verdict == "host_bound"
    found = finding(diagnosis, "host_bound")
    assert found.severity == "high" and (found.share or 0) > 0.8
    dispatch, untraced, device = found.evidence
    assert dispatch.name == "PjitFunction(step)" and dispatch.count == diagnosis.steps
    assert "every 179.8 ms" in dispatch.detail
    assert untraced.name == "no traced operation on python3"
    assert untraced.time_ms / diagnosis.steps == pytest.approx(163, abs=5)
    assert device.time_ms / diagnosis.steps == pytest.approx(12.6, abs=1)
    assert "prefetch" in found.remedy and "python_tracer_level=1" in found.remedy


@pytest.mark.parametrize("name", ["healthy_mlp_bf16", "seg_masked_loss", "seg_fixed_loss",
                                  "resnet50_dataloader_no_workers", "deep_narrow_mlp"])
def test_every_kernel_is_tied_to_the_operation_that_launched_it(name: str) -> None:
    profile = diagnosis_of(name).device_profile
    assert profile is not None and profile["devices"] == 1
    assert profile["attributed"] > 0.95  # through the correlation ids of the launches
    assert not any(op["name"] == op["kernel"] for op in profile["ops"]), profile["ops"]


def test_the_device_time_is_tied_to_the_operations_that_launched_it() -> None:
    profile = diagnosis_of("seg_masked_loss").device_profile
    assert profile is not None
    names = [op["name"] for op in profile["ops"]]
    assert names[0] == "autograd::engine::evaluate_function: ConvolutionBackward0"
    assert "aten::conv2d" in names
    assert sum(profile["classes"].values()) == pytest.approx(1.0, abs=0.001)
