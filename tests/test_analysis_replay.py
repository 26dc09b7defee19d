"""The replay of a trace's dependency graph: the unmodified graph reproduces each H100 fixture's step
time, and the fixes move it the way the job's measured pair of traces did."""

from __future__ import annotations

import json
from functools import cache, partial
from pathlib import Path
from typing import Any

import pytest

from gpuscope.analysis.diagnose import diagnose
from gpuscope.analysis.gains import estimate_gains
from gpuscope.analysis.kineto_json import read_kineto
from gpuscope.analysis.model import Trace
from gpuscope.analysis.replay import fidelity, replay, step_time
from gpuscope.analysis.replay_fixes import (
    NotModelled,
    autograd_counterparts,
    close_launch_gaps,
    fuse_op,
    op_calls,
    overlap_communication,
    overlap_untraced_host,
    predict,
    prefetch_input,
    remove_host_syncs,
    replace_with_dense,
    scale_op,
    use_tensor_cores,
)
from gpuscope.analysis.replay_graph import DEVICE, SYNC, StepGraph, build_graph
from gpuscope.analysis.sources import read_trace

FIXTURES = Path(__file__).parent / "fixtures" / "traces" / "h100"
INDEX_BACKWARD = "autograd::engine::evaluate_function: IndexBackward0"


@cache
def graph_of(name: str) -> StepGraph:
    (path,) = FIXTURES.glob(f"{name}.*")
    return build_graph(read_trace(path))


# Measured mean step time (ms, from the step markers) and whether device work is tied to launches.
FIXTURE_STEPS = {
    "deep_narrow_mlp": (29.56, True),
    "healthy_mlp_bf16": (15.29, True),
    "resnet50_dataloader_no_workers": (172.59, True),
    "seg_fixed_loss": (48.05, True),
    "seg_masked_loss": (72.02, True),
    "jax_python_generator": (179.82, True),  # XSpace: CUDA graph launches and transfers
}


@pytest.mark.parametrize("name", sorted(FIXTURE_STEPS))
def test_unmodified_replay_reproduces_the_measured_step_time(name: str) -> None:
    (path,) = FIXTURES.glob(f"{name}.*")
    result = fidelity(read_trace(path))
    measured_ms, linked = FIXTURE_STEPS[name]
    assert result.measured_us / 1e3 == pytest.approx(measured_ms, abs=0.01)
    assert result.replayed_us == pytest.approx(result.measured_us, rel=0.02)
    assert result.linked is linked


def test_every_node_replays_to_its_measured_time() -> None:
    graph = graph_of("resnet50_dataloader_no_workers")  # kernels overlap on their stream (PDL)
    replayed = replay(graph)
    for i in range(len(graph)):
        assert replayed.start[i] == pytest.approx(graph.start[i], abs=0.01)
        assert replayed.end[i] == pytest.approx(graph.end(i), abs=0.01)


def test_synchronisations_wait_for_the_device_work_launched_before_them() -> None:
    graph = graph_of("seg_masked_loss")
    syncs = [i for i in range(len(graph)) if graph.kind[i] == SYNC]
    assert len(syncs) == 36  # nonzero, unique and item() each wait once
    waited = [i for i in syncs if graph.waits[i]]
    assert waited
    for sync in waited:
        for device in graph.waits[sync]:
            assert graph.kind[device] == DEVICE
            assert graph.start[graph.launch[device]] <= graph.start[sync]


def test_longer_device_work_lengthens_a_device_bound_step() -> None:
    graph = graph_of("seg_masked_loss")
    slower = graph.copy()
    for i in range(len(slower)):
        if slower.kind[i] == DEVICE:
            slower.dur[i] *= 2
    before, after = step_time(graph, replay(graph)), step_time(slower, replay(slower))
    assert 1.8 < after / before < 2.1


def test_masked_loss_fixes_predict_the_fixed_loss_speedup() -> None:
    """The dense loss (seg_fixed_loss) runs 72.02 -> 48.05 ms a step (1.50x). From the masked-loss
    trace alone, removing IndexBackward's kernels and its synchronisations predicts 1.32x: within 15%
    (the rest is the masked loss's forward indexing, which the fix does not name)."""
    measured = graph_of("seg_masked_loss").steps.time / graph_of("seg_fixed_loss").steps.time
    measured *= len(graph_of("seg_fixed_loss").steps.steps) / len(graph_of("seg_masked_loss").steps.steps)
    prediction = predict(graph_of("seg_masked_loss"), [partial(scale_op, op=INDEX_BACKWARD),
                                                       remove_host_syncs])
    assert measured == pytest.approx(1.50, abs=0.01)
    assert prediction.speedup == pytest.approx(measured, rel=0.15)
    assert 1.25 < prediction.speedup < 1.40
    assert [a.fix for a in prediction.assumptions] == ["costly_op", "host_sync"]
    assert "222 kernels of " + INDEX_BACKWARD in prediction.assumptions[0].text


def test_removing_the_synchronisations_of_a_device_bound_step_wins_little() -> None:
    prediction = predict(graph_of("seg_masked_loss"), [remove_host_syncs])
    assert 0 <= prediction.won_back < 0.05  # the device is busy 98% of the step


def test_one_background_loader_is_as_slow_as_the_input_it_prefetches() -> None:
    """resnet50 without workers: 75% of its 172.6 ms step in the DataLoader, 145 ms of loading a step."""
    prediction = predict(graph_of("resnet50_dataloader_no_workers"), [prefetch_input])
    assert 140e3 < prediction.after_us < 150e3
    assert {a.fix for a in prediction.assumptions} == {"input_bound"}


def test_enough_loaders_leave_the_step_its_device_time() -> None:
    prediction = predict(graph_of("resnet50_dataloader_no_workers"), [partial(prefetch_input, workers=4)])
    assert 40e3 < prediction.after_us < 60e3  # 40 ms of device work a step


def test_prefetching_needs_a_loader() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        prefetch_input(graph_of("resnet50_dataloader_no_workers"), workers=0)


def test_overlapping_the_dispatching_threads_python_leaves_the_device_and_the_dispatch() -> None:
    """jax_python_generator: a Python generator makes each batch on the thread that dispatches the
    steps (163 ms of 180 untraced); the device works 12.6 ms a step."""
    prediction = predict(graph_of("jax_python_generator"), [overlap_untraced_host])
    assert 3 < prediction.speedup < 6
    assert prediction.after_us > 12.6e3


def test_without_correlation_ids_a_fix_on_the_host_does_not_move_the_device() -> None:
    (path,) = FIXTURES.glob("jax_python_generator.*")
    trace = read_trace(path)
    for spans in trace.spans.values():
        for i in range(len(spans)):
            spans.corr[i] = -1
    graph = build_graph(trace)
    assert graph.linked == 0
    prediction = predict(graph, [overlap_untraced_host])
    assert prediction.after_us == pytest.approx(prediction.before_us, rel=1e-6)
    assert any(a.fix == "replay" and "no correlation ids" in a.text for a in prediction.assumptions)


def test_closing_launch_gaps_leaves_a_launch_bound_step_its_device_time() -> None:
    """deep_narrow_mlp: 6.1 ms of kernels a step in 29.6 ms, the device idle between 584 launches."""
    prediction = predict(graph_of("deep_narrow_mlp"), [close_launch_gaps])
    assert 2.5 < prediction.speedup < 4.5
    assert prediction.after_us > 6.1e3  # never below the device's own work


def test_closing_launch_gaps_wins_nothing_on_a_device_bound_step() -> None:
    prediction = predict(graph_of("healthy_mlp_bf16"), [close_launch_gaps])
    assert 0 <= prediction.won_back < 0.02


def test_a_negative_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="factor must be >= 0"):
        scale_op(graph_of("seg_masked_loss"), INDEX_BACKWARD, -1.0)


def test_a_faster_device_frees_a_host_that_waits_for_room_in_the_launch_queue() -> None:
    """seg_fixed_loss never synchronises: the host runs a full launch queue ahead of the device and its
    launches block until a kernel ends (up to 1.4 ms a call). Halving the convolutions' backward pass
    (62% of the device's time) shortens the step, through the launches that wait for it."""
    graph = graph_of("seg_fixed_loss")
    queued = [i for i in graph.waits if graph.kind[i] != SYNC]
    assert len(queued) > 100
    prediction = predict(graph, [partial(scale_op, op="autograd::engine::evaluate_function: "
                                                      "ConvolutionBackward0", factor=0.5)])
    assert 30e3 < prediction.after_us < 42e3


class TwoStreamSteps:
    """Kineto steps of a data-parallel job: the host launches a step's work ahead and synchronises at
    its end; on the device, ``compute`` kernels on stream 7, an all-reduce on stream 21 once they are
    done, then the optimizer's kernels on stream 7, which wait (an event) for the all-reduce."""

    def __init__(self, compute: int = 10, each: float = 500.0, allreduce: float = 3_000.0,
                 optimizer: int = 4) -> None:
        self.events: list[dict[str, Any]] = []
        self.corr = 0
        t = 1_000_000.0
        for n in range(6):
            host, device = t + 10.0, t + 30.0
            launched = []
            for stream, dur in [(7, each)] * compute + [(21, allreduce)] + [(7, each / 2)] * optimizer:
                launched.append((self.launch(host), stream, dur))
                host += 10.0
            for corr, stream, dur in launched:
                name = ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
                        if stream == 21 else "void at::native::vectorized_elementwise_kernel<4>(int)")
                self.kernel(name, device, dur, stream, corr)
                device += dur + (0.0 if stream == 21 else 2.0)
            self.host("cuda_runtime", "cudaDeviceSynchronize", host, device + 5.0 - host)
            end = device + 15.0
            self.host("user_annotation", f"ProfilerStep#{n}", t, end - t)
            t = end

    def host(self, cat: str, name: str, ts: float, dur: float, corr: int | None = None) -> None:
        args = {} if corr is None else {"correlation": corr}
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                            "args": args})

    def launch(self, ts: float) -> int:
        self.corr += 1
        self.host("cuda_runtime", "cudaLaunchKernel", ts, 5.0, self.corr)
        return self.corr

    def kernel(self, name: str, ts: float, dur: float, stream: int, corr: int) -> None:
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
                            "dur": dur, "args": {"device": 0, "stream": stream, "correlation": corr}})

    def read(self, path: Path) -> Trace:
        properties = [{"id": 0, "name": "NVIDIA H100", "computeMajor": 9, "computeMinor": 0}]
        path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": properties,
                                    "traceEvents": self.events}))
        return read_kineto(path)


def test_collectives_beside_the_compute_leave_the_step_its_compute(tmp_path: Path) -> None:
    """5 ms of compute, a 3 ms all-reduce after it, 1 ms of optimizer kernels that wait for it: 9 ms a
    step. With the all-reduce running beside the compute, the step is its 6 ms of compute."""
    trace = TwoStreamSteps().read(tmp_path / "ddp.pt.trace.json")
    graph = build_graph(trace)
    assert fidelity(trace).error < 0.02
    prediction = predict(graph, [overlap_communication])
    assert prediction.before_us == pytest.approx(9_060, rel=0.01)
    assert prediction.after_us == pytest.approx(6_060, rel=0.02)
    (assumption,) = prediction.assumptions
    assert assumption.fix == "communication_wait"
    assert "6 collective kernels" in assumption.text
    assert "6 compute kernels no longer wait" in assumption.text  # the optimizer's first, each step


def test_a_step_with_overlapped_collectives_is_no_shorter_than_its_communication(tmp_path: Path) -> None:
    """An 8 ms all-reduce beside 6 ms of compute: the step is the communication's 8 ms."""
    trace = TwoStreamSteps(allreduce=8_000.0).read(tmp_path / "ddp.pt.trace.json")
    prediction = predict(build_graph(trace), [overlap_communication])
    assert prediction.before_us == pytest.approx(14_060, rel=0.01)
    assert 8_000 <= prediction.after_us < 8_300
    assert "no shorter than the communication alone (8.0 ms a step)" in prediction.assumptions[0].text


def test_collectives_on_the_compute_stream_move_beside_it(tmp_path: Path) -> None:
    trace = TwoStreamSteps()
    for event in trace.events:
        if event["cat"] == "kernel":
            event["tid"] = event["args"]["stream"] = 7
    prediction = predict(build_graph(trace.read(tmp_path / "one.pt.trace.json")), [overlap_communication])
    assert prediction.after_us == pytest.approx(6_060, rel=0.02)


def test_overlapping_communication_needs_a_collective() -> None:
    with pytest.raises(NotModelled, match="no collective kernel"):
        overlap_communication(graph_of("healthy_mlp_bf16"))


def test_a_backward_function_and_its_forward_operator_are_counterparts() -> None:
    trace = graph_of("seg_masked_loss").trace
    assert autograd_counterparts(trace, INDEX_BACKWARD) == ["aten::index"]
    assert autograd_counterparts(trace, "aten::index") == [INDEX_BACKWARD]
    assert autograd_counterparts(trace, "aten::_unique2") == []


def test_a_fused_operation_makes_one_pass_a_call() -> None:
    """aten::cross_entropy_loss: a log-softmax and an nll_loss reduction a call, 3.2 ms a step; fused,
    the longest of the two (the reduction, 3.06 ms)."""
    graph = graph_of("seg_masked_loss")
    calls = op_calls(graph, {"aten::cross_entropy_loss"})
    assert {len(nodes) for nodes in calls.values()} == {2}
    fused = fuse_op(graph, "aten::cross_entropy_loss")
    for nodes in calls.values():
        kept = [fused.dur[i] for i in nodes]
        assert sorted(kept)[0] == 0.0
        assert max(kept) == max(graph.dur[i] for i in nodes)
    assert "make one pass a call" in fused.assumptions[-1].text


def test_the_communication_waits_gain_is_the_overlapped_step(tmp_path: Path) -> None:
    trace = TwoStreamSteps().read(tmp_path / "ddp.pt.trace.json")
    (found,) = [f for f in diagnose(trace).findings if f.kind == "communication_wait"]
    assert found.share == pytest.approx(3 / 9.06, abs=0.02)
    gain = estimate_gains(trace, [found]).of(found)
    assert (gain.before_ms, gain.after_ms) == (pytest.approx(9.06, rel=0.01), pytest.approx(6.06, rel=0.02))


def test_tensor_cores_shorten_fp32_kernels_no_further_than_the_shortest_kernel() -> None:
    """deep_narrow_mlp's fp32 kernels of a few microseconds stop at the trace's shortest kernel's time:
    a kernel's fixed cost, not its arithmetic, bounds them."""
    graph = graph_of("deep_narrow_mlp")
    fixed = use_tensor_cores(graph)
    shortest = min(graph.dur[i] for i in range(len(graph)) if graph.kind[i] == DEVICE and graph.dur[i] > 0)
    changed = [i for i in range(len(graph)) if fixed.dur[i] != graph.dur[i]]
    assert len(changed) == 1156
    assert {graph.kind[i] for i in changed} == {DEVICE}
    floored = [i for i in changed if fixed.dur[i] == shortest]
    assert floored and len(floored) < len(changed)
    for i in changed:
        assert fixed.dur[i] == pytest.approx(max(graph.dur[i] / 7.4, shortest))


def test_an_operation_with_no_device_work_has_no_dense_formulation_to_price() -> None:
    with pytest.raises(NotModelled, match="no device work of aten::nonexistent"):
        replace_with_dense(graph_of("seg_masked_loss"), "aten::nonexistent")


def test_the_dense_formulation_keeps_one_pass_of_each_call() -> None:
    graph = graph_of("seg_masked_loss")
    fixed = replace_with_dense(graph, INDEX_BACKWARD)
    calls = op_calls(graph, {INDEX_BACKWARD, "aten::index"})
    assert len(calls) == 19  # 12 backward calls on the autograd thread, 7 forward ones on the main thread
    for nodes in calls.values():
        kept = sorted(fixed.dur[i] for i in nodes)
        assert kept[:-1] == [0.0] * (len(nodes) - 1)
        assert kept[-1] == pytest.approx(min(144.0, sum(graph.dur[i] for i in nodes)), abs=1.0)


def test_an_input_wait_the_trace_ends_in_is_taken_out_too(tmp_path: Path) -> None:
    """Two 10 ms steps, each 4 ms of kernels then 6 ms waiting for the next batch: the last step's
    wait has no call after it (the capture ended), and prefetching takes it out as it does the first's."""
    events: list[dict[str, Any]] = []
    for n in range(2):
        start = 1_000_000.0 + n * 10_000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1,
                       "ts": start, "dur": 10_000.0, "args": {}})
        for k in range(4):
            corr = n * 10 + k + 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": start + 10.0 + k * 20.0, "dur": 5.0, "args": {"correlation": corr}})
            events.append({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "pid": 0, "tid": 7,
                           "ts": start + 30.0 + k * 1_000.0, "dur": 990.0,
                           "args": {"device": 0, "stream": 7, "correlation": corr}})
        events.append({"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": start + 4_000.0,
                       "dur": 6_000.0, "args": {},
                       "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"})
    path = tmp_path / "ends_waiting.pt.trace.json"
    path.write_text(json.dumps({"deviceProperties": [{"id": 0}], "traceEvents": events}))
    trace = read_kineto(path)
    assert fidelity(trace).error < 0.02
    prediction = predict(trace, [partial(prefetch_input, workers=8)])
    assert prediction.before_us == pytest.approx(10_000.0, rel=0.02)
    # Both steps lose their wait: what is left is the kernels' 4 ms (with 8 loaders, 0.75 ms of loading).
    assert prediction.after_us == pytest.approx(4_030.0, rel=0.05)
