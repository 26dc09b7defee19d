"""A client of the control API (gpuscope.v1.Agent): the `gpuscope capture` and `gpuscope captures` commands.

An address is a Unix socket path ("unix:PATH" too) or ``host:port`` of an agent serving TCP, which is
always TLS with a bearer token. Without one, the client looks where an agent started by the same user
listens (``/run/gpuscope/control.sock`` for root; ``$XDG_RUNTIME_DIR/gpuscope/control.sock`` or
``/tmp/gpuscope-<uid>/control.sock`` for anyone else), then at the node's agent's socket. Every failure
is a ControlError with a one-line message; ``usage`` marks those caused by the request itself.
``agent_info`` says which agent answered (its node name, pid, scenario), for the commands to show.

``get_capture`` writes the files of a capture under a directory the user names, and trusts nothing the
server sends: every path must be a plain relative path (no absolute path, no ``..``, no odd
characters), directories are opened without following symlinks, files are created exclusively (an
existing file is never overwritten, and a symlink in the way is refused), chunks must come in order.
On any failure the files and directories this download created are removed again, so the directory is
left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from gpuscope.capture.records import CaptureIdError, CaptureRecordError, check_capture_id, check_relative_path
from gpuscope.common.addresses import AddressError, parse_host_port
from gpuscope.common.user_paths import check_fallback_runtime_dir
from gpuscope.control.auth import read_token
from gpuscope.control.config import client_socket_candidates
from gpuscope.control.errors import ControlError
from gpuscope.generated.agent.v1 import agent_pb2, agent_pb2_grpc

DEFAULT_TIMEOUT_S = 10.0  # calls other than Capture and GetCapture
PEER_INFO_TIMEOUT_S = 1.0  # asking another agent who it is, while this one starts
# A Capture call may take its duration (and start delay) plus this: a PyTorch job writes its trace
# after recording, which the agent waits for up to capture.kineto.write_timeout (5 minutes by default).
CAPTURE_OVERHEAD_S = 360.0
DOWNLOAD_TIMEOUT_S = 600.0
MAX_RESPONSE_BYTES = 8 * 2**20
MAX_PATH_CHARS = 1024
MAX_PATH_DEPTH = 17  # the store allows 16 directory levels inside a capture
MAX_NAME_BYTES = 255
MAX_FILES = 10_000


def is_socket_address(address: str | Path) -> bool:
    """A Unix socket (a path, or "unix:PATH") rather than host:port."""
    if isinstance(address, Path):
        return True
    return address.startswith(("/", "./", "../", "unix:", "~"))


@dataclass(frozen=True, slots=True)
class CaptureListing:
    """ListCaptures' answer. ``refused_count``: triggers the agent refused since it started (None: an
    older agent, which keeps no refusals); ``refused``: those it keeps, newest first, when asked for;
    ``enabled``: the agent takes captures; ``document``: the whole listing, as GET /api/v1/captures
    answers it (None from an agent older than that field)."""

    captures: list[dict[str, Any]]
    refused_count: int | None
    refused: list[dict[str, Any]]
    enabled: bool = True
    document: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """Which agent answers: its node name, process id, version, and the scenario it simulates."""

    node_name: str
    pid: int
    version: str
    simulated_scenario: str | None
    control_socket: str
    capture_store: str | None

    def describe(self, where: str) -> str:
        """One line for a person: ``agent NODE (simulating SCENARIO, pid N) at WHERE``."""
        details = ([f"simulating {self.simulated_scenario}"] if self.simulated_scenario else []) + [
            f"pid {self.pid}"]
        return f"agent {self.node_name} ({', '.join(details)}) at {where}"


def default_socket(candidates: list[Path] | None = None) -> Path:
    """The socket a client of this user talks to when none is named: the first of ``candidates``
    (by default ``client_socket_candidates()``) that exists, else the first, for the error to name."""
    candidates = candidates or client_socket_candidates()
    for candidate in candidates:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.stat(candidate).st_mode):
                return candidate
    return candidates[0]


def describe_agent_at(path: Path, pid: int | None) -> str:
    """Who serves the control socket ``path``, as far as it says within a second: ``pid N, node
    NAME, simulating SCENARIO`` (what is known of it); for a message naming the other agent."""
    parts = [f"pid {pid}"] if pid else []
    try:
        with ControlClient(path, timeout=PEER_INFO_TIMEOUT_S) as client:
            info = client.agent_info()
    except ControlError:
        info = None
    if info is not None:
        parts = [f"pid {info.pid}", f"node {info.node_name}"] + (
            [f"simulating {info.simulated_scenario}"] if info.simulated_scenario else [])
    return ", ".join(parts) or "it did not say who it is"


class ControlClient:
    """One agent's control API. Use as a context manager, or call ``close``. ``address`` None: the
    local agent this user would talk to (``default_socket``)."""

    def __init__(self, address: str | Path | None = None, *, tls_ca: Path | None = None,
                 token_file: Path | None = None, token: str | None = None, tls_cert: Path | None = None,
                 tls_key: Path | None = None, tls_server_name: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._timeout = timeout
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
        self._looked_at: list[Path] = []
        if address is None:
            self._looked_at = client_socket_candidates()
            address = default_socket(self._looked_at)
        if is_socket_address(address):
            text = str(address)
            path = Path(text.removeprefix("unix:")).expanduser().absolute()
            self.where = str(path)
            _check_socket(path, self._looked_at)
            self._channel = grpc.insecure_channel(f"unix:{path}", options=options)
        else:
            try:
                peer = parse_host_port(str(address))
            except AddressError as err:
                raise ControlError(f"agent address: {err}", usage=True) from None
            self.where = str(address)
            if token is None:
                if token_file is None:
                    raise ControlError(f"the agent at {address} is reached over TCP, which needs a bearer "
                                       "token: pass --token-file", usage=True)
                token = read_token(token_file)
            if (tls_cert is None) != (tls_key is None):
                raise ControlError("a client certificate needs both --tls-cert and --tls-key", usage=True)
            credentials = grpc.composite_channel_credentials(
                grpc.ssl_channel_credentials(
                    root_certificates=None if tls_ca is None else _read_file(tls_ca, "TLS CA bundle"),
                    private_key=None if tls_key is None else _read_file(tls_key, "TLS client key"),
                    certificate_chain=None if tls_cert is None
                    else _read_file(tls_cert, "TLS client certificate")),
                grpc.access_token_call_credentials(token))  # "authorization: Bearer <token>", TLS only
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(str(peer), credentials, options=options)
        self._stub = agent_pb2_grpc.AgentStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the methods ---------------------------------------------------------------------------------------

    def get_snapshot(self) -> dict[str, Any]:
        response = self._call(self._stub.GetSnapshot, agent_pb2.GetSnapshotRequest())
        return _json(response.snapshot_json, "snapshot")

    def agent_info(self) -> AgentInfo | None:
        """Which agent answers; None for an agent older than this question (UNIMPLEMENTED)."""
        try:
            response = self._stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest(), timeout=self._timeout)
        except grpc.RpcError as err:
            if hasattr(err, "code") and err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise self._error(err) from None
        return AgentInfo(node_name=response.node_name or "(unnamed node)", pid=response.pid,
                         version=response.version, simulated_scenario=response.simulated_scenario or None,
                         control_socket=response.control_socket, capture_store=response.capture_store or None)

    def list_alerts(self) -> dict[str, Any]:
        response = self._call(self._stub.ListAlerts, agent_pb2.ListAlertsRequest())
        return _json(response.alerts_json, "alerts")

    def capture(self, *, gpu: int | None = None, pid: int | None = None, target: str | None = None,
                duration_s: float | None = None, start_at: float | None = None, reason: str | None = None,
                timeout: float | None = None) -> dict[str, Any]:
        """Ask for a capture and wait for its record (as JSON: id, outcome, gpu, pids, target, files...)."""
        chosen = [name for name, value in (("gpu", gpu), ("pid", pid), ("target", target))
                  if value is not None]
        if len(chosen) != 1:
            raise ControlError("name exactly one of gpu, pid or target", usage=True)
        request = agent_pb2.CaptureRequest()
        if gpu is not None:
            request.gpu = gpu
        elif pid is not None:
            request.pid = pid
        else:
            request.target = str(target)
        if duration_s is not None:
            if duration_s <= 0:
                raise ControlError("the capture duration must be positive", usage=True)
            request.duration_ms = max(1, round(duration_s * 1000))
        if start_at is not None:
            request.start_at = start_at
        if reason is not None:
            request.reason = reason
        if timeout is None:
            ahead = 0.0 if start_at is None else max(0.0, start_at - time.time())
            timeout = ahead + (duration_s or 30.0) + CAPTURE_OVERHEAD_S
        response = self._call(self._stub.Capture, request, timeout=timeout)
        return _json(response.record_json.encode(), "capture record")

    def list_captures(self, limit: int = 0) -> list[dict[str, Any]]:
        return self.capture_listing(limit).captures

    def capture_listing(self, limit: int = 0, *, include_refused: bool = False) -> CaptureListing:
        """The stored captures and, with ``include_refused``, the refused triggers the agent keeps."""
        response = self._call(self._stub.ListCaptures,
                              agent_pb2.ListCapturesRequest(limit=limit, include_refused=include_refused))
        captures = [_json(c.record_json.encode(), "capture record") for c in response.captures]
        refused: list[dict[str, Any]] = []
        if include_refused and response.refused_json:
            try:
                listed = json.loads(response.refused_json.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as err:
                raise ControlError(f"the agent sent a list of refused triggers that is not JSON: "
                                   f"{err}") from None
            if not isinstance(listed, list) or not all(isinstance(r, dict) for r in listed):
                raise ControlError("the agent sent a list of refused triggers that is not a JSON array of "
                                   "objects")
            refused = listed
        count = response.refused_count if response.HasField("refused_count") else None
        document = _json(response.listing_json, "capture listing") if response.listing_json else None
        enabled = True if document is None else document.get("enabled") is True
        return CaptureListing(captures, count, refused, enabled=enabled, document=document)

    def get_capture(self, capture_id: str, out_dir: Path, *,
                    timeout: float = DOWNLOAD_TIMEOUT_S) -> list[str]:
        """Download a capture's files under ``out_dir`` (created if missing); their relative paths."""
        try:
            check_capture_id(capture_id)
        except CaptureIdError as err:
            raise ControlError(str(err), usage=True) from None
        try:
            stream = self._stub.GetCapture(agent_pb2.GetCaptureRequest(id=capture_id), timeout=timeout)
            return write_chunks(stream, out_dir)
        except grpc.RpcError as err:
            raise self._error(err) from None

    # -- plumbing ------------------------------------------------------------------------------------------

    def _call(self, method: Any, request: Any, *, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=self._timeout if timeout is None else timeout)
        except grpc.RpcError as err:
            raise self._error(err) from None

    def _error(self, err: grpc.RpcError) -> ControlError:
        code: grpc.StatusCode | None = err.code() if hasattr(err, "code") else None
        details = (err.details() if hasattr(err, "details") else None) or str(err)
        details = " ".join(str(details).split())
        where = self.where
        if code == grpc.StatusCode.UNAVAILABLE:
            message = f"cannot reach the gpuscope agent at {where}: {details}"
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            message = f"the agent at {where} refused the credentials: {details}"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            message = f"no answer from the agent at {where} in time ({details})"
        elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED):
            message = f"{where}: {details}"
        else:
            message = f"{where}: {code.name if code else 'error'}: {details}"
        return ControlError(message, code=code, usage=code == grpc.StatusCode.INVALID_ARGUMENT)


def _check_socket(path: Path, looked_at: list[Path]) -> None:
    """A socket of this user's agent, or one it may use; ``looked_at``: the default sockets tried."""
    try:
        # An agent's socket under /tmp counts only in a directory of this user's own: anyone could
        # have made that directory and serve a socket of their own in it.
        check_fallback_runtime_dir(path.parent, create=False)
    except OSError as err:
        raise ControlError(f"not talking to the control socket {path}: {err.strerror or err}") from None
    try:
        info = os.stat(path)
    except FileNotFoundError:
        where = " or ".join(map(str, looked_at)) if len(looked_at) > 1 else str(path)
        raise ControlError(f"no gpuscope agent control socket at {where}: is the agent running "
                           "(gpuscope run)? Name another socket with --socket") from None
    except OSError as err:
        raise ControlError(f"cannot use the control socket {path}: {err.strerror or err}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise ControlError(f"{path} is not a socket (is it the agent's control.socket?)", usage=True)
    if not os.access(path, os.W_OK):
        raise ControlError(f"permission denied on the control socket {path}: run as root or as a member of "
                           "its group")


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ControlError(f"cannot read the {what} {path}: {err.strerror or err}", usage=True) from None


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ControlError(f"the agent sent a {what} that is not JSON: {err}") from None
    if not isinstance(document, dict):
        raise ControlError(f"the agent sent a {what} that is not a JSON object")
    return document


# -- writing a capture's files ---------------------------------------------------------------------------


def safe_relative_path(value: str) -> tuple[str, ...]:
    """The parts of a file path sent by a server, if it is a plain relative path; ControlError if it
    could leave the output directory (absolute, '..', '.', empty parts, backslashes, NUL, control
    characters) or is unreasonably long or deep."""
    if len(value) > MAX_PATH_CHARS:
        raise ControlError(f"the agent sent a file path of {len(value)} characters; refusing it")
    try:
        check_relative_path(value)
    except CaptureRecordError as err:
        raise ControlError(f"the agent sent an unsafe file path: {err}; refusing it") from None
    parts = tuple(value.split("/"))
    if len(parts) > MAX_PATH_DEPTH or any(len(p.encode()) > MAX_NAME_BYTES for p in parts):
        raise ControlError(f"the agent sent a file path {value!r} too deep or with too long a name; "
                           "refusing it")
    return parts


@dataclass
class _Open:
    relative: str
    fd: int
    offset: int


class _Writer:
    """Creates files and directories under one root, never following a link, never overwriting, and
    remembers what it created so that ``undo`` can remove exactly that."""

    def __init__(self, out_dir: Path) -> None:
        self._out = out_dir
        # The output directory and the parents it lacks: made here, and removed again by ``undo``.
        self._made_out = [p for p in (out_dir, *out_dir.parents) if not os.path.lexists(p)]
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._root = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise ControlError(f"cannot use the output directory {out_dir}: {err.strerror or err}",
                               usage=True) from None
        self._dirs: dict[tuple[str, ...], int] = {(): self._root}
        self._created_dirs: list[tuple[tuple[str, ...], str]] = []
        self._created_files: list[tuple[tuple[str, ...], str]] = []

    def create(self, parts: tuple[str, ...]) -> int:
        parent = self._directory(parts[:-1])
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(parts[-1], flags, 0o640, dir_fd=parent)
        except FileExistsError:
            raise ControlError(f"{self._out / '/'.join(parts)} already exists; refusing to overwrite it "
                               "(choose an empty directory with -o)") from None
        except OSError as err:
            raise ControlError(f"cannot create {self._out / '/'.join(parts)}: "
                               f"{err.strerror or err}") from None
        self._created_files.append((parts[:-1], parts[-1]))
        return fd

    def _directory(self, parts: tuple[str, ...]) -> int:
        fd = self._dirs.get(parts)
        if fd is not None:
            return fd
        parent = self._directory(parts[:-1])
        name = parts[-1]
        try:
            os.mkdir(name, 0o750, dir_fd=parent)
            self._created_dirs.append((parts[:-1], name))
        except FileExistsError:
            pass
        except OSError as err:
            raise ControlError(f"cannot create {self._out / '/'.join(parts)}: "
                               f"{err.strerror or err}") from None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ControlError(f"{self._out / '/'.join(parts)} is a symlink or not a directory; refusing "
                                   "to write through it") from None
            raise ControlError(f"cannot open {self._out / '/'.join(parts)}: {err.strerror or err}") from None
        self._dirs[parts] = fd
        return fd

    def undo(self) -> None:
        """Remove what this writer created (files, then directories deepest first), nothing else."""
        for parent, name in reversed(self._created_files):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._dirs[parent])
        for parent, name in reversed(self._created_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=self._dirs[parent])
        for made in self._made_out:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(made)
        self._created_files.clear()
        self._created_dirs.clear()
        self._made_out.clear()

    def close(self) -> None:
        for fd in self._dirs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._dirs.clear()


def write_chunks(chunks: Iterable[agent_pb2.FileChunk], out_dir: Path) -> list[str]:
    """Write a GetCapture stream under ``out_dir``; the relative paths written, in order. On any error
    (an unsafe path, an existing file, chunks out of order, a broken stream) everything this call
    created is removed and the error raised (ControlError, or the stream's own). Nothing is created
    before the stream's first answer: an id the agent does not have leaves ``out_dir`` untouched."""
    stream = iter(chunks)
    first = next(stream, None)  # the agent's NOT_FOUND (or any refusal) is raised here
    chunks = stream if first is None else itertools.chain((first,), stream)
    writer = _Writer(out_dir)
    current: _Open | None = None
    written: list[str] = []
    done: set[str] = set()
    try:
        for chunk in chunks:
            if current is None or current.relative != chunk.path:
                if current is not None:
                    raise ControlError(f"the agent sent {chunk.path!r} before the end of "
                                       f"{current.relative!r}")
                if chunk.path in done:
                    raise ControlError(f"the agent sent {chunk.path!r} twice")
                if len(done) >= MAX_FILES:
                    raise ControlError(f"the agent sent more than {MAX_FILES} files")
                current = _Open(chunk.path, writer.create(safe_relative_path(chunk.path)), 0)
            if chunk.offset != current.offset:
                raise ControlError(f"the agent sent {current.relative!r} out of order (offset "
                                   f"{chunk.offset}, expected {current.offset})")
            view = memoryview(chunk.data)
            try:
                while view:
                    view = view[os.write(current.fd, view):]
            except OSError as err:
                raise ControlError(f"cannot write {out_dir / current.relative}: "
                                   f"{err.strerror or err}") from None
            current.offset += len(chunk.data)
            if chunk.last:
                os.close(current.fd)
                done.add(current.relative)
                written.append(current.relative)
                current = None
        if current is not None:
            raise ControlError(f"the download ended in the middle of {current.relative!r}")
    except BaseException:
        if current is not None:
            with contextlib.suppress(OSError):
                os.close(current.fd)
        writer.undo()
        raise
    finally:
        writer.close()
    return written
