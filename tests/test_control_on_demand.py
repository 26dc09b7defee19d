"""The control API's gRPC server starts with its first client: until then the agent holds the socket
itself (no gRPC module, threads or wake-ups); early clients are relayed, later ones reach gRPC."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from agent_process import run_agent

from gpuscope.control.client import ControlClient


def grpc_loaded(pid: int) -> bool:
    return "cygrpc" in Path(f"/proc/{pid}/maps").read_text()


def test_grpc_starts_with_the_first_client_and_takes_over_the_socket(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy") as agent:  # no pods: no simulated kubelet
        pid = agent.proc.pid
        sock = tmp_path / f"control-{agent.port}.sock"
        mode = stat.S_IMODE(sock.stat().st_mode)
        before = sock.stat().st_ino
        assert not grpc_loaded(pid)
        threads_before = len(os.listdir(f"/proc/{pid}/task"))

        answers: list[int] = []

        def ask() -> None:
            with ControlClient(sock) as client:
                info = client.agent_info()
                assert info is not None
                answers.append(info.pid)

        early = [threading.Thread(target=ask) for _ in range(3)]  # several first clients at once
        for thread in early:
            thread.start()
        for thread in early:
            thread.join(30)
        assert answers == [pid, pid, pid]
        assert grpc_loaded(pid)
        assert sock.stat().st_ino != before  # gRPC's own socket now, in the same place
        assert stat.S_IMODE(sock.stat().st_mode) == mode
        ask()  # a later client reaches gRPC directly
        assert answers[-1] == pid
        assert len(os.listdir(f"/proc/{pid}/task")) > threads_before
        assert "control API: gRPC started for its first client" in agent.stderr()


def test_an_agent_nobody_called_removes_its_socket_at_exit(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy") as agent:  # no pods: no simulated kubelet
        sock = tmp_path / f"control-{agent.port}.sock"
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert not grpc_loaded(agent.proc.pid)
    assert not sock.exists()
