"""gpuscope.workload.serve: a PyTorch job made capturable over TCP with the TSL ProfilerService API.

A real training process (tests/workloads/torch_workload.py --serve 0) is profiled through the
Profile RPC with a plain gRPC client, as the agent's TSL backend does."""

from __future__ import annotations

import gc
import gzip
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from capturing import TORCH_WORKLOAD, DirectoryStaging, Workload, require_torch, start, stop, wait_ready

from gpuscope.generated.tsl import profiler_options_pb2, profiler_service_pb2, profiler_service_pb2_grpc

OPS = {"aten::mm", "aten::addmm", "aten::relu"}
BUSY = "Another profiling session active."


def start_job(tmp: Path, name: str, *args: str) -> Workload:
    """A PyTorch training loop that serves the ProfilerService on a port of its choosing."""
    return start(TORCH_WORKLOAD, tmp, name, "--serve", "0", *args, unset=("KINETO_USE_DAEMON",))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Workload]]:
    """A training job, an idle one and one that profiles itself, each serving on a free port."""
    require_torch()
    tmp = tmp_path_factory.mktemp("serve")
    started = {"busy": start_job(tmp, "busy"), "idle": start_job(tmp, "idle", "--idle"),
               "self": start_job(tmp, "self", "--self-profile")}
    try:
        for job in started.values():
            wait_ready(job)
        yield started
    finally:
        for job in started.values():
            stop(job)


def profile(address: str, duration_ms: int, *, timeout: float = 20.0) -> profiler_service_pb2.ProfileResponse:
    request = profiler_service_pb2.ProfileRequest(
        duration_ms=duration_ms, tools=["trace_viewer"], emit_xspace=True,
        opts=profiler_options_pb2.ProfileOptions(version=1, host_tracer_level=2, device_tracer_level=1,
                                                 duration_ms=duration_ms))
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub = profiler_service_pb2_grpc.ProfilerServiceStub(channel)
        response: profiler_service_pb2.ProfileResponse = stub.Profile(request, timeout=timeout)
        return response


def trace_names(response: profiler_service_pb2.ProfileResponse) -> set[str]:
    (tool,) = response.tool_data
    trace = json.loads(gzip.decompress(tool.data))
    return {str(e.get("name")) for e in trace["traceEvents"] if e.get("ph") == "X"}


def test_importing_gpuscope_workload_does_not_import_torch() -> None:
    code = "import sys, gpuscope.workload; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_profile_returns_the_training_threads_ops(jobs: dict[str, Workload]) -> None:
    started = time.monotonic()
    response = profile(jobs["busy"].address, 1000)
    elapsed = time.monotonic() - started
    assert not response.empty_trace
    assert [tool.name.endswith(".pt.trace.json.gz") for tool in response.tool_data] == [True]
    # Recorded from the server's thread, the ops of the main (training) thread are in the trace.
    assert trace_names(response) >= OPS
    assert 1.0 <= elapsed < 10.0


def test_a_second_concurrent_profile_is_busy(jobs: dict[str, Workload]) -> None:
    outcomes: list[profiler_service_pb2.ProfileResponse | grpc.RpcError] = []

    def call() -> None:
        try:
            outcomes.append(profile(jobs["busy"].address, 1500))
        except grpc.RpcError as err:
            outcomes.append(err)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    responses = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert len(errors) == 1 and len(responses) == 1, outcomes
    assert errors[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert errors[0].details() == BUSY
    assert trace_names(responses[0]) >= OPS


def test_an_idle_job_gives_an_empty_trace(jobs: dict[str, Workload]) -> None:
    response = profile(jobs["idle"].address, 300)
    assert response.empty_trace
    assert list(response.tool_data) == []


def test_a_job_profiling_itself_is_busy(jobs: dict[str, Workload]) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        profile(jobs["self"].address, 1000)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert BUSY in (raised.value.details() or "")
    assert time.monotonic() - started < 1.0


def test_serve_in_process_port_stop_and_limits() -> None:
    require_torch()
    import torch

    import gpuscope.workload

    server = gpuscope.workload.serve(port=0, host="127.0.0.1", max_duration_s=2.0)
    stop_stepping = threading.Event()

    def train() -> None:  # a loop without an optimizer marks its steps itself
        while not stop_stepping.wait(0.01):
            torch.relu(torch.ones(8, 8) @ torch.ones(8, 8))
            gpuscope.workload.step()

    stepping = threading.Thread(target=train)
    try:
        assert server.port > 0
        assert server.address == f"127.0.0.1:{server.port}"
        # The port is this server's alone (no SO_REUSEPORT sharing).
        with pytest.raises(OSError):
            gpuscope.workload.serve(port=server.port, host="127.0.0.1")
        assert profile(server.address, 0).empty_trace  # no length asked: nothing recorded
        # `serve(...)` as a bare statement: the handle is dropped, the server keeps running.
        port = gpuscope.workload.serve(port=0, host="127.0.0.1").port
        gc.collect()
        assert profile(f"127.0.0.1:{port}", 0).empty_trace
        for handle in [h for h in gpuscope.workload._LIVE if h.port == port]:
            handle.stop()
        with pytest.raises(grpc.RpcError) as raised:
            profile(server.address, 5000)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A session starts and stops at a step boundary: a process that never reached one says so.
        with pytest.raises(grpc.RpcError) as raised:
            profile(server.address, 100)
        assert raised.value.code() == grpc.StatusCode.ABORTED
        assert "no training step yet" in (raised.value.details() or "")
        stepping.start()
        # Terminate ends an active session early, at the next step boundary.
        results: list[profiler_service_pb2.ProfileResponse] = []
        thread = threading.Thread(target=lambda: results.append(profile(server.address, 2000)))
        thread.start()
        end = time.monotonic() + 10
        profiler = server._servicer.profiler
        while (profiler._active is None or not profiler._active.started.is_set()) and time.monotonic() < end:
            time.sleep(0.01)  # until the session is on (the stepping thread started it)
        time.sleep(0.2)
        terminated = time.monotonic()
        with grpc.insecure_channel(server.address) as channel:
            stub = profiler_service_pb2_grpc.ProfilerServiceStub(channel)
            stub.Terminate(profiler_service_pb2.TerminateRequest(session_id=""), timeout=5)
        assert results == []  # still recording when Terminate came
        thread.join()
        assert len(results) == 1
        assert time.monotonic() - terminated < 1.0
    finally:
        stop_stepping.set()
        if stepping.is_alive():
            stepping.join()
        server.stop()
    with pytest.raises(grpc.RpcError) as raised:
        profile(server.address, 100, timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server._servicer.profiler not in gpuscope.workload._PROFILERS  # step() no longer reaches it
    assert not torch.autograd.profiler._is_profiler_enabled


def test_a_session_records_and_is_stopped_by_the_thread_that_reached_the_step_boundary() -> None:
    require_torch()
    import torch

    import gpuscope.workload

    profiler = gpuscope.workload._TorchProfiler(torch)
    profiler.step()  # this process steps: a session waits for a boundary past its length
    keep_going = threading.Event()
    keep_going.set()
    results: list[tuple[bytes, bool]] = []
    asked = threading.Thread(target=lambda: results.append(profiler.record(0.05, keep_going)))
    asked.start()
    while profiler._pending is None:  # the server's thread has asked for a session
        time.sleep(0.01)
    owner_steps, owner_done = threading.Event(), threading.Event()

    def owner() -> None:  # a training thread: its step boundary starts the session, its next one ends it
        profiler.step()
        torch.relu(torch.ones(8, 8) @ torch.ones(8, 8))
        owner_steps.wait()
        profiler.step()
        owner_done.set()

    training = threading.Thread(target=owner)
    training.start()
    while profiler._active is None or not profiler._active.started.is_set():
        time.sleep(0.01)
    session = profiler._active
    time.sleep(0.1)  # past the session's length
    torch.addmm(torch.ones(8), torch.ones(8, 8), torch.ones(8, 8))  # another thread's op: not recorded
    profiler.step()  # another thread's step boundary does not stop it
    assert not session.stopped.is_set() and results == []
    owner_steps.set()
    training.join()
    asked.join()
    (trace, has_events), = results
    names = {str(e.get("name")) for e in json.loads(gzip.decompress(trace))["traceEvents"]}
    assert has_events and {"aten::mm", "aten::relu"} <= names and "aten::addmm" not in names
    assert profiler._active is None and not torch.autograd.profiler._is_profiler_enabled


def test_the_agents_backend_stores_the_chrome_trace(jobs: dict[str, Workload], tmp_path: Path) -> None:
    # The agent captures a serve() job like a JAX job (TSL backend over TCP) and stores its trace.
    from gpuscope.capture.model import CaptureTarget
    from gpuscope.capture.tsl import TslProfilerBackend

    job = jobs["busy"]
    result = TslProfilerBackend().capture(CaptureTarget("tsl", job.proc.pid, job.address), 1.0,
                                          DirectoryStaging(tmp_path), deadline_s=30.0)
    assert result.outcome == "captured", result.error
    (name,) = result.files
    assert name.endswith(".pt.trace.json.gz") and "/" not in name
    trace = json.loads(gzip.decompress((tmp_path / name).read_bytes()))
    assert {str(e.get("name")) for e in trace["traceEvents"] if e.get("ph") == "X"} >= OPS
