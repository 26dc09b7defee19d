"""The control API's gRPC servers: gpuscope.v1.Agent over a Unix socket, and over TCP with TLS and a
bearer token, answering from ``methods`` (``gpuscope.control.methods``): the agent's own, or a bridge to
them from the API's server process (``gpuscope.control.server_process``).

Two gRPC servers share one set of methods: the Unix socket one (always, when the API is enabled) trusts
the socket's file permissions (``control.socket_mode``, 0660 by default: the agent's user and group); the
TCP one (only when ``control.tcp`` is configured) requires TLS and ``Authorization: Bearer <token>`` on
every call, compared in constant time, and answers UNAUTHENTICATED before any method runs otherwise.

Requests are small: a server refuses any message over ``MAX_REQUEST_BYTES`` (gRPC answers
RESOURCE_EXHAUSTED before the method sees it).

The socket is bound inside a private (0700) directory next to it, chmod'ed, then linked into place, so no
client can connect while it still has the process umask's permissions; a stale socket (nobody answers)
is replaced, a live one or anything that is not a socket is refused: two agents never share a socket,
and the error names the agent that serves it (its pid, and its node name as GetAgentInfo gives it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpuscope.alerts.model import AlertSource
from gpuscope.capture.service import CaptureService
from gpuscope.capture.store import CaptureStore
from gpuscope.common.addresses import format_host_port, parse_host_port
from gpuscope.common.unixfs import read_bounded, same_file
from gpuscope.control.auth import read_token
from gpuscope.control.config import ControlConfig, TcpConfig
from gpuscope.control.errors import ControlError, ControlServerError
from gpuscope.control.interceptor import BearerTokenInterceptor
from gpuscope.control.methods import ApiError, ApiMethods, agent_methods
from gpuscope.control.socket_dir import place_socket, prepare_socket_dir
from gpuscope.documents import encode_document
from gpuscope.generated.agent.v1 import agent_pb2, agent_pb2_grpc
from gpuscope.snapshot import SnapshotSource

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024  # every request message is tiny; larger ones are refused by gRPC
MAX_RESPONSE_BYTES = 8 * 2**20  # a FileChunk is at most CHUNK_BYTES plus a path
CHUNK_BYTES = 2**20  # GetCapture sends files in pieces of 1 MiB
MAX_WORKERS = 8  # threads per server
MAX_CONCURRENT_RPCS = 16  # calls in progress or queued per server; RESOURCE_EXHAUSTED beyond
MAX_PEM_BYTES = 1 << 20  # a certificate chain, a key or a CA bundle


# -- the methods ----------------------------------------------------------------------------------------


class CallActivity:
    """Calls in progress and when the last one ended, for a server that exits when nobody calls."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_progress = 0
        self._last = clock()

    def begin(self) -> None:
        with self._lock:
            self._in_progress += 1

    def end(self) -> None:
        with self._lock:
            self._in_progress -= 1
            self._last = self._clock()

    def idle_for(self) -> float:
        """Seconds since the last call ended; 0 while one is in progress."""
        with self._lock:
            return 0.0 if self._in_progress else self._clock() - self._last


class _Servicer:
    """gpuscope.v1.Agent over ``methods``, this agent's or a bridge to them. ``user`` ("unix" or
    "token") is recorded as who asked for a capture."""

    def __init__(self, methods: ApiMethods, *, user: str, activity: CallActivity | None = None) -> None:
        self._methods = methods
        self._user = user
        self._activity = activity or CallActivity()

    def GetSnapshot(self, request: agent_pb2.GetSnapshotRequest,
                    context: grpc.ServicerContext) -> agent_pb2.GetSnapshotResponse:
        with self._call(context):
            return agent_pb2.GetSnapshotResponse(snapshot_json=self._methods.snapshot_json())

    def GetAgentInfo(self, request: agent_pb2.GetAgentInfoRequest,
                     context: grpc.ServicerContext) -> agent_pb2.AgentInfo:
        with self._call(context):
            return agent_pb2.AgentInfo(**self._methods.info)

    def ListAlerts(self, request: agent_pb2.ListAlertsRequest,
                   context: grpc.ServicerContext) -> agent_pb2.ListAlertsResponse:
        with self._call(context):
            return agent_pb2.ListAlertsResponse(alerts_json=self._methods.alerts_json())

    def Capture(self, request: agent_pb2.CaptureRequest,
                context: grpc.ServicerContext) -> agent_pb2.CaptureRecord:
        fields: dict[str, Any] = {}
        selector = request.WhichOneof("selector")
        if selector is not None:
            fields[selector] = getattr(request, selector)
        if request.duration_ms:
            fields["duration_ms"] = request.duration_ms
        for optional in ("reason", "start_at"):
            if request.HasField(optional):
                fields[optional] = getattr(request, optional)
        with self._call(context):
            return _record_message(self._methods.capture(fields, user=self._user, context=context))

    def ListCaptures(self, request: agent_pb2.ListCapturesRequest,
                     context: grpc.ServicerContext) -> agent_pb2.ListCapturesResponse:
        """The listing document whole (``listing_json``, as HTTP answers it), and its parts in the
        fields that clients older than ``listing_json`` read."""
        with self._call(context):
            listing = self._methods.list_captures(limit=request.limit,
                                                  include_refused=request.include_refused)
            response = agent_pb2.ListCapturesResponse(
                captures=[_record_message(record) for record in listing["captures"]],
                refused_count=listing["refused_count"], listing_json=encode_document(listing))
            if "refused" in listing:
                response.refused_json = json.dumps(listing["refused"], allow_nan=False).encode()
            return response

    def GetCapture(self, request: agent_pb2.GetCaptureRequest,
                   context: grpc.ServicerContext) -> Iterator[agent_pb2.FileChunk]:
        with self._call(context):
            files = self._methods.capture_files(request.id)
            for relative, path in files:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise ApiError("NOT_FOUND", f"capture {request.id} was removed (evicted?) while it "
                                                "was being sent") from None
                except OSError as err:
                    raise ApiError("INTERNAL", f"cannot read {relative} of capture {request.id}: "
                                               f"{err.strerror or err}") from None
                with os.fdopen(fd, "rb") as f:
                    yield from _chunks(relative, f)

    @contextlib.contextmanager
    def _call(self, context: grpc.ServicerContext) -> Iterator[None]:
        """One call: counted as activity; an ApiError ends it with its status code and message."""
        self._activity.begin()
        try:
            yield
        except ApiError as err:
            context.abort(grpc.StatusCode[err.code], err.message)
        finally:
            self._activity.end()


def _record_message(record: dict[str, Any]) -> agent_pb2.CaptureRecord:
    return agent_pb2.CaptureRecord(id=record["id"], outcome=f"OUTCOME_{record['outcome'].upper()}",
                                   record_json=json.dumps(record, allow_nan=False))


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

    def __init__(self, config: ControlConfig, methods: ApiMethods, *,
                 activity: CallActivity | None = None) -> None:
        self._config = config
        self._methods = methods
        self._unix_servicer = _Servicer(methods, user="unix", activity=activity)
        self._tcp_servicer = _Servicer(methods, user="token", activity=activity)
        self._servers: list[grpc.Server] = []
        self._socket_inode: tuple[int, int] | None = None
        self.tcp_port: int | None = None  # the bound TCP port (listen_address may say 0), once started

    @property
    def socket_identity(self) -> tuple[int, int] | None:
        """The (device, inode) of the Unix socket this server placed, while it serves."""
        return self._socket_inode

    @property
    def socket_path(self) -> Path:
        return self._config.socket

    def start(self, *, replacing: tuple[int, int] | None = None) -> None:
        """``replacing``: the identity (device, inode) of a socket at the path that this server's
        takes over in one rename (the on-demand listener's, see on_demand.py); else the path must be
        free or stale."""
        if self._servers:
            return
        self._methods.stopping.clear()
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
        self._methods.stopping.set()
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


def local_control_server(config: ControlConfig, *, service: CaptureService | None,
                         store: CaptureStore | None, snapshots: SnapshotSource, alerts: AlertSource | None,
                         hostname: str | None = None, wall_clock: Callable[[], float] = time.time,
                         simulated: str | None = None) -> ControlServer:
    """A server of the agent's own methods, in this process (the agent's with ``control.tcp``)."""
    return ControlServer(config, agent_methods(config, service=service, store=store, snapshots=snapshots,
                                               alerts=alerts, hostname=hostname, wall_clock=wall_clock,
                                               simulated=simulated))


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
