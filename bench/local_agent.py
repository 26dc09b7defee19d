"""What the benchmarks that start the agent as a subprocess share: a free loopback port, a
configuration that keeps what the agent writes in a temporary directory, and waiting until the agent
answers /-/ready."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path, **sections: Any) -> Path:
    """Defaults everywhere but ``sections`` (top-level keys), with every path the agent writes under
    ``tmp``."""
    config = {
        "capture": {"store": {"root": str(tmp / "captures")},
                    "kineto": {"trace_dir": str(tmp / "kineto-traces"),
                               "socket_dir": str(tmp / "kineto-ipc")}},
        "control": {"socket": str(tmp / "control" / "control.sock")},
        **sections,
    }
    path = tmp / "gpuscope.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


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
