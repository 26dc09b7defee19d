"""Make a PyTorch job capturable over TCP: one line in the training script.

    import gpuscope.workload
    gpuscope.workload.serve(port=6009)

``serve`` starts, in background threads of the job, a gRPC server that speaks the same
``tensorflow.ProfilerService`` API as TensorFlow's and JAX's profiler servers (the ``Profile`` RPC),
implemented with ``torch.profiler``. The gpuscope agent captures it like a JAX job: over TCP, so the
job needs no shared network namespace, socket or filesystem with the agent (a pod without host
networking). For jobs that do share the node's network, ``KINETO_USE_DAEMON=1`` is enough (see
``gpuscope.capture.kineto``).

A ``Profile`` call records for ``opts.duration_ms`` (or ``duration_ms``) and answers with the Chrome
trace JSON, gzip-compressed, as ``tool_data`` named ``<host>.pt.trace.json.gz`` (there is no XSpace
for PyTorch). The profiler is started and stopped by the training thread itself, at step boundaries:
after a ``torch.optim`` optimizer's ``step()`` (``serve`` hooks every optimizer of the process), or
where the script calls ``gpuscope.workload.step()``. Started from the server's thread, a profiler
that records the training thread can crash the job (see ``_TorchProfiler``). A capture covers the
steps from the first boundary after the request to the first one ``duration`` later.
``empty_trace`` is set when no step boundary came while it was asked (an idle job). While a session
is active (this server's, or ``torch.profiler`` used by the script itself), a second one fails at
once with FAILED_PRECONDITION "Another profiling session active.", as TensorFlow's and JAX's servers
do.

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

__all__ = ["BUSY_MESSAGE", "ProfilerServer", "serve", "step"]

log = logging.getLogger(__name__)

BUSY_MESSAGE = "Another profiling session active."
TRACE_SUFFIX = ".pt.trace.json.gz"
DEFAULT_MAX_DURATION_S = 60.0
# An event of any category but the profiler's own "Trace" span: the session recorded something.
_EVENT = re.compile(rb'"cat"\s*:\s*"(?!Trace")')
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_LIVE: set[ProfilerServer] = set()  # the running servers
# What step() reaches: the profilers of running servers, and of stopped ones whose session the
# training thread has not stopped yet (only it can).
_PROFILERS: set[_TorchProfiler] = set()
_OPTIMIZER_HOOK: list[Any] = []  # the handle of the hook on every optimizer's step, once installed


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

    def step(self) -> None:
        """A step boundary of the calling thread (``gpuscope.workload.step()`` does it for every server)."""
        self._servicer.profiler.step()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving. An active session is ended early: its caller gets what was recorded if
        that is sent within ``grace`` seconds."""
        self._servicer.terminate()
        self._server.stop(grace).wait()
        self._servicer.profiler.close()
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
    The server runs until ``stop()`` or the end of the process, whether or not the handle is kept.
    Call it from the thread that imported torch (the main thread), before the training loop."""
    torch = importlib.import_module("torch")
    profiler = _TorchProfiler(torch)
    profiler.warm_up()
    _hook_optimizers(torch)
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
    _PROFILERS.add(profiler)
    _LIVE.add(handle)  # `serve(...)` as a bare statement must not let the server be collected
    return handle


def step() -> None:
    """Marks a step boundary of the calling thread for every running server: where a capture starts
    and stops. Needed only in a loop that does not call a ``torch.optim`` optimizer's ``step()``
    (``serve`` hooks those); call it between two steps, on the thread that runs them."""
    for profiler in tuple(_PROFILERS):
        profiler.step()


def _hook_optimizers(torch: Any) -> None:
    """Makes every optimizer's ``step()`` a step boundary, once per process."""
    if _OPTIMIZER_HOOK:
        return
    try:
        register = importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook
    except (ImportError, AttributeError):  # an old torch: the script calls step() itself
        log.warning("this torch (%s) has no hook on every optimizer's step: captures start and stop only "
                    "where the script calls gpuscope.workload.step()", getattr(torch, "__version__", "?"))
        return
    _OPTIMIZER_HOOK.append(register(lambda _optimizer, _args, _kwargs: step()))


class _Busy(Exception):
    pass


class _NotRecorded(Exception):
    """The session could not be recorded at a step boundary (none came, or none came to end it)."""


# Why sessions start and stop on a training thread, at a step boundary: with PyTorch's
# ``profile_all_threads`` the profiler installs global RecordFunction callbacks, which every thread
# runs on every op, and stopping it from another thread (the server's) frees the profiler's state
# while a training thread is inside an op that still writes to it. Up to PyTorch 2.13 at least, that
# is a use-after-free: the job dies of SIGSEGV or of glibc's heap checks ("malloc(): unsorted double
# linked list corrupted", SIGABRT): once in 800 captures under CPU load (bench/capture_stress.py), but
# never is the only acceptable rate (PyTorch's fixes: pytorch/pytorch pull requests 187483, 188172).
# A profiler started and stopped by the training thread itself, between two steps, is the ordinary use of
# torch.profiler (thread-local callbacks, no op in flight on that thread, the autograd threads follow
# it): nothing for the training thread to race with. The price: a capture waits for a step boundary,
# covers whole steps (from the boundary where it starts to the first one ``duration`` later), and
# records the thread that reached the boundary (and the threads it hands work to, as autograd's),
# not unrelated threads of the process. A job that never reaches one gets no capture.
STEP_WAIT_S = 5.0  # how long past a capture's length a session waits for the step boundary that ends it


class _Session:
    """One capture, asked for by the server's thread, run by the training thread."""

    def __init__(self, duration_s: float, keep_going: threading.Event) -> None:
        self.duration_s = duration_s
        self.keep_going = keep_going
        self.started = threading.Event()  # or refused: then ``error`` says why
        self.stopped = threading.Event()
        self.abandoned = False  # its caller stopped waiting: the trace is dropped
        self.error: str | None = None
        self.profile: Any = None
        self.owner = 0  # the thread that started it, and must stop it
        self.end_at = 0.0

    def due(self) -> bool:
        return not self.keep_going.is_set() or time.monotonic() >= self.end_at


class _TorchProfiler:
    """Runs torch.profiler sessions on the thread that reaches a step boundary, and returns their
    Chrome trace."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.activities = activities
        self.stepped = threading.Event()  # a step boundary has been seen in this process
        self._lock = threading.Lock()
        self._pending: _Session | None = None  # asked for, not started yet
        self._active: _Session | None = None  # started, or stopped and not yet handed over
        self._closed = False  # its server stopped

    def _experimental_config(self) -> Any:
        make = self.torch._C._profiler._ExperimentalConfig
        try:
            return make(trace_only=True)  # skip building Python event objects: only the trace is read
        except TypeError:  # trace_only is recent
            return make()

    def busy(self) -> bool:
        """Whether torch.profiler is already recording in this process (the script profiles itself)."""
        return bool(getattr(self.torch.autograd.profiler, "_is_profiler_enabled", False))

    def warm_up(self) -> None:
        """Starts Kineto on the calling thread (``serve``'s) with an empty session, so that the first
        capture does not pay for it in a training step and Kineto runs its client's initialisation on
        the thread that imported torch (started elsewhere, it prints "External init callback must run
        in same thread as registerClient" and skips it). Thread-local, so ops running meanwhile on
        other threads never see it."""
        if self.busy():
            return
        try:
            with self.torch.profiler.profile(activities=[self.torch.profiler.ProfilerActivity.CPU],
                                             experimental_config=self._experimental_config()):
                pass
        except RuntimeError as err:  # a profiler on this thread after all: the first capture starts Kineto
            log.debug("profiler warm-up skipped: %s", err)

    def step(self) -> None:
        """A step boundary of the calling thread: starts an asked-for session here, or stops this
        thread's session once it is due. Nothing else (two attribute reads) when no capture runs."""
        if not self.stepped.is_set():
            self.stepped.set()
        active = self._active
        if active is not None:
            if active.owner == threading.get_ident() and not active.stopped.is_set() and active.due():
                self._stop(active)
            return
        if self._pending is not None and (session := self._take_pending()) is not None:
            self._start(session)

    def _take_pending(self) -> _Session | None:
        """The asked-for session, made the active one; None when another thread took it first or the
        server stopped (then nothing would step it to its end)."""
        with self._lock:
            if self._closed:
                return None
            session, self._pending = self._pending, None
            if session is not None:
                self._active = session
            return session

    def _start(self, session: _Session) -> None:
        try:
            if self.busy():
                raise RuntimeError("torch.profiler is already recording")
            profile = self.torch.profiler.profile(activities=self.activities,
                                                  experimental_config=self._experimental_config())
            profile.start()
        except Exception as err:  # anything: this runs in the job's training step, which must go on
            session.error = f"{BUSY_MESSAGE} ({err})" if isinstance(err, RuntimeError) else \
                f"the profiler did not start: {type(err).__name__}: {err}"
            self._release(session)
        else:
            session.profile = profile
            session.owner = threading.get_ident()
            session.end_at = time.monotonic() + session.duration_s
        session.started.set()

    def _stop(self, session: _Session) -> None:
        try:
            session.profile.stop()
        except Exception as err:  # never expected (the session is this thread's); the step goes on
            session.error = f"the profiler did not stop: {type(err).__name__}: {err}"
        with self._lock:  # against record() giving up on it at this moment
            session.stopped.set()
            dropped = session.abandoned
        if dropped:
            self._release(session)

    def _release(self, session: _Session) -> None:
        with self._lock:
            if self._active is session:
                self._active = None
            done = self._closed and self._active is None
        if done:
            _PROFILERS.discard(self)

    def close(self) -> None:
        """Its server stopped: step() leaves it alone once no session of it runs."""
        with self._lock:
            self._closed = True
            done = self._active is None
        if done:
            _PROFILERS.discard(self)

    def record(self, duration_s: float, keep_going: threading.Event) -> tuple[bytes, bool]:
        """Records from the first step boundary for ``duration_s`` (or until ``keep_going`` is
        cleared) to the next step boundary; (gzip Chrome trace, whether it has events). _Busy when
        the profiler is taken; _NotRecorded when no step boundary came to start or to end it."""
        if self.busy():
            raise _Busy(BUSY_MESSAGE)
        session = _Session(duration_s, keep_going)
        with self._lock:
            if self._pending is not None or self._active is not None:
                raise _Busy(BUSY_MESSAGE)
            self._pending = session
        stepped_before = self.stepped.is_set()
        if not self._wait(session.started, duration_s + (STEP_WAIT_S if stepped_before else 0.0), keep_going):
            with self._lock:
                withdrawn = self._pending is session
                if withdrawn:
                    self._pending = None
            if withdrawn:
                if self.stepped.is_set() or not keep_going.is_set():
                    return b"", False  # no step boundary came while asked (or it was called off)
                raise _NotRecorded(
                    "this process has reached no training step yet: a capture starts and stops at step "
                    "boundaries (a torch.optim optimizer's step, or gpuscope.workload.step())")
            session.started.wait()  # a training thread took it just now
        if session.error is not None:
            raise _Busy(session.error)
        if not session.stopped.wait(duration_s + STEP_WAIT_S):
            with self._lock:
                session.abandoned = not session.stopped.is_set()
            if session.abandoned:  # the training thread stops and drops it at its next boundary
                raise _NotRecorded(f"no step boundary came within {STEP_WAIT_S:g} s of the capture's end "
                                   "to stop the profiler (a step longer than that?)")
        try:
            if session.error is not None:
                raise _NotRecorded(session.error)
            with tempfile.TemporaryDirectory(prefix="gpuscope-profile-") as directory:
                path = Path(directory) / "trace.json"
                session.profile.export_chrome_trace(str(path))
                raw = path.read_bytes()
        finally:
            self._release(session)
        return gzip.compress(raw, compresslevel=3, mtime=0), bool(_EVENT.search(raw))

    @staticmethod
    def _wait(event: threading.Event, timeout_s: float, keep_going: threading.Event) -> bool:
        """Waits for ``event`` up to ``timeout_s``, or until ``keep_going`` is cleared."""
        end = time.monotonic() + timeout_s
        while not event.is_set() and keep_going.is_set() and (left := end - time.monotonic()) > 0:
            event.wait(min(left, 0.05))
        return event.is_set()


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
            except _NotRecorded as err:
                context.abort(grpc.StatusCode.ABORTED, str(err))
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
