"""Ask the agent running on this machine for its latest snapshot, for `gpuscope snapshot`.

First its control socket (``control.socket`` of this command's settings: the control API's
GetSnapshot), then its HTTP endpoint ``GET /api/v1/snapshot`` at ``web.listen_address``, on loopback
only (an agent listening on every interface is asked at 127.0.0.1, or ::1 for ``[::]``; a non-loopback
host is not asked). Both are bounded: a short timeout, and at most MAX_SNAPSHOT_BYTES read. Where an
agent is there but cannot be asked (the socket is not ours to use, the HTTP port wants a password or
TLS, the answer is not a snapshot), ``note`` says so and the next way is tried; nothing listening is
said nothing of. None when no agent answered: the command then samples NVML itself.
"""

from __future__ import annotations

import http.client
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuscope.cli.local_agent import accepts, listening_at
from gpuscope.common.addresses import format_host_port
from gpuscope.common.json_input import JsonInputError, load_json
from gpuscope.config import Settings
from gpuscope.snapshot import Snapshot, SnapshotJsonError
from gpuscope.web.server import SERVER_NAME

TIMEOUT_S = 2.0  # each connection, read or call; a local agent answers at once
NO_SNAPSHOT_YET_WAIT_S = 3.0  # an agent that just started: its first tick is due within a second or so
MAX_SNAPSHOT_BYTES = 8 * 2**20  # as the control client's MAX_RESPONSE_BYTES
SNAPSHOT_PATH = "/api/v1/snapshot"


@dataclass(frozen=True, slots=True)
class AgentSnapshot:
    snapshot: Snapshot
    document: dict[str, Any]  # the JSON as the agent sent it (for --json)
    where: str  # "http://127.0.0.1:9847" or "control socket /run/gpuscope/control.sock"
    details: str  # "node gpu-07", "node gpu-07, simulating demo"


class _NoAnswer(Exception):
    """This way of asking got no snapshot; the message (when there is one) says why, for a note."""


def ask_running_agent(settings: Settings, note: Callable[[str], None]) -> AgentSnapshot | None:
    """The running agent's snapshot, by its control socket or its HTTP endpoint; None if neither answered."""
    for ask in (_by_socket, _by_http):
        try:
            answer = ask(settings)
        except _NoAnswer as err:
            if str(err):
                note(f"{err}; not using it")
            continue
        if answer is not None:
            return answer
    return None


def _parse(document: dict[str, Any], where: str) -> Snapshot:
    try:
        return Snapshot.from_json(document)
    except SnapshotJsonError as err:
        raise _NoAnswer(f"the agent at {where} sent a snapshot this command cannot read ({err})") from None


# -- the control socket -------------------------------------------------------------------------------------


def _by_socket(settings: Settings) -> AgentSnapshot | None:
    path: Path = settings.control.socket
    if not accepts(path):  # no socket, or a stale one: no agent there
        return None
    from gpuscope.control.client import ControlClient  # grpc: loaded only when an agent may be there
    from gpuscope.control.errors import ControlError

    where = f"control socket {path}"
    deadline = time.monotonic() + NO_SNAPSHOT_YET_WAIT_S
    try:
        with ControlClient(path, timeout=TIMEOUT_S) as client:
            while True:
                try:
                    document = client.get_snapshot()
                    break
                except ControlError as err:
                    if "no snapshot yet" not in str(err) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            info = client.agent_info()
    except ControlError as err:
        raise _NoAnswer(f"the agent's {where} did not give a snapshot: {err}") from None
    snapshot = _parse(document, where)
    details = [f"node {info.node_name if info is not None else snapshot.hostname}"]
    if info is not None and info.simulated_scenario:
        details.append(f"simulating {info.simulated_scenario}")
    return AgentSnapshot(snapshot, document, where, ", ".join(details))


# -- HTTP ---------------------------------------------------------------------------------------------------


def _loopback_host(listen_address: str) -> tuple[str, int] | None:
    """Where to ask an agent listening at ``listen_address`` on this machine: loopback only."""
    address = listening_at(listen_address)
    if address is None:
        return None
    host = address.host
    if host in ("", "0.0.0.0"):
        return "127.0.0.1", address.port
    if host == "::":
        return "::1", address.port
    if host == "localhost":
        return host, address.port
    try:
        return (host, address.port) if ipaddress.ip_address(host).is_loopback else None
    except ValueError:  # a host name: it may name another machine
        return None


def _serves_tls(config_file: Path | None) -> bool:
    """The web configuration file turns TLS on (its tls_server_config names a certificate)."""
    if config_file is None:
        return False
    try:
        raw = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # the agent could not start with it either; ask, and see
    tls = raw.get("tls_server_config") if isinstance(raw, dict) else None
    return isinstance(tls, dict) and bool(tls.get("cert_file"))


def _by_http(settings: Settings) -> AgentSnapshot | None:
    target = _loopback_host(settings.web.listen_address)
    if target is None:
        return None
    host, port = target
    where = f"http://{format_host_port(host, port)}"
    if _serves_tls(settings.web.config_file):
        raise _NoAnswer(f"the agent's HTTP endpoint at https://{format_host_port(host, port)} uses TLS "
                        f"(web.config_file {settings.web.config_file}); this command asks plain HTTP only")
    deadline = time.monotonic() + NO_SNAPSHOT_YET_WAIT_S
    while True:
        status, body = _get(host, port, where)
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # 503: no snapshot yet, the agent's first tick has not finished
    if status in (401, 403):
        raise _NoAnswer(f"the agent at {where} requires authentication ({status} "
                        f"{'Unauthorized' if status == 401 else 'Forbidden'}: basic auth or client "
                        "certificates in its web.config_file)")
    if status != 200:
        raise _NoAnswer(f"the agent at {where} answered {SNAPSHOT_PATH} with HTTP {status}")
    try:
        document = load_json(body, max_bytes=MAX_SNAPSHOT_BYTES)
    except JsonInputError as err:
        raise _NoAnswer(f"the agent at {where} sent a snapshot that is not JSON ({err})") from None
    if not isinstance(document, dict):
        raise _NoAnswer(f"the agent at {where} sent a snapshot that is not a JSON object")
    snapshot = _parse(document, where)
    return AgentSnapshot(snapshot, document, where, f"node {snapshot.hostname}")


def _get(host: str, port: int, where: str) -> tuple[int, bytes]:
    """``GET /api/v1/snapshot``: the status, and the body of a 200 (at most MAX_SNAPSHOT_BYTES).
    _NoAnswer: without a message when nothing listens; with one when what listens is not a gpuscope
    agent speaking plain HTTP, or its snapshot is too large."""
    connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        try:
            connection.connect()
        except OSError:  # nothing listening: no agent here
            raise _NoAnswer("") from None
        try:
            connection.request("GET", SNAPSHOT_PATH, headers={"Accept": "application/json"})
            response = connection.getresponse()
            server = (response.getheader("Server") or "").split("/")[0]
            if server != SERVER_NAME:
                raise _NoAnswer(f"what answers at {where} is not a gpuscope agent (Server: "
                                f"{server or 'not named'})")
            body = response.read(MAX_SNAPSHOT_BYTES + 1) if response.status == 200 else b""
        except (OSError, http.client.HTTPException) as err:
            raise _NoAnswer(f"the listener at {where} did not answer plain HTTP (TLS, or not an agent: "
                            f"{type(err).__name__}: {err})") from None
        if len(body) > MAX_SNAPSHOT_BYTES:
            raise _NoAnswer(f"the agent at {where} sent a snapshot larger than {MAX_SNAPSHOT_BYTES} bytes")
        return response.status, body
    finally:
        connection.close()
