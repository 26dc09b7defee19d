"""The processes of bench/gpu_scenarios.py: the agent, the ``gpuscope`` command line, the jobs; each in
its own process group, stopped whatever happens."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from local_agent import free_port, wait_ready

PR_SET_PDEATHSIG = 1  # prctl(2)
STEADY_WINDOWS = 2  # step-time windows a job reports before it is captured

# ----------------------------------------------------------------------------- processes


def stop_group(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """End a process started with start_new_session=True, and whatever it started: SIGTERM to its
    process group, then SIGKILL to what is left of the group after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the leader if it still runs, and children it left behind
    proc.wait()


def terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when this script's process ends (Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Agent:
    """``gpuscope run`` as a subprocess with everything it writes under ``tmp``."""

    def __init__(self, tmp: Path, *, simulate: bool, profiler_port: int, log_level: str) -> None:
        self.tmp = tmp
        self.socket = tmp / "control" / "control.sock"
        self.kineto_sockets = tmp / "kineto-ipc"
        self.log = tmp / "agent.log"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = {
            # No alert-triggered captures: an alert on a job's GPU would take the node's one capture
            # slot (this script's capture would come back "busy") and the hourly budget.
            "alerting": {"enabled": False},
            "capture": {
                "store": {"root": str(tmp / "captures"), "quota_bytes": 8 * 2**30},
                "kineto": {"trace_dir": str(tmp / "kineto-traces"), "socket_dir": str(self.kineto_sockets)},
                "profiler_ports": [profiler_port],
                "hourly_budget": 3600,
                "user_hourly_budget": 3600,
                # A launch-bound job's Kineto trace (hundreds of thousands of events) is over the
                # default 64 MiB, and Kineto takes a while to write it.
                "max_trace_bytes": 2**30,
                "deadline_margin": "60s",
            },
            "control": {"socket": str(self.socket)},
        }
        self.config = tmp / "gpuscope.yaml"
        self.config.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.command = [sys.executable, "-m", "gpuscope", "run", "--config", str(self.config),
                        "--web.listen-address", f"127.0.0.1:{self.port}", "--log-level", log_level]
        if simulate:
            self.command += ["--simulate", "demo"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        with self.log.open("wb") as log:
            # Its own session: Ctrl-C reaches this script only, which then stops the agent itself. Should
            # this script be killed outright, the kernel sends the agent SIGTERM (the jobs exit anyway:
            # their standard input closes). preexec_fn is safe here: the agent starts before any thread.
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         preexec_fn=terminate_with_parent)  # noqa: PLW1509
        try:
            wait_ready(self.base, self.proc, timeout)
        except SystemExit as err:
            raise RuntimeError(f"{err}; its log:\n{tail(self.log, 20)}") from None
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent is ready but has no control socket at {self.socket}; its "
                                   f"log:\n{tail(self.log, 20)}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # the agent first: it stops the simulator's helper processes itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        if self.proc is not None:
            stop_group(self.proc)

    def cli(self, *args: str, timeout: float) -> CliRun:
        """Run ``gpuscope ARGS --socket <the control socket>``."""
        return CliRun([sys.executable, "-m", "gpuscope", *args, "--socket", str(self.socket)], timeout)


class CliRun:
    """A gpuscope command, run to its end (or killed at ``timeout``), with when it first wrote to
    stderr: the capture command's first line there says which agent answered, just before it sends
    its request."""

    def __init__(self, command: list[str], timeout: float) -> None:
        self.started = time.monotonic()
        self.first_stderr: float | None = None
        self.timed_out = False
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        out: list[str] = []
        err: list[str] = []

        def read_stdout() -> None:
            assert proc.stdout is not None
            out.append(proc.stdout.read())

        def read_stderr() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if self.first_stderr is None:
                    self.first_stderr = time.monotonic()
                err.append(line)

        readers = [threading.Thread(target=read, daemon=True) for read in (read_stdout, read_stderr)]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
        finally:  # also on Ctrl-C: the command is in its own session, so it is stopped here
            if proc.poll() is None:
                stop_group(proc, grace=2.0)
            for reader in readers:
                reader.join(5)
        self.ended = time.monotonic()
        self.returncode = proc.returncode
        self.stdout, self.stderr = "".join(out), "".join(err)

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except ValueError:
            return None

    def failure(self) -> str:
        if self.timed_out:
            return "timed out"
        return last_line(self.stderr) or last_line(self.stdout) or f"exit status {self.returncode}"


class JobProcess:
    """A job of bench/gpu_jobs, its stdout read on a thread: "info", "step_ms" and "ready" lines."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.ready_at: float | None = None
        self.step_ms: list[tuple[float, float]] = []  # (monotonic time received, ms)
        self.info: dict[str, str] = {}
        self._changed = threading.Condition()
        self._ended = False
        with log.open("w") as stderr:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=stderr, text=True, env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line, now = raw.strip(), time.monotonic()
            with self._changed:
                if line == "ready":
                    self.ready_at = now
                elif line.startswith("step_ms "):
                    with contextlib.suppress(ValueError):
                        self.step_ms.append((now, float(line.split()[1])))
                elif line.startswith("info "):
                    key, _, value = line[5:].partition(" ")
                    self.info[key] = value
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_steady(self, deadline: float) -> None:
        """Return once the job is ready and has reported STEADY_WINDOWS step times since; raise
        RuntimeError when it exits or ``deadline`` passes first."""
        with self._changed:
            while self.ready_at is None or len(self.windows_after(self.ready_at)) < STEADY_WINDOWS:
                if self._ended or self.proc.poll() is not None:
                    raise RuntimeError(f"the job exited (status {self.proc.wait()}) before its steady loop: "
                                       f"{last_line(tail(self.log)) or 'no output'}")
                left = deadline - time.monotonic()
                if left <= 0:
                    last = last_line(tail(self.log))
                    raise RuntimeError("the job was not in its steady loop in time"
                                       + (f" (its last line: {last})" if last else ""))
                self._changed.wait(min(1.0, left))

    def windows_after(self, since: float, until: float = float("inf")) -> list[float]:
        return [ms for at, ms in self.step_ms if since <= at <= until]

    def stop(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the job exits on its own when its stdin closes
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        stop_group(self.proc)
