"""What the benchmarks that start the agent as a subprocess share: a free loopback port, and waiting
until the agent answers /-/ready."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base: str, agent: subprocess.Popen[bytes] | None = None, timeout: float = 60.0) -> None:
    """Returns once ``base``/-/ready answers 200; exits when ``agent`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if agent is not None and agent.poll() is not None:
            raise SystemExit(f"the agent exited with status {agent.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/-/ready", timeout=5) as response:
                response.read()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"agent at {base} did not become ready in {timeout:.0f} s")


def stop(agent: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the agent has not exited within ``timeout`` seconds; reaped either way."""
    agent.terminate()
    try:
        agent.wait(timeout)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
