"""Traces of kinds this suite's jobs do not write, each built in the shape its writer gives it: a PyTorch
1.8/1.9 trace, one with nothing readable, one cut off, a TensorFlow XSpace of several GPUs with its
own Steps line, an inference step whose host runs far ahead of the device, one step with its
preprocessing in it. Each is read through the real readers and diagnosed as a whole."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from gpuscope.analysis.diagnose import Diagnosis, diagnose, diagnose_devices
from gpuscope.analysis.kineto_json import read_kineto
from gpuscope.analysis.model import Kind
from gpuscope.analysis.render import format_diagnosis
from gpuscope.analysis.xspace import read_xspace
from gpuscope.cli.explain import explain_path
from gpuscope.generated.tsl import xplane_pb2

BASE = 1_700_000_000_000_000.0  # microseconds since the epoch


def write(path: Path, events: list[dict[str, Any]], **top: Any) -> Path:
    path.write_bytes(gzip.compress(json.dumps({**top, "traceEvents": events}).encode()))
    return path


def diagnosed(path: Path) -> Diagnosis:
    diagnosis = diagnose(read_kineto(path))
    assert format_diagnosis(diagnosis)
    return diagnosis


def kinds(diagnosis: Diagnosis) -> set[str]:
    return {f.kind for f in diagnosis.findings}


# -- PyTorch 1.8/1.9: capitalised categories, "stream 7" threads, grids without "blocks per SM" --------

def old_kineto_events(steps: int = 6, step_us: float = 10_000.0) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}}]
    corr = 1
    for n in range(steps):
        t = BASE + n * step_us
        events.append({"ph": "X", "cat": "Operator", "name": f"ProfilerStep#{n + 2}", "pid": 4242,
                       "tid": "4242", "ts": t, "dur": step_us, "args": {}})
        events.append({"ph": "X", "cat": "Operator", "name": "aten::conv2d", "pid": 4242, "tid": "4242",
                       "ts": t + 100, "dur": 800, "args": {}})
        for k in range(8):  # the device busy most of the step, in kernels launched inside the op
            launch = t + 110 + k * 90
            events.append({"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 4242,
                           "tid": "4242", "ts": launch, "dur": 10, "args": {"correlation": corr,
                                                                             "external id": 7}})
            events.append({"ph": "X", "cat": "Kernel",
                           "name": "volta_scudnn_128x64_relu_interior_nn_v1", "pid": 0, "tid": "stream 7",
                           "ts": t + 1_000 + k * 1_100, "dur": 1_050,
                           "args": {"queued": 0, "device": 0, "context": 1, "stream": 7,
                                    "correlation": corr, "grid": [2, 1, 1], "block": [128, 1, 1]}})
            corr += 1
        events.append({"ph": "X", "cat": "Memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0,
                       "tid": "stream 7", "ts": t + 9_900, "dur": 50, "args": {"stream": 7}})
    return events


def test_a_pytorch_1_8_trace_is_read_and_diagnosed(tmp_path: Path) -> None:
    path = write(tmp_path / "old.pt.trace.json.gz", old_kineto_events(),
                 deviceProperties=[{"id": 0, "name": "Tesla V100-SXM2-16GB", "computeMajor": 7,
                                    "computeMinor": 0, "numSms": 80}])
    trace = read_kineto(path)
    assert trace.framework == "pytorch"
    assert trace.count(Kind.KERNEL) == 48 and trace.count(Kind.MEMCPY) == 6
    assert trace.count(Kind.RUNTIME) == 48 and trace.count(Kind.STEP) == 6
    assert {span.track for span in trace.iter(Kind.KERNEL)} == {"GPU 0 stream 7"}
    assert {round(fill, 6) for fill in trace.spans[Kind.KERNEL].fill} == {2 / 80}  # grid / the GPU's SMs
    assert trace.compute_capability == (7, 0)
    diagnosis = diagnosed(path)
    assert diagnosis.steps >= 4 and diagnosis.step_method == "markers"
    assert 0.8 < diagnosis.breakdown["busy"] < 0.9  # 8 kernels of 1.05 ms in each 10 ms step
    assert diagnosis.verdict not in ("unreadable", "inconclusive") and not diagnosis.partial


def test_a_trace_with_nothing_readable_is_unreadable_never_healthy(tmp_path: Path) -> None:
    empty = diagnosed(write(tmp_path / "empty.pt.trace.json.gz", []))
    assert empty.verdict == "unreadable" and "no events" in empty.unreadable
    annotations = [{"ph": "X", "cat": "gpu_user_annotation", "name": "a", "pid": 0, "tid": 1, "ts": BASE + i,
                    "dur": 1} for i in range(3)]
    other = diagnosed(write(tmp_path / "other.pt.trace.json.gz", annotations))
    assert other.verdict == "unreadable"
    assert "category 'gpu_user_annotation' (3)" in other.unreadable
    assert "verdict: unreadable" in format_diagnosis(other)
    assert "healthy" not in format_diagnosis(other)


def test_a_truncated_trace_is_partial_and_says_so(tmp_path: Path) -> None:
    text = json.dumps({"deviceProperties": [{"id": 0, "computeMajor": 9, "computeMinor": 0}],
                       "traceEvents": old_kineto_events(steps=6)})
    path = tmp_path / "cut.pt.trace.json"
    path.write_text(text[:int(len(text) * 0.8)])
    diagnosis = diagnosed(path)
    assert diagnosis.partial and "ends inside its events" in diagnosis.partial[0]
    assert all(f.severity != "high" for f in diagnosis.findings)
    assert diagnosis.verdict != "healthy"  # inconclusive, or a finding of what was read


# -- the host far ahead of the device: bubbles between queued kernels are no launch gaps --------------

def inference_events(*, host_ahead: bool) -> list[dict[str, Any]]:
    """Steps of 400 short kernels with 1.4 us between them. Ahead: each was launched 1 ms before it ran.
    Behind: each launch returns after the previous kernel ended, and kernels wait for it."""
    events: list[dict[str, Any]] = []
    corr = 1
    for n in range(5):
        t0 = BASE + n * 8_000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1,
                       "ts": t0, "dur": 8_000.0, "args": {}})
        t = t0 + 200.0
        for _ in range(400):
            launch_end = t - 1_000.0 if host_ahead else t - 0.4
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": launch_end - 3.0, "dur": 3.0, "args": {"correlation": corr}})
            events.append({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32", "pid": 0,
                           "tid": 7, "ts": t, "dur": 16.0, "args": {"stream": 7, "correlation": corr}})
            corr += 1
            t += 16.0 + 1.4
    return events


def test_bubbles_between_queued_kernels_are_not_launch_gaps(tmp_path: Path) -> None:
    ahead = diagnosed(write(tmp_path / "ahead.pt.trace.json.gz", inference_events(host_ahead=True)))
    assert "launch_bound" not in kinds(ahead)
    assert ahead.breakdown["launch_gaps"] == 0 and ahead.breakdown["queued_gaps"] > 0.05
    assert "idle_between_steps" not in kinds(ahead)  # the bubbles are the device's, no finding's
    behind = diagnosed(write(tmp_path / "behind.pt.trace.json.gz", inference_events(host_ahead=False)))
    assert "launch_bound" in kinds(behind)
    assert behind.breakdown["launch_gaps"] > 0.05 and behind.breakdown["queued_gaps"] == 0


# -- one step: its preprocessing is input; idle with no cause is inconclusive, not between steps ------

def one_step_events(preprocess: str | None) -> list[dict[str, Any]]:
    t = BASE
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": t,
         "dur": 400_000.0, "args": {}}]
    if preprocess:
        events.append({"ph": "X", "cat": "python_function", "name": preprocess, "pid": 1, "tid": 1,
                       "ts": t + 10.0, "dur": 218_000.0, "args": {}})
    else:  # a first call: the host loads modules and allocates, traced, while the device waits
        for k in range(46):
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1,
                           "ts": t + 10.0 + k * 5_000.0, "dur": 4_990.0, "args": {}})
            events.append({"ph": "X", "cat": "cuda_driver", "name": "cuModuleLoadData", "pid": 1, "tid": 1,
                           "ts": t + 20.0 + k * 5_000.0, "dur": 4_900.0, "args": {}})
    for k in range(170):  # the device busy after the first 230 ms
        start = t + 230_000.0 + k * 1_000.0
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": start - 20,
                       "dur": 15.0, "args": {}})
        events.append({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32", "pid": 0,
                       "tid": 7, "ts": start, "dur": 990.0, "args": {"stream": 7}})
    return events


def test_preprocessing_in_the_only_step_is_input(tmp_path: Path) -> None:
    frame = "transformers/pipelines/video_classification.py(120): preprocess"
    diagnosis = diagnosed(write(tmp_path / "pre.pt.trace.json.gz", one_step_events(frame)))
    assert diagnosis.verdict == "input_bound"
    assert diagnosis.breakdown["input"] > 0.5
    assert "idle_between_steps" not in kinds(diagnosis)


def test_idle_in_the_only_step_with_no_cause_is_inconclusive(tmp_path: Path) -> None:
    diagnosis = diagnosed(write(tmp_path / "one.pt.trace.json.gz", one_step_events(None)))
    assert "idle_between_steps" not in kinds(diagnosis)
    assert diagnosis.verdict == "inconclusive"
    assert any("only step" in limit for limit in diagnosis.limits)


# -- counting: one sync point per blocking call, each wait once in the evidence ----------------------

def test_an_item_is_one_sync_point_and_a_nested_wait_one_row(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    step = 10_000.0
    for n in range(6):
        t = BASE + n * step
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": t,
             "dur": step, "args": {}},
            # A data-loader wait recorded as nested frames: one wait of 4 ms.
            {"ph": "X", "cat": "user_annotation",
             "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "pid": 1, "tid": 1,
             "ts": t + 10, "dur": 4_000, "args": {}},
            {"ph": "X", "cat": "python_function", "name": "torch/utils/data/dataloader.py(630): __next__",
             "pid": 1, "tid": 1, "ts": t + 11, "dur": 3_990, "args": {}},
            {"ph": "X", "cat": "python_function", "name": "data.py(12): __getitem__", "pid": 1, "tid": 1,
             "ts": t + 20, "dur": 3_900, "args": {}},
            # loss.item(): is_nonzero around _local_scalar_dense, one blocking copy.
            {"ph": "X", "cat": "cpu_op", "name": "aten::is_nonzero", "pid": 1, "tid": 1, "ts": t + 9_000,
             "dur": 500, "args": {}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::_local_scalar_dense", "pid": 1, "tid": 1,
             "ts": t + 9_010, "dur": 480, "args": {}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 1, "ts": t + 9_020,
             "dur": 460, "args": {"correlation": 10_000 + n}},
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32", "pid": 0, "tid": 7,
             "ts": t + 4_100, "dur": 4_800, "args": {"stream": 7}},
        ]
    diagnosis = diagnosed(write(tmp_path / "item.pt.trace.json.gz", events))
    (sync,) = [c for c in diagnosis.checks if c.kind == "host_sync"]
    assert sync.value == 1.0  # per step: the item(), not its two nested operators
    (found,) = [f for f in diagnosis.findings if f.kind == "input_bound"]
    assert [e.name for e in found.evidence] == ["enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"]
    assert found.evidence[0].time_ms < 6 * 4.0 + 0.1  # never more than the waits themselves


# -- a TensorFlow XSpace of eight GPUs, two of which ran kernels, with a Steps line -------------------

def tensorflow_xspace(gpus: int = 8, active: tuple[int, ...] = (0, 1)) -> xplane_pb2.XSpace:
    space = xplane_pb2.XSpace()
    host = space.planes.add(id=0, name="/host:CPU")
    host.event_metadata[1].name = "MemcpyH2D"
    host.event_metadata[1].id = 1
    line = host.lines.add(id=1, name="tf_Compute", timestamp_ns=int(BASE * 1000))
    for n in range(40):  # copies every 5 ms, which a reader inferring steps would take for them
        line.events.add(metadata_id=1, offset_ps=n * 5_000_000_000, duration_ps=100_000_000)
    for index in range(gpus):
        plane = space.planes.add(id=index + 1, name=f"/device:GPU:{index}")
        plane.event_metadata[1].name = "volta_sgemm_128x64_nn"
        plane.event_metadata[1].id = 1
        for n in range(4):
            plane.event_metadata[10 + n].name = str(100 + n)
            plane.event_metadata[10 + n].id = 10 + n
        ops = plane.lines.add(id=1, name="TensorFlow Ops", timestamp_ns=int(BASE * 1000))
        ops.events.add(metadata_id=1, offset_ps=0, duration_ps=1_000)
        steps = plane.lines.add(id=2, name="Steps", timestamp_ns=int(BASE * 1000))
        stream = plane.lines.add(id=3, name="Stream #14(Compute)", timestamp_ns=int(BASE * 1000))
        for n in range(4):
            steps.events.add(metadata_id=10 + n, offset_ps=n * 50_000_000_000, duration_ps=50_000_000_000)
            if index in active:
                stream.events.add(metadata_id=1, offset_ps=n * 50_000_000_000 + 1_000_000_000,
                                  duration_ps=45_000_000_000)
    return space


def test_a_tensorflow_xspace_keeps_its_gpus_apart_and_its_own_steps(tmp_path: Path) -> None:
    path = tmp_path / "worker.xplane.pb"
    path.write_bytes(tensorflow_xspace().SerializeToString())
    trace = read_xspace(path)
    assert trace.framework == "tensorflow"
    assert trace.devices == {f"GPU {i}": (4 if i < 2 else 0) for i in range(8)}
    assert list(trace.step_numbers) == [100, 101, 102, 103]
    diagnoses = diagnose_devices(trace)
    assert [d.source for d in diagnoses] == [f"{path} [GPU 0]", f"{path} [GPU 1]"]
    for diagnosis in diagnoses:
        assert diagnosis.steps >= 3 and diagnosis.step_method == "markers"
        assert diagnosis.step_marker == "100"
        assert diagnosis.breakdown["busy"] > 0.85  # one GPU's own busy time, not the union of eight
        assert any("6 of the 8 GPUs" in p for p in diagnosis.partial)
        assert all(f.severity != "high" for f in diagnosis.findings)
        assert "host_bound" not in kinds(diagnosis)


def test_explain_reports_each_gpu_of_a_process_that_drives_several(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "worker.xplane.pb"
    path.write_bytes(tensorflow_xspace().SerializeToString())
    assert explain_path(path, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert [trace["source"] for trace in report["traces"]] == [f"{path} [GPU 0]", f"{path} [GPU 1]"]
    assert all(trace["partial"] for trace in report["traces"])


# -- fragments: a device with no kernel in the step, or a handful in the only step -------------------

def test_a_gpu_that_ran_only_copies_is_inconclusive(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    for n in range(4):
        t = BASE + n * 10_000.0
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": t,
             "dur": 10_000.0, "args": {}},
            {"ph": "X", "cat": "user_annotation",
             "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "pid": 1, "tid": 1,
             "ts": t, "dur": 6_000.0, "args": {}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7,
             "ts": t + 6_100.0, "dur": 500.0, "args": {"stream": 7}}]
    diagnosis = diagnosed(write(tmp_path / "copies.pt.trace.json.gz", events))
    assert any("no kernel" in p for p in diagnosis.partial)
    assert all(f.severity == "low" for f in diagnosis.findings)  # the input wait is there, but of no step
    assert diagnosis.verdict == "inconclusive"


def launches(steps: int) -> list[dict[str, Any]]:
    """Steps of 3 ms, each of five launches half a millisecond apart of a kernel of a few microseconds."""
    events: list[dict[str, Any]] = []
    for n in range(steps):
        t = BASE + n * 3_000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1,
                       "ts": t, "dur": 3_000.0, "args": {}})
        for k in range(5):
            corr = n * 10 + k + 1
            events += [
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                 "ts": t + 100 + k * 500.0, "dur": 400.0, "args": {"correlation": corr}},
                {"ph": "X", "cat": "kernel", "name": "reduce_kernel", "pid": 0, "tid": 7,
                 "ts": t + 505 + k * 500.0, "dur": 5.0, "args": {"stream": 7, "correlation": corr}}]
    return events


def test_a_handful_of_kernels_in_one_step_is_a_fragment_not_a_bottleneck(tmp_path: Path) -> None:
    fragment = diagnosed(write(tmp_path / "fragment.pt.trace.json.gz", launches(1)))
    assert any("5 kernel(s) in one step" in p for p in fragment.partial)
    assert fragment.verdict == "inconclusive"
    # The same launches repeated over steps are a pattern: launch-bound, however few a step.
    repeated = diagnosed(write(tmp_path / "steps.pt.trace.json.gz", launches(4)))
    assert not repeated.partial and repeated.verdict == "launch_bound"
