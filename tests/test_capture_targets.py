"""Target resolution against real processes listening on real 127.0.0.1 ports (children of the test)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pytest
from snapshots import gpu_uuid, make_gpu, make_process

from gpuscope.capture.config import StaticTarget
from gpuscope.capture.model import CaptureTarget
from gpuscope.capture.targets import TargetResolver, connect_address, listening_sockets, parent_pid
from gpuscope.snapshot import GpuReading

# A child that listens on (host, port 0), optionally through a grandchild that does not, reports
# "<port> <pid of the GPU process>", then on "check" reports whether anyone connected to it.
LISTENER = r"""
import os, select, socket, subprocess, sys
host, spawn = sys.argv[1], sys.argv[2] == "spawn"
server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
server.bind((host, 0))
server.listen(4)
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) \
    if spawn else None
print(server.getsockname()[1], child.pid if child else os.getpid(), flush=True)
sys.stdin.readline()
ready, _, _ = select.select([server], [], [], 0.05)  # a connect would be queued already
print("connected" if ready else "untouched", flush=True)
if child:
    child.stdin.close()
    child.wait()
"""


@dataclass
class Listener:
    port: int
    pid: int  # the process that holds the GPU (the listener itself, or its child)
    listener_pid: int
    proc: subprocess.Popen[str]

    def touched(self) -> bool:
        """Whether any connection reached the listening socket."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip() == "connected"


@contextmanager
def listener(host: str = "127.0.0.1", *, via_parent: bool = False) -> Iterator[Listener]:
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, host, "spawn" if via_parent else "direct"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout
        port, pid = map(int, proc.stdout.readline().split())
        yield Listener(port, pid, proc.pid, proc)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if via_parent and pid != proc.pid:
            with suppress(ProcessLookupError):
                os.kill(pid, 9)


def gpu_with(*pids: int, index: int = 0, **process_overrides: object) -> GpuReading:
    return make_gpu(index, processes=tuple(make_process(pid, **process_overrides) for pid in pids))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- real sockets -------------------------------------------------------------------------------------


def test_a_process_listening_on_a_configured_port_is_a_tsl_target() -> None:
    with listener() as child:
        resolver = TargetResolver(profiler_ports=[6009, child.port])
        targets = resolver.resolve(gpu_with(child.pid))
        assert targets == [CaptureTarget("tsl", child.pid, f"127.0.0.1:{child.port}",
                                         f"port {child.port} of pid {child.pid}")]
        assert resolver.resolve_pid(child.pid) == targets
        assert not child.touched(), "resolution reads the socket table; it never connects"


def test_a_parent_listening_on_a_configured_port_is_a_target() -> None:
    with listener(via_parent=True) as child:
        assert child.pid != child.listener_pid and parent_pid(child.pid) == child.listener_pid
        resolver = TargetResolver(profiler_ports=[child.port])
        assert resolver.resolve(gpu_with(child.pid)) == [
            CaptureTarget("tsl", child.pid, f"127.0.0.1:{child.port}",
                          f"port {child.port} of parent pid {child.listener_pid}")]
        assert not child.touched()


def test_a_port_not_in_the_list_is_no_target_and_is_not_touched() -> None:
    with listener() as child:
        resolver = TargetResolver(profiler_ports=[free_port()])
        assert resolver.resolve(gpu_with(child.pid)) == []
        assert resolver.resolve_pid(child.pid) == []
        assert not child.touched(), "a port outside the list is never probed"


def test_the_listener_does_see_a_connection() -> None:
    """The control for the "not touched" checks above: a real connection attempt is seen."""
    with listener() as child, socket.create_connection(("127.0.0.1", child.port), timeout=5):
        assert child.touched()


def test_a_wildcard_bind_is_dialled_on_loopback_and_a_specific_one_as_bound() -> None:
    with listener("0.0.0.0") as wildcard, listener("127.0.0.2") as specific:
        resolver = TargetResolver(profiler_ports=[wildcard.port, specific.port])
        targets = resolver.resolve(gpu_with(wildcard.pid, specific.pid))
        assert [t.address for t in targets] == [f"127.0.0.1:{wildcard.port}", f"127.0.0.2:{specific.port}"]


def test_kineto_registration_wins() -> None:
    with listener() as child:
        resolver = TargetResolver(profiler_ports=[child.port], kineto_registered=lambda: {child.pid: "job-1"})
        assert resolver.resolve(gpu_with(child.pid)) == [
            CaptureTarget("kineto", child.pid, None, "kineto-registration")]
        assert resolver.resolve_pid(child.pid)[0].kind == "kineto"


def test_listening_sockets_of_real_and_vanished_processes() -> None:
    with listener() as child:
        assert ("127.0.0.1", child.port) in listening_sockets(child.pid)
    assert listening_sockets(child.listener_pid) == []  # gone
    assert parent_pid(child.listener_pid) is None
    assert TargetResolver(profiler_ports=[child.port]).resolve(gpu_with(child.listener_pid)) == []


# -- the order of the ways, and static targets (injected socket tables) -----------------------------


class Table:
    """A fake socket table and process tree that records which pids were looked up."""

    def __init__(self, sockets: dict[int, list[tuple[str, int]]],
                 parents: dict[int, int] | None = None) -> None:
        self.sockets = sockets
        self.parents = parents or {}
        self.asked: list[int] = []

    def connections(self, pid: int) -> Iterable[tuple[str, int]]:
        self.asked.append(pid)
        return self.sockets.get(pid, [])

    def parent_of(self, pid: int) -> int | None:
        return self.parents.get(pid)

    def resolver(self, ports: list[int], **kw: object) -> TargetResolver:
        return TargetResolver(profiler_ports=ports, connections=self.connections, parent_of=self.parent_of,
                              **kw)  # type: ignore[arg-type]


def test_the_first_configured_port_wins_and_other_ports_are_ignored() -> None:
    table = Table({100: [("0.0.0.0", 22), ("127.0.0.1", 9012), ("0.0.0.0", 6009)]})
    assert [t.address for t in table.resolver([6009, 9012]).resolve(gpu_with(100))] == ["127.0.0.1:6009"]
    assert [t.address for t in table.resolver([9012, 6009]).resolve(gpu_with(100))] == ["127.0.0.1:9012"]
    assert table.resolver([2222]).resolve(gpu_with(100)) == []


def test_the_process_itself_before_its_parent() -> None:
    table = Table({100: [("0.0.0.0", 6010)], 50: [("0.0.0.0", 6009)]}, parents={100: 50, 101: 50})
    targets = table.resolver([6009, 6010]).resolve(gpu_with(100, 101))
    assert [(t.pid, t.address, t.source) for t in targets] == [
        (100, "127.0.0.1:6010", "port 6010 of pid 100"),
        (101, "127.0.0.1:6009", "port 6009 of parent pid 50"),
    ]


def test_two_processes_behind_one_parent_give_one_target() -> None:
    table = Table({50: [("::", 6009)]}, parents={100: 50, 101: 50})
    targets = table.resolver([6009]).resolve(gpu_with(100, 101))
    assert [(t.pid, t.address) for t in targets] == [(100, "127.0.0.1:6009")]


def test_invisible_processes_are_not_looked_up_by_pid() -> None:
    table = Table({100: [("0.0.0.0", 6009)]})
    resolver = table.resolver([6009], kineto_registered=lambda: {100: "x"},
                              static_targets=[StaticTarget(address="10.0.0.7:6009", gpu=0)])
    targets = resolver.resolve(gpu_with(100, host_visible=False))
    assert targets == [CaptureTarget("tsl", None, "10.0.0.7:6009", "config")]
    assert table.asked == []


def test_static_targets() -> None:
    table = Table({100: [("0.0.0.0", 6009)]})
    static = [
        StaticTarget(address="gpu0:1", gpu=0),
        StaticTarget(address="gpu1:1", gpu=1),
        StaticTarget(address="uuid2:1", uuid=gpu_uuid(2)),
        StaticTarget(address="pid200:1", pid=200),
        StaticTarget(address="pid100:1", pid=100),
        StaticTarget(address="all:1", all=True),
        StaticTarget(address="all:1", gpu=0),  # the same endpoint twice: once
    ]
    resolver = table.resolver([6009], static_targets=static)
    # Every process resolved: static targets are not needed.
    assert [t.address for t in resolver.resolve(gpu_with(100))] == ["127.0.0.1:6009"]
    # One process unresolved: the static targets naming it, its GPU, or all GPUs are added.
    assert [(t.address, t.pid) for t in resolver.resolve(gpu_with(100, 200))] == [
        ("127.0.0.1:6009", 100), ("gpu0:1", None), ("pid200:1", 200), ("all:1", None)]
    assert [t.address for t in resolver.resolve(gpu_with(300, index=2))] == ["uuid2:1", "all:1"]
    # No compute process at all (e.g. not visible to NVML): the GPU's static targets.
    assert [t.address for t in resolver.resolve(make_gpu(1, processes=()))] == ["gpu1:1", "all:1"]
    # By pid: only targets naming that pid.
    assert [t.address for t in resolver.resolve_pid(200)] == ["pid200:1"]
    assert all(t.kind == "tsl" and t.source == "config" for t in resolver.resolve_pid(200))


def test_a_mig_device_capture_uses_no_static_target_named_for_the_gpu() -> None:
    """The static targets that name the GPU profile whoever listens there: on a GPU split into MIG
    devices, often another tenant's job. A capture of one device keeps those naming its processes."""
    table = Table({100: [("0.0.0.0", 6009)]})
    static = [StaticTarget(address="gpu0:1", gpu=0), StaticTarget(address="uuid0:1", uuid=gpu_uuid(0)),
              StaticTarget(address="all:1", all=True), StaticTarget(address="pid200:1", pid=200),
              StaticTarget(address="pid300:1", pid=300)]
    resolver = table.resolver([6009], static_targets=static)
    on_device = gpu_with(100, 200, gpu_instance=1, compute_instance=0)
    assert [(t.address, t.pid) for t in resolver.resolve(on_device, mig_device=True)] == [
        ("127.0.0.1:6009", 100), ("pid200:1", 200)]
    # The whole GPU (an alert on it): the GPU's static targets as before.
    assert [t.address for t in resolver.resolve(on_device)] == [
        "127.0.0.1:6009", "gpu0:1", "uuid0:1", "all:1", "pid200:1"]
    # No process on the device, or none visible from the host: nothing.
    assert resolver.resolve(make_gpu(0, processes=()), mig_device=True) == []
    assert resolver.resolve(gpu_with(300, host_visible=False), mig_device=True) == []


def test_graphics_processes_are_not_targets() -> None:
    table = Table({100: [("0.0.0.0", 6009)]})
    assert table.resolver([6009]).resolve(gpu_with(100, kind="graphics")) == []
    assert table.asked == []


def test_a_broken_kineto_registry_does_not_stop_port_discovery(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> dict[int, object]:
        raise RuntimeError("registry socket closed")

    table = Table({100: [("0.0.0.0", 6009)]})
    with caplog.at_level(logging.WARNING):
        targets = table.resolver([6009], kineto_registered=broken).resolve(gpu_with(100))
    assert [t.kind for t in targets] == ["tsl"]
    assert "cannot read the Kineto registrations: registry socket closed" in caplog.text


@pytest.mark.parametrize("pid", [0, -1, True, "100", 1.5])
def test_resolve_pid_refuses_what_cannot_be_a_pid(pid: object) -> None:
    with pytest.raises(ValueError, match="a pid must be a positive integer"):
        TargetResolver().resolve_pid(pid)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ip", "expected"), [
    ("0.0.0.0", "127.0.0.1:6009"),
    ("::", "127.0.0.1:6009"),
    ("127.0.0.1", "127.0.0.1:6009"),
    ("10.1.2.3", "10.1.2.3:6009"),
    ("::1", "[::1]:6009"),
    ("::ffff:10.1.2.3", "10.1.2.3:6009"),
    ("fe80::1%eth0", "[fe80::1]:6009"),
])
def test_connect_address(ip: str, expected: str) -> None:
    assert connect_address(ip, 6009) == expected
