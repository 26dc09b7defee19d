"""The agent's handle on its control API server process (``gpuscope.control.server_process``): start it
with its end of a private socket, answer its calls (``gpuscope.control.bridge``), end it."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from gpuscope.control.bridge import AgentBridge
from gpuscope.control.config import ControlConfig
from gpuscope.control.errors import ControlServerError
from gpuscope.control.methods import ControlMethods
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

START_TIMEOUT_S = 20.0  # from the process's start to its socket in place (a Python start and gRPC's import)
EXIT_TIMEOUT_S = 1.0  # from the end of its socket to its exit, before it is killed


class ServerProcess:
    """One server process. ``on_idle``: it has had no call for its idle time (called on the bridge's
    thread; the agent takes the socket back, then calls ``release``). ``on_closed``: its end of the
    socket is closed and it has exited (reaped; on the bridge's thread)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, methods: ControlMethods, *,
                 on_idle: Callable[[ServerProcess], None],
                 on_closed: Callable[[ServerProcess], None]) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.identity: tuple[int, int] | None = None  # its socket's (device, inode), once it is ready
        self._ready = threading.Event()
        self.closed = threading.Event()  # it has exited
        self._failure: str | None = None
        self._on_closed = on_closed
        self._bridge = AgentBridge(sock, methods, on_ready=self._ready_at, on_failed=self._failed,
                                   on_idle=lambda: on_idle(self), on_closed=self._closed)

    @classmethod
    def start(cls, config: ControlConfig, methods: ControlMethods, *, replacing: tuple[int, int] | None,
              idle_timeout_s: float, on_idle: Callable[[ServerProcess], None],
              on_closed: Callable[[ServerProcess], None],
              timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
        """A server process whose socket has taken the place of ``replacing`` at ``config.socket``;
        ControlServerError says why there is none."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        args = {"socket": str(config.socket), "mode": config.socket_mode,
                "replacing": list(replacing) if replacing is not None else None,
                "bridge_fd": theirs.fileno(), "idle_timeout_s": idle_timeout_s, "info": methods.info,
                # Its warnings; all it says when the agent logs at DEBUG.
                "log_level": "DEBUG" if log.isEnabledFor(logging.DEBUG) else "WARNING"}
        command = [sys.executable, "-m", "gpuscope.control.server_process", json.dumps(args)]
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        except OSError as err:
            ours.close()
            raise ControlServerError(f"cannot start the control API's server process ({sys.executable}): "
                                     f"{err.strerror or err}") from err
        finally:
            theirs.close()
        handle = cls(proc, ours, methods, on_idle=on_idle, on_closed=on_closed)
        start_thread("gpuscope-control-bridge", handle._bridge.serve)
        if not handle._ready.wait(timeout_s):
            handle.stop()
            raise ControlServerError(f"the control API's server process (pid {handle.pid}) did not serve "
                                     f"within {timeout_s:g}s")
        if handle._failure is not None:
            handle.stop()
            raise ControlServerError(handle._failure)
        return handle

    def release(self) -> None:
        """The agent holds the socket again: the process finishes its calls in progress and exits."""
        self._bridge.release()

    def stop(self) -> None:
        """End it now: its calls in progress fail (UNAVAILABLE), and it exits (or is killed)."""
        self._bridge.close()
        self._reap()

    # -- on the bridge's thread -------------------------------------------------------------------------

    def _ready_at(self, identity: tuple[int, int]) -> None:
        self.identity = identity
        self._ready.set()

    def _failed(self, message: str) -> None:
        self._failure = message
        self._ready.set()

    def _closed(self) -> None:
        self._reap()
        self.closed.set()
        if not self._ready.is_set():
            self._failure = (f"the control API's server process (pid {self.pid}) exited with status "
                             f"{self._proc.returncode} before it served")
            self._ready.set()
            return
        self._on_closed(self)

    def _reap(self) -> None:
        try:
            self._proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("control API: its server process (pid %d) did not exit; killing it", self.pid)
            self._proc.kill()
            self._proc.wait()

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode
