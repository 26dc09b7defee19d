"""Headless Chromium for the status page's tests: found (or skipped), and driven over its DevTools
protocol on a pipe (``--remote-debugging-pipe``: the browser reads commands on fd 3 and writes replies
on fd 4, JSON messages ending with a NUL byte), which needs no package beyond the standard library.
Also a PNG decoder, for the screenshots it takes."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pytest


def find_chromium() -> str:
    """Debian's chromium (or the chromium-browser name other distributions use); a skip locally when
    missing, a failure in CI (``CI`` set), where scripts/test.sh installs it."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None:
            return path
    message = "chromium is not installed (apt-get install chromium)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class DevToolsBrowser:
    """One headless Chromium with one page, every exchange bounded by ``timeout`` seconds."""

    def __init__(self, chromium: str, profile: Path, log: Path, timeout: float) -> None:
        self.timeout = timeout
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()
        # Above fd 4, so that neither lands on the other's target before it is moved there.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (commands_read, replies_write)]
        os.close(commands_read)
        os.close(replies_write)
        argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"]
        try:
            self.pid = os.posix_spawn(chromium, argv, dict(os.environ), file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
                (os.POSIX_SPAWN_OPEN, 2, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
                (os.POSIX_SPAWN_DUP2, high[0], 3), (os.POSIX_SPAWN_DUP2, high[1], 4)])
        finally:
            for fd in high:
                os.close(fd)
        self._session = ""

    def __enter__(self) -> DevToolsBrowser:
        try:
            target = self.command("Target.createTarget", url="about:blank", session=False)["targetId"]
            self._session = self.command("Target.attachToTarget", targetId=target, flatten=True,
                                         session=False)["sessionId"]
            self.command("Page.enable")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self._send({"id": 0, "method": "Browser.close"})
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.05)
        os.close(self._commands)
        os.close(self._replies)

    def command(self, method: str, *, session: bool = True, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its reply; its ``result``, or an AssertionError."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        self._send(message)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result
            if "method" in reply:
                self._events.append(reply)

    def wait_for_event(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            for event in self._events:
                if event["method"] == method:
                    self._events.remove(event)
                    return event
            self._events.append(self._receive(deadline, method))

    def load(self, url: str, width: int, height: int) -> None:
        """Open ``url`` in a ``width`` x ``height`` window (CSS pixels, one device pixel each)."""
        self.command("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                     mobile=False)
        self._events.clear()
        self.command("Page.navigate", url=url)
        self.wait_for_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        reply = self.command("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise AssertionError(f"{expression[:200]}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self) -> bytes:
        """The window as a PNG."""
        return base64.b64decode(self.command("Page.captureScreenshot", format="png")["data"])

    def _send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._commands, data):]

    def _receive(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise AssertionError(f"no reply from Chromium in {self.timeout} s ({waiting_for})")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise AssertionError(f"Chromium closed its pipe ({waiting_for})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        decoded: dict[str, Any] = json.loads(message)
        return decoded


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def png_rows(data: bytes) -> list[bytes]:
    """The rows of an 8-bit RGB or RGBA PNG without interlacing, as RGB(A) bytes, unfiltered."""
    width, height = png_size(data)
    depth, colour, _, _, interlace = data[24:29]
    assert depth == 8 and colour in {2, 6} and interlace == 0, (depth, colour, interlace)
    channels = 3 if colour == 2 else 4
    compressed = b""
    offset = 8
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        if kind == b"IDAT":
            compressed += data[offset + 8:offset + 8 + length]
        offset += 12 + length
    raw = zlib.decompress(compressed)
    stride = width * channels
    rows = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, row = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        _unfilter(kind, row, previous, channels)
        rows.append(bytes(row))
        previous = row
    return rows


def _unfilter(kind: int, row: bytearray, above: bytearray, bpp: int) -> None:
    if kind == 0:
        return
    for i in range(len(row)):
        left = row[i - bpp] if i >= bpp else 0
        up = above[i]
        if kind == 1:
            row[i] = (row[i] + left) & 0xFF
        elif kind == 2:
            row[i] = (row[i] + up) & 0xFF
        elif kind == 3:
            row[i] = (row[i] + ((left + up) >> 1)) & 0xFF
        else:
            corner = above[i - bpp] if i >= bpp else 0
            guess = left + up - corner
            pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
            row[i] = (row[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
