"""The control API (gpuscope.v1.Agent): a real ControlServer on a Unix socket (and on TLS), a real capture
service over a real store; the profiler is a fake backend where the point is the API, and a real JAX job
for one capture end to end (Capture -> ListCaptures -> GetCapture -> the XSpace parses)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from capturing import Workload
from pki import Pki, make_pki
from pydantic import ValidationError
from snapshots import FakeSource
from test_alert_scenarios import ManualClock
from test_capture_service import scenario_for

from gpuscope.capture.config import CaptureConfig, StaticTarget
from gpuscope.capture.model import BackendResult, CaptureTarget, StagingArea
from gpuscope.capture.policy import CapturePolicy
from gpuscope.capture.records import record_from_bytes
from gpuscope.capture.service import CaptureService
from gpuscope.capture.store import CaptureStore
from gpuscope.capture.targets import TargetResolver
from gpuscope.capture.tsl import TslProfilerBackend
from gpuscope.common.user_paths import default_dirs
from gpuscope.control.client import AgentInfo, ControlClient, safe_relative_path, write_chunks
from gpuscope.control.config import ControlConfig
from gpuscope.control.errors import ControlError, ControlServerError
from gpuscope.control.server import CHUNK_BYTES, ControlServer, local_control_server
from gpuscope.generated.agent.v1 import agent_pb2, agent_pb2_grpc
from gpuscope.generated.tsl import xplane_pb2
from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import Nvml
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation
from gpuscope.simulate.loader import parse_scenario
from gpuscope.snapshot import GpuReading, Snapshot
from gpuscope.version import __version__

PROFILER = "127.0.0.1:6009"  # what the fake backend "profiles"
TOKEN = "s3cret-token-0123456789abcdef"


def bare_server(config: ControlConfig) -> ControlServer:
    """A server of an agent that takes no captures and has no alerts."""
    return local_control_server(config, service=None, store=None, snapshots=FakeSource(), alerts=None)


# -- helpers shared with test_cli_capture.py ----------------------------------------------------------------


class FakeBackend:
    """Writes one trace of ``size`` bytes per capture (more than one chunk by default); counts calls."""

    kind = "tsl"

    def __init__(self, size: int = CHUNK_BYTES * 2 + 12345, outcome: str = "captured") -> None:
        self.size = size
        self.outcome = outcome
        self.calls: list[tuple[float, str | None, float]] = []  # (wall clock, address, duration)

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult:
        self.calls.append((time.time(), target.address, duration_s))
        if self.outcome != "captured":
            return BackendResult(self.outcome, error="fake")  # type: ignore[arg-type]
        with staging.new_file("fake", ".xplane.pb", folders=("plugins", "profile", staging.run)) as new:
            new.file.write(os.urandom(self.size))
            return BackendResult("captured", files=(new.publish(),))


class GatedBackend(FakeBackend):
    """Holds every capture until ``release`` is set; ``started`` is set when one begins."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started = threading.Event()
        self.release = threading.Event()

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult:
        self.started.set()
        self.release.wait(timeout=30)
        return super().capture(target, duration_s, staging, deadline_s=deadline_s)


def one_gpu_snapshot() -> Snapshot:
    gpu = GpuReading(index=0, uuid="GPU-fake-0", name="Fake GPU", pci_bus_id="00000000:01:00.0", up=True)
    return Snapshot(timestamp=time.time(), hostname="node", nvml_up=True, driver_version="1",
                    gpus=(gpu,), sample_duration_seconds=0.01)


@dataclass
class Node:
    """An agent's control side: server, capture service, store and fake backend."""

    server: ControlServer
    service: CaptureService | None
    store: CaptureStore | None
    backend: FakeBackend
    socket: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def client(self) -> ControlClient:
        return ControlClient(self.socket)

    def stub(self) -> tuple[grpc.Channel, Any]:
        channel = grpc.insecure_channel(f"unix:{self.socket}")
        return channel, agent_pb2_grpc.AgentStub(channel)


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a socket address holds at most 107 bytes; pytest's tmp is long)."""
    path = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def running_node(tmp: Path, *, capture: dict[str, Any] | None = None, control: dict[str, Any] | None = None,
                 backend: FakeBackend | None = None, with_service: bool = True,
                 snapshot: Snapshot | None = None, alerts: Any = None) -> Iterator[Node]:
    backend = backend or FakeBackend()
    with short_dir() as sockets:
        sock = sockets / "run" / "gpuscope" / "control.sock"
        config = ControlConfig.model_validate({"socket": str(sock), **(control or {})})
        store = service = None
        if with_service:
            capture_config = CaptureConfig.model_validate(
                {"store": {"root": str(tmp / "captures")}, "duration": "200ms", **(capture or {})})
            store = CaptureStore(tmp / "captures", quota_bytes=capture_config.store.quota_bytes)
            service = CaptureService(
                store=store, policy=CapturePolicy(capture_config),
                resolver=TargetResolver(profiler_ports=[6009],
                                        static_targets=[StaticTarget(address=PROFILER, all=True)]),
                backends={"tsl": backend}, snapshots=FakeSource(snapshot), hostname="node",
                deadline_margin_s=5.0)
            service.start()
        server = local_control_server(config, service=service, store=store, snapshots=FakeSource(snapshot),
                               alerts=alerts, hostname="node")
        server.start()
        try:
            yield Node(server, service, store, backend, sock)
        finally:
            server.stop(grace=0)
            if service is not None:
                service.stop()
            if store is not None:
                store.close()


def tcp_control(pki: Pki, token_file: Path, *, mtls: bool = False) -> dict[str, Any]:
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    tcp = {"listen_address": "127.0.0.1:0", "tls_cert_file": str(pki.server_cert),
           "tls_key_file": str(pki.server_key), "token_file": str(token_file)}
    if mtls:
        tcp["client_ca_file"] = str(pki.ca)
    return {"tcp": tcp}


def rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return caught.value


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- configuration -------------------------------------------------------------------------------------------


def test_config_defaults_and_refusals() -> None:
    config = ControlConfig()
    assert config.socket == default_dirs().runtime / "control.sock" and config.socket_mode == 0o660
    assert config.enabled and not config.tcp.enabled
    assert ControlConfig.model_validate({"socket_mode": "0640"}).socket_mode == 0o640
    assert ControlConfig.model_validate({"socket_mode": 0o600}).socket_mode == 0o600
    problems = {
        "TLS and a bearer token": {"tcp": {"listen_address": "0.0.0.0:9848"}},
        "token_file": {"tcp": {"listen_address": ":9848", "tls_cert_file": "/c", "tls_key_file": "/k"}},
        "listen_address is not": {"tcp": {"token_file": "/t"}},
        "world-writable": {"socket_mode": "0666"},
        "absolute path": {"socket": "run/control.sock"},
        "at most 107 bytes": {"socket": "/" + "x" * 120},
        "octal": {"socket_mode": "abc"},
        "port": {"tcp": {"listen_address": "host:99999", "tls_cert_file": "/c", "tls_key_file": "/k",
                         "token_file": "/t"}},
        "Extra inputs": {"max_capture_duration": "10s"},
    }
    for expected, data in problems.items():
        with pytest.raises(ValidationError, match=expected):
            ControlConfig.model_validate(data)
    full = ControlConfig.model_validate({"tcp": {"listen_address": "[::1]:9848", "tls_cert_file": "/c",
                                                 "tls_key_file": "/k", "token_file": "/t"}})
    assert full.tcp.enabled


# -- the Unix socket -----------------------------------------------------------------------------------------


def test_socket_mode_directory_and_cleanup(tmp_path: Path) -> None:
    with running_node(tmp_path) as node:
        info = os.lstat(node.socket)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o660
        assert stat.S_IMODE(os.stat(node.socket.parent).st_mode) == 0o750  # created by the server
        assert os.listdir(node.socket.parent) == ["control.sock"]  # the private bind directory is gone
        with node.client() as client:
            assert client.list_captures() == []
    assert not node.socket.exists()  # stop removed it


def test_the_agent_says_who_it_is(tmp_path: Path) -> None:
    with running_node(tmp_path) as node, node.client() as client:
        assert node.store is not None
        info = client.agent_info()
        assert info == AgentInfo(node_name="node", pid=os.getpid(), version=__version__,
                                 simulated_scenario=None, control_socket=str(node.socket),
                                 capture_store=str(node.store.root))
        assert info.describe(client.where) == f"agent node (pid {os.getpid()}) at {node.socket}"
    with short_dir() as folder:
        config = ControlConfig.model_validate({"socket": str(folder / "control.sock")})
        server = local_control_server(config, service=None, store=None, snapshots=FakeSource(), alerts=None,
                               hostname="sim", simulated="demo")
        server.start()
        try:
            with ControlClient(folder / "control.sock") as client:
                info = client.agent_info()
                assert info is not None and info.capture_store is None
                assert info.describe("X") == f"agent sim (simulating demo, pid {os.getpid()}) at X"
        finally:
            server.stop()


def test_an_agent_older_than_the_question_is_no_error() -> None:
    # An agent without GetAgentInfo answers UNIMPLEMENTED: the client says it does not know the node.
    with short_dir() as folder:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        old_agent = agent_pb2_grpc.AgentServicer()  # type: ignore[no-untyped-call]
        agent_pb2_grpc.add_AgentServicer_to_server(old_agent, server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix:{folder / 'old.sock'}")
        server.start()
        try:
            with ControlClient(folder / "old.sock") as client:
                assert client.agent_info() is None
        finally:
            server.stop(0)


def test_a_stale_socket_is_replaced_a_live_one_or_a_file_is_refused(tmp_path: Path) -> None:
    with short_dir() as folder:
        path = folder / "control.sock"
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(path))
        stale.close()  # bound, never listening: nobody answers
        config = ControlConfig.model_validate({"socket": str(path), "socket_mode": "0600"})
        first = bare_server(config)
        first.start()
        try:
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
            second = bare_server(config)
            identity = os.lstat(path).st_ino
            # The second names the first (it asks it who it is) and what to set instead.
            hostname = socket.gethostname()
            with pytest.raises(ControlServerError, match=re.escape(
                    f"the control socket {path} is in use by another agent (pid {os.getpid()}, node "
                    f"{hostname}); set control.socket (GPUSCOPE_CONTROL__SOCKET) to give this agent its "
                    "own")):
                second.start()
            second.stop()  # a refused server's stop leaves the other agent's socket alone
            assert stat.S_ISSOCK(os.lstat(path).st_mode) and os.lstat(path).st_ino == identity
            with ControlClient(path) as client:
                assert client.list_alerts() == {"enabled": False, "alerts": []}
            with ControlClient(path) as client:
                assert client.list_alerts() == {"enabled": False, "alerts": []}
        finally:
            first.stop()
        path.write_text("not a socket")
        with pytest.raises(ControlServerError, match="exists and is not a socket"):
            bare_server(config).start()
        assert path.read_text() == "not a socket"


def test_an_uncreatable_socket_directory_is_a_clear_error(tmp_path: Path) -> None:
    with short_dir() as folder:
        (folder / "file").write_text("")
        path = folder / "file" / "control.sock"
        server = bare_server(ControlConfig.model_validate({"socket": str(path)}))
        with pytest.raises(ControlServerError, match=re.escape(str(path.parent))):
            server.start()
        server.stop()  # harmless


# -- the methods ---------------------------------------------------------------------------------------------


def test_snapshot_and_alerts(tmp_path: Path) -> None:
    with running_node(tmp_path, with_service=False) as node, node.client() as client:
        with pytest.raises(ControlError, match="no snapshot yet") as caught:
            client.get_snapshot()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert client.list_alerts() == {"enabled": False, "alerts": []}
    snapshot = one_gpu_snapshot()

    class Alerts:
        def alerts(self) -> list[Any]:
            return []

    with running_node(tmp_path, snapshot=snapshot, alerts=Alerts()) as node, node.client() as client:
        document = client.get_snapshot()
        assert document["hostname"] == "node" and document["gpus"][0]["uuid"] == "GPU-fake-0"
        assert document == json.loads(json.dumps(snapshot.to_json()))
        assert client.list_alerts() == {"enabled": True, "alerts": []}


def test_capture_list_and_get_through_the_api(tmp_path: Path) -> None:
    with running_node(tmp_path, snapshot=one_gpu_snapshot()) as node, node.client() as client:
        assert node.store is not None
        record = client.capture(gpu=0, duration_s=0.25, reason="looking at stalls")
        assert record["outcome"] == "captured", record
        for key in ("id", "outcome", "gpu", "pids", "target", "files"):
            assert key in record
        assert record["gpu"] == 0 and record["target"] == f"tsl {PROFILER}"
        assert record["trigger"] == {"kind": "user", "alertname": None, "user": "unix", "judged_since": None,
                                     "judged_until": None, "alert_summary": None}
        assert record["duration_s"] == 0.25 and node.backend.calls[0][2] == 0.25
        by_target = client.capture(target=PROFILER)  # no duration: the agent's default (200ms)
        assert by_target["outcome"] == "captured" and by_target["duration_s"] == 0.2

        listed = client.list_captures()
        assert [r["id"] for r in listed] == [by_target["id"], record["id"]]  # newest first
        assert [r["id"] for r in client.list_captures(limit=1)] == [by_target["id"]]

        out = tmp_path / "download"
        written = client.get_capture(record["id"], out)
        stored = {f.relative: f.path.read_bytes() for f in node.store.files(record["id"])}
        assert written == sorted(stored) == ["capture.json", *record["files"]]
        assert tree(out) == stored  # byte for byte, over several 1 MiB chunks
        assert record_from_bytes((out / "capture.json").read_bytes()).id == record["id"]


def test_get_capture_streams_files_in_1mib_chunks(tmp_path: Path) -> None:
    with running_node(tmp_path, backend=FakeBackend(size=CHUNK_BYTES * 2)) as node:
        with node.client() as client:
            capture_id = client.capture(target=PROFILER)["id"]
        channel, stub = node.stub()
        with channel:
            chunks = list(stub.GetCapture(agent_pb2.GetCaptureRequest(id=capture_id), timeout=10))
    trace = [c for c in chunks if c.path.endswith(".xplane.pb")]
    assert [(c.offset, len(c.data), c.last) for c in trace] == [(0, CHUNK_BYTES, False),
                                                                (CHUNK_BYTES, CHUNK_BYTES, True)]
    assert [c.path for c in chunks if c.last] == ["capture.json", trace[0].path]


def test_invalid_requests_are_invalid_argument_and_capture_nothing(tmp_path: Path) -> None:
    with running_node(tmp_path) as node:
        channel, stub = node.stub()
        with channel:
            bad = {
                "gpu, pid or target": agent_pb2.CaptureRequest(duration_ms=1000),
                "longer than the maximum": agent_pb2.CaptureRequest(gpu=0, duration_ms=31_000),
                "ahead": agent_pb2.CaptureRequest(gpu=0, start_at=time.time() + 600),
                "finite": agent_pb2.CaptureRequest(gpu=0, start_at=float("nan")),
                "GPU index": agent_pb2.CaptureRequest(gpu=-1),
                "process id": agent_pb2.CaptureRequest(pid=0),
                "not supported": agent_pb2.CaptureRequest(target="unix:/var/run/x:1"),
                "no port": agent_pb2.CaptureRequest(target="nowhere"),
            }
            for expected, request in bad.items():
                err = rpc_error(lambda request=request: stub.Capture(request, timeout=10))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (expected, err)
                assert expected in err.details(), (expected, err.details())
        with node.client() as client, pytest.raises(ControlError, match="exactly one") as caught:
            client.capture(gpu=0, pid=1)
        assert caught.value.usage
    assert node.backend.calls == [] and node.store is not None
    assert not list((tmp_path / "captures").glob("2*"))


def test_a_refusal_is_a_result_not_an_error(tmp_path: Path) -> None:
    with running_node(tmp_path, capture={"enabled": False}) as node, node.client() as client:
        record = client.capture(gpu=0, duration_s=1)
        assert record["outcome"] == "refused" and "capture.enabled" in record["error"]
        record = client.capture(gpu=0, duration_s=20)
        assert record["outcome"] == "refused"
    with running_node(tmp_path / "b", with_service=False) as node, node.client() as client:
        record = client.capture(pid=123)
        assert record["outcome"] == "refused" and "disabled" in record["error"] and record["pids"] == [123]
        # As GET /api/v1/captures answers: a listing that says so, not an error.
        listing = client.capture_listing()
        assert listing.document == {"enabled": False, "downloads": False, "captures": [], "refused_count": 0}
        assert listing.captures == [] and not listing.enabled
    assert node.backend.calls == []


def test_oversized_requests_are_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    with running_node(tmp_path) as node:
        channel, stub = node.stub()
        with channel:
            huge = agent_pb2.CaptureRequest(target="h" * 100_000 + ":6009", duration_ms=100)
            err = rpc_error(lambda: stub.Capture(huge, timeout=10))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            big_id = agent_pb2.GetCaptureRequest(id="x" * 100_000)
            err = rpc_error(lambda: stub.GetCapture(big_id, timeout=10))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # The server is still fine afterwards.
            assert stub.ListCaptures(agent_pb2.ListCapturesRequest(), timeout=10).captures == []
    assert node.backend.calls == []
    assert not list((tmp_path / "captures").glob("2*"))


@pytest.mark.parametrize("capture_id", [
    "../x", "..", "../../etc/passwd", "/etc/passwd", "a/b", "", ".", ".lock", ".staging",
    "20250101T000000Z-gpu0-abcdef/../x", "20250101T000000Z-gpu0-abcdef/", "%2e%2e%2f", "x\x00y",
    "20250101T000000Z-gpu0-ABCDEF",
])
def test_traversal_and_malformed_ids_are_invalid_argument(tmp_path: Path, capture_id: str) -> None:
    with running_node(tmp_path, with_service=True) as node:
        (tmp_path / "captures" / ".." / "secret").write_text("outside")
        channel, stub = node.stub()
        with channel:
            err = rpc_error(lambda: stub.GetCapture(agent_pb2.GetCaptureRequest(id=capture_id), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        with node.client() as client, pytest.raises(ControlError) as caught:
            client.get_capture(capture_id, tmp_path / "out")
        assert caught.value.usage  # refused before anything is sent
    assert not (tmp_path / "out").exists()


def test_an_unknown_id_is_not_found_and_creates_no_directory(tmp_path: Path) -> None:
    with running_node(tmp_path) as node, node.client() as client:
        with pytest.raises(ControlError, match="no capture") as caught:
            client.get_capture("20250101T000000Z-gpu0-abcdef", tmp_path / "new" / "out")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND and not caught.value.usage
    assert not (tmp_path / "new").exists(), "failed first, created nothing"


# -- the client's side of GetCapture -------------------------------------------------------------------------


def test_get_never_overwrites_and_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    with running_node(tmp_path) as node, node.client() as client:
        record = client.capture(target=PROFILER)
        out = tmp_path / "out"
        client.get_capture(record["id"], out)
        before = tree(out)
        mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
        with pytest.raises(ControlError, match="already exists; refusing to overwrite"):
            client.get_capture(record["id"], out)
        assert tree(out) == before and {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes

        # A directory holding only the trace's name: capture.json (sent first) is written, then the
        # trace collides; the download is undone, the existing file kept as it was.
        other = tmp_path / "other"
        trace = other / record["files"][0]
        trace.parent.mkdir(parents=True)
        trace.write_bytes(b"mine")
        with pytest.raises(ControlError, match="refusing to overwrite"):
            client.get_capture(record["id"], other)
        assert tree(other) == {record["files"][0]: b"mine"}


def chunk(path: str, data: bytes = b"x", offset: int = 0, last: bool = True) -> agent_pb2.FileChunk:
    return agent_pb2.FileChunk(path=path, offset=offset, data=data, last=last)


@pytest.mark.parametrize("path", [
    "../evil", "../../evil", "/tmp/evil", "a/../../evil", "a/../b", "./a", "a//b", "a/", "", "a\\..\\evil",
    "a\x00b", "..", ".", "x/" * 40 + "f", "a" * 300,
])
def test_the_client_refuses_paths_that_could_escape(tmp_path: Path, path: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(ControlError, match="refusing"):
        safe_relative_path(path)
    with pytest.raises(ControlError):
        write_chunks([chunk("capture.json", b"{}"), chunk(path, b"evil")], out)
    assert not out.exists()  # capture.json, written first, was removed again, and the directory made for it
    assert not (tmp_path / "evil").exists()


def test_the_client_refuses_symlinks_in_the_way_and_broken_streams(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "plugins").symlink_to(outside)
    with pytest.raises(ControlError, match="symlink"):
        write_chunks([chunk("plugins/profile/x.xplane.pb", b"evil")], out)
    (out / "capture.json").symlink_to(outside / "target")
    with pytest.raises(ControlError, match="refusing to overwrite"):
        write_chunks([chunk("capture.json", b"evil")], out)
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in out.iterdir()) == ["capture.json", "plugins"]

    clean = tmp_path / "clean"
    broken = {
        "out of order": [chunk("a", b"12", last=False), chunk("a", b"3", offset=5)],
        "middle of": [chunk("a", b"12", last=False)],
        "before the end": [chunk("a", b"1", last=False), chunk("b")],
        "twice": [chunk("a"), chunk("a")],
    }
    for expected, chunks in broken.items():
        with pytest.raises(ControlError, match=expected):
            write_chunks(chunks, clean)
        assert not clean.exists(), expected  # the directory made for the download too
    assert write_chunks([chunk("d/e/f", b"ab", last=False), chunk("d/e/f", b"c", offset=2), chunk("g", b"")],
                        clean) == ["d/e/f", "g"]
    assert tree(clean) == {"d/e/f": b"abc", "g": b""}


def test_a_malicious_server_cannot_write_outside(tmp_path: Path) -> None:
    """A server that streams '../evil': the real client, over a real channel, refuses it."""

    class Evil(agent_pb2_grpc.AgentServicer):  # type: ignore[misc]
        def GetCapture(self, request: Any, context: Any) -> Iterator[agent_pb2.FileChunk]:
            yield chunk("capture.json", b"{}")
            yield chunk("../evil", b"gotcha")

    from concurrent import futures

    with short_dir() as folder:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        agent_pb2_grpc.add_AgentServicer_to_server(Evil(), server)
        server.add_insecure_port(f"unix:{folder / 'evil.sock'}")
        server.start()
        try:
            with ControlClient(folder / "evil.sock") as client, pytest.raises(ControlError, match="unsafe"):
                client.get_capture("20250101T000000Z-gpu0-abcdef", tmp_path / "out")
        finally:
            server.stop(0)
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "out").exists()


def test_a_missing_socket_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ControlError, match=r"no gpuscope agent control socket at .* is the agent running"):
        ControlClient(tmp_path / "nothing.sock")


# -- TCP: TLS and a bearer token -----------------------------------------------------------------------------


def test_tcp_requires_tls_and_the_token(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    control = tcp_control(pki, tmp_path / "token")
    with running_node(tmp_path, control=control, snapshot=one_gpu_snapshot()) as node:
        port = node.server.tcp_port
        assert port
        address = f"127.0.0.1:{port}"
        with ControlClient(address, tls_ca=pki.ca, token_file=tmp_path / "token") as client:
            record = client.capture(gpu=0, duration_s=0.1)
            assert record["outcome"] == "captured"
            assert record["trigger"]["user"] == "token"
            assert [r["id"] for r in client.list_captures()] == [record["id"]]
            assert client.get_capture(record["id"], tmp_path / "got")
        calls = len(node.backend.calls)

        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-token-0123456789")
        with ControlClient(address, tls_ca=pki.ca, token_file=wrong) as client:
            for call in (lambda: client.capture(gpu=0, duration_s=0.1), client.list_captures,
                         lambda: client.get_capture(record["id"], tmp_path / "wrong-out")):
                with pytest.raises(ControlError, match="refused the credentials") as caught:
                    call()
                assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert not (tmp_path / "wrong-out").exists() or not list((tmp_path / "wrong-out").iterdir())

        # No token at all (TLS alone), and a token in another scheme.
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        with grpc.secure_channel(address, credentials) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            for metadata in ((), (("authorization", f"Basic {TOKEN}"),), (("authorization", TOKEN),),
                             (("authorization", f"Bearer {TOKEN}x"),)):
                err = rpc_error(lambda metadata=metadata: stub.Capture(
                    agent_pb2.CaptureRequest(gpu=0, duration_ms=100), metadata=metadata, timeout=10))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
                assert "bearer token" in err.details()
                assert TOKEN not in err.details()
            ok = stub.ListCaptures(agent_pb2.ListCapturesRequest(), timeout=10,
                                   metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert len(ok.captures) == 1
        # Plain text to the TLS port does not get through either.
        with grpc.insecure_channel(address) as channel:
            err = rpc_error(lambda: agent_pb2_grpc.AgentStub(channel).ListCaptures(
                agent_pb2.ListCapturesRequest(), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert len(node.backend.calls) == calls  # nothing captured without the token
        assert node.store is not None and len(node.store.list()) == 1


def test_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    control = tcp_control(pki, tmp_path / "token", mtls=True)
    with running_node(tmp_path, control=control) as node:
        address = f"127.0.0.1:{node.server.tcp_port}"
        with ControlClient(address, tls_ca=pki.ca, token_file=tmp_path / "token", tls_cert=pki.client_cert,
                           tls_key=pki.client_key) as client:
            assert client.list_captures() == []
        with ControlClient(address, tls_ca=pki.ca, token_file=tmp_path / "token") as client, \
                pytest.raises(ControlError, match="cannot reach"):
            client.list_captures()


def test_tcp_setup_errors_are_clear(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    control = tcp_control(pki, tmp_path / "token")
    (tmp_path / "token").write_text("short")
    with short_dir() as folder:
        config = ControlConfig.model_validate({"socket": str(folder / "c.sock"), **control})
        server = bare_server(config)
        with pytest.raises(ControlServerError, match="shorter than 16") as caught:
            server.start()
        assert "short" not in str(caught.value).replace("shorter", "")  # the token is never shown
        assert not (folder / "c.sock").exists()  # the Unix socket was not left behind

        missing = {**control["tcp"], "tls_cert_file": str(tmp_path / "missing.crt")}
        (tmp_path / "token").write_text(TOKEN)
        config = ControlConfig.model_validate({"socket": str(folder / "c.sock"), "tcp": missing})
        with pytest.raises(ControlServerError, match=r"missing\.crt"):
            bare_server(config).start()

        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = {**control["tcp"], "listen_address": f"127.0.0.1:{taken.getsockname()[1]}"}
            config = ControlConfig.model_validate({"socket": str(folder / "c.sock"), "tcp": busy})
            with pytest.raises(ControlServerError, match=r"cannot listen on control\.tcp\.listen_address"):
                bare_server(config).start()
    with pytest.raises(ControlError, match="needs a bearer token"):
        ControlClient("127.0.0.1:1", tls_ca=pki.ca)


# -- concurrency ---------------------------------------------------------------------------------------------


def test_other_methods_answer_while_a_capture_runs(tmp_path: Path) -> None:
    backend = GatedBackend(size=10)
    with running_node(tmp_path, backend=backend) as node, node.client() as client:
        results: list[dict[str, Any]] = []
        worker = threading.Thread(target=lambda: results.append(client.capture(target=PROFILER,
                                                                               duration_s=1.5)))
        worker.start()
        assert backend.started.wait(timeout=10)
        started = time.monotonic()
        assert client.list_captures() == [] and client.list_alerts()["enabled"] is False
        assert time.monotonic() - started < 1.0 and not results  # the capture is still held
        queued: list[dict[str, Any]] = []
        second = threading.Thread(target=lambda: queued.append(client.capture(target=PROFILER,
                                                                              duration_s=0.1)))
        second.start()  # queued behind the first
        backend.release.set()
        worker.join(timeout=20)
        second.join(timeout=20)
        assert results[0]["outcome"] == "captured" and queued[0]["outcome"] == "captured"


def test_stop_does_not_wait_for_a_capture_in_progress(tmp_path: Path) -> None:
    backend = GatedBackend(size=10)
    with running_node(tmp_path, backend=backend) as node, node.client() as client:
        errors: list[ControlError] = []

        def call() -> None:
            try:
                client.capture(target=PROFILER, duration_s=1)
            except ControlError as err:
                errors.append(err)

        worker = threading.Thread(target=call)
        worker.start()
        assert backend.started.wait(timeout=10)
        started = time.monotonic()
        node.server.stop(grace=0.2)
        assert time.monotonic() - started < 1.0
        worker.join(timeout=5)
        assert errors and errors[0].code == grpc.StatusCode.UNAVAILABLE, errors
        assert not node.socket.exists()
        assert node.store is not None
        backend.release.set()
        deadline = time.monotonic() + 10  # the capture itself went on, and was stored
        while not node.store.list() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.outcome for r in node.store.list()] == ["captured"]


# -- a real JAX job, end to end ---------------------------------------------------------------------------


def test_a_real_jax_capture_through_the_api(jax_job: Workload, tmp_path: Path) -> None:
    clock = ManualClock()
    config = CaptureConfig.model_validate({"store": {"root": str(tmp_path / "captures")},
                                           "profiler_ports": [jax_job.port], "duration": "1s"})
    store = CaptureStore(tmp_path / "captures", quota_bytes=config.store.quota_bytes)
    simulation = Simulation(parse_scenario(scenario_for(jax_job.proc.pid), source="control-e2e"), clock=clock)
    simulation.install()
    sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                      wall_clock=lambda: 1.7e9 + clock.now, hostname="sim-node")
    service = CaptureService(store=store, policy=CapturePolicy(config),
                             resolver=TargetResolver(profiler_ports=config.profiler_ports, static_targets=[]),
                             backends={"tsl": TslProfilerBackend()}, snapshots=sampler,
                             hostname="sim-node", deadline_margin_s=config.deadline_margin)
    service.start()
    try:
        sampler.tick()  # GPU 1 runs the JAX job (its real pid)
        with short_dir() as folder:
            control = ControlConfig.model_validate({"socket": str(folder / "control.sock")})
            server = local_control_server(control, service=service, store=store, snapshots=sampler,
                                   alerts=None, hostname="sim-node")
            server.start()
            try:
                with ControlClient(folder / "control.sock") as client:
                    record = client.capture(gpu=1, duration_s=0.8)
                    assert record["outcome"] == "captured", record
                    assert record["gpu"] == 1 and jax_job.proc.pid in record["pids"]
                    assert record["target"] == f"tsl 127.0.0.1:{jax_job.port}"
                    assert [r["id"] for r in client.list_captures()] == [record["id"]]
                    written = client.get_capture(record["id"], tmp_path / "got")
            finally:
                server.stop()
        assert written == ["capture.json", *record["files"]]
        (xplane,) = [f for f in written if f.endswith(".xplane.pb")]
        data = (tmp_path / "got" / xplane).read_bytes()
        assert data == (store.path(record["id"]) / xplane).read_bytes()
        space = xplane_pb2.XSpace.FromString(data)
        assert "/host:CPU" in [plane.name for plane in space.planes]
        assert sum(len(line.events) for plane in space.planes for line in plane.lines) > 100
    finally:
        service.stop()
        sampler.stop()
        simulation.uninstall()
        store.close()
