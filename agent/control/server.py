"""The control API server: gpuscope.v1.Agent over a Unix socket, and over TCP with TLS and a bearer token.

Two gRPC servers share one servicer: the Unix socket one (always, when the API is enabled) trusts the
socket's file permissions (``control.socket_mode``, 0660 by default: the agent's user and group); the TCP
one (only when ``control.tcp`` is configured) requires TLS and ``Authorization: Bearer <token>`` on every
call, compared in constant time, and answers UNAUTHENTICATED before any method runs otherwise.

Requests are small: a server refuses any message over ``MAX_REQUEST_BYTES`` (gRPC answers
RESOURCE_EXHAUSTED before the method sees it). A capture blocks its call for its duration, so at most
``MAX_WAITING_CAPTURES`` Capture calls wait at a time (RESOURCE_EXHAUSTED beyond), which keeps threads free
for the other methods. A capture the policy refuses is a result (status OK, outcome "refused"); a request
that cannot be a capture (no selector, a duration over the maximum, a start time too far ahead) is
INVALID_ARGUMENT with the reason.

The socket is bound inside a private (0700) directory next to it, chmod'ed, then linked into place, so no
client can connect while it still has the process umask's permissions; a stale socket (nobody answers)
is replaced, a live one or anything that is not a socket is refused: two agents never share a socket,
and the error names the agent that serves it (its pid, and its node name as GetAgentInfo gives it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpuscope.alerts.model import AlertSource
from gpuscope.capture.config import MAX_DURATION_SECONDS
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.capture.records import CaptureIdError
from gpuscope.capture.service import CaptureRequest, CaptureService
from gpuscope.capture.store import CaptureNotFoundError, CaptureStore, CaptureStoreError, new_capture_id
from gpuscope.capture.tsl import parse_target
from gpuscope.common.addresses import format_host_port, parse_host_port
from gpuscope.common.durations import format_duration
from gpuscope.common.unixfs import read_bounded, same_file
from gpuscope.control.auth import read_token
from gpuscope.control.config import (
    ControlConfig,
    TcpConfig,
)
from gpuscope.control.errors import ControlError, ControlServerError
from gpuscope.control.interceptor import BearerTokenInterceptor
from gpuscope.control.socket_dir import place_socket, prepare_socket_dir
from gpuscope.generated.agent.v1 import agent_pb2, agent_pb2_grpc
from gpuscope.snapshot import Snapshot, SnapshotSource
from gpuscope.version import __version__

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024  # every request message is tiny; larger ones are refused by gRPC
MAX_RESPONSE_BYTES = 8 * 2**20  # a FileChunk is at most CHUNK_BYTES plus a path
CHUNK_BYTES = 2**20  # GetCapture sends files in pieces of 1 MiB
MAX_WORKERS = 8  # threads per server
MAX_CONCURRENT_RPCS = 16  # calls in progress or queued per server; RESOURCE_EXHAUSTED beyond
MAX_WAITING_CAPTURES = 4  # Capture calls blocked at a time
MAX_START_DELAY_S = 60.0  # start_at at most this far ahead (the capture service waits no longer)
_POLL_S = 0.2  # how often a waiting Capture call checks for a stop or a vanished client
DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10_000
MAX_REASON_CHARS = 200
# A capture id names the GPU in at most 4 digits (records.CAPTURE_ID): a larger index made even the record
# of its refusal fail with CaptureIdError, a traceback instead of an answer.
MAX_GPU_INDEX = 9999
MAX_PEM_BYTES = 1 << 20  # a certificate chain, a key or a CA bundle
# A Capture call without a deadline waits this long at most for its record (the capture goes on).
DEFAULT_CAPTURE_WAIT_S = MAX_START_DELAY_S + MAX_DURATION_SECONDS + 120.0


# -- the methods ----------------------------------------------------------------------------------------


class _Servicer:
    """gpuscope.v1.Agent. ``transport`` ("unix" or "tcp") is recorded as who asked for a capture."""

    def __init__(self, *, service: CaptureService | None, store: CaptureStore | None,
                 snapshots: SnapshotSource, alerts: AlertSource | None, hostname: str,
                 wall_clock: Callable[[], float], waiting: threading.BoundedSemaphore,
                 stopping: threading.Event, user: str, info: agent_pb2.AgentInfo | None = None) -> None:
        # Who this agent is (GetAgentInfo): by default only what the process knows of itself.
        self._info = info or agent_pb2.AgentInfo(node_name=hostname, pid=os.getpid(), version=__version__)
        self._service = service
        self._store = store
        self._snapshots = snapshots
        self._alerts = alerts
        self._hostname = hostname
        self._wall_clock = wall_clock
        self._waiting = waiting
        self._stopping = stopping
        self._user = user

    def GetSnapshot(self, request: agent_pb2.GetSnapshotRequest,
                    context: grpc.ServicerContext) -> agent_pb2.GetSnapshotResponse:
        snapshot = self._snapshots.latest()
        if snapshot is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no snapshot yet: the first sampling tick has not "
                                                       "finished")
        return agent_pb2.GetSnapshotResponse(snapshot_json=json.dumps(snapshot.to_json()).encode())

    def GetAgentInfo(self, request: agent_pb2.GetAgentInfoRequest,
                     context: grpc.ServicerContext) -> agent_pb2.AgentInfo:
        return self._info

    def ListAlerts(self, request: agent_pb2.ListAlertsRequest,
                   context: grpc.ServicerContext) -> agent_pb2.ListAlertsResponse:
        alerts = [] if self._alerts is None else [a.to_json() for a in self._alerts.alerts()]
        document = {"enabled": self._alerts is not None, "alerts": alerts}
        return agent_pb2.ListAlertsResponse(alerts_json=json.dumps(document).encode())

    def Capture(self, request: agent_pb2.CaptureRequest,
                context: grpc.ServicerContext) -> agent_pb2.CaptureRecord:
        try:
            capture = self._capture_request(request)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        # Checked here, not in the capture service, so that every client hears "no such GPU" instead of
        # a capture that found no profiler.
        missing = _missing_gpu(capture.gpu, self._snapshots.latest(), self._hostname)
        if missing is not None:
            context.abort(*missing)
        if request.HasField("reason"):
            log.info("capture requested over the control API (%s): %s", self._user,
                     request.reason[:MAX_REASON_CHARS])
        if self._service is None:
            record = self._unserved(capture, "captures are disabled on this agent (capture.enabled: false "
                                             "or the capture store could not be opened)")
            return _record_message(record)
        if not self._waiting.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{MAX_WAITING_CAPTURES} capture requests are already waiting on this agent; "
                          "try again when they are done")
        try:
            record = self._wait(self._service.submit(capture), context)
        finally:
            self._waiting.release()
        return _record_message(record)

    def ListCaptures(self, request: agent_pb2.ListCapturesRequest,
                     context: grpc.ServicerContext) -> agent_pb2.ListCapturesResponse:
        store = self._require_store(context)
        limit = min(request.limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        records = store.list()[:limit]
        response = agent_pb2.ListCapturesResponse(captures=[_record_message(r) for r in records])
        if self._service is not None:
            refusals = self._service.refusals
            response.refused_count = refusals.total
            if request.include_refused:
                refused = [r.to_json() for r in refusals.recent(limit)]
                response.refused_json = json.dumps(refused, allow_nan=False).encode()
        return response

    def GetCapture(self, request: agent_pb2.GetCaptureRequest,
                   context: grpc.ServicerContext) -> Iterator[agent_pb2.FileChunk]:
        store = self._require_store(context)
        try:
            files = store.files(request.id)
        except CaptureIdError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except CaptureNotFoundError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        except CaptureStoreError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        for stored in files:
            try:
                fd = os.open(stored.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                context.abort(grpc.StatusCode.NOT_FOUND, f"capture {request.id} was removed (evicted?) "
                                                         "while it was being sent")
            except OSError as err:
                context.abort(grpc.StatusCode.INTERNAL, f"cannot read {stored.relative} of capture "
                                                        f"{request.id}: {err.strerror or err}")
            with os.fdopen(fd, "rb") as f:
                yield from _chunks(stored.relative, f)

    # -- helpers -----------------------------------------------------------------------------------------

    def _wait(self, future: futures.Future[CaptureRecord], context: grpc.ServicerContext) -> CaptureRecord:
        """The capture's record; the call ends early (the capture goes on, and is stored if it succeeds)
        when its deadline passes, the client goes away or the server stops."""
        remaining = context.time_remaining()
        wait = DEFAULT_CAPTURE_WAIT_S if remaining is None else max(0.0, remaining - 0.2)
        deadline = time.monotonic() + wait
        while True:
            try:
                return future.result(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
            except futures.TimeoutError:
                pass
            if self._stopping.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "the agent is stopping; the capture in progress "
                                                           "may still be stored")
            if not context.is_active():
                context.abort(grpc.StatusCode.CANCELLED, "the client went away")
            if time.monotonic() >= deadline:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "the capture did not finish before the call's deadline; it may still be "
                              "stored: see `gpuscope captures ls`")

    def _capture_request(self, request: agent_pb2.CaptureRequest) -> CaptureRequest:
        """The service's request for an API request; ValueError names what makes it invalid."""
        selector = request.WhichOneof("selector")
        if selector is None:
            raise ValueError("name what to capture: gpu, pid or target")
        gpu = pid = target = None
        if selector == "gpu":
            if not 0 <= request.gpu <= MAX_GPU_INDEX:
                raise ValueError(f"gpu must be a GPU index (0 to {MAX_GPU_INDEX}), got {request.gpu}")
            gpu = request.gpu
        elif selector == "pid":
            if request.pid <= 0:
                raise ValueError(f"pid must be a process id (1 or more), got {request.pid}")
            pid = request.pid
        else:
            parse_target(request.target)  # AddressError (a ValueError): host:port, nothing else
            target = request.target.strip()
        duration = request.duration_ms / 1000 if request.duration_ms else None  # 0: the agent's default
        if duration is not None and duration > MAX_DURATION_SECONDS:
            raise ValueError(f"duration {format_duration(duration)} is longer than the maximum capture "
                             f"of {format_duration(MAX_DURATION_SECONDS)}")
        if request.HasField("reason") and len(request.reason) > MAX_REASON_CHARS:
            raise ValueError(f"reason is longer than {MAX_REASON_CHARS} characters")
        start_at = None
        if request.HasField("start_at"):
            start_at = request.start_at
            if not math.isfinite(start_at):
                raise ValueError("start_at must be a finite Unix time")
            ahead = start_at - self._wall_clock()
            if ahead > MAX_START_DELAY_S:
                raise ValueError(f"start_at is {format_duration(round(ahead, 1))} ahead; at most "
                                 f"{format_duration(MAX_START_DELAY_S)} (are the nodes' clocks in sync?)")
        trigger = Trigger("fleet" if start_at is not None else "user", user=self._user)
        return CaptureRequest(trigger, gpu=gpu, pid=pid, target=target, duration_s=duration,
                              start_at=start_at)

    def _unserved(self, request: CaptureRequest, reason: str) -> CaptureRecord:
        now = self._wall_clock()
        return CaptureRecord(
            id=new_capture_id(now, gpu=request.gpu, pid=request.pid, token=secrets.token_hex(3)),
            trigger=request.trigger, gpu=request.gpu, pids=() if request.pid is None else (request.pid,),
            targets=(), start=now, duration_s=request.duration_s or 0.0, bytes=0, outcome="refused",
            error=reason, hostname=self._hostname)

    def _require_store(self, context: grpc.ServicerContext) -> CaptureStore:
        if self._store is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "captures are disabled on this agent (no capture store)")
        return self._store


def _missing_gpu(gpu: int | None, snapshot: Snapshot | None,
                 hostname: str) -> tuple[grpc.StatusCode, str] | None:
    """Why GPU ``gpu`` cannot be captured on this node, as (status, message): the node has no such GPU
    (INVALID_ARGUMENT, naming the GPUs it has), or NVML is down so it knows none (FAILED_PRECONDITION).
    None when the GPU exists, when no GPU is named, or before the first sampling tick."""
    if gpu is None or snapshot is None:
        return None
    if not snapshot.nvml_up:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"GPU {gpu}: NVML is not available on {hostname}, so the agent knows no GPU to capture; "
                "capture a process (pid) or a profiler (target) instead")
    indexes = sorted(g.index for g in snapshot.gpus)
    if gpu in indexes:
        return None
    has = f"its GPUs are {', '.join(map(str, indexes))}" if indexes else "it has no GPUs"
    return grpc.StatusCode.INVALID_ARGUMENT, f"GPU {gpu} does not exist on {hostname}: {has}"


def _record_message(record: CaptureRecord) -> agent_pb2.CaptureRecord:
    return agent_pb2.CaptureRecord(id=record.id, outcome=f"OUTCOME_{record.outcome.upper()}",
                                   record_json=json.dumps(record.to_json(), allow_nan=False))


def _chunks(relative: str, f: Any) -> Iterator[agent_pb2.FileChunk]:
    """The chunks of one open file, in order; the last has last=True (an empty file: one empty chunk)."""
    offset = 0
    data: bytes = f.read(CHUNK_BYTES)
    while True:
        following: bytes = f.read(CHUNK_BYTES) if len(data) == CHUNK_BYTES else b""
        yield agent_pb2.FileChunk(path=relative, offset=offset, data=data, last=not following)
        if not following:
            return
        offset += len(data)
        data = following


# -- the server -------------------------------------------------------------------------------------------


class ControlServer:
    """The control API's listeners. ``start`` raises ControlServerError (the caller decides whether the
    agent goes on without the API); ``stop`` is safe to call at any time, twice included."""

    def __init__(self, config: ControlConfig, *, service: CaptureService | None, store: CaptureStore | None,
                 snapshots: SnapshotSource, alerts: AlertSource | None,
                 hostname: str | None = None, wall_clock: Callable[[], float] = time.time,
                 simulated: str | None = None) -> None:
        self._config = config
        self._stopping = threading.Event()
        hostname = hostname or socket.gethostname()
        # Who this agent is, for clients to say which agent they talk to (``simulated``: the scenario).
        info = agent_pb2.AgentInfo(node_name=hostname, pid=os.getpid(), version=__version__,
                                   simulated_scenario=simulated or "", control_socket=str(config.socket),
                                   capture_store=str(store.root) if store is not None else "")
        common: dict[str, Any] = dict(service=service, store=store, snapshots=snapshots, alerts=alerts,
                                      hostname=hostname, wall_clock=wall_clock,
                                      waiting=threading.BoundedSemaphore(MAX_WAITING_CAPTURES),
                                      stopping=self._stopping, info=info)
        self._unix_servicer = _Servicer(user="unix", **common)
        self._tcp_servicer = _Servicer(user="token", **common)
        self._servers: list[grpc.Server] = []
        self._socket_inode: tuple[int, int] | None = None
        self.tcp_port: int | None = None  # the bound TCP port (listen_address may say 0), once started

    @property
    def socket_path(self) -> Path:
        return self._config.socket

    def start(self, *, replacing: tuple[int, int] | None = None) -> None:
        """``replacing``: the identity (device, inode) of a socket at the path that this server's
        takes over in one rename (the on-demand listener's, see on_demand.py); else the path must be
        free or stale."""
        if self._servers:
            return
        self._stopping.clear()
        try:
            self._start_unix(replacing)
            if self._config.tcp.enabled:
                self._start_tcp(self._config.tcp)
        except BaseException:
            self.stop(grace=0)
            raise
        where = [f"unix:{self._config.socket}"] + ([] if self.tcp_port is None else [
            f"{self._config.tcp.listen_address} (TLS, bearer token)"])
        log.info("control API (gpuscope.v1.Agent) listening on %s", ", ".join(where))

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop listening; calls in progress get ``grace`` seconds (a waiting Capture call ends at once,
        UNAVAILABLE: its capture goes on in the capture service)."""
        self._stopping.set()
        servers, self._servers = self._servers, []
        for server in servers:
            server.stop(grace).wait()
        self._remove_socket()
        self.tcp_port = None

    # -- Unix socket ---------------------------------------------------------------------------------------

    def _start_unix(self, replacing: tuple[int, int] | None) -> None:
        path = self._config.socket
        if replacing is None:
            prepare_socket_dir(path)
        server = _grpc_server(self._unix_servicer, interceptors=[])
        try:
            identity = place_socket(
                path, self._config.socket_mode,
                lambda where: _bind(server, f"unix:{where}", what=f"the control socket {path}"),
                replacing=replacing)
        except ControlServerError:
            server.stop(0)
            raise
        self._socket_inode = identity
        server.start()
        self._servers.append(server)

    def _remove_socket(self) -> None:
        """Unlink the socket if it is still the one this server made (never another agent's)."""
        ours, self._socket_inode = self._socket_inode, None
        if same_file(self._config.socket, ours):
            with contextlib.suppress(OSError):
                os.unlink(self._config.socket)

    # -- TCP -----------------------------------------------------------------------------------------------

    def _start_tcp(self, tcp: TcpConfig) -> None:
        assert tcp.listen_address and tcp.tls_cert_file and tcp.tls_key_file and tcp.token_file
        try:
            token = read_token(tcp.token_file, what="control API token file", agent_side=True)
        except ControlError as err:
            raise ControlServerError(str(err)) from None
        cert = _read_pem(tcp.tls_cert_file, "TLS certificate")
        key = _read_pem(tcp.tls_key_file, "TLS private key")
        client_ca = None if tcp.client_ca_file is None else _read_pem(tcp.client_ca_file, "client CA")
        try:
            credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                                      require_client_auth=client_ca is not None)
        except Exception as err:  # grpc raises plain errors for unusable PEM
            raise ControlServerError(f"cannot use the control API's TLS files: {err}") from err
        address = parse_host_port(tcp.listen_address, listen=True)
        server = _grpc_server(self._tcp_servicer, interceptors=[BearerTokenInterceptor(token)])
        # ":port" listens on every interface: "[::]" is dual-stack for gRPC.
        self.tcp_port = _bind(server, format_host_port(address.host or "::", address.port),
                              what=f"control.tcp.listen_address {tcp.listen_address}",
                              credentials=credentials)
        server.start()
        self._servers.append(server)


def _grpc_server(servicer: _Servicer, *, interceptors: list[grpc.ServerInterceptor]) -> grpc.Server:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="gpuscope-control"),
        interceptors=interceptors, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                 ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
                 ("grpc.so_reuseport", 0)])  # never share a port with another process
    agent_pb2_grpc.add_AgentServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    return server


def _bind(server: grpc.Server, address: str, *, what: str,
          credentials: grpc.ServerCredentials | None = None) -> int:
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as err:  # "Failed to bind to address ..."
        raise ControlServerError(f"cannot listen on {what}: {str(err).split(';')[0]}") from err
    if not port:
        raise ControlServerError(f"cannot listen on {what}")
    return int(port)


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = read_bounded(path, MAX_PEM_BYTES, follow_symlinks=True)  # e.g. a Kubernetes Secret
    except OSError as err:
        raise ControlServerError(f"cannot read the control API's {what} {path}: "
                                 f"{err.strerror or err}") from err
    if b"-----BEGIN " not in data:
        raise ControlServerError(f"the control API's {what} {path} is not PEM")
    return data
