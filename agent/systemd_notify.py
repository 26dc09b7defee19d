"""systemd's notify protocol: READY once serving, WATCHDOG from the sampling loop, STOPPING on exit.

The watchdog ping is sent from the sampler's snapshot listener, not from a timer thread: if an NVML
call hangs, ticks stop, pings stop, and systemd restarts the agent after WatchdogSec. Outside systemd
(no NOTIFY_SOCKET) every method does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

from gpuscope.snapshot import Snapshot

log = logging.getLogger(__name__)


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # An abstract socket is written "@name"; on the wire its first byte is NUL.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        watchdog_usec = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not watchdog_pid or watchdog_pid == str(os.getpid())
        # Ping at half the timeout, as sd_watchdog_enabled(3) recommends.
        self._ping_every = int(watchdog_usec) / 2e6 if watchdog_usec.isdigit() and watchdog_for_us else None
        self._clock = clock
        self._last_ping = float("-inf")
        self._failed = False

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings, or None when systemd set no watchdog for this process."""
        return self._ping_every

    def ready(self, status: str = "") -> None:
        self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Sampler listener: a tick finished, so the sampling loop is alive."""
        if self._ping_every is None:
            return
        now = self._clock()
        if now - self._last_ping >= self._ping_every:
            self._last_ping = now
            self._send("WATCHDOG=1")

    def _send(self, message: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), self._address)
        except OSError as err:
            if not self._failed:  # systemd went away or the socket is wrong: say so once
                self._failed = True
                log.warning("cannot notify systemd at %s: %s", self._address.replace("\0", "@"), err)
