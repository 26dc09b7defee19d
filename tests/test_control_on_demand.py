"""The control API's gRPC server runs in a server process while clients call: the agent holds the socket
itself until its first client (no gRPC module, threads or wake-ups), starts the process for it, relays
early clients, takes the socket back when the process has been idle (or ended), and never loads gRPC."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent_process import run_agent
from capturing import Workload

from gpuscope.control.client import ControlClient

FAST_IDLE = {"GPUSCOPE_CONTROL__IDLE_TIMEOUT": "1s"}


def grpc_loaded(pid: int) -> bool:
    return "cygrpc" in Path(f"/proc/{pid}/maps").read_text()


def children(pid: int) -> list[int]:
    """The agent's control API server processes (a simulated node's stand-in jobs are its children too)."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:  # a thread may end meanwhile, and a child exit
            started = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except FileNotFoundError:
            continue
        for child in started:
            try:
                command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"gpuscope.control.server_process" in command:
                found.append(int(child))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def agent_info_pid(sock: Path) -> int:
    with ControlClient(sock) as client:
        info = client.agent_info()
        assert info is not None
        return info.pid


def test_the_first_client_starts_a_server_process_that_takes_over_the_socket(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy") as agent:  # no pods: no simulated kubelet
        pid = agent.proc.pid
        sock = tmp_path / f"control-{agent.port}.sock"
        mode = stat.S_IMODE(sock.stat().st_mode)
        before = sock.stat().st_ino
        assert children(pid) == []

        answers: list[int] = []
        early = [threading.Thread(target=lambda: answers.append(agent_info_pid(sock))) for _ in range(3)]
        for thread in early:  # several first clients at once: one starts the process, all are answered
            thread.start()
        for thread in early:
            thread.join(30)
        assert answers == [pid, pid, pid]  # the agent's own info, through its server process
        (server,) = children(pid)
        assert grpc_loaded(server)
        assert not grpc_loaded(pid)
        assert sock.stat().st_ino != before  # the server process's socket now, in the same place
        assert stat.S_IMODE(sock.stat().st_mode) == mode
        assert agent_info_pid(sock) == pid  # a later client reaches it directly
        assert children(pid) == [server]
        assert f"its server process (pid {server}) serves" in agent.stderr()
    wait_until(lambda: not alive(server), 5)
    assert not sock.exists()


def test_an_idle_server_process_exits_and_the_agent_holds_the_socket_again(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy", env=FAST_IDLE) as agent:
        pid = agent.proc.pid
        sock = tmp_path / f"control-{agent.port}.sock"
        assert agent_info_pid(sock) == pid
        (first,) = children(pid)
        served_by_first = sock.stat().st_ino
        wait_until(lambda: not alive(first))
        assert children(pid) == []  # exited, and reaped
        assert stat.S_ISSOCK(sock.stat().st_mode) and sock.stat().st_ino != served_by_first
        assert "exits after 1s without a call; the agent holds" in agent.stderr()
        assert agent_info_pid(sock) == pid  # the next client starts another
        (second,) = children(pid)
        assert second != first
        assert not grpc_loaded(pid)


def test_a_server_process_that_dies_is_replaced_at_the_next_client(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy") as agent:
        pid = agent.proc.pid
        sock = tmp_path / f"control-{agent.port}.sock"
        assert agent_info_pid(sock) == pid
        (first,) = children(pid)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: "ended with status -9" in agent.stderr())
        assert children(pid) == []
        assert agent_info_pid(sock) == pid
        (second,) = children(pid)
        assert second != first


def test_a_server_process_outlives_no_agent(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy") as agent:
        sock = tmp_path / f"control-{agent.port}.sock"
        agent_info_pid(sock)
        (server,) = children(agent.proc.pid)
        agent.proc.kill()  # no chance to stop it: the server process sees its socket to the agent end
        agent.proc.wait()
        wait_until(lambda: not alive(server), 10)
        assert not sock.exists()  # it removed its own socket


def test_an_agent_nobody_called_removes_its_socket_at_exit(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy") as agent:  # no pods: no simulated kubelet
        sock = tmp_path / f"control-{agent.port}.sock"
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert not grpc_loaded(agent.proc.pid)
        assert children(agent.proc.pid) == []
    assert not sock.exists()


def test_a_capture_of_a_jax_job_through_the_api_loads_no_grpc_into_the_agent(tmp_path: Path,
                                                                              jax_job: Workload) -> None:
    with run_agent(tmp_path, "--simulate", "healthy") as agent:
        sock = tmp_path / f"control-{agent.port}.sock"
        with ControlClient(sock) as client:
            record = client.capture(target=jax_job.address, duration_s=1.0, timeout=120)
        assert record["outcome"] == "captured", record
        assert any(name.endswith(".xplane.pb") for name in record["files"])
        # The call came through the API's server process, the trace through a profiler client process.
        assert not grpc_loaded(agent.proc.pid)
