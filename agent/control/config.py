"""The `control:` section of the configuration: where the control API (gpuscope.v1.Agent) listens.

```yaml
control:
  socket: /run/gpuscope/control.sock   # local clients (the `gpuscope` CLI); always on
  socket_mode: 0660                    # owner and group may connect; never world-writable
  tcp:                                 # remote clients (fleet captures): off unless set, and then
    listen_address: "10.0.0.5:9848"    # only with TLS and a bearer token
    tls_cert_file: /etc/gpuscope/tls/tls.crt
    tls_key_file: /etc/gpuscope/tls/tls.key
    client_ca_file: /etc/gpuscope/tls/ca.crt   # optional: also require client certificates (mTLS)
    token_file: /etc/gpuscope/token             # "Authorization: Bearer <token>" (at least 16 characters)
```

The longest capture a client may ask for is ``capture.max_duration`` (the capture policy's), not a key here.

The socket's default depends on who runs the agent (``common/user_paths``): ``/run/gpuscope/control.sock``
for root, ``control.sock`` in the runtime directory for anyone else (``$XDG_RUNTIME_DIR/gpuscope``, or
``/tmp/gpuscope-<uid>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from gpuscope.common.config_types import Duration, FilePath, ListenAddress, Section, UnixSocketPath
from gpuscope.common.user_paths import SYSTEM_RUNTIME_DIR, DefaultDirs, default_dirs

SOCKET_NAME = "control.sock"
DEFAULT_SOCKET = SYSTEM_RUNTIME_DIR / SOCKET_NAME  # root's, and the node's agent's
DEFAULT_SOCKET_MODE = 0o660


def default_socket(dirs: DefaultDirs | None = None) -> Path:
    """Where an agent run by this user listens unless control.socket says otherwise."""
    return (dirs or default_dirs()).runtime / SOCKET_NAME


def client_socket_candidates(dirs: DefaultDirs | None = None) -> list[Path]:
    """Where a client of this user looks for an agent, in order: the socket of an agent this user
    would run, then the node's (a user in the socket's group may use the node's agent)."""
    return list(dict.fromkeys((default_socket(dirs), DEFAULT_SOCKET)))


def _octal_mode(value: object) -> object:
    """0660 (YAML's octal int), "0660", "0o660" or "660" (strings are octal)."""
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        try:
            return int(text, 8)
        except ValueError:
            raise ValueError(f"expected an octal file mode such as 0660, got {value!r}") from None
    return value


def _socket_mode(value: int) -> int:
    if not 0 <= value <= 0o777:
        raise ValueError(f"{value} is not a file mode (write it in octal, e.g. 0660)")
    if value & 0o002:
        raise ValueError(f"socket_mode {value:#o} would let every local user drive captures "
                         "(world-writable); grant access through the socket's group instead, e.g. 0660")
    return value


class TcpConfig(Section):
    """The control API over TCP: only with TLS and a bearer token (all of them, or none)."""

    listen_address: ListenAddress | None = Field(
        None, description="host:port, [v6]:port or :port (every interface). Unset: no TCP listener.")
    tls_cert_file: FilePath | None = Field(None, description="Server certificate chain (PEM).")
    tls_key_file: FilePath | None = Field(None, description="Private key of the certificate (PEM).")
    client_ca_file: FilePath | None = Field(None, description="CA bundle (PEM) that client certificates must "
                                                          "chain to; set it to require mutual TLS.")
    token_file: FilePath | None = Field(None, description="File holding the bearer token clients must send "
                                                      "(Authorization: Bearer <token>).")

    @model_validator(mode="after")
    def _tls_and_token(self) -> TcpConfig:
        names = ("tls_cert_file", "tls_key_file", "token_file")
        if self.listen_address is None:
            extra = [n for n in (*names, "client_ca_file") if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} set but listen_address is not: set "
                                 "control.tcp.listen_address to serve the control API over TCP")
            return self
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"the control API listens on TCP only with TLS and a bearer token: set "
                             f"{', '.join(missing)} (or remove listen_address to use the Unix socket only)")
        return self

    @property
    def enabled(self) -> bool:
        return self.listen_address is not None


class ControlConfig(Section):
    enabled: bool = Field(True, description="Serve the control API (the `gpuscope capture` CLI needs it).")
    socket: UnixSocketPath = Field(
        default_factory=default_socket,  # called without arguments: its parameter has a default
        description="Unix socket of the control API (its directory is created 0750). Default: "
                    "/run/gpuscope/control.sock for root, else control.sock in the user's runtime "
                    "directory ($XDG_RUNTIME_DIR/gpuscope, or /tmp/gpuscope-<uid>).")
    socket_mode: Annotated[int, BeforeValidator(_octal_mode), AfterValidator(_socket_mode)] = Field(
        DEFAULT_SOCKET_MODE, description="Permissions of the socket (octal); who may connect may capture.")
    idle_timeout: Duration = Field(60.0, ge=1.0, le=86400.0, description=(
        "How long the control API's server process stays after its last call; then the agent takes the "
        "socket back and the process exits (the next client starts another, in about a second). gRPC "
        "lives only in that process, so the agent's memory does not grow with the API's use. Unused with "
        "control.tcp: the agent then serves the API itself."))
    tcp: TcpConfig = Field(default_factory=TcpConfig)
