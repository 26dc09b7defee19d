"""The trace readers of gpuscope.analysis: real traces that PyTorch and JAX write on the CPU, synthetic
GPU traces in both formats with every span checked, the Kineto reader's streaming across chunk
boundaries, the bounds on what is read, malformed files, and where traces are found."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from capturing import require_jax, require_torch

import gpuscope.analysis.xspace as xspace_module
from gpuscope.analysis.errors import TraceError, TraceFormatError, TraceTooLargeError
from gpuscope.analysis.kineto_json import read_kineto
from gpuscope.analysis.model import Kind, Trace
from gpuscope.analysis.sources import find_traces, read_trace
from gpuscope.analysis.xspace import read_xspace
from gpuscope.generated.tsl import xplane_pb2

Row = tuple[float, float, str, str]  # start, dur, name, track


def rows(trace: Trace, kind: Kind) -> list[Row]:
    return [(span.start, span.dur, span.name, span.track) for span in trace.iter(kind)]


def contents(trace: Trace) -> tuple[Any, ...]:
    """Everything a reader put in a trace but the file's name."""
    return (trace.format, trace.framework, trace.has_device, trace.has_stacks, list(trace.step_numbers),
            {kind: rows(trace, kind) for kind in Kind})


def run_script(source: str, tmp: Path, *args: str) -> None:
    script = tmp / "job.py"
    script.write_text(source)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


# --- a real PyTorch trace (CPU) --------------------------------------------------------------------

TORCH_JOB = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                            schedule=torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1),
                            with_stack=True,
                            on_trace_ready=lambda p: p.export_chrome_trace(sys.argv[1])) as prof:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        prof.step()
"""


@pytest.fixture(scope="module")
def torch_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_torch()
    tmp = tmp_path_factory.mktemp("torch")
    out = tmp / "worker0.pt.trace.json"
    run_script(TORCH_JOB, tmp, str(out))
    return out


def assert_sorted_from_zero(trace: Trace) -> None:
    for kind in Kind:
        starts = list(trace.spans[kind].start)
        assert starts == sorted(starts), kind
        assert all(start >= 0 for start in starts), kind
    assert min(s.start[0] for s in trace.spans.values() if len(s)) == 0


def test_reads_a_real_pytorch_trace(torch_trace: Path) -> None:
    trace = read_trace(torch_trace)
    assert trace.format == "kineto"
    assert trace.source == str(torch_trace)
    assert trace.framework == "pytorch"
    assert trace.has_device is False
    assert trace.has_stacks is True
    steps = rows(trace, Kind.STEP)
    assert len(steps) == 3
    first = trace.step_numbers[0]
    assert list(trace.step_numbers) == [first, first + 1, first + 2]
    assert [name for _, _, name, _ in steps] == [f"ProfilerStep#{n}" for n in trace.step_numbers]
    host_ops = {name for _, _, name, _ in rows(trace, Kind.HOST_OP)}
    assert "aten::_local_scalar_dense" in host_ops  # loss.item()
    assert any("DataLoader" in name for name in host_ops)
    assert "ProfilerStep#1" not in host_ops  # a step is a STEP span only
    assert trace.count(Kind.PYTHON) > 0
    for kind in (Kind.RUNTIME, Kind.KERNEL, Kind.MEMCPY, Kind.MEMSET, Kind.CPU_COMPUTE):
        assert trace.count(kind) == 0
    assert {track for _, _, _, track in rows(trace, Kind.HOST_OP)} <= {
        f"thread {event['tid']}" for event in json.loads(torch_trace.read_text())["traceEvents"]}
    assert_sorted_from_zero(trace)
    assert trace.end > steps[-1][0]


def test_reads_the_same_pytorch_trace_gzipped(torch_trace: Path, tmp_path: Path) -> None:
    zipped = tmp_path / (torch_trace.name + ".gz")
    zipped.write_bytes(gzip.compress(torch_trace.read_bytes()))
    assert find_traces(zipped) == [zipped]
    assert contents(read_trace(zipped)) == contents(read_trace(torch_trace))


def test_a_real_pytorch_trace_read_in_small_chunks_is_the_same(torch_trace: Path) -> None:
    assert contents(read_kineto(torch_trace, chunk_chars=997)) == contents(read_kineto(torch_trace))


def test_the_kineto_reader_keeps_every_event_json_load_sees(torch_trace: Path) -> None:
    """Against the whole file loaded at once: every complete event of a kept category, none other."""
    events = json.loads(torch_trace.read_text())["traceEvents"]
    kept = [e for e in events if e.get("ph") == "X" and e.get("cat") in
            ("cpu_op", "user_annotation", "python_function")]
    trace = read_kineto(torch_trace)
    assert trace.events_read == len(kept)
    origin = min(e["ts"] for e in kept)
    expected = sorted((e["ts"] - origin, e["dur"], e["name"]) for e in kept)
    read = sorted((s.start, s.dur, s.name) for kind in Kind for s in trace.iter(kind))
    assert read == expected


# --- a real JAX trace (CPU) ------------------------------------------------------------------------

JAX_JOB = """
import sys
import jax
import jax.numpy as jnp

@jax.jit
def train_step(x, w):
    return jnp.tanh(x @ w).sum(), w * 0.99

x = jnp.ones((64, 64))
w = jnp.ones((64, 64))
train_step(x, w)[0].block_until_ready()  # compiled before the profile
jax.profiler.start_trace(sys.argv[1])
for i in range(3):
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
        loss, w = train_step(x, w)
        loss.block_until_ready()
jax.profiler.stop_trace()
"""


@pytest.fixture(scope="module")
def jax_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_jax()
    tmp = tmp_path_factory.mktemp("jax")
    run_script(JAX_JOB, tmp, str(tmp / "logs"))
    return tmp / "logs"


def test_finds_the_xspace_of_a_jax_profile_and_not_its_json_copy(jax_log_dir: Path) -> None:
    written = sorted(p.name.split(".", 1)[1] for p in jax_log_dir.rglob("*") if p.is_file())
    assert written == ["trace.json.gz", "xplane.pb"]
    found = find_traces(jax_log_dir)
    assert len(found) == 1
    assert found[0].name.endswith(".xplane.pb")
    assert found[0].parent.parent.name == "profile"  # plugins/profile/<run>/<host>.xplane.pb


def test_reads_a_real_jax_trace(jax_log_dir: Path) -> None:
    trace = read_trace(find_traces(jax_log_dir)[0])
    assert trace.format == "xspace"
    assert trace.framework == "jax"
    assert trace.has_device is False
    steps = rows(trace, Kind.STEP)
    assert list(trace.step_numbers) == [0, 1, 2]
    assert [name for _, _, name, _ in steps] == ["train"] * 3
    assert all(dur > 0 for _, dur, _, _ in steps)
    compute = rows(trace, Kind.CPU_COMPUTE)
    assert compute
    assert all(track.startswith(("tf_XLA", "XLA", "tf_Compute")) for _, _, _, track in compute)
    assert not any(name.startswith(("end: ", "ThreadpoolListener::")) for _, _, name, _ in compute)
    # The jitted computations run inside the steps.
    assert all(any(s <= c < s + d for s, d, _, _ in steps) for c, _, _, _ in compute)
    assert trace.count(Kind.PYTHON) > 0
    assert not any(name.startswith("$") for _, _, name, _ in rows(trace, Kind.PYTHON))
    assert any(name.startswith("PjitFunction") for _, _, name, _ in rows(trace, Kind.HOST_OP))
    assert_sorted_from_zero(trace)


# --- synthetic GPU traces --------------------------------------------------------------------------

BASE_US = 1_700_000_000_000.0  # Kineto's ts: microseconds of the system clock


def kineto_gpu_events() -> list[dict[str, Any]]:
    def event(cat: str, name: str, ts: float, dur: float, *, pid: int = 100, tid: int = 101,
              **args: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": BASE_US + ts,
                "dur": dur, "args": args}

    return [
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 101, "args": {"name": "thread 101 (python)"}},
        event("user_annotation", "ProfilerStep#5", 0, 1000),
        event("python_function", "train.py(10): step", 1, 998),
        event("cpu_op", "aten::mm", 10, 20.5, **{"External id": 3}),
        event("cuda_runtime", "cudaLaunchKernel", 12, 4),
        event("cuda_driver", "cuLaunchKernel", 13, 2, tid=102),
        event("kernel", "void gemm<float>(...)", 20, 50.25, pid=0, tid=7, device=0, stream=7),
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 80, 5, pid=0, tid=7, device=0, stream=7),
        event("gpu_memset", "Memset (Device)", 90, 1.5, pid=1, tid=9),  # no stream arg: the tid
        event("gpu_user_annotation", "aten::mm", 20, 50, pid=0, tid=7),  # skipped
        event("ac2g", "ac2g", 12, 0),  # skipped
        event("overhead", "Instrumentation", 5, 1),  # skipped
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 100, "tid": 101, "ts": BASE_US + 12, "id": 3},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "pid": 0, "tid": 7, "ts": BASE_US + 20, "id": 3,
         "bp": "e"},
        {"ph": "i", "s": "t", "name": "instant", "pid": 100, "tid": 101, "ts": BASE_US + 3},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": BASE_US - 50, "dur": 2000},  # skipped, though it starts first
    ]


KINETO_GPU_ROWS = {
    Kind.STEP: [(0.0, 1000.0, "ProfilerStep#5", "thread 101")],
    Kind.PYTHON: [(1.0, 998.0, "train.py(10): step", "thread 101")],
    Kind.HOST_OP: [(10.0, 20.5, "aten::mm", "thread 101")],
    Kind.RUNTIME: [(12.0, 4.0, "cudaLaunchKernel", "thread 101"),
                   (13.0, 2.0, "cuLaunchKernel", "thread 102")],
    Kind.KERNEL: [(20.0, 50.25, "void gemm<float>(...)", "GPU 0 stream 7")],
    Kind.MEMCPY: [(80.0, 5.0, "Memcpy DtoH (Device -> Pinned)", "GPU 0 stream 7")],
    Kind.MEMSET: [(90.0, 1.5, "Memset (Device)", "GPU 1 stream 9")],
    Kind.CPU_COMPUTE: [],
}


def write_kineto(path: Path, events: list[dict[str, Any]], *, before: dict[str, Any] | None = None,
                 after: dict[str, Any] | None = None, indent: int | None = None) -> Path:
    """A trace as Kineto lays it out: keys around ``traceEvents``, pretty-printed or not."""
    document = {**(before or {}), "traceEvents": events, **(after or {})}
    text = json.dumps(document, indent=indent)
    path.write_bytes(gzip.compress(text.encode()) if path.name.endswith(".gz") else text.encode())
    return path


def test_reads_a_synthetic_kineto_gpu_trace(tmp_path: Path) -> None:
    path = write_kineto(tmp_path / "gpu.pt.trace.json", kineto_gpu_events(),
                        before={"schemaVersion": 1, "deviceProperties": []},
                        after={"traceName": "gpu", "baseTimeNanoseconds": 1_700_000_000_000_000_000})
    trace = read_kineto(path)
    assert {kind: rows(trace, kind) for kind in Kind} == KINETO_GPU_ROWS
    assert list(trace.step_numbers) == [5]
    assert trace.framework == "pytorch"
    assert trace.has_device is True  # kernels were seen
    assert trace.events_read == 8


def test_device_properties_alone_say_a_device_was_traced(tmp_path: Path) -> None:
    cpu_only = [e for e in kineto_gpu_events() if e.get("cat") in ("cpu_op", "user_annotation")]
    plain = read_kineto(write_kineto(tmp_path / "a.json", cpu_only, after={"deviceProperties": []}))
    assert plain.has_device is False
    gpu = read_kineto(write_kineto(tmp_path / "b.json", cpu_only,
                                   after={"deviceProperties": [{"id": 0, "name": "NVIDIA H100"}]}))
    assert gpu.has_device is True
    assert gpu.count(Kind.KERNEL) == 0


def test_an_empty_kineto_trace_reads_as_no_events(tmp_path: Path) -> None:
    trace = read_kineto(write_kineto(tmp_path / "empty.json", []))
    assert trace.events_read == 0
    assert trace.framework == ""
    assert trace.end == 0.0


@pytest.mark.parametrize("chunk_chars", [1, 2, 3, 7, 64, 1000])
def test_events_split_across_chunks_read_the_same(tmp_path: Path, chunk_chars: int) -> None:
    # A number at the top level is the one value that decodes whole from a piece of itself.
    path = write_kineto(tmp_path / "gpu.json", kineto_gpu_events(), indent=2,
                        before={"schemaVersion": 123456789, "deviceProperties": []},
                        after={"distributedInfo": {"rank": 3, "backend": "nccl"},
                               "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceName": "ünïcode"})
    expected = contents(read_kineto(path))
    assert expected[-1] == KINETO_GPU_ROWS
    assert contents(read_kineto(path, chunk_chars=chunk_chars)) == expected


def xspace_gpu_trace() -> xplane_pb2.XSpace:
    base_ns = 1_700_000_000_123_456_789  # an absolute time: past what a double holds to the ns
    space = xplane_pb2.XSpace(hostnames=["host0"])

    def plane(name: str, events: list[str], stats: list[str]) -> xplane_pb2.XPlane:
        new = space.planes.add(id=len(space.planes), name=name)
        for i, event_name in enumerate(events, start=1):
            new.event_metadata[i].id = i
            new.event_metadata[i].name = event_name
        for i, stat_name in enumerate(stats, start=1):
            new.stat_metadata[i].id = i
            new.stat_metadata[i].name = stat_name
        return new

    def add(line: xplane_pb2.XLine, metadata_id: int, offset_us: float, dur_us: float,
            **stats: int) -> xplane_pb2.XEvent:
        event = line.events.add(metadata_id=metadata_id, offset_ps=int(offset_us * 1e6),
                                duration_ps=int(dur_us * 1e6))
        for stat_id, value in stats.items():
            stat = event.stats.add(metadata_id=int(stat_id[1:]))
            if stat_id == "s1":
                stat.uint64_value = value
            else:
                stat.int64_value = value
        return event

    meta = plane("/host:metadata", [], ["jax_version", "process_id"])
    meta.stats.add(metadata_id=1, str_value="0.10.2")
    meta.stats.add(metadata_id=2, int64_value=1234)

    host = plane("/host:CPU", ["train", "cudaLaunchKernel", "$train.py:12 step", "jit_step", "inner",
                               "cuStreamSynchronize", "cudnnConvolutionForward"],
                 ["step_num", "_r", "hlo_op"])
    python = host.lines.add(id=1, name="python", timestamp_ns=base_ns)
    add(python, 1, 0, 1000, s1=7, s2=1)  # the step
    add(python, 3, 1, 998)
    add(python, 4, 10, 100)
    add(python, 5, 11, 5, s1=7, s2=0)  # a nested step annotation: a host op
    add(python, 2, 20, 4.5)
    add(python, 6, 900, 50)
    add(python, 7, 30, 2)  # cudnn...: not a CUDA runtime call
    aggregate = python.events.add(metadata_id=4, num_occurrences=3, duration_ps=1)
    assert aggregate.WhichOneof("data") == "num_occurrences"  # no start: skipped

    gpu = plane("/device:GPU:0", ["fusion_1", "MemcpyDtoH", "Memset", "jit_step"], ["hlo_op"])
    stream = gpu.lines.add(id=7, name="Stream #7(compute)", timestamp_ns=base_ns + 2000)
    add(stream, 1, 20, 50.5, s1=3)
    add(stream, 2, 80, 5)
    add(stream, 3, 90, 0.25)
    ops = gpu.lines.add(id=100, name="XLA Ops", timestamp_ns=base_ns + 2000)
    add(ops, 1, 20, 50.5)
    modules = gpu.lines.add(id=101, name="XLA Modules", timestamp_ns=base_ns + 2000)
    add(modules, 4, 20, 80)

    tpu = plane("/device:TPU:0", ["tpu_op"], [])
    add(tpu.lines.add(id=1, name="Stream #1", timestamp_ns=base_ns - 10_000_000), 1, 0, 10)
    env = plane("Task Environment", [], ["profile_start_time"])
    env.stats.add(metadata_id=1, uint64_value=base_ns)
    return space


XSPACE_GPU_ROWS = {
    Kind.STEP: [(0.0, 1000.0, "train", "python")],
    Kind.PYTHON: [(1.0, 998.0, "train.py:12 step", "python")],
    Kind.HOST_OP: [(10.0, 100.0, "jit_step", "python"), (11.0, 5.0, "inner", "python"),
                   (30.0, 2.0, "cudnnConvolutionForward", "python")],
    Kind.RUNTIME: [(20.0, 4.5, "cudaLaunchKernel", "python"), (900.0, 50.0, "cuStreamSynchronize", "python")],
    Kind.KERNEL: [(22.0, 50.5, "fusion_1", "GPU 0 Stream #7(compute)")],
    Kind.MEMCPY: [(82.0, 5.0, "MemcpyDtoH", "GPU 0 Stream #7(compute)")],
    Kind.MEMSET: [(92.0, 0.25, "Memset", "GPU 0 Stream #7(compute)")],
    Kind.CPU_COMPUTE: [],
}


def test_reads_a_synthetic_xspace_gpu_trace(tmp_path: Path) -> None:
    path = tmp_path / "host0.xplane.pb"
    path.write_bytes(xspace_gpu_trace().SerializeToString())
    trace = read_trace(path)
    assert {kind: rows(trace, kind) for kind in Kind} == XSPACE_GPU_ROWS
    assert list(trace.step_numbers) == [7]
    assert trace.framework == "jax"
    assert trace.has_device is True
    assert trace.format == "xspace"


def test_xla_cpu_thread_pools_compute(tmp_path: Path) -> None:
    space = xplane_pb2.XSpace()
    host = space.planes.add(id=1, name="/host:CPU")
    for i, name in enumerate(["fusion", "end: fusion", "ThreadpoolListener::Record", "marker"], start=1):
        host.event_metadata[i].name = name
    for line_name in ("tf_XLAEigen/1", "XLAPjRtCpuClient/2", "tf_Compute/3", "python"):
        line = host.lines.add(name=line_name, timestamp_ns=1000)
        for metadata_id in (1, 2, 3):
            line.events.add(metadata_id=metadata_id, offset_ps=metadata_id * 1_000_000, duration_ps=2_000_000)
        line.events.add(metadata_id=4, offset_ps=9_000_000, duration_ps=0)  # takes no time
    path = tmp_path / "cpu.xplane.pb"
    path.write_bytes(space.SerializeToString())
    trace = read_xspace(path)
    pools = ("tf_XLAEigen/1", "XLAPjRtCpuClient/2", "tf_Compute/3")
    assert rows(trace, Kind.CPU_COMPUTE) == [(0.0, 2.0, "fusion", track) for track in pools]
    not_compute = ("end: fusion", "ThreadpoolListener::Record", "marker")
    host_ops = [(name, track) for track in pools for name in not_compute]
    host_ops += [(name, "python") for name in ("fusion", *not_compute)]  # not an XLA thread pool
    assert sorted((name, track) for _, _, name, track in rows(trace, Kind.HOST_OP)) == sorted(host_ops)
    assert trace.framework == ""
    assert trace.has_device is False


def test_a_long_xspace_line_read_a_run_of_events_at_a_time_is_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "host0.xplane.pb"
    path.write_bytes(xspace_gpu_trace().SerializeToString())
    whole = contents(read_xspace(path))
    monkeypatch.setattr(xspace_module, "EVENT_RUN_BYTES", 40)  # a few events a run
    assert contents(read_xspace(path)) == whole
    monkeypatch.setattr(xspace_module, "EVENT_RUN_BYTES", 1)  # one event a run
    assert contents(read_xspace(path)) == whole


# --- bounds and malformed files --------------------------------------------------------------------

@pytest.mark.parametrize("cut", [1, 40, 120, -2, -1])
def test_a_kineto_trace_cut_before_its_first_event_or_after_its_events_is_a_format_error(
        tmp_path: Path, cut: int) -> None:
    text = json.dumps({"schemaVersion": 1, "traceEvents": kineto_gpu_events()}, indent=1)
    assert text.index('"ph": "X"') > 120  # the cuts are before the first event that is read
    path = tmp_path / "cut.pt.trace.json"
    path.write_text(text[:cut])
    with pytest.raises(TraceFormatError, match=str(path)) as raised:
        read_kineto(path, chunk_chars=64)
    assert "character" in str(raised.value)


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.9])
def test_a_kineto_trace_cut_inside_its_events_is_read_up_to_the_cut_and_marked(
        tmp_path: Path, cut: float) -> None:
    events = kineto_gpu_events()
    text = json.dumps({"schemaVersion": 1, "traceEvents": events}, indent=1)
    path = tmp_path / "cut.pt.trace.json"
    kept = text[:int(len(text) * cut)]
    path.write_text(kept)
    whole = read_kineto(write_kineto(tmp_path / "whole.pt.trace.json", events))
    trace = read_kineto(path, chunk_chars=64)
    assert trace.truncated and not whole.truncated
    assert 0 < trace.events_read <= whole.events_read
    # Exactly the events that were whole before the cut.
    complete = json.loads(kept[:kept.rindex("\n  }") + 4] + "]}")["traceEvents"]
    assert trace.events_read == read_kineto(write_kineto(tmp_path / "kept.pt.trace.json",
                                                         complete)).events_read


@pytest.mark.parametrize("text", [
    "", "[]", '{"schemaVersion": 1}', '{"traceEvents": {}}', '{"traceEvents": [1 2]}',
    '{"traceEvents": []} {}', '{"traceEvents": [{"ph": "X",}]}', '{"traceEvents": ["unterminated]}',
    "\x00\x01binary",
])
def test_what_is_not_a_kineto_trace_is_a_format_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=str(path)):
        read_kineto(path)


def test_a_file_without_trace_events_says_so(tmp_path: Path) -> None:
    path = write_kineto(tmp_path / "x.json", [])
    path.write_text('{"schemaVersion": 1, "deviceProperties": []}')
    with pytest.raises(TraceFormatError, match="no traceEvents"):
        read_kineto(path)


def test_corrupt_gzip_is_a_format_error(tmp_path: Path) -> None:
    data = gzip.compress(json.dumps({"traceEvents": kineto_gpu_events()}).encode())
    truncated = tmp_path / "cut.pt.trace.json.gz"
    truncated.write_bytes(data[: len(data) // 2])
    not_gzip = tmp_path / "plain.pt.trace.json.gz"
    not_gzip.write_text('{"traceEvents": []}')
    for path in (truncated, not_gzip):
        with pytest.raises(TraceFormatError, match=str(path)):
            read_trace(path)


def test_a_gzip_bomb_stops_at_max_bytes(tmp_path: Path) -> None:
    # 64 MiB of whitespace inside the events array compress to about 64 KiB.
    bomb = tmp_path / "bomb.pt.trace.json.gz"
    with gzip.open(bomb, "wb") as out:
        out.write(b'{"traceEvents": [')
        for _ in range(64):
            out.write(b" " * (1 << 20))
        out.write(b"]}")
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(TraceTooLargeError, match=str(bomb)):
        read_trace(bomb, max_bytes=4 << 20)
    assert read_trace(bomb, max_bytes=128 << 20).events_read == 0


def test_a_kineto_trace_over_max_bytes_is_too_large(tmp_path: Path) -> None:
    path = write_kineto(tmp_path / "gpu.json", kineto_gpu_events() * 50)
    size = path.stat().st_size
    with pytest.raises(TraceTooLargeError):
        read_kineto(path, max_bytes=size // 2, chunk_chars=1024)
    assert read_kineto(path, max_bytes=size).events_read == 8 * 50


def test_an_xspace_over_max_bytes_is_too_large(tmp_path: Path) -> None:
    path = tmp_path / "host0.xplane.pb"
    path.write_bytes(xspace_gpu_trace().SerializeToString())
    size = path.stat().st_size
    with pytest.raises(TraceTooLargeError, match=str(path)):
        read_trace(path, max_bytes=size - 1)
    assert read_trace(path, max_bytes=size).count(Kind.KERNEL) == 1


@pytest.mark.parametrize("data", [b"", b"\xff" * 20, b"\x0a\x05abc", b"\x0b", b"\x12\x03abc"])
def test_what_is_not_an_xspace_is_a_format_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bad.xplane.pb"
    path.write_bytes(data)
    with pytest.raises(TraceFormatError, match=str(path)):
        read_xspace(path)


def test_a_truncated_xspace_is_a_format_error(tmp_path: Path) -> None:
    data = xspace_gpu_trace().SerializeToString()
    path = tmp_path / "cut.xplane.pb"
    for cut in (len(data) // 3, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(TraceFormatError, match=str(path)):
            read_xspace(path)


def test_a_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    for name in ("gone.pt.trace.json", "gone.xplane.pb"):
        with pytest.raises(TraceError, match=name):
            read_trace(tmp_path / name)
        with pytest.raises(TraceError, match="no such file"):
            find_traces(tmp_path / name)


# --- finding traces --------------------------------------------------------------------------------

def touch(path: Path, mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_finds_the_traces_under_a_directory(tmp_path: Path) -> None:
    pytorch = touch(tmp_path / "tb" / "worker0.1700000000.pt.trace.json")
    zipped = touch(tmp_path / "tb" / "worker1.1700000000.pt.trace.json.gz")
    run = tmp_path / "logs" / "plugins" / "profile" / "2024_05_01_12_00_00"
    xspace = touch(run / "host0.xplane.pb")
    touch(run / "host0.trace.json.gz")  # JAX's copy of the XSpace
    alone = touch(tmp_path / "logs" / "plugins" / "profile" / "old" / "host0.trace.json.gz")
    touch(tmp_path / "tb" / "config.json")  # not named as a trace
    touch(tmp_path / "tb" / "notes.txt")
    (tmp_path / "tb" / "link.pt.trace.json").symlink_to(pytorch)
    (tmp_path / "linked").symlink_to(tmp_path / "tb", target_is_directory=True)
    assert find_traces(tmp_path) == sorted([pytorch, zipped, xspace, alone])
    assert find_traces(run) == [xspace]
    assert find_traces(xspace) == [xspace]
    assert find_traces(tmp_path / "tb" / "config.json") == [tmp_path / "tb" / "config.json"]


def test_keeps_the_newest_traces_of_a_crowded_directory(tmp_path: Path) -> None:
    paths = [touch(tmp_path / f"d{i % 3}" / f"w{i:03}.pt.trace.json", mtime=1_700_000_000 + i)
             for i in range(70)]
    assert find_traces(tmp_path) == sorted(paths[6:])


def test_no_trace_is_an_error_naming_the_directory(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match=str(empty)):
        find_traces(empty)
    touch(empty / "config.json")
    touch(empty / "sub" / "events.out.tfevents.1700000000.host0")
    with pytest.raises(TraceError, match=str(empty)):
        find_traces(empty)


def test_a_file_that_is_not_a_trace_is_an_error(tmp_path: Path) -> None:
    notes = touch(tmp_path / "notes.txt")
    with pytest.raises(TraceError, match=r"not a trace file: .*notes\.txt \(expected"):
        find_traces(notes)
    with pytest.raises(TraceError, match="not a trace file"):
        read_trace(notes)


def test_xspace_ties_device_work_to_its_launch_by_correlation_id() -> None:
    """XLA launches each step as a CUDA graph (``cuGraphLaunch``) and copies its input from a PjRt
    thread (``MemcpyH2D``): both carry the correlation id of the device work they started."""
    fixtures = Path(__file__).parent / "fixtures" / "traces" / "h100"
    trace = read_xspace(fixtures / "jax_python_generator.xplane.pb")
    host = {trace.spans[kind].corr[i] for kind in (Kind.RUNTIME, Kind.HOST_OP)
            for i in range(len(trace.spans[kind])) if trace.spans[kind].corr[i] >= 0}
    runtime = trace.spans[Kind.RUNTIME]
    launches = [trace.names[runtime.name[i]] for i in range(len(runtime)) if runtime.corr[i] >= 0]
    assert launches and all(name.startswith("cuGraphLaunch") for name in launches)
    for kind in (Kind.KERNEL, Kind.MEMCPY, Kind.MEMSET):
        spans = trace.spans[kind]
        assert all(spans.corr[i] in host for i in range(len(spans)))
