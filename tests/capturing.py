"""What the capture tests share: real training processes (JAX and PyTorch on the CPU) started as
subprocesses, and a staging area over a plain directory for the backends.

A workload prints ``ready`` once it is capturable (a ``port N`` line first when it chose its own
port) and exits when its standard input closes, so it never outlives the test that started it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuscope.common.unixfs import NewFile

WORKLOADS = Path(__file__).resolve().parent / "workloads"
JAX_WORKLOAD = WORKLOADS / "jax_workload.py"
TORCH_WORKLOAD = WORKLOADS / "torch_workload.py"


def require(module: str, install: str) -> None:
    """Skip a test whose real peer is not installed; in CI (``CI`` set) that is a failure instead."""
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not installed ({install})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def require_jax() -> None:
    require("jax", "pip install jax")


def require_torch() -> None:
    require("torch", "pip install torch==2.13.0, the CPU wheel")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Workload:
    proc: subprocess.Popen[str]
    log: Path
    port: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def start(script: Path, tmp: Path, name: str, *args: str, port: int = 0, env: Mapping[str, str] = (),
          unset: tuple[str, ...] = ()) -> Workload:
    """Start ``script`` with ``args``; its stderr goes to ``tmp/<name>.log``."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(env)}
    for key in unset:
        environment.pop(key, None)
    log = tmp / f"{name}.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=environment)
    return Workload(proc, log, port)


def start_jax(tmp: Path, *, idle: bool = False) -> Workload:
    """A JAX job serving the profiler on a free port; jitted matmuls on the CPU (or, idle, nothing)."""
    port = free_port()
    return start(JAX_WORKLOAD, tmp, f"jax-{port}", str(port), *(["--idle"] if idle else []), port=port,
                 env={"JAX_PLATFORMS": "cpu"})


def wait_ready(workload: Workload, timeout: float = 60.0) -> None:
    """Wait for the ``ready`` line (taking the port from a ``port N`` line before it)."""
    lines: queue.Queue[str] = queue.Queue()
    stdout = workload.proc.stdout
    assert stdout is not None

    def read() -> None:
        for line in stdout:
            lines.put(line)
            if line.strip() == "ready":
                return
        lines.put("")  # end of output: the process exited

    threading.Thread(target=read, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout).strip()
        except queue.Empty:
            line = ""
        if line.startswith("port "):
            workload.port = int(line.split()[1])
            continue
        if line != "ready":
            raise AssertionError(f"{workload.log.stem} not ready (exit {workload.proc.poll()}, last line "
                                 f"{line!r}):\n{workload.log.read_text()}")
        return


def stop(workload: Workload) -> None:
    if workload.proc.stdin is not None:
        with contextlib.suppress(OSError):
            workload.proc.stdin.close()  # the workload exits when its stdin closes
    try:
        workload.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        workload.proc.kill()
        workload.proc.wait(timeout=5)


class DirectoryStaging:
    """A capture backend's staging area over a plain directory (the store's Staging does the same
    under its root), so a backend's files can be checked where they land."""

    def __init__(self, path: Path, run: str = "run1") -> None:
        self.path = path
        self.run = run

    def new_file(self, stem: str, suffix: str, *, folders: tuple[str, ...] = ()) -> NewFile:
        return NewFile(self.path.joinpath(*folders), stem, suffix, relative_to=self.path)
