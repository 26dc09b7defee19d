"""The Kineto on-demand daemon and capture backend: against real PyTorch processes on the CPU
(KINETO_USE_DAEMON=1), and against scripted clients for what a PyTorch process does not send.

The processes reach the daemon through a socket file (KINETO_IPC_SOCKET_DIR, a fresh short directory
per run), so runs in parallel never share an address; one test uses the real abstract @dynolog and
skips when something else on this host holds it. A KINETO_CONFIG file shortens the processes' poll
period from 5 s to 1 s. The directories named in ``capture.kineto`` are checked through
``build_captures``, as the agent uses them."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from capturing import TORCH_WORKLOAD, DirectoryStaging, Workload, require_torch, start, stop, wait_ready
from snapshots import FakeSource

from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.factory import Captures, build_captures
from gpuscope.capture.kineto.backend import KinetoBackend
from gpuscope.capture.kineto.daemon import KinetoDaemon, PendingTrace
from gpuscope.capture.kineto.errors import KinetoDaemonError
from gpuscope.capture.kineto.protocol import HEADER, REQUEST
from gpuscope.capture.model import BackendResult, CaptureTarget
from gpuscope.common.unixfs import safe_file_name

OPS = {"aten::mm", "aten::addmm", "aten::relu"}
POLL_S = 1  # ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS for the test processes
DEADLINE_S = 20.0


def start_workload(tmp: Path, name: str, *args: str, socket_dir: Path | None) -> Workload:
    """A PyTorch training loop started with KINETO_USE_DAEMON=1, polling every POLL_S."""
    kineto_config = tmp / "libkineto.conf"
    kineto_config.write_text(f"ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS={POLL_S}\n")
    env = {"KINETO_USE_DAEMON": "1", "KINETO_CONFIG": str(kineto_config)}
    if socket_dir is not None:
        env["KINETO_IPC_SOCKET_DIR"] = str(socket_dir)
    return start(TORCH_WORKLOAD, tmp, name, *args, env=env,
                 unset=() if socket_dir is not None else ("KINETO_IPC_SOCKET_DIR",))


def wait_registered(daemon: KinetoDaemon, pid: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while pid not in daemon.registered():
        if time.monotonic() > end:
            raise AssertionError(f"pid {pid} never registered; registered: {daemon.registered()}")
        time.sleep(0.05)


def wait_profiling(daemon: KinetoDaemon, pid: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not daemon.registered()[pid].profiling:
        if time.monotonic() > end:
            raise AssertionError(f"pid {pid} never reported a busy profiler: {daemon.registered()[pid]}")
        time.sleep(0.05)


@dataclass
class Node:
    daemon: KinetoDaemon
    backend: KinetoBackend
    socket_dir: Path
    busy: Workload
    idle: Workload
    self_profiling: Workload


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp paths can be too long for
    # <dir>/dynoconfigclient<uuid>.
    path = Path(tempfile.mkdtemp(prefix="gk-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def node(short_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A daemon on a private socket file and three PyTorch jobs: training, idle, profiling itself."""
    require_torch()
    tmp = tmp_path_factory.mktemp("kineto")
    socket_dir = short_dir / "sock"
    daemon = KinetoDaemon(socket_dir=socket_dir, trace_dir=short_dir / "traces")
    daemon.start()
    workloads = [start_workload(tmp, "busy", socket_dir=socket_dir),
                 start_workload(tmp, "idle", "--idle", socket_dir=socket_dir),
                 start_workload(tmp, "self", "--self-profile", socket_dir=socket_dir)]
    try:
        for workload in workloads:
            wait_ready(workload)
        for workload in workloads:
            wait_registered(daemon, workload.pid)
        yield Node(daemon, KinetoBackend(daemon), socket_dir, *workloads)
    finally:
        for workload in workloads:
            stop(workload)
        daemon.stop()


def capture(node: Node, pid: int, staging: Path, duration_s: float = 1.0,
            deadline_s: float = DEADLINE_S) -> BackendResult:
    return node.backend.capture(CaptureTarget("kineto", pid, source="kineto-registration"), duration_s,
                                DirectoryStaging(staging), deadline_s=deadline_s)


def trace_events(path: Path) -> list[dict[str, object]]:
    data = json.loads(gzip.decompress(path.read_bytes()))
    events = data["traceEvents"]
    assert isinstance(events, list)
    return events


# --- real PyTorch processes -------------------------------------------------------------------------

def test_registration_of_a_pytorch_process(node: Node) -> None:
    registration = node.daemon.registered()[node.busy.pid]
    assert registration.pid == registration.reported_pid == node.busy.pid
    # The process reports its ancestors: the test process started it.
    assert registration.ancestors[0] == os.getpid()
    assert registration.uid == os.geteuid()
    assert registration.profiling is False
    assert registration.job_id == int(os.environ.get("SLURM_JOB_ID", "0"))
    # The processes keep polling (every POLL_S seconds here); one whose activity profiler is busy
    # (torch.profiler in the script) says so in its polls.
    wait_profiling(node.daemon, node.self_profiling.pid)
    end = time.monotonic() + 3 * POLL_S
    while node.daemon.registered()[node.busy.pid].polls == registration.polls:
        assert time.monotonic() < end, "no poll for three poll periods"
        time.sleep(0.05)
    assert node.daemon.registered()[node.busy.pid].last_seen > registration.last_seen


def test_captures_a_training_process(node: Node, tmp_path: Path) -> None:
    started = time.monotonic()
    result = capture(node, node.busy.pid, tmp_path)
    elapsed = time.monotonic() - started
    assert result.outcome == "captured", (result, node.busy.log.read_text())
    assert result.error is None
    (name,) = result.files
    host = re.escape(safe_file_name(socket.gethostname(), limit=64))
    assert re.fullmatch(rf"{host}_{node.busy.pid}\.\d{{13}}\.pt\.trace\.json\.gz", name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary file left behind
    events = trace_events(tmp_path / name)
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    assert names >= OPS, sorted(str(n) for n in names)[:50]
    assert {e.get("pid") for e in events if e.get("name") == "aten::addmm"} == {node.busy.pid}
    # A poll (≤ 1 s here), the recording (1 s), the writing (a few seconds).
    assert 1.0 <= elapsed < DEADLINE_S
    assert list(node.daemon.trace_dir.iterdir()) == []  # the capture's directory is gone
    assert node.daemon.stats()["configs_delivered"] >= 1


def test_a_trace_over_max_trace_bytes_is_not_read(node: Node, tmp_path: Path) -> None:
    small = KinetoBackend(node.daemon, max_trace_bytes=1000)
    result = small.capture(CaptureTarget("kineto", node.busy.pid, source="kineto-registration"), 0.5,
                           DirectoryStaging(tmp_path), deadline_s=DEADLINE_S)
    assert result.outcome == "failed" and list(tmp_path.iterdir()) == []
    # Refused as the job writes it (its .json.tmp grows past the cap), or once complete: never read.
    assert result.error is not None and re.fullmatch(
        r"the trace (is|has grown to) [0-9.]+ [KM]iB, larger than capture\.kineto\.max_trace_bytes "
        r"\(1000 B\); it was not read\. Capture for less time, or raise the limit",
        result.error), result.error
    assert list(node.daemon.trace_dir.iterdir()) == []  # the job's file is removed all the same


def test_a_second_concurrent_capture_is_busy(node: Node, tmp_path: Path) -> None:
    results: list[BackendResult] = []
    first = threading.Thread(target=lambda: results.append(capture(node, node.busy.pid, tmp_path / "a")))
    first.start()
    try:
        end = time.monotonic() + 5
        while node.busy.pid not in node.daemon._pending and time.monotonic() < end:
            time.sleep(0.01)
        second = capture(node, node.busy.pid, tmp_path / "b")
    finally:
        first.join()
    assert second.outcome == "busy", second
    assert "already in flight" in (second.error or "")
    assert results[0].outcome == "captured", results
    assert not (tmp_path / "b").exists()


def test_an_idle_process_gives_an_empty_trace(node: Node, tmp_path: Path) -> None:
    result = capture(node, node.idle.pid, tmp_path, duration_s=0.5)
    assert result.outcome == "empty", result
    assert result.files == ()
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_a_process_profiling_itself_is_busy(node: Node, tmp_path: Path) -> None:
    wait_profiling(node.daemon, node.self_profiling.pid)
    started = time.monotonic()
    result = capture(node, node.self_profiling.pid, tmp_path)
    assert result.outcome == "busy", result
    assert "already profiling" in (result.error or "")
    assert time.monotonic() - started < 1.0


def test_an_unregistered_pid_is_unreachable(node: Node, tmp_path: Path) -> None:
    started = time.monotonic()
    result = capture(node, os.getppid(), tmp_path)  # our parent never polls
    assert result.outcome == "unreachable", result
    assert "not registered" in (result.error or "")
    assert time.monotonic() - started < 0.5


def test_a_process_that_stops_polling_is_unreachable_by_the_deadline(node: Node, tmp_path: Path) -> None:
    # A scripted client polls once, then never again: its config is never taken.
    with ScriptedClient(node.socket_dir, "silent") as client:
        client.request(node.daemon.address, [os.getpid()])  # registered under our own pid
        started = time.monotonic()
        result = capture(node, os.getpid(), tmp_path, duration_s=0.5, deadline_s=1.5)
        elapsed = time.monotonic() - started
    assert result.outcome == "unreachable", result
    assert "did not poll" in (result.error or "")
    assert 1.4 <= elapsed < 2.5
    assert os.getpid() not in node.daemon._pending
    assert list(node.daemon.trace_dir.iterdir()) == []


def test_malformed_datagrams_are_ignored(node: Node) -> None:
    daemon = node.daemon
    before = daemon.stats()
    with ScriptedClient(node.socket_dir, "bad") as client:
        garbage = [
            b"",
            b"x",
            b"\xff" * 39,
            HEADER.pack(5, b"req") + b"abc",  # size does not match
            HEADER.pack(4, b"req") + b"abcd",  # body too short for a request
            HEADER.pack(16, b"req") + REQUEST.pack(3, 0, 0),  # no pids
            HEADER.pack(20, b"req") + REQUEST.pack(3, 2, 0) + struct.pack("=i", 1),  # n too large
            HEADER.pack(20, b"req") + REQUEST.pack(3, 1, 0) + struct.pack("=i", -5),  # bad pid
            HEADER.pack(20, b"req") + REQUEST.pack(3, -1, 0) + struct.pack("=i", 1),
            HEADER.pack(3, b"zzz") + b"abc",  # unknown type
            HEADER.pack(4, b"ctxt") + b"abcd",  # context of the wrong size
            os.urandom(5000),
        ]
        for datagram in garbage:
            client.sock.sendto(datagram, daemon.address)
        # From a socket that is not a Kineto client's: no reply is ever sent there.
        other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        other.bind(str(node.socket_dir / "not-a-client"))
        try:
            other.sendto(HEADER.pack(20, b"req") + REQUEST.pack(3, 1, 0) + struct.pack("=i", 4242),
                         daemon.address)
            # The daemon still answers a well-formed request, and nothing came back for the garbage.
            config = client.request(daemon.address, [os.getpid(), os.getppid()])
            assert config == b""
            other.settimeout(0.2)
            with pytest.raises(TimeoutError):
                other.recv(100)
        finally:
            other.close()
            (node.socket_dir / "not-a-client").unlink()
        with pytest.raises(TimeoutError):
            client.sock.settimeout(0.2)
            client.sock.recv(100)
    after = daemon.stats()
    assert after["malformed"] - before["malformed"] == len(garbage) + 1
    assert after["errors"] == before["errors"]
    assert daemon.running
    assert 4242 not in daemon.registered()


def test_context_messages_are_answered(node: Node) -> None:
    # GPU builds register each CUDA context ({int32 gpu; int32 pid; int64 jobid}) and wait for the
    # number of processes on that GPU.
    with ScriptedClient(node.socket_dir, "ctxt") as client:
        client.sock.sendto(HEADER.pack(16, b"ctxt") + struct.pack("=iiq", 3, os.getpid(), 0),
                           node.daemon.address)
        data = client.sock.recv(100)
    size, kind = HEADER.unpack_from(data)
    assert (size, kind.rstrip(b"\0")) == (4, b"ctxt")
    assert struct.unpack_from("=i", data, HEADER.size) == (1,)
    assert node.daemon.registered()[os.getpid()].gpus == (3,)


def test_a_second_daemon_on_the_same_socket_file_is_refused(node: Node) -> None:
    other = KinetoDaemon(socket_dir=node.socket_dir, trace_dir=node.daemon.trace_dir)
    with pytest.raises(KinetoDaemonError, match="another Kineto daemon"):
        other.start()
    assert node.daemon.running


# --- without PyTorch --------------------------------------------------------------------------------

class ScriptedClient:
    """A Kineto client by hand: a datagram socket named like PyTorch's, in ``socket_dir``."""

    def __init__(self, socket_dir: Path, name: str) -> None:
        self.path = socket_dir / f"dynoconfigclient-test-{name}-{os.getpid()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def __enter__(self) -> ScriptedClient:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.sock.bind(str(self.path))
        self.sock.settimeout(2.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def request(self, address: str, pids: list[int], config_type: int = 3) -> bytes:
        body = REQUEST.pack(config_type, len(pids), 0) + struct.pack(f"={len(pids)}i", *pids)
        self.sock.sendto(HEADER.pack(len(body), b"req") + body, address)
        data = self.sock.recv(65536)
        size, kind = HEADER.unpack_from(data)
        assert kind.rstrip(b"\0") == b"req"
        assert size == len(data) - HEADER.size
        return data[HEADER.size:]


def test_registrations_expire_and_configs_go_to_the_next_poll(short_dir: Path) -> None:
    now = [1000.0]
    socket_dir = short_dir / "sock-expire"
    daemon = KinetoDaemon(socket_dir=socket_dir, trace_dir=short_dir / "traces-expire",
                          clock=lambda: now[0], expire_after_s=15.0)
    with daemon, ScriptedClient(socket_dir, "expire") as client:
        assert client.request(daemon.address, [os.getpid(), 1]) == b""
        registration = daemon.registered()[os.getpid()]
        assert (registration.ancestors, registration.last_seen, registration.polls) == ((1,), 1000.0, 1)

        trace = daemon.request_trace(os.getpid(), 1500)
        assert trace.directory.parent == daemon.trace_dir
        assert trace.directory.is_dir()
        # A poll while the process's activity profiler is busy (type 1): not handed over, busy.
        assert client.request(daemon.address, [os.getpid(), 1], config_type=1) == b""
        assert trace.busy is not None and trace.event.is_set()
        daemon.finish(trace)
        assert not trace.directory.exists()
        assert daemon.registered()[os.getpid()].profiling is True
        assert client.request(daemon.address, [os.getpid(), 1]) == b""  # its profiler is free again

        trace = daemon.request_trace(os.getpid(), 1500)
        config = client.request(daemon.address, [os.getpid(), 1]).decode()
        assert config.splitlines() == [f"ACTIVITIES_LOG_FILE={trace.directory}/trace.json",
                                       "ACTIVITIES_DURATION_MSECS=1500",
                                       "ACTIVITIES_WARMUP_PERIOD_SECS=0", "PROFILE_START_TIME=0"]
        assert trace.event.wait(2.0)  # marked delivered once the reply is sent
        assert trace.delivered is not None and trace.busy is None
        assert client.request(daemon.address, [os.getpid(), 1]) == b""  # handed over once
        daemon.finish(trace)

        now[0] += 14.0
        assert os.getpid() in daemon.registered()
        now[0] += 2.0
        assert daemon.registered() == {}
    assert not (socket_dir / "dynolog").exists()  # removed at stop


def test_the_backend_without_a_running_daemon(short_dir: Path, tmp_path: Path) -> None:
    daemon = KinetoDaemon(socket_dir=short_dir / "sock-none", trace_dir=short_dir / "traces-none")
    backend = KinetoBackend(daemon)
    target = CaptureTarget("kineto", os.getpid())
    result = backend.capture(target, 1.0, DirectoryStaging(tmp_path, "r"), deadline_s=5.0)
    assert result.outcome == "unreachable"
    assert "not running" in (result.error or "")
    assert backend.capture(CaptureTarget("tsl", 1, "127.0.0.1:6009"), 1.0, DirectoryStaging(tmp_path, "r"),
                           deadline_s=5.0).outcome == "failed"
    assert backend.capture(target, 2.0, DirectoryStaging(tmp_path, "r"), deadline_s=1.0).outcome == "failed"


def test_a_symlinked_trace_directory_is_refused(short_dir: Path) -> None:
    link = short_dir / "traces-link"
    link.symlink_to(short_dir)
    daemon = KinetoDaemon(socket_dir=short_dir / "sock-link", trace_dir=link)
    with pytest.raises(KinetoDaemonError, match="symlink"):
        daemon.start()


def test_the_abstract_address_taken_by_another_daemon(short_dir: Path) -> None:
    """What happens where dynolog (or another gpuscope) already serves the host: a clear error."""
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        try:
            squatter.bind("\0dynolog\0")
        except OSError:
            pytest.skip("@dynolog is already bound on this host (dynolog or another agent runs)")
        daemon = KinetoDaemon(trace_dir=short_dir / "traces-abstract")
        with pytest.raises(KinetoDaemonError, match=r"@dynolog is already bound.*dynolog"):
            daemon.start()
        assert not daemon.running
    finally:
        squatter.close()


def test_real_pytorch_through_the_abstract_socket(short_dir: Path, tmp_path: Path) -> None:
    """The default address, exactly as PyTorch uses it (no KINETO_IPC_SOCKET_DIR)."""
    require_torch()
    daemon = KinetoDaemon(trace_dir=short_dir / "traces-abstract")
    try:
        daemon.start()
    except KinetoDaemonError as err:
        pytest.skip(f"cannot use the abstract address here: {err}")
    workload = start_workload(tmp_path, "abstract", socket_dir=None)
    try:
        wait_ready(workload)
        wait_registered(daemon, workload.pid)
        result = KinetoBackend(daemon).capture(CaptureTarget("kineto", workload.pid), 0.5,
                                               DirectoryStaging(tmp_path / "out"), deadline_s=DEADLINE_S)
        assert result.outcome == "captured", (result, workload.log.read_text())
        names = {e.get("name") for e in trace_events(tmp_path / "out" / result.files[0])}
        assert names >= OPS
    finally:
        stop(workload)
        daemon.stop()


def test_a_waiting_capture_ends_when_the_daemon_stops(short_dir: Path, tmp_path: Path) -> None:
    socket_dir = short_dir / "sock-stop"
    daemon = KinetoDaemon(socket_dir=socket_dir, trace_dir=short_dir / "traces-stop")
    daemon.start()
    results: list[BackendResult] = []
    try:
        with ScriptedClient(socket_dir, "stop") as client:
            client.request(daemon.address, [os.getpid()])
            thread = threading.Thread(target=lambda: results.append(KinetoBackend(daemon).capture(
                CaptureTarget("kineto", os.getpid()), 1.0, DirectoryStaging(tmp_path), deadline_s=30.0)))
            thread.start()
            while os.getpid() not in daemon._pending:
                time.sleep(0.01)
    finally:
        stopped = time.monotonic()
        daemon.stop()
    thread.join(timeout=5)
    assert [(r.outcome, r.error) for r in results] == [("unreachable", "the Kineto daemon stopped")]
    assert time.monotonic() - stopped < 2.0
    assert list(daemon.trace_dir.iterdir()) == []


def poll_as(uid: int | None, client_path: Path, address: str) -> tuple[int, int]:
    """Forks a child that polls the daemon once (as ``uid``, if given) and then waits; (its pid, a
    pipe whose closing ends it)."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: socket calls only, then _exit
        try:
            os.close(hold_w)
            os.close(ready_r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.settimeout(5)
            sock.bind(str(client_path))
            body = REQUEST.pack(3, 1, 0) + struct.pack("=i", 1)
            sock.sendto(HEADER.pack(len(body), b"req") + body, address)
            sock.recv(1000)
            os.write(ready_w, b"x")
            os.read(hold_r, 1)
        except BaseException as err:
            os.write(2, f"child: {err!r}\n".encode())
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        assert os.read(ready_r, 1) == b"x"
    finally:
        os.close(ready_r)
    return pid, hold_w


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_the_capture_directory_belongs_to_the_process_user(short_dir: Path) -> None:
    os.chmod(short_dir, 0o711)  # mkdtemp's 0700 would keep the other user out
    socket_dir = short_dir / "sock-user"
    daemon = KinetoDaemon(socket_dir=socket_dir, trace_dir=short_dir / "traces-user")
    with daemon:
        assert stat_mode(socket_dir) == 0o1733  # every user's process makes its socket here
        assert stat_mode(socket_dir / "dynolog") == 0o666
        assert stat_mode(daemon.trace_dir) == 0o711  # enterable, not listable
        client_path = socket_dir / "dynoconfigclient-test-nobody"
        pid, hold = poll_as(65534, client_path, daemon.address)
        try:
            registration = daemon.registered()[pid]
            assert (registration.uid, registration.gid) == (65534, 65534)
            trace = daemon.request_trace(pid, 1000)
            st = trace.directory.stat()
            assert (st.st_uid, st.st_gid, stat_mode(trace.directory)) == (65534, 65534, 0o700)
            daemon.finish(trace)
        finally:
            os.close(hold)
            os.waitpid(pid, 0)
            with contextlib.suppress(FileNotFoundError):
                client_path.unlink()


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_many_processes_poll_at_once(short_dir: Path) -> None:
    socket_dir = short_dir / "sock-many"
    daemon = KinetoDaemon(socket_dir=socket_dir, trace_dir=short_dir / "traces-many", max_clients=30)
    children: list[tuple[int, int]] = []
    with daemon:
        try:
            for n in range(40):
                children.append(poll_as(None, socket_dir / f"dynoconfigclient-test-many-{n}", daemon.address))
            # Every process got its answer; the first 30 are registered, the others dropped.
            registered = daemon.registered()
            assert len(registered) == 30
            assert set(registered) == {pid for pid, _ in children[:30]}
            end = time.monotonic() + 2  # the last reply is counted just after it is sent
            while daemon.stats()["replies"] < 40 and time.monotonic() < end:
                time.sleep(0.01)
            stats = daemon.stats()
            assert (stats["requests"], stats["replies"], stats["clients_dropped"]) == (40, 40, 10)
        finally:
            # Each child also holds the pipes of those forked before it: close all, then reap.
            for _, hold in children:
                os.close(hold)
            for pid, _ in children:
                os.waitpid(pid, 0)


# --- the directories, as configured (capture.kineto) ----------------------------------------------

def configured(tmp_path: Path, **kineto: Path) -> Captures:
    config = CaptureConfig.model_validate({"store": {"root": str(tmp_path / "store")},
                                           "kineto": {k: str(v) for k, v in kineto.items()}})
    captures = build_captures(config, snapshots=FakeSource(), hostname="node-1")
    assert captures is not None
    return captures


def test_the_configured_directories_are_used(short_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """capture.kineto.trace_dir and socket_dir with a real PyTorch job: both are made at start (their
    missing parent too), the job polls the socket there and writes its trace in the trace directory."""
    require_torch()
    base = short_dir / "configured"
    captures = configured(tmp_path, trace_dir=base / "traces", socket_dir=base / "ipc")
    daemon = captures.kineto
    assert (daemon.trace_dir, daemon.socket_dir) == (base / "traces", base / "ipc")
    written: list[Path] = []
    finish = daemon.finish

    def finish_noting_the_files(trace: PendingTrace) -> None:
        written.extend(trace.directory.iterdir())
        finish(trace)

    monkeypatch.setattr(daemon, "finish", finish_noting_the_files)
    captures.start()
    workload = start_workload(tmp_path, "configured", socket_dir=base / "ipc")
    try:
        # The parent lets other users' jobs through (capture/kineto/directories.py: the modes).
        assert [stat_mode(p) for p in (base, base / "traces", base / "ipc")] == [0o755, 0o711, 0o1733]
        wait_ready(workload)
        wait_registered(daemon, workload.pid)
        result = KinetoBackend(daemon).capture(CaptureTarget("kineto", workload.pid), 0.5,
                                               DirectoryStaging(tmp_path / "out"), deadline_s=DEADLINE_S)
        assert result.outcome == "captured", (result, workload.log.read_text())
        (trace_file,) = written
        assert trace_file.parent.parent == base / "traces"
        assert trace_file.name == f"trace_{workload.pid}.json"
        assert list((base / "traces").iterdir()) == []
    finally:
        stop(workload)
        captures.stop()
    assert not (base / "ipc" / "dynolog").exists()


def make_dir(path: Path, mode: int, uid: int | None = None) -> None:
    path.mkdir(parents=True)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, uid)


def symlink_to_a_directory(path: Path) -> None:
    make_dir(path.parent / f"{path.name}-target", 0o711)
    path.symlink_to(path.parent / f"{path.name}-target")


NOT_ROOT = os.geteuid() != 0
BAD_DIRECTORIES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    # name: (the setting at fault, how its directory is made beforehand, what the warning says)
    "trace dir writable by all": ("trace_dir", lambda p: make_dir(p, 0o777),
                                  r"can be listed or written by other users \(mode 0777\).*chmod 0711"),
    "trace dir listable": ("trace_dir", lambda p: make_dir(p, 0o755), r"listed or written .*mode 0755"),
    "trace dir closed": ("trace_dir", lambda p: make_dir(p, 0o700),
                         r"other users cannot enter .*mode 0700.*chmod 0711"),
    "trace dir not the agent's to write": ("trace_dir", lambda p: make_dir(p, 0o511),
                                           r"cannot list, write or enter its own .*mode 0511.*chmod 0711"),
    "trace dir a symlink": ("trace_dir", symlink_to_a_directory, r"is a symlink, which the agent never"),
    "trace dir a file": ("trace_dir", lambda p: p.write_text("x"), r"is not a directory"),
    "trace dir of another user": ("trace_dir", lambda p: make_dir(p, 0o711, uid=65534),
                                  r"belongs to uid 65534, not to the agent"),
    "socket dir not sticky": ("socket_dir", lambda p: make_dir(p, 0o777),
                              r"writable by everyone without the sticky bit \(mode 0777\).*chmod 1733"),
    "socket dir a symlink": ("socket_dir", symlink_to_a_directory, r"is a symlink, which the agent never"),
    "socket dir of another user": ("socket_dir", lambda p: make_dir(p, 0o1777, uid=65534),
                                   r"belongs to uid 65534, neither the agent nor root"),
}


@pytest.mark.parametrize("case", BAD_DIRECTORIES)
def test_an_unusable_directory_disables_pytorch_captures_naming_the_setting(
        case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    setting, prepare, message = BAD_DIRECTORIES[case]
    if "another user" in case and NOT_ROOT:
        pytest.skip("needs root to give a directory to another user")
    # Short names: the socket file must fit a Unix socket address.
    base = Path(tempfile.mkdtemp(prefix="gk-", dir="/tmp"))
    try:
        directories = {"trace_dir": base / "t", "socket_dir": base / "s"}
        prepare(directories[setting])
        before = sorted((p.name, stat_mode(p)) for p in base.iterdir())
        captures = configured(tmp_path, **directories)
        with caplog.at_level(logging.WARNING, logger="gpuscope.capture.factory"):
            captures.start()
        try:
            assert not captures.kineto.running
            (record,) = [r for r in caplog.records if "PyTorch (Kineto) captures disabled" in r.message]
            assert re.search(message, record.message), record.message
            assert record.message.endswith(f"(setting capture.kineto.{setting})"), record.message
            # Nothing was changed: no mode set on a directory the agent did not make.
            if setting == "trace_dir":
                assert sorted((p.name, stat_mode(p)) for p in base.iterdir()) == before
        finally:
            captures.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_existing_directories_keep_their_mode_and_leftovers_are_removed(short_dir: Path) -> None:
    """A trace directory from an earlier run (a RuntimeDirectory kept across restarts, a hostPath):
    accepted as it is, and the capture folders a crashed daemon left there are removed at start."""
    traces, sockets = short_dir / "kept-traces", short_dir / "kept-ipc"
    make_dir(traces, 0o701)  # others may enter, not list: fine, and left so
    make_dir(sockets, 0o1777)  # what earlier versions made: sticky, so fine
    leftover = traces / "4242-0123456789abcdef"
    leftover.mkdir()
    (leftover / "trace_7.json").write_text("{}")
    (traces / "notes").write_text("not ours to remove")
    with KinetoDaemon(socket_dir=sockets, trace_dir=traces):
        assert (stat_mode(traces), stat_mode(sockets)) == (0o701, 0o1777)
        assert sorted(p.name for p in traces.iterdir()) == ["notes"]


def test_relative_directories_are_refused() -> None:
    with pytest.raises(ValueError, match="trace_dir must be an absolute path, got 'traces'"):
        KinetoDaemon(trace_dir="traces")
    with pytest.raises(ValueError, match="socket_dir must be an absolute path, got 'ipc'"):
        KinetoDaemon(socket_dir="ipc")
