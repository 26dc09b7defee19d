"""Start `gpuscope run` as a real subprocess on a loopback port, for whole-binary tests."""

from __future__ import annotations

import base64
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0, *, context: ssl.SSLContext | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


class RunningAgent:
    """``tls``: the CA file the agent's certificate chains to (it serves https on localhost);
    ``user``: basic-auth credentials sent with every request."""

    def __init__(self, proc: subprocess.Popen[str], port: int, log: Path, *, tls: Path | None = None,
                 user: tuple[str, str] | None = None) -> None:
        self.proc = proc
        self.port = port
        self.base = f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"
        self.log = log
        self.context = ssl.create_default_context(cafile=str(tls)) if tls else None
        self.headers = {}
        if user is not None:
            token = base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"

    def get(self, path: str) -> tuple[int, str]:
        return http_get(self.base + path, context=self.context, headers=self.headers)

    def stderr(self) -> str:
        return self.log.read_text()

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.stderr()}")
            try:
                if self.get("/-/healthy")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"agent not healthy after {timeout} s:\n{self.stderr()}")

    def wait_for(self, path: str, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        body = ""
        while time.monotonic() < deadline:
            status, body = self.get(path)
            if status == 200 and text in body:
                return body
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not in {path} after {timeout} s; last body:\n{body[:2000]}")


@contextmanager
def run_agent(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
              port: int | None = None, tls: Path | None = None,
              user: tuple[str, str] | None = None) -> Iterator[RunningAgent]:
    """`gpuscope run` on 127.0.0.1:``port`` (default: a free one) until the block ends; ``tls`` and
    ``user`` as RunningAgent's, for an agent started with a web configuration file."""
    port = port or free_port()
    log = tmp_path / f"agent-{port}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuscope", "run", "--web.listen-address", f"127.0.0.1:{port}", *args],
            stdout=subprocess.DEVNULL, stderr=err, text=True,
            # Captures go to the test's directory, never the machine's /var/lib/gpuscope.
            env={**os.environ, "GPUSCOPE_CAPTURE__STORE__ROOT": str(tmp_path / f"captures-{port}"),
                 "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / f"control-{port}.sock"),
                 **(env or {})},
        )
    agent = RunningAgent(proc, port, log, tls=tls, user=user)
    try:
        agent.wait_healthy()
        yield agent
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def run_ready_server(argv: list[str], base: str, log_path: Path, what: str,
                     timeout: float = 60.0) -> Iterator[str]:
    """Run a Prometheus-ecosystem server (``argv``, logging to ``log_path``) until the block ends,
    once its ``base + "/-/ready"`` answers 200; yields ``base``."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if http_get(base + "/-/ready", timeout=1.0)[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what} did not start:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
