"""What a busy device does, and a GPU shared by the processes of one capture: Kineto traces written here
with a known share of each pattern (kernels tied to their operators by correlation ids, grid sizes as
Kineto records them), read through the real reader and the real `gpuscope explain`."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from gpuscope.analysis.diagnose import Diagnosis, diagnose
from gpuscope.analysis.kineto_json import read_kineto
from gpuscope.analysis.render import format_diagnosis
from gpuscope.cli.explain import explain_path

STEP_US = 10_000.0
STEPS = 8
MAIN, STREAM = 100, 7
BASE_NS = 1_795_000_000_000_000_000  # a Unix time in 2026


class Job:
    """A PyTorch-shaped trace: each kernel launched by a cudaLaunchKernel inside its operator on the
    main thread, tied to it by a correlation id, with Kineto's "blocks per SM"."""

    def __init__(self, pid: int = 1, *, capability: tuple[int, int] | None = (9, 0)) -> None:
        self.pid = pid
        self.events: list[dict[str, Any]] = []
        self.correlation = 1000 * pid
        self.capability = capability

    def op(self, name: str, ts: float, dur: float, cat: str = "cpu_op") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": self.pid, "tid": MAIN, "ts": ts,
                            "dur": dur, "args": {}})

    def kernel(self, op: str, kernel: str, ts: float, dur: float, *, blocks_per_sm: float = 4.0) -> None:
        """``op`` launches ``kernel`` 20 us before it runs at ``ts``."""
        self.correlation += 1
        self.op(op, ts - 25.0, 10.0)
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": self.pid,
                            "tid": MAIN, "ts": ts - 20.0, "dur": 4.0,
                            "args": {"correlation": self.correlation}})
        self.events.append({"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": STREAM, "ts": ts,
                            "dur": dur, "args": {"stream": STREAM, "correlation": self.correlation,
                                                 "blocks per SM": blocks_per_sm}})

    def steps(self, parts: list[tuple[str, str, float]], *, offset: float = 0.0, **kernel: Any) -> Job:
        """Every step runs ``parts`` (op, kernel, microseconds) back to back from its start."""
        for n in range(STEPS):
            start = 1_000_000.0 + offset + n * STEP_US
            self.op(f"ProfilerStep#{n}", start, STEP_US, cat="user_annotation")
            at = start + 30.0
            for op, name, dur in parts:
                self.kernel(op, name, at, dur, **kernel)
                at += dur
        return self

    def write(self, path: Path) -> Path:
        properties = [] if self.capability is None else [
            {"id": 0, "name": "GPU", "computeMajor": self.capability[0], "computeMinor": self.capability[1],
             "numSms": 132}]
        path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": properties,
                                    "baseTimeNanoseconds": BASE_NS, "traceEvents": self.events}))
        return path

    def diagnose(self, tmp_path: Path) -> Diagnosis:
        diagnosis = diagnose(read_kineto(self.write(tmp_path / f"job{self.pid}.pt.trace.json")))
        assert format_diagnosis(diagnosis)
        return diagnosis


FP32_CONV = "void cudnn::cnn::wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>(int, float*)"
BF16_GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT"
TO_NHWC = "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>(int)"
INDEX_BACKWARD = "void (anonymous namespace)::indexing_backward_kernel_stride_1<float>(long const*)"
SPIN = "void spin_wait_kernel(int*)"


def kinds(diagnosis: Diagnosis) -> dict[str, str]:
    return {f.kind: f.severity for f in diagnosis.findings}


def test_fp32_convolutions_on_a_tensor_core_gpu_leave_its_tensor_cores_idle(tmp_path: Path) -> None:
    job = Job().steps([("aten::conv2d", FP32_CONV, 6_000.0), ("aten::linear", BF16_GEMM, 3_800.0)])
    diagnosis = job.diagnose(tmp_path)
    assert diagnosis.verdict == "tensor_cores_idle"
    (found,) = [f for f in diagnosis.findings if f.kind == "tensor_cores_idle"]
    assert found.severity == "high" and found.share == pytest.approx(0.60, abs=0.01)
    assert (found.evidence[0].name, found.evidence[0].count) == ("aten::conv2d", STEPS)
    assert found.evidence[0].detail.startswith("cudnn::cnn::wgrad_alg0_engine<float")
    assert "compute capability 9.0" in found.summary and "autocast" in found.remedy
    profile = diagnosis.device_profile
    assert profile is not None and profile["attributed"] == 1.0
    assert [op["name"] for op in profile["ops"]] == ["aten::conv2d", "aten::linear"]


def test_a_gpu_without_tensor_cores_is_not_told_to_use_them(tmp_path: Path) -> None:
    job = Job(capability=(6, 1)).steps([("aten::conv2d", FP32_CONV, 9_800.0)])
    diagnosis = job.diagnose(tmp_path)
    assert diagnosis.verdict == "healthy"
    assert "tensor_cores_idle" not in {c.kind for c in diagnosis.checks}


def test_layout_conversions_and_a_costly_indexing_op_are_named(tmp_path: Path) -> None:
    job = Job().steps([("aten::conv2d", BF16_GEMM, 6_000.0), ("aten::conv2d", TO_NHWC, 1_000.0),
                       ("autograd::engine::evaluate_function: IndexBackward0", INDEX_BACKWARD, 2_500.0)])
    diagnosis = job.diagnose(tmp_path)
    assert kinds(diagnosis) == {"costly_op": "high", "layout_conversion": "moderate"}
    (costly,) = [f for f in diagnosis.findings if f.kind == "costly_op"]
    assert costly.share == pytest.approx(0.25, abs=0.01) and costly.per_step == 1.0
    assert costly.evidence[0].name == "autograd::engine::evaluate_function: IndexBackward0"
    assert "indexing_backward_kernel_stride_1<float>" in costly.summary


def test_kernels_that_fill_few_sms_are_small_grids(tmp_path: Path) -> None:
    """A GPU NVML calls 98% busy whose kernels run one block on a few of its 132 SMs."""
    job = Job().steps([("aten::spin", SPIN, 9_800.0)], blocks_per_sm=0.0076)
    diagnosis = job.diagnose(tmp_path)
    assert diagnosis.verdict == "small_grids"
    (found,) = diagnosis.findings
    assert found.severity == "high" and found.share == pytest.approx(0.98, abs=0.01)
    assert found.evidence[0].name == "spin_wait_kernel" and found.evidence[0].detail == "aten::spin"


def test_an_idle_device_makes_its_kernels_efficiency_low(tmp_path: Path) -> None:
    """Busy 30% of each step: fp32 kernels are not what the step waits for."""
    job = Job().steps([("aten::conv2d", FP32_CONV, 3_000.0)])
    for n in range(STEPS):
        job.op("aten::_save_checkpoint", 1_000_000.0 + n * STEP_US + 3_100.0, 6_800.0)
    diagnosis = job.diagnose(tmp_path)
    assert diagnosis.verdict == "idle_between_steps"
    assert kinds(diagnosis)["tensor_cores_idle"] == "low"


def capture_of(folder: Path, jobs: list[Job], *, gpu: int | None = 0) -> Path:
    folder.mkdir()
    for job in jobs:
        job.write(folder / f"node_{job.pid}.1.pt.trace.json")
    (folder / "capture.json").write_text(json.dumps({"id": "x", "gpu": gpu}))
    return folder


def explain_json(path: Path) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert explain_path(path, as_json=True) == 0
    return dict(json.loads(out.getvalue()))


def test_two_processes_whose_kernels_overlap_on_one_gpu_share_it(tmp_path: Path) -> None:
    """Time-sliced, each process's kernels stretch over the other's slices: both look busy all the time,
    at the same time."""
    trainer = Job(1).steps([("aten::linear", BF16_GEMM, 9_900.0)])
    evaluator = Job(2).steps([("aten::linear", BF16_GEMM, 9_900.0)], offset=3_000.0)
    report = explain_json(capture_of(tmp_path / "capture", [trainer, evaluator]))
    first, second = report["traces"]
    assert report["verdict"] == "shared_gpu"
    for trace, other in ((first, "node_2.1.pt.trace.json"), (second, "node_1.1.pt.trace.json")):
        assert [f["kind"] for f in trace["findings"]] == ["shared_gpu"]
        (shared,) = trace["findings"]
        assert shared["severity"] == "high" and shared["share"] > 0.6
        assert shared["evidence"][0]["name"].endswith(other)
        assert "one process per GPU" in shared["remedy"]
    # All but the first 3 ms of its first step and the 0.1 ms gaps: (6.9 + 7 x 9.8) ms in 80 ms.
    assert first["findings"][0]["share"] == pytest.approx(0.944, abs=0.005)


def test_processes_that_take_turns_or_are_not_of_one_gpu_share_nothing(tmp_path: Path) -> None:
    first = Job(1).steps([("aten::linear", BF16_GEMM, 4_000.0)])
    second = Job(2).steps([("aten::linear", BF16_GEMM, 4_000.0)], offset=5_000.0)
    turns = explain_json(capture_of(tmp_path / "turns", [first, second]))
    assert turns["verdict"] == "host_bound"  # each idles 60% of its step, outside any operation
    assert all(f["kind"] != "shared_gpu" for t in turns["traces"] for f in t["findings"])
    assert [c["value"] for t in turns["traces"] for c in t["checks"] if c["kind"] == "shared_gpu"] == [0, 0]
    # Overlapping, but not known to be on one GPU (no capture record naming one): not compared.
    overlapping = [Job(3).steps([("aten::linear", BF16_GEMM, 9_900.0)]),
                   Job(4).steps([("aten::linear", BF16_GEMM, 9_900.0)])]
    for folder, gpu in (("ranks", None), ("plain", 0)):
        path = capture_of(tmp_path / folder, overlapping, gpu=gpu)
        if folder == "plain":
            (path / "capture.json").unlink()
        report = explain_json(path)
        # Two traces of no one capture or job: each its own verdict, none over both.
        assert report["verdict"] == ("healthy" if folder == "ranks" else None)
        assert [t["verdict"] for t in report["traces"]] == ["healthy", "healthy"]
        assert all(c["kind"] != "shared_gpu" for t in report["traces"] for c in t["checks"])


def test_collectives_that_gather_are_communication_not_a_costly_op(tmp_path: Path) -> None:
    """FSDP's all-gathers overlap the compute on their own stream: the device time of c10d's
    all-gather is communication, not a data-dependent operation to replace."""
    job = Job().steps([("aten::linear", BF16_GEMM, 7_000.0),
                       ("c10d::_allgather_base_", "ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 2_800.0)])
    diagnosis = job.diagnose(tmp_path)
    assert "costly_op" not in {f.kind for f in diagnosis.findings}
    (check,) = [c for c in diagnosis.checks if c.kind == "costly_op"]
    assert check.value == 0


def test_backward_on_the_autograd_thread_is_traced_host_work_not_untraced_python(tmp_path: Path) -> None:
    """PyTorch runs the backward pass on the autograd engine's thread, while the main thread waits in
    code the profiler does not trace: that thread's operators are traced work, not Python. The device
    idles inside the step while they run: the host is slower than the device (not idle between steps)."""
    job = Job()
    for n in range(STEPS):
        start = 1_000_000.0 + n * STEP_US
        job.op(f"ProfilerStep#{n}", start, STEP_US, cat="user_annotation")
        job.kernel("aten::linear", BF16_GEMM, start + 30.0, 2_000.0)
        for k in range(4):  # the backward: an operator on thread 2, then the device idles 1.5 ms
            at = start + 2_100.0 + k * 1_900.0
            job.correlation += 1
            job.events.append({"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: "
                               "AddmmBackward0", "pid": 1, "tid": 2, "ts": at, "dur": 1_850.0, "args": {}})
            job.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                               "tid": 2, "ts": at + 1_800.0, "dur": 4.0,
                               "args": {"correlation": job.correlation}})
            job.events.append({"ph": "X", "cat": "kernel", "name": BF16_GEMM, "pid": 0, "tid": STREAM,
                               "ts": at + 1_820.0, "dur": 300.0, "args": {"stream": STREAM,
                                                                          "correlation": job.correlation}})
    diagnosis = job.diagnose(tmp_path)
    assert "idle_between_steps" not in {f.kind for f in diagnosis.findings}
    assert diagnosis.verdict == "host_bound"
    assert diagnosis.breakdown["host_busy"] > 0.5 and diagnosis.breakdown["host_untraced"] < 0.05
    (found,) = [f for f in diagnosis.findings if f.kind == "host_bound"]
    assert "runs the steps' own operations" in found.summary
    assert found.evidence[0].name == "autograd::engine::evaluate_function: AddmmBackward0"


def test_untraced_time_on_the_step_thread_is_host_bound_named_by_its_marker(tmp_path: Path) -> None:
    job = Job().steps([("aten::linear", BF16_GEMM, 4_000.0)])  # then 6 ms in untraced Python
    diagnosis = job.diagnose(tmp_path)
    assert diagnosis.verdict == "host_bound"
    (found,) = diagnosis.findings
    marker, untraced, device = found.evidence
    assert (marker.name, marker.count) == ("ProfilerStep", STEPS)
    assert marker.time_ms == pytest.approx(STEPS * STEP_US / 1e3)
    assert "runs ProfilerStep (every 10.0 ms)" in found.summary
    assert untraced.time_ms / STEPS == pytest.approx(6.0, abs=0.1)
    assert device.count == STEPS and device.time_ms / STEPS == pytest.approx(4.0, abs=0.1)


def test_a_process_that_drives_two_gpus_fills_each_at_its_own_share(tmp_path: Path) -> None:
    """fp32 convolutions 40% of the step on each of two GPUs: 40%, not 80%."""
    job = Job().steps([("aten::conv2d", FP32_CONV, 4_000.0), ("aten::linear", BF16_GEMM, 5_800.0)])
    job.events += [{**e, "pid": 1 if e["pid"] == 0 else e["pid"]} for e in job.events if e["cat"] == "kernel"]
    diagnosis = job.diagnose(tmp_path)
    assert diagnosis.device_profile is not None and diagnosis.device_profile["devices"] == 2
    (found,) = [f for f in diagnosis.findings if f.kind == "tensor_cores_idle"]
    assert found.share == pytest.approx(0.40, abs=0.01)


def test_non_finite_times_are_left_out_and_tiny_steps_do_not_fail(tmp_path: Path) -> None:
    path = tmp_path / "odd.pt.trace.json"
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1,
               "ts": 10.0 + n, "dur": 1.0} for n in range(4)]
    events += [{"ph": "X", "cat": "kernel", "name": "void at::native::index_elementwise_kernel<128>(int)",
                "pid": 0, "tid": 7, "ts": 10.2 + n, "dur": 0.12, "args": {"stream": 7}} for n in range(4)]
    # Python's JSON decoder reads NaN and Infinity: they must not enter a sum.
    text = json.dumps({"traceEvents": events})[:-2] + ', {"ph": "X", "cat": "kernel", "name": "bad", ' \
        '"pid": 0, "tid": 7, "ts": 11.5, "dur": NaN}, {"ph": "X", "cat": "kernel", "name": "worse", ' \
        '"pid": 0, "tid": 7, "ts": Infinity, "dur": 1}]}'
    path.write_text(text)
    trace = read_kineto(path)
    assert "bad" not in trace.names and "worse" not in trace.names
    diagnosis = diagnose(trace)
    report = json.dumps(diagnosis.to_json(), allow_nan=False)  # valid JSON: no NaN anywhere
    assert format_diagnosis(diagnosis) and report


def test_the_unclassified_share_is_reported_with_its_largest_kernels(tmp_path: Path) -> None:
    job = Job().steps([("aten::linear", BF16_GEMM, 6_000.0), ("aten::spin", SPIN, 2_000.0),
                       ("autograd::engine::evaluate_function: IndexBackward0", INDEX_BACKWARD, 1_000.0)])
    diagnosis = job.diagnose(tmp_path)
    profile = diagnosis.device_profile
    assert profile is not None
    assert profile["unmatched"] == pytest.approx(3 / 9, abs=0.01)
    assert [k["name"] for k in profile["unmatched_kernels"]] == [
        "spin_wait_kernel", "indexing_backward_kernel_stride_1<float>"]
    assert profile["unmatched_kernels"][0]["share"] == pytest.approx(2 / 9, abs=0.01)
    text = format_diagnosis(diagnosis)
    assert "unclassified 33%: spin_wait_kernel 22%, indexing_backward_kernel_stride_1<float> 11%" in text


def test_collectives_with_one_block_per_channel_are_not_small_grids(tmp_path: Path) -> None:
    """NCCL runs one block per channel by design: 16 blocks on 132 SMs is not a grid to enlarge."""
    allreduce = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)"
    job = Job().steps([("nccl:all_reduce", allreduce, 9_800.0)], blocks_per_sm=16 / 132)
    diagnosis = job.diagnose(tmp_path)
    assert "small_grids" not in {f.kind for f in diagnosis.findings}
    profile = diagnosis.device_profile
    assert profile is not None and profile["classes"]["collective"] == 1.0


SOFTMAX = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
           "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)")
LOG_SOFTMAX = ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 4, true, false>("
               "float*, float const*, int, int, int, bool const*, int, bool)")
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
       "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)")


def test_unfused_attention_is_a_dominant_op_with_fused_attention_as_its_remedy(tmp_path: Path) -> None:
    job = Job().steps([("aten::linear", BF16_GEMM, 3_000.0), ("aten::matmul", BF16_GEMM, 2_000.0),
                       ("aten::softmax", SOFTMAX, 2_500.0), ("aten::matmul", BF16_GEMM, 2_300.0)])
    diagnosis = job.diagnose(tmp_path)
    assert diagnosis.verdict == "dominant_op"
    (found,) = diagnosis.findings
    assert found.severity == "high" and "unfused attention" in found.summary
    assert found.share == pytest.approx(0.68, abs=0.01)  # softmax and the batched matmuls
    assert [e.name for e in found.evidence] == ["aten::matmul", "aten::softmax"]
    assert "scaled_dot_product_attention" in found.remedy and 'attn_implementation="sdpa"' in found.remedy


def test_an_elementwise_op_that_dominates_the_device_is_named(tmp_path: Path) -> None:
    job = Job().steps([("aten::linear", BF16_GEMM, 5_800.0), ("aten::add", ADD, 4_000.0)])
    diagnosis = job.diagnose(tmp_path)
    (found,) = diagnosis.findings
    assert (found.kind, found.severity) == ("dominant_op", "moderate")
    assert found.summary.startswith("aten::add takes 41% of the device's time")
    assert "elementwise kernels" in found.summary and "torch.compile" in found.remedy


@pytest.mark.parametrize("parts", [
    [("aten::linear", BF16_GEMM, 9_800.0)],  # matrix work dominating is healthy
    # the loss's log-softmax
    [("aten::linear", BF16_GEMM, 7_300.0), ("aten::cross_entropy_loss", LOG_SOFTMAX, 2_500.0)],
])
def test_matmuls_and_the_loss_softmax_are_not_a_dominant_op(
        tmp_path: Path, parts: list[tuple[str, str, float]]) -> None:
    diagnosis = Job().steps(parts).diagnose(tmp_path)
    assert diagnosis.verdict == "healthy"
    (check,) = [c for c in diagnosis.checks if c.kind == "dominant_op"]
    assert check.passed


def test_the_remedy_follows_the_trace_framework_and_gpu(tmp_path: Path) -> None:
    job = Job(capability=(7, 5)).steps([("aten::conv2d", FP32_CONV, 6_000.0),
                                        ("aten::linear", BF16_GEMM, 3_800.0)])
    (found,) = [f for f in job.diagnose(tmp_path).findings if f.kind == "tensor_cores_idle"]
    assert "GradScaler" in found.remedy and "float16" in found.remedy
    assert not any(word in found.remedy.lower() for word in ("bf16", "bfloat16", "tf32"))
