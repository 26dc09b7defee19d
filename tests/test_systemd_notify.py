"""sd_notify: READY when serving, WATCHDOG pings from the sampling loop, STOPPING at exit."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_process import run_agent
from snapshots import make_snapshot

from gpuscope.systemd_notify import SystemdNotifier


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    yield sock, path
    sock.close()


def receive_until(sock: socket.socket, wanted: str, timeout: float = 20.0) -> list[str]:
    messages: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if any(wanted in m for m in messages):
            return messages
    raise AssertionError(f"{wanted!r} not received; got {messages}")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_pings_follow_ticks_at_half_the_timeout(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    clock = Clock()
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"}, clock=clock)
    assert notifier.watchdog_interval == 5.0
    snapshot = make_snapshot()
    sock.settimeout(0.2)
    notifier.on_snapshot(snapshot)  # first tick: ping
    assert sock.recv(100) == b"WATCHDOG=1"
    clock.now = 4.0
    notifier.on_snapshot(snapshot)  # too soon: no ping
    with pytest.raises(TimeoutError):
        sock.recv(100)
    clock.now = 5.5
    notifier.on_snapshot(snapshot)
    assert sock.recv(100) == b"WATCHDOG=1"
    # A hung sampling loop calls no listener, so no ping is sent and systemd's watchdog fires.


def test_no_watchdog_for_another_pid_and_nothing_outside_systemd() -> None:
    other = SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000000",
                             "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval is None
    outside = SystemdNotifier({})
    assert not outside.enabled
    outside.ready()  # no socket: does nothing, raises nothing
    outside.on_snapshot(make_snapshot())


def test_unreachable_socket_is_logged_once(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock"), "WATCHDOG_USEC": "2"})
    notifier.ready()
    notifier.on_snapshot(make_snapshot())
    notifier.stopping()
    assert sum("cannot notify systemd" in r.getMessage() for r in caplog.records) == 1


def test_the_agent_notifies_ready_watchdog_and_stopping(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    with run_agent(tmp_path, "--simulate", "healthy", "--sample-interval", "100ms", env=env) as agent:
        messages = receive_until(sock, "READY=1")
        ready = next(m for m in messages if "READY=1" in m)
        assert f"port {agent.port}" in ready
        receive_until(sock, "WATCHDOG=1")
        agent.proc.send_signal(signal.SIGTERM)
        receive_until(sock, "STOPPING=1")
        assert agent.proc.wait(5) == 0
