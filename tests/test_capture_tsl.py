"""The TSL (TensorFlow/JAX) capture backend: against real JAX processes on the CPU, and against a
scripted in-process ProfilerService for the answers a JAX job does not give."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from capturing import DirectoryStaging, Workload, free_port

from gpuscope.capture import tsl
from gpuscope.capture.model import BackendResult, CaptureTarget
from gpuscope.capture.tsl import TslProfilerBackend, parse_target
from gpuscope.common.unixfs import safe_file_name
from gpuscope.generated.tsl import profiler_service_pb2, xplane_pb2

JITTED = "gpuscope_matmul_step"  # the workload's jitted function


def capture(address: str, duration_s: float, staging: Path, *, pid: int | None = None, run: str = "run1",
            deadline_s: float = 10.0, backend: TslProfilerBackend | None = None) -> BackendResult:
    target = CaptureTarget("tsl", pid, address)
    return (backend or TslProfilerBackend()).capture(target, duration_s, DirectoryStaging(staging, run),
                                                     deadline_s=deadline_s)


def listing(staging: Path) -> list[str]:
    return sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())


# --- real JAX processes ---------------------------------------------------------------------------

def event_names(space: xplane_pb2.XSpace) -> set[str]:
    names = set()
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                names.add(plane.event_metadata[event.metadata_id].name)
    return names


def test_captures_a_running_jax_job(jax_job: Workload, tmp_path: Path) -> None:
    busy = jax_job
    started = time.monotonic()
    result = capture(busy.address, 0.8, tmp_path, pid=busy.proc.pid)
    elapsed = time.monotonic() - started
    assert result.outcome == "captured", result
    assert result.error is None
    host = safe_file_name(socket.gethostname())
    assert result.files == (f"plugins/profile/run1/{host}_pid{busy.proc.pid}.xplane.pb",)
    assert listing(tmp_path) == list(result.files)  # no temporary file left behind
    assert 0.8 <= elapsed < 10

    space = xplane_pb2.XSpace.FromString((tmp_path / result.files[0]).read_bytes())
    assert list(space.hostnames) == [socket.gethostname()]
    assert "/host:CPU" in [plane.name for plane in space.planes]
    assert sum(len(line.events) for plane in space.planes for line in plane.lines) > 100
    names = event_names(space)
    assert any(JITTED in name for name in names), sorted(names)[:50]
    # The events span about the requested length (the server records for opts.duration_ms).
    host_plane = next(plane for plane in space.planes if plane.name == "/host:CPU")
    ends = [line.timestamp_ns + (e.offset_ps + e.duration_ps) // 1000 for line in host_plane.lines
            for e in line.events]
    starts = [line.timestamp_ns + e.offset_ps // 1000 for line in host_plane.lines for e in line.events]
    assert 0.5e9 < max(ends) - min(starts) < 2e9


def test_a_second_capture_in_the_same_run_gets_its_own_file(jax_job: Workload, tmp_path: Path) -> None:
    busy = jax_job
    first = capture(busy.address, 0.3, tmp_path, run="2024_05_01_12_00_00")
    second = capture(busy.address, 0.3, tmp_path, run="2024_05_01_12_00_00")
    host = safe_file_name(socket.gethostname())
    assert first.files == (f"plugins/profile/2024_05_01_12_00_00/{host}_port{busy.port}.xplane.pb",)
    assert second.files == (f"plugins/profile/2024_05_01_12_00_00/{host}_port{busy.port}-2.xplane.pb",)
    assert listing(tmp_path) == sorted([*first.files, *second.files])


def test_a_concurrent_capture_is_busy(jax_job: Workload, tmp_path: Path) -> None:
    busy = jax_job
    results: dict[str, BackendResult] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", capture(busy.address, 4.0,
                                                                                 tmp_path / "a")))
    first.start()
    time.sleep(1.5)  # its client process has started, and its session too
    second = capture(busy.address, 1.0, tmp_path / "b")
    assert first.is_alive()  # refused at once, not queued behind the first
    first.join(timeout=30)
    # Measured: INTERNAL "Another profiling session active."
    assert second == BackendResult("busy", error="Another profiling session active.")
    assert results["first"].outcome == "captured"
    assert not (tmp_path / "b").exists()


def test_an_idle_jax_job_is_empty(idle_jax_job: Workload, tmp_path: Path) -> None:
    # Measured: after the full duration, empty_trace=true (with a host plane that has no events).
    idle = idle_jax_job
    started = time.monotonic()
    result = capture(idle.address, 0.5, tmp_path, pid=idle.proc.pid)
    assert result == BackendResult("empty")
    assert 0.5 <= time.monotonic() - started < 5
    assert listing(tmp_path) == []


def test_ipv6_loopback(jax_job: Workload, tmp_path: Path) -> None:
    busy = jax_job
    try:
        with socket.create_connection(("::1", busy.port), timeout=1):
            pass
    except OSError:
        pytest.skip("no IPv6 loopback here, or the server does not listen on it")
    assert capture(f"[::1]:{busy.port}", 0.2, tmp_path).outcome == "captured"


# --- no server, a silent server -------------------------------------------------------------------

def test_a_dead_port_is_unreachable_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    result = capture(f"127.0.0.1:{free_port()}", 1.0, tmp_path, deadline_s=3.0)
    assert result.outcome == "unreachable"
    assert result.error is not None and "connect" in result.error.lower()
    assert time.monotonic() - started < 3.0 + 1.0  # measured: milliseconds
    assert listing(tmp_path) == []


def test_a_server_that_never_answers_is_unreachable_within_the_deadline(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts TCP connections (backlog) but never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        result = capture(f"127.0.0.1:{silent.getsockname()[1]}", 0.5, tmp_path, deadline_s=1.5)
        elapsed = time.monotonic() - started
    assert result.outcome == "unreachable", result
    assert result.error is not None and "deadline" in result.error
    assert 1.4 < elapsed < 1.5 + 1.0


# --- a scripted ProfilerService --------------------------------------------------------------------

@dataclass
class Scripted:
    """Answers Profile with ``reply(request, context)``; records the requests."""

    reply: Callable[[profiler_service_pb2.ProfileRequest, Any], bytes]
    requests: list[profiler_service_pb2.ProfileRequest] = field(default_factory=list)


@pytest.fixture
def scripted() -> Iterator[tuple[str, Scripted]]:
    servicer = Scripted(reply=lambda request, context: b"")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))

    def profile(request: profiler_service_pb2.ProfileRequest, context: Any) -> bytes:
        servicer.requests.append(request)
        return servicer.reply(request, context)

    # Raw bytes out, so that a test can send what no well-formed message would.
    handler = grpc.method_handlers_generic_handler("tensorflow.ProfilerService", {
        "Profile": grpc.unary_unary_rpc_method_handler(
            profile, request_deserializer=profiler_service_pb2.ProfileRequest.FromString,
            response_serializer=lambda data: data)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def space_bytes(*, planes: int = 1, hostname: str = "worker-0", errors: tuple[str, ...] = ()) -> bytes:
    space = xplane_pb2.XSpace(hostnames=[hostname], errors=list(errors))
    for index in range(planes):
        plane = space.planes.add(id=index, name=f"/device:GPU:{index}")
        plane.event_metadata[1].name = "kernel"
        plane.lines.add(id=1, name="stream 7", timestamp_ns=1_000).events.add(metadata_id=1, offset_ps=5,
                                                                              duration_ps=10)
    return space.SerializeToString()


def response(**fields: Any) -> bytes:
    return profiler_service_pb2.ProfileResponse(**fields).SerializeToString()


def test_the_request(scripted: tuple[str, Scripted], tmp_path: Path) -> None:
    address, server = scripted
    server.reply = lambda request, context: response(empty_trace=True)
    backend = TslProfilerBackend(python_tracer_level=1)
    assert capture(address, 1.25, tmp_path, run="r7", backend=backend).outcome == "empty"
    (request,) = server.requests
    assert request.duration_ms == 1250 and request.opts.duration_ms == 1250
    assert request.emit_xspace and list(request.tools) == ["xplane"]
    assert (request.opts.version, request.opts.host_tracer_level, request.opts.device_tracer_level,
            request.opts.python_tracer_level) == (1, 2, 1, 1)
    assert request.session_id == "r7" and request.host_name == "127.0.0.1"
    assert request.repository_root.endswith("plugins/profile")


def test_the_trace_is_stored_byte_for_byte(scripted: tuple[str, Scripted], tmp_path: Path) -> None:
    address, server = scripted
    space = space_bytes(hostname="pod/a b", errors=("CUPTI: insufficient privileges",))
    server.reply = lambda request, context: response(xspace=xplane_pb2.XSpace.FromString(space))
    result = capture(address, 0.1, tmp_path, pid=42)
    assert result.outcome == "captured"
    assert result.files == ("plugins/profile/run1/pod_a_b_pid42.xplane.pb",)
    assert (tmp_path / result.files[0]).read_bytes() == space
    assert result.error == "profiler reported: CUPTI: insufficient privileges"


def test_tool_data_from_a_server_without_emit_xspace(scripted: tuple[str, Scripted], tmp_path: Path) -> None:
    address, server = scripted
    data = space_bytes()
    tool = profiler_service_pb2.ProfileToolData(name="worker-0.xplane.pb", data=data)
    server.reply = lambda request, context: response(tool_data=[tool])
    result = capture(address, 0.1, tmp_path)
    assert result.outcome == "captured"
    assert (tmp_path / result.files[0]).read_bytes() == data


@pytest.mark.parametrize(("reply", "expected"), [
    (response(xspace=xplane_pb2.XSpace()), BackendResult("empty")),  # present but empty
    (response(xspace=xplane_pb2.XSpace(hostnames=["h"])), BackendResult("empty")),  # no planes
    (response(empty_trace=True, xspace=xplane_pb2.XSpace.FromString(space_bytes())), BackendResult("empty")),
], ids=["empty-xspace", "no-planes", "empty-trace"])
def test_empty_answers(scripted: tuple[str, Scripted], tmp_path: Path, reply: bytes,
                       expected: BackendResult) -> None:
    address, server = scripted
    server.reply = lambda request, context: reply
    assert capture(address, 0.1, tmp_path) == expected
    assert listing(tmp_path) == []


def test_no_trace_at_all_is_a_failure(scripted: tuple[str, Scripted], tmp_path: Path) -> None:
    address, _ = scripted  # answers an empty ProfileResponse: what an old server ignoring emit_xspace does
    result = capture(address, 0.1, tmp_path)
    assert result.outcome == "failed"
    assert result.error is not None and "emit_xspace" in result.error


@pytest.mark.parametrize(("code", "details", "outcome"), [
    (grpc.StatusCode.INTERNAL, "Another profiling session active.", "busy"),
    (grpc.StatusCode.UNAVAILABLE, "Another profiling session active.", "busy"),
    (grpc.StatusCode.FAILED_PRECONDITION, "profiler is in use", "busy"),
    (grpc.StatusCode.UNAVAILABLE, "server shutting down", "unreachable"),
    (grpc.StatusCode.UNIMPLEMENTED, "Monitor is not implemented", "failed"),
    (grpc.StatusCode.INTERNAL, "disk full", "failed"),
])
def test_errors(scripted: tuple[str, Scripted], tmp_path: Path, code: grpc.StatusCode, details: str,
                outcome: str) -> None:
    address, server = scripted

    def abort(request: profiler_service_pb2.ProfileRequest, context: Any) -> bytes:
        context.abort(code, details)
        raise AssertionError("unreachable")

    server.reply = abort
    result = capture(address, 0.1, tmp_path)
    assert result.outcome == outcome
    assert result.error is not None and details in result.error
    if outcome == "failed" and code == grpc.StatusCode.INTERNAL:
        assert result.error == "INTERNAL: disk full"


def test_garbage_is_a_failure(scripted: tuple[str, Scripted], tmp_path: Path) -> None:
    address, server = scripted
    server.reply = lambda request, context: b"\xff\xff\xff"
    assert capture(address, 0.1, tmp_path).outcome == "failed"
    # A truncated XSpace (a plane of 5 bytes, 2 sent): refused when read, nothing written.
    server.reply = lambda request, context: response() + b"\x42\x04\x0a\x05ab"
    result = capture(address, 0.1, tmp_path)
    assert result.outcome == "failed" and listing(tmp_path) == []


def test_a_staging_directory_that_cannot_be_written_is_a_failure(scripted: tuple[str, Scripted],
                                                                  tmp_path: Path) -> None:
    address, server = scripted
    server.reply = lambda request, context: response(xspace=xplane_pb2.XSpace.FromString(space_bytes()))
    (tmp_path / "plugins").write_text("a file where a folder should be")
    result = capture(address, 0.1, tmp_path)
    assert result.outcome == "failed" and result.error is not None
    assert result.error.startswith(("FileExistsError", "NotADirectoryError"))


def big_space(size: int) -> bytes:
    """An XSpace of about ``size`` bytes (a plane's name carries the bulk)."""
    space = xplane_pb2.XSpace.FromString(space_bytes())
    space.planes[0].name = "x" * size
    return space.SerializeToString()


def test_a_trace_over_max_trace_bytes_is_refused_as_it_arrives(scripted: tuple[str, Scripted],
                                                               tmp_path: Path) -> None:
    address, server = scripted
    space = big_space(3 << 20)
    server.reply = lambda request, context: response(xspace=xplane_pb2.XSpace.FromString(space))
    small = TslProfilerBackend(max_trace_bytes=2 << 20)
    result = capture(address, 0.1, tmp_path, backend=small)
    assert result.outcome == "failed" and listing(tmp_path) == []
    assert result.error is not None
    assert result.error.startswith("the target's trace is larger than capture.max_trace_bytes (2.0 MiB)")
    assert "Received message larger than max" in result.error  # gRPC refused it from its length prefix
    # Within the limit (and its allowance for the response's other fields): stored whole.
    result = capture(address, 0.1, tmp_path, backend=TslProfilerBackend(max_trace_bytes=4 << 20))
    assert result.outcome == "captured" and (tmp_path / result.files[0]).read_bytes() == space


def test_a_trace_just_over_the_limit_within_the_allowance_is_refused_too(scripted: tuple[str, Scripted],
                                                                       tmp_path: Path) -> None:
    address, server = scripted
    space = big_space((2 << 20) + 1000)  # over 2 MiB, under 2 MiB + the 1 MiB allowance: read, then refused
    server.reply = lambda request, context: response(xspace=xplane_pb2.XSpace.FromString(space))
    result = capture(address, 0.1, tmp_path, backend=TslProfilerBackend(max_trace_bytes=2 << 20))
    assert result.outcome == "failed" and listing(tmp_path) == []
    assert result.error is not None and f"({len(space)} bytes)" in result.error


# --- the profiler client process ----------------------------------------------------------------

def scripted_client(script: str) -> TslProfilerBackend:
    """A backend whose client process runs ``script`` instead of making the call."""
    backend = TslProfilerBackend()
    backend.client_command = (sys.executable, "-c", script)
    return backend


def answer_line(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode() + b"\n"


def test_a_client_process_that_dies_without_an_answer_is_a_failure_that_says_so(tmp_path: Path) -> None:
    backend = scripted_client("import sys; sys.stderr.write('out of memory\\n'); sys.exit(3)")
    result = capture("127.0.0.1:1", 0.1, tmp_path, backend=backend)
    assert result == BackendResult("failed", error="the profiler client process ended with status 3 without "
                                                   "an answer: out of memory")


def test_a_trace_handed_over_in_part_is_a_failure_and_leaves_no_file(tmp_path: Path) -> None:
    header = {"outcome": "captured", "error": None,
              "file": {"folders": ["plugins", "profile", "run1"], "stem": "h", "suffix": ".xplane.pb",
                       "bytes": 100}}
    script = f"import sys; sys.stdout.buffer.write({answer_line(header)!r} + b'x' * 10)"
    result = capture("127.0.0.1:1", 0.1, tmp_path, backend=scripted_client(script))
    assert result == BackendResult("failed", error="the profiler client process sent 10 of the trace's 100 "
                                                   "bytes")
    assert listing(tmp_path) == []


def test_a_trace_larger_than_the_limit_is_not_read_from_the_client_process(tmp_path: Path) -> None:
    header = {"outcome": "captured", "error": None,
              "file": {"folders": [], "stem": "h", "suffix": ".xplane.pb", "bytes": 1 << 40}}
    script = f"import sys; sys.stdout.buffer.write({answer_line(header)!r})"
    result = capture("127.0.0.1:1", 0.1, tmp_path, backend=scripted_client(script))
    assert result.outcome == "failed" and result.error is not None
    assert result.error.startswith("the target's trace is larger than capture.max_trace_bytes (64.0 MiB)")
    assert listing(tmp_path) == []


def test_a_client_process_past_its_deadline_is_killed(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tsl, "CLIENT_EXIT_S", 0.2)
    started = time.monotonic()
    result = capture("127.0.0.1:1", 0.1, tmp_path, deadline_s=0.5,
                     backend=scripted_client("import time; time.sleep(60)"))
    assert result.outcome == "failed" and result.error is not None
    assert result.error.startswith("the profiler client process ended with status -9 without an answer")
    assert time.monotonic() - started < 30


# --- validation -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "host", "port", "target"), [
    ("127.0.0.1:6009", "127.0.0.1", 6009, "127.0.0.1:6009"),
    ("localhost:1", "localhost", 1, "localhost:1"),
    ("worker-0.job.ns.svc.cluster.local:65535", "worker-0.job.ns.svc.cluster.local", 65535,
     "worker-0.job.ns.svc.cluster.local:65535"),
    ("[::1]:6009", "::1", 6009, "[::1]:6009"),
    ("[fd00::a:1]:6009", "fd00::a:1", 6009, "[fd00::a:1]:6009"),
    ("grpc://10.0.0.7:6009", "10.0.0.7", 6009, "10.0.0.7:6009"),
])
def test_addresses(text: str, host: str, port: int, target: str) -> None:
    address = parse_target(text)
    assert (address.host, address.port, str(address)) == (host, port, target)


@pytest.mark.parametrize("text", [
    "", "6009", "host", "host:", ":6009", "host:0", "host:65536", "host:60x9", "host:-1", "::1:6009",
    "[::1]", "[nonsense]:6009", "unix:/tmp/profiler.sock", "unix:///tmp/s:1", "dns:///host:6009",
    "ipv4:127.0.0.1:6009", "a,b:6009", "host name:6009", "http://host:6009", "-host:6009",
    "a" * 300 + ":6009",
])
def test_bad_addresses(text: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        parse_target(text)
    result = capture(text, 0.1, tmp_path)  # never raises
    assert result.outcome == "failed" and result.error


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"run": "../escape"}, "run name"),
    ({"run": ""}, "run name"),
    ({"run": ".."}, "run name"),
    ({"run": "a/b"}, "run name"),
    ({"deadline_s": 0.5}, "deadline"),
    ({"deadline_s": 1.0}, "deadline"),
    ({"duration_s": 0.0}, "must be positive"),
    ({"duration_s": float("nan")}, "must be positive"),
])
def test_bad_arguments_fail_without_a_call(kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    result = capture(f"127.0.0.1:{free_port()}", kwargs.pop("duration_s", 1.0), tmp_path, **kwargs)
    assert result.outcome == "failed"
    assert result.error is not None and message in result.error


def test_targets_of_another_kind_fail(tmp_path: Path) -> None:
    backend = TslProfilerBackend()
    for target in (CaptureTarget("kineto", 12), CaptureTarget("tsl", 12)):
        result = backend.capture(target, 1.0, DirectoryStaging(tmp_path, "r"), deadline_s=5)
        assert result.outcome == "failed" and result.error is not None
