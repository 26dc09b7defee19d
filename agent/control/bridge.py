"""The private socket between the agent and its control API server process.

The server process (``gpuscope.control.server_process``) holds the gRPC server; the agent holds what
the methods need (the capture service, the store, the latest snapshot, the alerts). Each gRPC call
becomes one message to the agent and one answer back, so the agent never loads gRPC.

Messages are JSON objects, each after its length in 4 bytes (big-endian), read only up to a bound
(``MAX_CALL_BYTES`` from the server process: its calls are gRPC requests of at most 64 KiB;
``MAX_ANSWER_BYTES`` from the agent). The socket is a ``socketpair`` made for one server process,
so only that process can send on it.

From the server process: ``{"ready": [device, inode]}`` (its socket is in place),
``{"failed": message}``, ``{"idle": true}`` (no call for the idle time: it would exit),
``{"call": id, "method": name, "args": {...}, "wait_s": seconds or null}`` and ``{"cancel": id}``
(the client went away). From the agent: ``{"answer": id, "result": ...}`` or
``{"answer": id, "error": [code, message]}``, and ``{"release": true}`` (the agent holds the
socket again: stop serving and exit). The end of the stream, either way, means the other side is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuscope.control.methods import POLL_S, ApiError, CallContext, ControlMethods
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

MAX_CALL_BYTES = 1 << 20  # a call carries a gRPC request's fields (at most 64 KiB)
MAX_ANSWER_BYTES = 64 << 20  # ListCaptures with its largest limit, with room to spare
MAX_CALLS = 32  # calls answered at a time (the server process's gRPC allows 16 in progress)
_LENGTH_BYTES = 4


class BridgeError(Exception):
    """The other side sent something that is not a message of this protocol."""


class Bridge:
    """One end of the socket: whole messages out (from any thread) and in (from one reader)."""

    def __init__(self, sock: socket.socket, *, max_in: int) -> None:
        self._sock = sock
        self._max_in = max_in
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> bool:
        """Send ``message``; False when the other side is gone."""
        body = json.dumps(message).encode()
        with self._send_lock:
            try:
                self._sock.sendall(len(body).to_bytes(_LENGTH_BYTES, "big") + body)
            except OSError:
                return False
        return True

    def receive(self) -> dict[str, Any] | None:
        """The next message; None at the end of the stream. BridgeError for anything else."""
        header = self._read(_LENGTH_BYTES, at_start=True)
        if header is None:
            return None
        size = int.from_bytes(header, "big")
        if size > self._max_in:
            raise BridgeError(f"a message of {size} bytes, over the {self._max_in} allowed")
        body = self._read(size, at_start=False)
        try:
            message = json.loads(body or b"")
        except ValueError as err:
            raise BridgeError(f"a message that is not JSON: {err}") from None
        if not isinstance(message, dict):
            raise BridgeError("a message that is not a JSON object")
        return message

    def close(self) -> None:
        """End the stream both ways (the other side reads its end), then let go of the socket."""
        with contextlib.suppress(OSError):  # already shut down, or never connected
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _read(self, size: int, *, at_start: bool) -> bytes | None:
        data = bytearray()
        while len(data) < size:
            try:
                chunk = self._sock.recv(min(size - len(data), 1 << 20))
            except OSError:
                chunk = b""
            if not chunk:
                if at_start and not data:
                    return None
                raise BridgeError("the stream ended inside a message")
            data += chunk
        return bytes(data)


# -- the agent's end ----------------------------------------------------------------------------------------


class _BridgedCall:
    """A call as the methods see it: its deadline from the server process, and whether its client is
    still there (until the server process cancels the call, or goes away)."""

    def __init__(self, wait_s: float | None, gone: threading.Event) -> None:
        self._deadline = None if wait_s is None else time.monotonic() + max(0.0, float(wait_s))
        self.cancelled = threading.Event()
        self._gone = gone

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return not (self.cancelled.is_set() or self._gone.is_set())


class AgentBridge:
    """The agent's end: answers the server process's calls from ``methods`` (each on a thread of its own:
    a Capture call waits for its capture) and passes its other messages to the callbacks."""

    def __init__(self, sock: socket.socket, methods: ControlMethods, *,
                 on_ready: Callable[[tuple[int, int]], None], on_failed: Callable[[str], None],
                 on_idle: Callable[[], None], on_closed: Callable[[], None]) -> None:
        self._bridge = Bridge(sock, max_in=MAX_CALL_BYTES)
        self._methods = methods
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._on_idle = on_idle
        self._on_closed = on_closed
        self._calls: dict[int, _BridgedCall] = {}
        self._lock = threading.Lock()
        self._gone = threading.Event()

    def serve(self) -> None:
        """Read messages until the stream ends (run on a thread of its own)."""
        try:
            while True:
                message = self._bridge.receive()
                if message is None:
                    return
                self._handle(message)
        except BridgeError as err:
            log.warning("control API: its server process sent %s; closing the connection to it", err)
        finally:
            self._gone.set()
            self._bridge.close()
            self._on_closed()

    def release(self) -> None:
        self._bridge.send({"release": True})

    def close(self) -> None:
        """End the stream: the server process stops serving and exits."""
        self._gone.set()
        self._bridge.close()

    def _handle(self, message: dict[str, Any]) -> None:
        if "call" in message:
            call_id = message["call"]
            if not isinstance(call_id, int):
                raise BridgeError("a call without an integer id")
            call = _BridgedCall(message.get("wait_s"), self._gone)
            with self._lock:
                busy = len(self._calls) >= MAX_CALLS
                if not busy:
                    self._calls[call_id] = call
            if busy:
                self._bridge.send({"answer": call_id, "error": [
                    "RESOURCE_EXHAUSTED", f"{MAX_CALLS} calls are already in progress on this agent"]})
                return
            start_thread("gpuscope-control-call", lambda: self._answer(call_id, call, message))
        elif "cancel" in message:
            with self._lock:
                cancelled = self._calls.get(message["cancel"])
            if cancelled is not None:
                cancelled.cancelled.set()
        elif "ready" in message:
            device, inode = message["ready"]
            self._on_ready((int(device), int(inode)))
        elif "failed" in message:
            self._on_failed(str(message["failed"]))
        elif "idle" in message:
            self._on_idle()
        else:
            raise BridgeError(f"a message of no known kind ({', '.join(sorted(message)) or 'empty'})")

    def _answer(self, call_id: int, call: _BridgedCall, message: dict[str, Any]) -> None:
        try:
            answer = {"answer": call_id, "result": self._run(str(message.get("method")),
                                                              message.get("args") or {}, call)}
        except ApiError as err:
            answer = {"answer": call_id, "error": [err.code, err.message]}
        except (TypeError, ValueError, KeyError) as err:  # arguments this protocol never sends
            answer = {"answer": call_id, "error": ["INTERNAL", f"a malformed call: {err}"]}
        except Exception as err:  # a defect: the call ends with it rather than wait for its client's deadline
            log.exception("control API: %s failed", message.get("method"))
            answer = {"answer": call_id, "error": ["INTERNAL", f"{type(err).__name__}: {err}"]}
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        self._bridge.send(answer)

    def _run(self, method: str, args: dict[str, Any], call: _BridgedCall) -> Any:
        methods = self._methods
        if method == "snapshot_json":
            return methods.snapshot_json().decode()
        if method == "alerts_json":
            return methods.alerts_json().decode()
        if method == "capture":
            return methods.capture(dict(args["fields"]), user=str(args["user"]), context=call)
        if method == "list_captures":
            return methods.list_captures(limit=int(args["limit"]),
                                         include_refused=bool(args["include_refused"]))
        if method == "capture_files":
            return [[relative, str(path)] for relative, path in methods.capture_files(str(args["id"]))]
        raise ApiError("UNIMPLEMENTED", f"no method {method!r}")


# -- the server process's end -------------------------------------------------------------------------------


class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: tuple[str, str] | None = None


class _NoClient:
    """The context of a call with no deadline whose client cannot go away while it is answered."""

    def time_remaining(self) -> float | None:
        return None

    def is_active(self) -> bool:
        return True


class RemoteMethods:
    """The agent's methods, called over the bridge (``gpuscope.control.methods.ApiMethods``).
    ``info``: GetAgentInfo's fields, as the agent gave them when it started this process."""

    def __init__(self, sock: socket.socket, *, info: dict[str, Any]) -> None:
        self.info = info
        self.stopping = threading.Event()
        self.released = threading.Event()  # the agent holds the socket again
        self.closed = threading.Event()  # the agent is gone (or stopping)
        self.ended = threading.Event()  # either of the two: time to stop serving
        self._bridge = Bridge(sock, max_in=MAX_ANSWER_BYTES)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        start_thread("gpuscope-control-bridge", self._read)

    def send(self, message: dict[str, Any]) -> None:
        self._bridge.send(message)

    def close(self) -> None:
        self._bridge.close()

    def snapshot_json(self) -> bytes:
        return str(self._call("snapshot_json", {})).encode()

    def alerts_json(self) -> bytes:
        return str(self._call("alerts_json", {})).encode()

    def capture(self, fields: dict[str, Any], *, user: str, context: CallContext) -> dict[str, Any]:
        record: dict[str, Any] = self._call("capture", {"fields": fields, "user": user}, context)
        return record

    def list_captures(self, *, limit: int, include_refused: bool) -> dict[str, Any]:
        listing: dict[str, Any] = self._call("list_captures", {"limit": limit,
                                                               "include_refused": include_refused})
        return listing

    def capture_files(self, capture_id: str) -> list[tuple[str, Path]]:
        files = self._call("capture_files", {"id": capture_id})
        return [(str(relative), Path(path)) for relative, path in files]

    def _call(self, method: str, args: dict[str, Any], context: CallContext | None = None) -> Any:
        context = context or _NoClient()
        call_id = next(self._ids)
        pending = _Pending()
        with self._lock:
            if self.closed.is_set():
                raise ApiError("UNAVAILABLE", "the agent is stopping")
            self._pending[call_id] = pending
        try:
            if not self._bridge.send({"call": call_id, "method": method, "args": args,
                                      "wait_s": context.time_remaining()}):
                raise ApiError("UNAVAILABLE", "the agent is stopping")
            while not pending.done.wait(POLL_S):
                if not context.is_active():
                    self._bridge.send({"cancel": call_id})
                    raise ApiError("CANCELLED", "the client went away")
        finally:
            with self._lock:
                self._pending.pop(call_id, None)
        if pending.error is not None:
            raise ApiError(*pending.error)
        return pending.result

    def _read(self) -> None:
        try:
            while (message := self._bridge.receive()) is not None:
                if "release" in message:
                    self.released.set()
                    self.ended.set()
                    continue
                with self._lock:
                    pending = self._pending.get(message.get("answer", -1))
                if pending is None:
                    continue  # a call whose client went away
                if "error" in message:
                    code, text = message["error"]
                    pending.error = (str(code), str(text))
                else:
                    pending.result = message.get("result")
                pending.done.set()
        except BridgeError as err:
            log.warning("control API: the agent sent %s", err)
        finally:
            with self._lock:
                self.closed.set()
                self.ended.set()
                waiting = list(self._pending.values())
            for pending in waiting:
                pending.error = ("UNAVAILABLE", "the agent is stopping; a capture in progress may still be "
                                                "stored")
                pending.done.set()
