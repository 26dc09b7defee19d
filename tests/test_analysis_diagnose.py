"""The findings on GPU traces: signals that exist only with a device (kernel gaps, CUDA runtime calls,
collectives) cannot come from the CPU builds of the frameworks this suite runs, so these traces are
written here in the formats the frameworks write (Kineto's Chrome trace JSON, as PyTorch exports it
with CUDA activity; XSpace, as TensorFlow and JAX write it) with a known share of each pattern, and
read through the same readers as a real trace. One real trace, captured by the agent from a PyTorch
job on an H200 (fixtures/traces), checks the whole on a GPU's own events.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuscope.analysis.diagnose import HIGH, MODERATE, Diagnosis, diagnose
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.kineto_json import read_kineto
from gpuscope.analysis.model import Kind, Trace
from gpuscope.analysis.render import format_diagnosis
from gpuscope.analysis.steps import find_steps
from gpuscope.analysis.xspace import read_xspace
from gpuscope.generated.tsl import xplane_pb2

STEP_US = 10_000.0
STEPS = 8
HOST, TID, DEVICE, STREAM = 1234, 1234, 0, 7


class KinetoTrace:
    """A PyTorch-shaped trace with CUDA activity: host events on one thread, kernels on stream 7."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": HOST, "tid": TID, "args": {"name": "python3"}}]

    def host(self, cat: str, name: str, ts: float, dur: float) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": HOST, "tid": TID, "ts": ts,
                            "dur": dur, "args": {}})

    def kernel(self, name: str, ts: float, dur: float, cat: str = "kernel") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": DEVICE, "tid": STREAM, "ts": ts,
                            "dur": dur, "args": {"device": DEVICE, "stream": STREAM}})

    def launch(self, ts: float, dur: float = 5.0) -> None:
        self.host("cuda_runtime", "cudaLaunchKernel", ts, dur)

    def write(self, path: Path) -> Trace:
        path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "H100"}],
                                    "traceEvents": self.events}))
        return read_kineto(path)


def steps(build: Callable[[KinetoTrace, float, int], None]) -> KinetoTrace:
    trace = KinetoTrace()
    for n in range(STEPS):
        start = 1_000_000.0 + n * STEP_US
        trace.host("user_annotation", f"ProfilerStep#{n}", start, STEP_US)
        build(trace, start, n)
    return trace


def run(tmp_path: Path, build: Callable[[KinetoTrace, float, int], None]) -> Diagnosis:
    diagnosis = diagnose(steps(build).write(tmp_path / "trace.pt.trace.json"))
    assert format_diagnosis(diagnosis)  # renders
    return diagnosis


def kernels(trace: KinetoTrace, start: float, length: float, *, each: float = 500.0, gap: float = 2.0,
            name: str = "sm90_xmma_gemm_bf16") -> float:
    """Back-to-back kernels covering [start, start + length); where they end."""
    t = start
    while t + each <= start + length:
        trace.launch(t - 50.0)
        trace.kernel(name, t, each)
        t += each + gap
    return t


def finding(diagnosis: Diagnosis, kind: str) -> Any:
    (found,) = [f for f in diagnosis.findings if f.kind == kind]
    return found


# -- the verdicts --------------------------------------------------------------------------------------


def test_a_busy_gpu_is_healthy(tmp_path: Path) -> None:
    diagnosis = run(tmp_path, lambda t, start, n: kernels(t, start + 20.0, STEP_US - 40.0))
    assert diagnosis.verdict == "healthy"
    assert diagnosis.findings == ()
    assert diagnosis.breakdown["busy"] > 0.94
    assert (diagnosis.steps, diagnosis.step_method, diagnosis.device) == (STEPS, "markers", True)


def test_waiting_for_the_dataloader_is_input_bound(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        t.host("user_annotation", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
               start, 4_000.0)
        kernels(t, start + 4_000.0, 6_000.0)

    diagnosis = run(tmp_path, build)
    assert diagnosis.verdict == "input_bound"
    found = finding(diagnosis, "input_bound")
    assert found.severity == "high"
    assert found.share == pytest.approx(0.40, abs=0.01)
    assert found.evidence[0].name.startswith("enumerate(DataLoader)")
    assert found.evidence[0].count == STEPS
    assert found.evidence[0].time_ms == pytest.approx(STEPS * 4.0, rel=0.01)
    assert "num_workers" in found.remedy


def test_the_gpu_idle_behind_item_calls_is_host_sync(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        end = kernels(t, start, 6_000.0, each=600.0, gap=0.0)
        # .item(): the host waits for the stream, reads the value back, then works 3 ms before it
        # launches the next step's kernels.
        t.host("cpu_op", "aten::item", start + 200.0, end - start - 100.0)
        t.host("cpu_op", "aten::_local_scalar_dense", start + 210.0, end - start - 120.0)
        t.host("cuda_runtime", "cudaStreamSynchronize", start + 220.0, end - start - 140.0)
        t.kernel("Memcpy DtoH (Device -> Pinned)", end, 4.0, cat="gpu_memcpy")

    diagnosis = run(tmp_path, build)
    assert diagnosis.verdict == "host_sync"
    found = finding(diagnosis, "host_sync")
    assert found.per_step == 1.0  # the runtime call inside the op is not counted again
    assert found.share == pytest.approx(0.40, abs=0.02)
    assert found.severity == "high"
    assert found.evidence[0].name == "aten::_local_scalar_dense"


def test_an_explicit_synchronize_counts_as_a_sync_point(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        end = kernels(t, start, 7_000.0, each=700.0, gap=0.0)
        t.host("cuda_runtime", "cudaDeviceSynchronize", start + 100.0, end - start - 90.0)

    diagnosis = run(tmp_path, build)
    found = finding(diagnosis, "host_sync")
    assert (found.per_step, found.evidence[0].name) == (1.0, "cudaDeviceSynchronize")
    assert found.share == pytest.approx(0.30, abs=0.02)


def test_many_tiny_kernels_with_launch_gaps_is_launch_bound(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        at = start
        while at + 20.0 <= start + STEP_US:
            t.launch(at, 14.0)
            t.kernel("vectorized_elementwise_kernel<add>", at + 14.0, 5.0)
            at += 20.0

    diagnosis = run(tmp_path, build)
    assert diagnosis.verdict == "launch_bound"
    found = finding(diagnosis, "launch_bound")
    assert found.severity == "high"
    assert found.share == pytest.approx(0.75, abs=0.02)
    assert found.per_step == pytest.approx(STEP_US / 20.0, rel=0.01)
    assert "CUDA graphs" in found.remedy


def test_long_kernels_with_short_gaps_are_not_launch_bound(tmp_path: Path) -> None:
    """Gaps of 100 us between 1 ms kernels: 9% idle, but the kernels are long, and the host is not
    launching during the gaps (launched well ahead): not launch overhead."""
    def build(t: KinetoTrace, start: float, n: int) -> None:
        at = start
        while at + 1_100.0 <= start + STEP_US:
            t.launch(start + (at - start) / 100, 5.0)
            t.kernel("sm90_gemm", at, 1_000.0)
            at += 1_100.0

    diagnosis = run(tmp_path, build)
    assert "launch_bound" not in {f.kind for f in diagnosis.findings}


def test_exposed_allreduce_is_communication_wait(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        end = kernels(t, start, 6_000.0)
        t.kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", end,
                 3_500.0)

    diagnosis = run(tmp_path, build)
    assert diagnosis.verdict == "communication_wait"
    found = finding(diagnosis, "communication_wait")
    assert found.share == pytest.approx(0.35, abs=0.02)
    assert found.evidence[0].name.startswith("ncclDevKernel_AllReduce")


def test_allreduce_overlapped_with_compute_is_not_a_wait(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        kernels(t, start, STEP_US - 10.0)
        t.events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum", "pid": DEVICE,
                         "tid": 21, "ts": start + 1_000.0, "dur": 5_000.0, "args": {"stream": 21}})

    assert run(tmp_path, build).verdict == "healthy"


def test_host_work_between_steps_is_idle_between_steps(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        end = kernels(t, start, 6_000.0, each=600.0, gap=0.0)
        t.host("cpu_op", "aten::_save_checkpoint", end + 10.0, 3_900.0)

    diagnosis = run(tmp_path, build)
    assert diagnosis.verdict == "idle_between_steps"
    found = finding(diagnosis, "idle_between_steps")
    assert found.share == pytest.approx(0.40, abs=0.02)
    assert found.evidence[0].name == "aten::_save_checkpoint"


@pytest.mark.parametrize(("idle_us", "severity"), [(390.0, None), (600.0, "moderate"), (2_100.0, "high")])
def test_severity_follows_the_documented_thresholds(tmp_path: Path, idle_us: float, severity: str | None,
                                                    ) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        t.host("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", start,
               idle_us)
        kernels(t, start + idle_us, STEP_US - idle_us, each=100.0, gap=0.0)

    diagnosis = run(tmp_path, build)
    found = [f for f in diagnosis.findings if f.kind == "input_bound"]
    assert [f.severity for f in found] == ([severity] if severity else [])
    assert (MODERATE, HIGH) == (0.05, 0.20)


def test_findings_come_most_severe_first(tmp_path: Path) -> None:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        t.host("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", start, 800.0)
        end = kernels(t, start + 800.0, 5_000.0)
        t.host("cpu_op", "aten::_save_checkpoint", end + 10.0, start + STEP_US - end - 20.0)

    diagnosis = run(tmp_path, build)
    assert [(f.kind, f.severity) for f in diagnosis.findings] == [("idle_between_steps", "high"),
                                                                  ("input_bound", "moderate")]


# -- XSpace --------------------------------------------------------------------------------------------


def xspace_input_bound(path: Path) -> Path:
    """A TensorFlow-shaped XSpace: steps annotated with step_num, tf.data's IteratorGetNext on the host
    while the GPU idles, then kernels on a stream; a derived "XLA Ops" line that must not count."""
    space = xplane_pb2.XSpace()
    host = space.planes.add(id=1, name="/host:CPU")
    names = {1: "train_step", 2: "Iterator::GetNext", 3: "cudaLaunchKernel"}
    for key, name in names.items():
        host.event_metadata[key].id = key
        host.event_metadata[key].name = name
    host.stat_metadata[1].id, host.stat_metadata[1].name = 1, "step_num"
    host.stat_metadata[2].id, host.stat_metadata[2].name = 2, "_r"
    line = host.lines.add(id=7, name="tf_pool/7", timestamp_ns=1_000_000)
    device = space.planes.add(id=2, name="/device:GPU:0")
    device.event_metadata[1].id, device.event_metadata[1].name = 1, "volta_sgemm_128x64_nn"
    stream = device.lines.add(id=1, name="Stream #14(MemcpyH2D,Compute)", timestamp_ns=1_000_000)
    derived = device.lines.add(id=2, name="XLA Ops", timestamp_ns=1_000_000)
    ps = 1_000_000  # picoseconds per microsecond
    for n in range(STEPS):
        start = int(n * STEP_US) * ps
        step = line.events.add(metadata_id=1, offset_ps=start, duration_ps=int(STEP_US) * ps)
        step.stats.add(metadata_id=1, int64_value=n)
        step.stats.add(metadata_id=2, int64_value=1)
        line.events.add(metadata_id=2, offset_ps=start, duration_ps=3_000 * ps)
        line.events.add(metadata_id=3, offset_ps=start + 3_000 * ps, duration_ps=5 * ps)
        stream.events.add(metadata_id=1, offset_ps=start + 3_010 * ps, duration_ps=6_980 * ps)
        derived.events.add(metadata_id=1, offset_ps=start, duration_ps=int(STEP_US) * ps)
    path.write_bytes(space.SerializeToString())
    return path


def test_an_xspace_trace_with_tf_data_waits_is_input_bound(tmp_path: Path) -> None:
    diagnosis = diagnose(read_xspace(xspace_input_bound(tmp_path / "host.xplane.pb")))
    assert (diagnosis.format, diagnosis.steps, diagnosis.step_method) == ("xspace", STEPS, "markers")
    found = finding(diagnosis, "input_bound")
    assert found.share == pytest.approx(0.30, abs=0.01)
    assert found.evidence[0].name == "Iterator::GetNext"
    assert diagnosis.verdict == "input_bound"


# -- steps ---------------------------------------------------------------------------------------------


def test_steps_come_from_optimizer_annotations_when_no_step_is_marked(tmp_path: Path) -> None:
    trace = KinetoTrace()
    for n in range(5):
        trace.host("user_annotation", "Optimizer.step#SGD.step", 1_000.0 * n + 900.0, 50.0)
    found = find_steps(trace.write(tmp_path / "t.json"))
    assert found.method == "optimizer"
    assert [round(s.duration) for s in found.steps] == [1000, 1000, 1000, 1000]


def test_steps_repeat_the_longest_top_level_operation_otherwise(tmp_path: Path) -> None:
    trace = KinetoTrace()
    for n in range(4):
        trace.host("cpu_op", "PjitFunction(train_step)", 2_000.0 * n, 800.0)
        trace.host("cpu_op", "aten::add", 2_000.0 * n + 100.0, 10.0)  # nested: not a candidate
        trace.host("cpu_op", "log_metrics", 2_000.0 * n + 1_000.0, 100.0)
    found = find_steps(trace.write(tmp_path / "t.json"))
    assert (found.method, found.marker, len(found.steps)) == ("periodic", "PjitFunction(train_step)", 3)


def test_a_trace_that_does_not_repeat_is_one_step(tmp_path: Path) -> None:
    trace = KinetoTrace()
    trace.host("cpu_op", "aten::mm", 0.0, 100.0)
    trace.kernel("gemm", 10.0, 50.0)
    diagnosis = diagnose(trace.write(tmp_path / "t.json"))
    assert (diagnosis.steps, diagnosis.step_method) == (1, "whole")
    assert any("whole trace" in limit for limit in diagnosis.limits)


# -- interval arithmetic -------------------------------------------------------------------------------


def test_interval_sets_answer_covered_time_in_any_window() -> None:
    spans = IntervalSet.merge([(5, 7), (0, 2), (1, 3), (10, 12)])
    assert list(spans) == [(0, 3), (5, 7), (10, 12)]
    assert spans.total == 7
    assert [spans.covered(a, b) for a, b in [(0, 12), (2, 6), (3, 5), (6, 11), (-5, 0), (12, 20)]] == [
        7, 2, 0, 2, 0, 0]
    other = IntervalSet.merge([(1, 6)])
    assert list(spans.difference(other)) == [(0, 1), (6, 7), (10, 12)]
    assert list(spans.intersection(other)) == [(1, 3), (5, 6)]
    assert spans.gaps(0, 12) == [(3, 5), (7, 10)]
    assert spans.gap_around(4) == (3, 5) and spans.gap_around(6) is None and spans.gap_around(13) == (12,
                                                                                                  float("inf"))


def test_spans_are_sorted_and_start_at_zero(tmp_path: Path) -> None:
    trace = KinetoTrace()
    trace.kernel("b", 5_000.0, 1.0)
    trace.kernel("a", 4_000.0, 1.0)
    read = trace.write(tmp_path / "t.json")
    assert [(s.start, s.name) for s in read.iter(Kind.KERNEL)] == [(0.0, "a"), (1_000.0, "b")]


def test_jax_dispatch_around_each_step_on_the_cpu_is_launch_overhead(tmp_path: Path) -> None:
    """XLA on the CPU (a JAX job without a GPU), taken over the profiler server (no metadata plane):
    each 5 ms step spends 0.8 ms in PjitFunction's dispatch before the computation runs."""
    space = xplane_pb2.XSpace()
    host = space.planes.add(id=1, name="/host:CPU")
    for key, name in {1: "train", 2: "PjitFunction(train_step)", 3: "fusion.3"}.items():
        host.event_metadata[key].id = key
        host.event_metadata[key].name = name
    host.stat_metadata[1].id, host.stat_metadata[1].name = 1, "step_num"
    main = host.lines.add(id=1, name="python", timestamp_ns=1_000_000)
    xla = host.lines.add(id=2, name="tf_XLAPjRtCpuClient/2", timestamp_ns=1_000_000)
    ps = 1_000_000
    for n in range(STEPS):
        start = n * 5_000 * ps
        main.events.add(metadata_id=1, offset_ps=start, duration_ps=5_000 * ps).stats.add(
            metadata_id=1, int64_value=n)
        main.events.add(metadata_id=2, offset_ps=start, duration_ps=5_000 * ps)
        xla.events.add(metadata_id=3, offset_ps=start + 800 * ps, duration_ps=4_200 * ps)
    path = tmp_path / "jax.xplane.pb"
    path.write_bytes(space.SerializeToString())
    trace = read_xspace(path)
    diagnosis = diagnose(trace)
    assert trace.framework == "jax"
    assert diagnosis.verdict == "launch_bound"
    found = finding(diagnosis, "launch_bound")
    assert found.share == pytest.approx(0.16, abs=0.01)
    assert "while the framework dispatches it (0.80 ms per step)" in found.summary
    assert found.evidence[0].name == "PjitFunction(train_step)"
    assert diagnosis.breakdown["dispatch"] == pytest.approx(0.16, abs=0.01)


def test_item_of_a_cpu_tensor_and_a_sync_on_an_idle_device_are_not_host_syncs(tmp_path: Path) -> None:
    """On a GPU trace, ``.item()`` that calls no CUDA runtime read a CPU tensor; a synchronisation that
    began while the device was already idle did not cause the gap it ended in."""
    def build(t: KinetoTrace, start: float, n: int) -> None:
        end = kernels(t, start, 6_000.0, each=600.0, gap=0.0)
        for k in range(20):  # metrics on CPU tensors, in the idle tail
            t.host("cpu_op", "aten::_local_scalar_dense", end + 100.0 + k * 10, 2.0)
        t.host("cuda_runtime", "cudaStreamSynchronize", end + 500.0, 10.0)  # the device was idle already
        t.host("cpu_op", "aten::_save_checkpoint", end + 600.0, 3_000.0)

    diagnosis = run(tmp_path, build)
    assert "host_sync" not in {f.kind for f in diagnosis.findings}
    assert diagnosis.breakdown["host_sync"] == 0
    assert diagnosis.verdict == "idle_between_steps"


def test_a_step_cut_by_the_end_of_the_recording_is_left_out(tmp_path: Path) -> None:
    trace = steps(lambda t, start, n: kernels(t, start, STEP_US - 10.0))
    trace.host("user_annotation", f"ProfilerStep#{STEPS}", 1_000_000.0 + STEPS * STEP_US, 49.0)
    diagnosis = diagnose(trace.write(tmp_path / "t.json"))
    assert (diagnosis.steps, diagnosis.mean_step_ms) == (STEPS, pytest.approx(STEP_US / 1e3))


def test_a_capture_of_start_up_says_so(tmp_path: Path) -> None:
    trace = KinetoTrace()
    trace.host("user_annotation", "[param|benchmark]", 0.0, 40e6)
    trace.host("cuda_runtime", "cudaDeviceGetStreamPriorityRange", 1e6, 29e6)
    trace.kernel("first_conv", 30e6, 1e3)
    diagnosis = diagnose(trace.write(tmp_path / "t.json"))
    assert any(limit.startswith("The device's first activity comes 30.0 s into the trace: it recorded "
                                "start-up") for limit in diagnosis.limits)


REAL_TRACE = Path(__file__).parent / "fixtures" / "traces" / "h200_pytorch_input_loop.pt.trace.json.gz"


def test_a_real_pytorch_trace_from_an_h200_is_host_sync_with_its_sync_points_counted() -> None:
    # Captured by the agent through Kineto's on-demand protocol from a PyTorch job on an H200: each
    # step makes its batch on the CPU, copies it to the GPU from pageable memory (x and y: each copy
    # waits for the stream), runs four forward/backward passes of an MLP and reads the loss with
    # .item(). The GPU idles while the host, held at the .item(), makes the next batch.
    diagnosis = diagnose(read_kineto(REAL_TRACE))
    assert format_diagnosis(diagnosis)
    assert (diagnosis.framework, diagnosis.device, diagnosis.step_method) == ("pytorch", True, "markers")
    assert diagnosis.steps >= 10
    assert 80.0 <= diagnosis.mean_step_ms <= 120.0
    assert diagnosis.verdict == "host_sync"
    found = finding(diagnosis, "host_sync")
    assert found.severity == "high"
    assert 0.2 <= found.share <= 0.4
    assert found.per_step == pytest.approx(3.0, abs=0.3)  # the .item() and the two pageable copies
    assert {e.name for e in found.evidence} == {"aten::_local_scalar_dense", "cudaStreamSynchronize"}
    assert diagnosis.breakdown["compute"] == pytest.approx(1.0 - found.share, abs=0.02)
    assert diagnosis.breakdown["input"] < 0.01  # no DataLoader: nothing waits on one


def test_an_optimizers_reads_of_its_cpu_step_counters_are_not_sync_points_on_a_cpu_trace(
        tmp_path: Path) -> None:
    """AdamW reads each parameter's step counter (a CPU tensor) with .item(): on a trace without the
    device's side, those are not synchronisation points; a read in the step's own code still is."""
    trace = KinetoTrace()
    for n in range(STEPS):
        start = 1_000_000.0 + n * STEP_US
        trace.host("user_annotation", f"ProfilerStep#{n}", start, STEP_US)
        trace.host("user_annotation", "Optimizer.step#AdamW.step", start + 6_000.0, 3_000.0)
        for k in range(32):
            trace.host("cpu_op", "aten::_local_scalar_dense", start + 6_010.0 + k * 50.0, 5.0)
        if n % 2 == 0:
            trace.host("cpu_op", "aten::_local_scalar_dense", start + 9_500.0, 5.0)  # loss.item() every 2
    trace.events = [e for e in trace.events if e.get("cat") != "kernel"]
    path = tmp_path / "cpu.pt.trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": trace.events}))
    diagnosis = diagnose(read_kineto(path))
    assert not diagnosis.device
    (check,) = [c for c in diagnosis.checks if c.kind == "host_sync"]
    assert check.value == 0.5
    assert diagnosis.verdict == "healthy"
