"""The Kineto on-demand wire protocol: datagrams between PyTorch processes and the node's daemon.

Measured against PyTorch 2.13 (CPU wheel):

* Request: header ``{size_t size; char type[32] = "req"}`` (40 bytes), body ``{int32 type; int32 n;
  int64 jobid; int32 pids[n]}``. ``type`` is a bit set (1 events, 2 activities): 3 normally, 1 while
  the process's activity profiler is busy (a trace running, or the script profiling itself with
  ``torch.profiler``): then a trace config would be ignored. ``pids`` is the process then its
  ancestors, as the process sees them (its PID namespace); ``jobid`` is ``SLURM_JOB_ID``.
* Reply, on the client's socket: the same header (type ``"req"``) and a config text; empty means
  nothing to do.
* GPU builds also send ``"ctxt"`` messages (``{int32 gpu; int32 pid; int64 jobid}``) when a CUDA
  context is made, and wait for an ``int32`` reply (the number of processes on that GPU).

Everything here is pure: bytes in, values out. Parsers raise ``MalformedDatagram`` naming what is
wrong, which the daemon counts and ignores. The client's side (``encode_request``, ``parse_config``,
the addresses) serves the simulator's processes, which poll the daemon as PyTorch does.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SOCKET_NAME = "dynolog"
CLIENT_PREFIX = "dynoconfigclient"
HEADER = struct.Struct("=Q32s")  # size_t size; char type[32]
REQUEST = struct.Struct("=iiq")  # int32 type; int32 n; int64 jobid; then int32 pids[n]
CONTEXT = struct.Struct("=iiq")  # int32 gpu; int32 pid; int64 jobid
UCRED = struct.Struct("=iII")  # struct ucred {pid_t pid; uid_t uid; gid_t gid}
TYPE_REQUEST = b"req"
TYPE_CONTEXT = b"ctxt"
CONFIG_EVENTS = 1
CONFIG_ACTIVITIES = 2
MAX_PIDS = 1024  # a process and its ancestors: a handful in practice
MAX_DATAGRAM = HEADER.size + REQUEST.size + 4 * MAX_PIDS
MAX_GPUS = 1024
DEFAULT_POLL_PERIOD_S = 5.0
TRACE_NAME = "trace.json"  # the process writes trace_<its pid>.json next to it

Credentials = tuple[int, int, int]  # (pid, uid, gid) of the sender, from the kernel


class MalformedDatagram(ValueError):
    """A datagram that is not a well-formed Kineto message; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ConfigRequest:
    """A process's poll: it and its ancestors' pids (its own namespace), its job id, and whether its
    activity profiler can take a trace now."""

    config_type: int
    job_id: int
    pids: tuple[int, ...]

    @property
    def profiler_busy(self) -> bool:
        """It asked without the activities bit: a trace config would be ignored now."""
        return not self.config_type & CONFIG_ACTIVITIES


@dataclass(frozen=True, slots=True)
class ContextMessage:
    """A process made a CUDA context on ``gpu``."""

    gpu: int
    pid: int
    job_id: int


def split_message(data: bytes, flags: int) -> tuple[bytes, bytes]:
    """(message type, body) of one received datagram."""
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) < HEADER.size:
        raise MalformedDatagram("truncated or short datagram")
    size, raw_type = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    if size != len(body):
        raise MalformedDatagram(f"header size {size} != body length {len(body)}")
    return raw_type.split(b"\0", 1)[0], body


def parse_request(body: bytes) -> ConfigRequest:
    if len(body) < REQUEST.size:
        raise MalformedDatagram("request body too short")
    config_type, n, job_id = REQUEST.unpack_from(body)
    if not 0 < n <= MAX_PIDS or len(body) != REQUEST.size + 4 * n:
        raise MalformedDatagram(f"request with {n} pids in {len(body)} bytes")
    pids = struct.unpack_from(f"={n}i", body, REQUEST.size)
    if any(p <= 0 for p in pids):
        raise MalformedDatagram("request with a non-positive pid")
    return ConfigRequest(config_type, job_id, pids)


def parse_context(body: bytes) -> ContextMessage:
    if len(body) != CONTEXT.size:
        raise MalformedDatagram("context body of the wrong size")
    gpu, pid, job_id = CONTEXT.unpack_from(body)
    if pid <= 0 or not 0 <= gpu < MAX_GPUS:
        raise MalformedDatagram("context with an invalid pid or GPU")
    return ContextMessage(gpu, pid, job_id)


def encode_message(kind: bytes, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def encode_context_reply(processes_on_gpu: int) -> bytes:
    return encode_message(TYPE_CONTEXT, struct.pack("=i", processes_on_gpu))


def sender_credentials(ancdata: list[tuple[int, int, bytes]]) -> Credentials | None:
    """The kernel's (pid, uid, gid) of the sender (SCM_CREDENTIALS, with SO_PASSCRED set)."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= UCRED.size:
            pid, uid, gid = UCRED.unpack_from(data)
            return pid, uid, gid
    return None


def trace_config(log_file: Path, duration_ms: int, warmup_s: int) -> bytes:
    """The config text that makes a process record ``duration_ms`` and write ``log_file``'s
    ``trace_<pid>.json`` (``PROFILE_START_TIME=0``: at once, after ``warmup_s``)."""
    return (f"ACTIVITIES_LOG_FILE={log_file}\n"
            f"ACTIVITIES_DURATION_MSECS={max(1, int(duration_ms))}\n"
            f"ACTIVITIES_WARMUP_PERIOD_SECS={max(0, int(warmup_s))}\n"
            "PROFILE_START_TIME=0\n").encode()


def daemon_address(socket_dir: Path | None, socket_name: str = DEFAULT_SOCKET_NAME) -> str:
    """Where a daemon listens, as the agent writes it: ``@dynolog`` (the abstract socket) or the path of
    the socket file ``<socket_dir>/dynolog``."""
    return f"@{socket_name}" if socket_dir is None else str(socket_dir / socket_name)


def socket_address(address: str) -> str:
    """``address`` (as ``daemon_address`` writes it) for connect() and sendto(): an abstract name is
    ``"\\0<name>\\0"``, its trailing NUL part of the name, as Kineto spells it."""
    return f"\0{address[1:]}\0" if address.startswith("@") else address


def client_address(daemon: str, unique: str) -> str:
    """A client socket's address next to the daemon's ``daemon`` address, named as PyTorch names its
    own (``dynoconfigclient<unique>``): abstract for an abstract daemon, else a file in its directory."""
    if daemon.startswith("@"):
        return f"\0{CLIENT_PREFIX}{unique}"
    return str(Path(daemon).parent / f"{CLIENT_PREFIX}{unique}")


def encode_request(pids: tuple[int, ...], *, job_id: int = 0, profiler_busy: bool = False) -> bytes:
    """A poll: the process then its ancestors, its job id; without the activities bit while its
    profiler is busy (a trace config would be ignored)."""
    if not 0 < len(pids) <= MAX_PIDS or any(p <= 0 for p in pids):
        raise ValueError(f"a request names 1 to {MAX_PIDS} positive pids, got {pids!r}")
    config_type = CONFIG_EVENTS if profiler_busy else CONFIG_EVENTS | CONFIG_ACTIVITIES
    body = REQUEST.pack(config_type, len(pids), job_id) + struct.pack(f"={len(pids)}i", *pids)
    return encode_message(TYPE_REQUEST, body)


def parse_config(text: bytes) -> dict[str, str]:
    """The ``KEY=VALUE`` lines of a config text (a reply's body; empty: nothing to do)."""
    try:
        lines = text.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise MalformedDatagram(f"a config that is not UTF-8: {err}") from None
    config: dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise MalformedDatagram(f"a config line that is not KEY=VALUE: {line[:80]!r}")
        config[key.strip()] = value.strip()
    return config
