"""One thread for the agent's listening sockets.

The HTTP listener, the control API's socket (while no client calls) and the Kineto daemon's socket
each wait for what may not come for days. One thread waits on all of them in one ``epoll`` (``poll``
elsewhere) and runs the handler of the socket that is ready: one thread instead of three, and still
no wake-up while nothing comes. A handler runs on that thread, so it returns quickly: it accepts a
connection and hands it to a thread of its own, or reads the datagrams that came and answers them.

The thread starts with the first socket added: a component that adds none costs no thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from gpuscope.health import SourceHealth
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

Handler = Callable[[], None]


class SocketListeners:
    """Waits on sockets on one thread named ``name`` and calls each one's handler when it can be read.

    ``add`` and ``remove`` may be called from any thread, a handler's included. Once ``remove``
    returns, the handler it removed is not running and is not called again, so the caller may close
    the socket."""

    def __init__(self, name: str, *, health: SourceHealth | None = None, source: str | None = None) -> None:
        self.name = name
        self._health, self._source = health, source
        self._selector: selectors.BaseSelector | None = None  # with the thread: nothing held before
        self._wake_reader: socket.socket | None = None
        self._wake_writer: socket.socket | None = None
        self._handlers: dict[int, Handler] = {}  # fd -> the handler to call
        # Held while a handler runs and while the sockets change, so that a removed handler is never
        # called after remove() returns. Reentrant: a handler may remove its own socket.
        self._dispatch = threading.RLock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def alive(self) -> bool:
        """The thread runs (it has not died of a bug, nor been closed)."""
        return self._thread is not None and self._thread.is_alive()

    def add(self, sock: Any, handler: Handler) -> None:
        """Call ``handler`` on this thread whenever ``sock`` (a socket, or anything with fileno())
        can be read; starts the thread the first time."""
        with self._dispatch:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            if self._selector is None:
                self._selector = selectors.DefaultSelector()
                self._wake_reader, self._wake_writer = socket.socketpair()
                self._wake_reader.setblocking(False)
                self._wake_writer.setblocking(False)  # never waits: a wake-up pending is enough
                self._selector.register(self._wake_reader, selectors.EVENT_READ)
            self._selector.register(sock, selectors.EVENT_READ)
            self._handlers[sock.fileno()] = handler
            if self._thread is None:
                self._thread = start_thread(self.name, functools.partial(self._run, self._selector),
                                            health=self._health, source=self._source)
        self._wake()  # a poll() in progress (not epoll's) sees the new socket at its next call

    def remove(self, sock: Any) -> None:
        """Stop watching ``sock``; waits for its handler if it is running on the thread, and it is
        not called again even if its socket is ready."""
        if self._handlers.pop(sock.fileno(), None) is None:  # from now on the thread skips it
            return
        with self._dispatch:  # a call in progress ends first
            if self._selector is not None:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(sock)

    def close(self, timeout: float = 1.0) -> None:
        """End the thread (waiting up to ``timeout`` for a handler still running) and free what it
        used; the sockets still added are the callers' to close. Idempotent."""
        with self._dispatch:
            if self._closed:
                return
            self._closed = True
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if (thread is None or not thread.is_alive()) and self._selector is not None:
            self._selector.close()
            for end in (self._wake_reader, self._wake_writer):
                if end is not None:
                    end.close()

    def _wake(self) -> None:
        writer = self._wake_writer
        if writer is not None:
            with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
                writer.send(b"\0")

    def _run(self, selector: selectors.BaseSelector) -> None:
        while True:
            ready = selector.select()
            for key, _ in ready:
                if key.fileobj is self._wake_reader:
                    with contextlib.suppress(OSError):
                        while key.fileobj.recv(4096):
                            pass
                    if self._closed:
                        return
                    continue
                with self._dispatch:
                    handler = self._handlers.get(key.fd)
                    if handler is None:  # removed since select() returned: not watched any more
                        with contextlib.suppress(KeyError, ValueError, OSError):
                            selector.unregister(key.fileobj)
                        continue
                    if self._closed:
                        return
                    try:
                        handler()
                    except Exception:  # one socket's failure must not stop the others
                        log.exception("%s: error handling a ready socket", self.name)
