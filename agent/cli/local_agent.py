"""Is a gpuscope agent running on this machine? Asked by `gpuscope snapshot` when it finds no NVML itself,
so that it can point at the agent's view instead of leaving the user at "no driver".

Two bounded, local probes, at the addresses this command's own settings name (the agent's defaults
unless the same configuration file or variables say otherwise): the HTTP listener, recognised by its
``Server: gpuscope`` header, and the control socket, recognised by something accepting connections on
it. Neither reads the agent's data: the command says where it is.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
from dataclasses import dataclass
from pathlib import Path

from gpuscope.cli.invocation import command_name
from gpuscope.common.addresses import AddressError, HostPort, format_host_port, parse_host_port
from gpuscope.web.server import SERVER_NAME

PROBE_TIMEOUT_S = 0.5  # a local listener answers at once; nothing listening is refused at once
_WILDCARDS = ("", "0.0.0.0", "::")  # listen on every interface: reached here as localhost


@dataclass(frozen=True, slots=True)
class LocalAgent:
    url: str | None  # the base of its HTTP endpoints, when they answered
    socket: Path | None  # its control socket, when something accepts connections on it


def find_local_agent(listen_address: str, control_socket: Path) -> LocalAgent | None:
    """The agent listening at ``listen_address`` (HTTP) or on ``control_socket``; None if neither."""
    url = _http_agent(listen_address)
    sock = control_socket if accepts(control_socket) else None
    return None if url is None and sock is None else LocalAgent(url, sock)


def listening_at(listen_address: str) -> HostPort | None:
    """The address an agent configured with ``listen_address`` listens at; None where there is nothing
    to find (not an address, or any free port)."""
    try:
        address = parse_host_port(listen_address, listen=True)
    except AddressError:
        return None
    return None if address.port == 0 else address


def _http_agent(listen_address: str) -> str | None:
    address = listening_at(listen_address)
    if address is None:
        return None
    host = "localhost" if address.host in _WILDCARDS else address.host
    connection = http.client.HTTPConnection(host, address.port, timeout=PROBE_TIMEOUT_S)
    try:
        connection.request("GET", "/-/healthy")
        server = connection.getresponse().getheader("Server") or ""
    except (OSError, http.client.HTTPException):  # nothing there, TLS, or not HTTP
        return None
    finally:
        connection.close()
    # Any status will do (401 with basic auth, 503 unhealthy): the header says who answered.
    return f"http://{format_host_port(host, address.port)}" if server.split("/")[0] == SERVER_NAME else None


def accepts(path: Path) -> bool:
    """Something accepts connections on the Unix socket ``path`` (or it is there but not for us)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except PermissionError:  # it is there, for the agent's group only
            return True
        except OSError:  # no socket, or a stale one nobody accepts on
            return False
        with contextlib.suppress(OSError):
            probe.shutdown(socket.SHUT_RDWR)
        return True


def no_nvml_hints(agent: LocalAgent | None) -> list[str]:
    """What to do when this machine has no NVML: simulate a node, or look at the running agent."""
    lines = ["no NVIDIA driver answered on this machine; to try gpuscope without a GPU, sample a "
             "simulated node: --simulate NAME (e.g. --simulate demo; "
             f"`{command_name()} scenarios` lists them)"]
    if agent is not None and agent.url is not None:
        lines.append(f"a gpuscope agent is running here: its latest snapshot is at "
                     f"{agent.url}/api/v1/snapshot")
    elif agent is not None:
        lines.append(f"a gpuscope agent is running here (control socket {agent.socket}): its HTTP endpoint "
                     "/api/v1/snapshot serves its latest snapshot")
    return lines
