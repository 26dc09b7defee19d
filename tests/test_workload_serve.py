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
        while server._servicer._current is None and time.monotonic() < end:  # the session is on
            time.sleep(0.01)
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
