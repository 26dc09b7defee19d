"""Make a PyTorch job capturable over TCP: one line in the training script.

    import gpuscope.workload
    gpuscope.workload.serve(port=6009)

``serve`` starts, in background threads of the job, a gRPC server that speaks the same
``tensorflow.ProfilerService`` API as TensorFlow's and JAX's profiler servers (the ``Profile`` RPC),
implemented with ``torch.profiler``. The gpuscope agent captures it like a JAX job: over TCP, so the
job needs no shared network namespace, socket or filesystem with the agent (a pod without host
networking). For jobs that do share the node's network, ``KINETO_USE_DAEMON=1`` is enough (see
``gpuscope.capture.kineto``).

A ``Profile`` call records the whole process (every thread: the profiler runs with
``profile_all_threads``, without which a profiler started from the server's thread sees none of the
training thread's ops) for ``opts.duration_ms`` (or ``duration_ms``), and answers with the Chrome
trace JSON, gzip-compressed, as ``tool_data`` named ``<host>.pt.trace.json.gz`` (there is no XSpace
for PyTorch). ``empty_trace`` is set when nothing ran. While a session is active (this server's,
or ``torch.profiler`` used by the script itself), a second one fails at once with
FAILED_PRECONDITION "Another profiling session active.", as TensorFlow's and JAX's servers do.

torch is imported when ``serve`` is called, never when this module is imported.
"""

from __future__ import annotations

import gzip
import importlib
import logging
import os
import re
import socket
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpuscope.generated.tsl import profiler_service_pb2, profiler_service_pb2_grpc

__all__ = ["BUSY_MESSAGE", "ProfilerServer", "serve"]

log = logging.getLogger(__name__)

BUSY_MESSAGE = "Another profiling session active."
TRACE_SUFFIX = ".pt.trace.json.gz"
DEFAULT_MAX_DURATION_S = 60.0
# An event of any category but the profiler's own "Trace" span: the session recorded something.
_EVENT = re.compile(rb'"cat"\s*:\s*"(?!Trace")')
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_LIVE: set[ProfilerServer] = set()  # the running servers


class ProfilerServer:
    """A running ``serve``: ``port`` is the bound port (useful with ``port=0``); ``stop()`` ends it."""

    def __init__(self, server: grpc.Server, servicer: _ProfilerServicer, host: str, port: int) -> None:
        self._server = server
        self._servicer = servicer
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving. An active session is ended early: its caller gets what was recorded if
        that is sent within ``grace`` seconds."""
        self._servicer.terminate()
        self._server.stop(grace).wait()
        _LIVE.discard(self)

    def __enter__(self) -> ProfilerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(port: int = 6009, host: str = "0.0.0.0", *,
          max_duration_s: float = DEFAULT_MAX_DURATION_S) -> ProfilerServer:
    """Serves ``tensorflow.ProfilerService`` for this PyTorch process on ``host:port`` (``port=0``:
    any free port) in background threads; returns at once. OSError when the port cannot be bound;
    ImportError when torch is not installed. Sessions longer than ``max_duration_s`` are refused.
    The server runs until ``stop()`` or the end of the process, whether or not the handle is kept."""
    profiler = _TorchProfiler(importlib.import_module("torch"))
    servicer = _ProfilerServicer(profiler, max_duration_s=max_duration_s)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpuscope-profiler"),
        options=[("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)])
    profiler_service_pb2_grpc.add_ProfilerServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    bind = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind)
    except RuntimeError as err:  # recent grpcio raises instead of returning 0
        raise OSError(f"cannot listen on {bind}: {err}") from err
    if not bound:
        raise OSError(f"cannot listen on {bind}")
    server.start()
    log.info("gpuscope profiler server listening on %s (pid %d)", bind.rsplit(":", 1)[0] + f":{bound}",
              os.getpid())
    handle = ProfilerServer(server, servicer, host, bound)
    _LIVE.add(handle)  # `serve(...)` as a bare statement must not let the server be collected
    return handle


class _Busy(Exception):
    pass


class _TorchProfiler:
    """Runs one torch.profiler session over every thread and returns its Chrome trace."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.activities = activities
        self.all_threads = True
        try:
            torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        except (AttributeError, TypeError):
            self.all_threads = False
            log.warning("this torch (%s) cannot profile all threads (_ExperimentalConfig"
                         "(profile_all_threads=True)): captures will miss the training thread's ops",
                         getattr(torch, "__version__", "?"))

    def _experimental_config(self) -> Any:
        make = self.torch._C._profiler._ExperimentalConfig
        if not self.all_threads:
            return make()
        try:
            return make(profile_all_threads=True, trace_only=True)
        except TypeError:  # trace_only (skip building Python event objects) is recent
            return make(profile_all_threads=True)

    def busy(self) -> bool:
        """Whether torch.profiler is already recording in this process (the script profiles itself)."""
        return bool(getattr(self.torch.autograd.profiler, "_is_profiler_enabled", False))

    def record(self, duration_s: float, keep_going: threading.Event) -> tuple[bytes, bool]:
        """Records for ``duration_s`` (or until ``keep_going`` is cleared); (gzip Chrome trace, whether
        it has events). _Busy when the profiler is taken."""
        torch = self.torch
        if self.busy():
            raise _Busy(BUSY_MESSAGE)
        profile = torch.profiler.profile(activities=self.activities,
                                         experimental_config=self._experimental_config())
        try:
            profile.start()
        except RuntimeError as err:
            raise _Busy(f"{BUSY_MESSAGE} ({err})") from err
        try:
            end = time.monotonic() + duration_s
            while keep_going.is_set() and (left := end - time.monotonic()) > 0:
                time.sleep(min(left, 0.05))
        finally:
            profile.stop()
        with tempfile.TemporaryDirectory(prefix="gpuscope-profile-") as directory:
            path = Path(directory) / "trace.json"
            profile.export_chrome_trace(str(path))
            raw = path.read_bytes()
        return gzip.compress(raw, compresslevel=3, mtime=0), bool(_EVENT.search(raw))


class _ProfilerServicer(profiler_service_pb2_grpc.ProfilerServiceServicer):
    def __init__(self, profiler: _TorchProfiler, *, max_duration_s: float) -> None:
        self.profiler = profiler
        self.max_duration_s = max_duration_s
        self.hostname = _UNSAFE.sub("_", socket.gethostname()).lstrip(".")[:64] or "host"
        self._session = threading.Lock()
        self._current: threading.Event | None = None  # the active session's "keep recording" flag

    def terminate(self) -> None:
        """Ends the active session early (it answers with what it recorded so far)."""
        current = self._current
        if current is not None:
            current.clear()

    def Profile(self, request: profiler_service_pb2.ProfileRequest,
                context: grpc.ServicerContext) -> profiler_service_pb2.ProfileResponse:
        duration_ms = request.opts.duration_ms or request.duration_ms
        if duration_ms <= 0:
            return profiler_service_pb2.ProfileResponse(empty_trace=True)
        if duration_ms > self.max_duration_s * 1000:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"duration_ms {duration_ms} exceeds this server's limit "
                          f"of {self.max_duration_s:g} s")
        if not self._session.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, BUSY_MESSAGE)
        try:
            keep_going = threading.Event()
            keep_going.set()
            self._current = keep_going
            context.add_callback(keep_going.clear)  # the client cancelled or went away
            try:
                data, has_events = self.profiler.record(duration_ms / 1000, keep_going)
            except _Busy as err:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            if not has_events:
                return profiler_service_pb2.ProfileResponse(empty_trace=True)
            tool = profiler_service_pb2.ProfileToolData(name=f"{self.hostname}{TRACE_SUFFIX}", data=data)
            return profiler_service_pb2.ProfileResponse(tool_data=[tool], empty_trace=False)
        finally:
            self._current = None
            self._session.release()

    def Terminate(self, request: profiler_service_pb2.TerminateRequest,
                  context: grpc.ServicerContext) -> profiler_service_pb2.TerminateResponse:
        self.terminate()
        return profiler_service_pb2.TerminateResponse()
