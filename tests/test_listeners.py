"""One thread waits on the agent's listening sockets (HTTP, the control API's socket until its first
client, the Kineto daemon's) and runs the handler of the one that is ready; it does not wake while
nothing comes, a removed handler is never run again, and one handler's failure spares the others."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_process import run_agent
from polling import wait_until

from gpuscope.capture.kineto.daemon import KinetoDaemon
from gpuscope.listeners import SocketListeners


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def voluntary_switches(thread: threading.Thread) -> int:
    """How often ``thread`` went to sleep so far (it wakes once per sleep)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt"))


def datagram_pair() -> tuple[socket.socket, socket.socket]:
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    reader.setblocking(False)
    return reader, writer


def drain(sock: socket.socket, into: list[bytes]) -> Callable[[], None]:
    def handler() -> None:
        while True:
            try:
                into.append(sock.recv(64))
            except BlockingIOError:
                return
    return handler


def test_one_thread_runs_each_ready_sockets_handler_and_sleeps_while_nothing_comes() -> None:
    listeners = SocketListeners("gpuscope-test-listen")
    (a, a_peer), (b, b_peer) = datagram_pair(), datagram_pair()
    got_a: list[bytes] = []
    got_b: list[bytes] = []
    try:
        assert not named("gpuscope-test-listen")  # no socket yet: no thread
        listeners.add(a, drain(a, got_a))
        listeners.add(b, drain(b, got_b))
        assert len(named("gpuscope-test-listen")) == 1 and listeners.alive
        a_peer.send(b"one")
        b_peer.send(b"two")
        a_peer.send(b"three")
        wait_until(lambda: got_a == [b"one", b"three"] and got_b == [b"two"])
        thread = named("gpuscope-test-listen")[0]
        time.sleep(0.1)
        before = voluntary_switches(thread)
        time.sleep(1.5)  # nothing comes: the thread stays asleep
        assert voluntary_switches(thread) - before <= 1
        b_peer.send(b"four")  # and still answers at once
        wait_until(lambda: got_b == [b"two", b"four"], timeout=2)
    finally:
        listeners.close()
        for sock in (a, a_peer, b, b_peer):
            sock.close()
    assert not listeners.alive and not named("gpuscope-test-listen")
    with pytest.raises(RuntimeError, match="closed"):
        listeners.add(a, lambda: None)


def test_remove_waits_for_the_running_handler_and_it_is_never_run_again() -> None:
    listeners = SocketListeners("gpuscope-test-listen")
    sock, peer = datagram_pair()
    entered, release = threading.Event(), threading.Event()
    calls: list[bytes] = []

    def slow_handler() -> None:
        calls.append(sock.recv(64))
        entered.set()
        release.wait(10)

    removed = threading.Event()
    try:
        listeners.add(sock, slow_handler)
        peer.send(b"x")
        assert entered.wait(5)
        peer.send(b"y")  # ready again once the handler returns
        remover = threading.Thread(target=lambda: (listeners.remove(sock), removed.set()))
        remover.start()
        time.sleep(0.2)
        assert not removed.is_set()  # the handler still runs: remove() waits for it
        release.set()
        remover.join(5)
        assert removed.is_set()
        time.sleep(0.3)
        assert calls == [b"x"]  # "y" stays unread: the handler was removed
    finally:
        release.set()
        listeners.close()
        sock.close()
        peer.close()


def test_a_failing_handler_is_logged_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    listeners = SocketListeners("gpuscope-test-listen")
    (bad, bad_peer), (good, good_peer) = datagram_pair(), datagram_pair()
    got: list[bytes] = []
    failures: list[bytes] = []

    def failing() -> None:
        failures.append(bad.recv(64))
        raise ValueError("a bug in one handler")

    def removes_itself() -> None:
        drain(good, got)()
        listeners.remove(good)  # from its own handler

    try:
        with caplog.at_level(logging.ERROR, logger="gpuscope.listeners"):
            listeners.add(bad, failing)
            listeners.add(good, removes_itself)
            bad_peer.send(b"boom")
            wait_until(lambda: failures == [b"boom"])
            good_peer.send(b"fine")
            wait_until(lambda: got == [b"fine"])
            good_peer.send(b"unheard")
            bad_peer.send(b"boom again")
            wait_until(lambda: len(failures) == 2)  # the thread survived the first failure
        assert got == [b"fine"] and listeners.alive
        assert "error handling a ready socket" in caplog.text and "a bug in one handler" in caplog.text
    finally:
        listeners.close()
        for sock in (bad, bad_peer, good, good_peer):
            sock.close()


def test_a_kineto_daemon_on_shared_listeners_stops_without_ending_them() -> None:
    listeners = SocketListeners("gpuscope-test-listen")
    other, other_peer = datagram_pair()
    got: list[bytes] = []
    with tempfile.TemporaryDirectory(prefix="gs-listen-") as directory:
        daemon = KinetoDaemon(socket_name="gs-test", socket_dir=Path(directory) / "ipc",
                              trace_dir=Path(directory) / "traces", listeners=listeners)
        try:
            listeners.add(other, drain(other, got))
            daemon.start()
            assert daemon.running and not named("gpuscope-kineto")
            client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            client.sendto(b"not a Kineto message", str(Path(directory) / "ipc" / "gs-test"))
            client.close()
            wait_until(lambda: daemon.stats()["datagrams"] == 1)  # read on the shared thread
            daemon.stop()
            assert not daemon.running and listeners.alive
            other_peer.send(b"still here")
            wait_until(lambda: got == [b"still here"])
        finally:
            daemon.stop()
            listeners.close()
            other.close()
            other_peer.close()


def test_the_agent_waits_on_its_http_control_and_kineto_sockets_with_one_thread(tmp_path: Path) -> None:
    short = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))  # a Unix socket's path is short
    env = {"GPUSCOPE_CAPTURE__KINETO__SOCKET_DIR": str(short / "ipc"),
           "GPUSCOPE_CAPTURE__KINETO__TRACE_DIR": str(short / "traces")}
    with run_agent(tmp_path, "--simulate", "healthy", env=env) as agent:
        task = Path(f"/proc/{agent.proc.pid}/task")

        def names() -> list[str]:
            found = []
            for tid in os.listdir(task):
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    found.append((task / tid / "comm").read_text().strip())
            return sorted(found)

        time.sleep(0.3)
        connection_threads = max(names().count("gs-http"), 1)  # left by the readiness checks
        for _ in range(3):  # a scraper's requests, apart
            with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=10) as response:
                assert response.status == 200
            time.sleep(0.3)
        assert names().count("gs-listen") == 1, names()
        assert not {"gs-control", "gs-kineto"} & set(names()), names()
        # Each request is served by a connection thread that waits for the next: none is added.
        assert names().count("gs-http") == connection_threads, names()
        assert (short / "ipc" / "dynolog").exists()  # the Kineto daemon listens
        assert (tmp_path / f"control-{agent.port}.sock").exists()  # and so does the control API
