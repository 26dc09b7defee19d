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
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

DEFAULT_SOCKET = Path("/run/gpuscope/control.sock")
DEFAULT_SOCKET_MODE = 0o660
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes on Linux, with the terminating NUL


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_listen_address(value: str) -> tuple[str, int]:
    """(host, port) of "host:port", "[v6]:port" or ":port" (every interface: host "::");
    port 0 asks for a free port (tests). ValueError says what is wrong."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"expected [v6-address]:port, got {value!r}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address (in {value!r})") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"expected host:port or :port, got {value!r}")
        if ":" in host:
            raise ValueError(f"write an IPv6 address in brackets, [addr]:port, got {value!r}")
        if host and not all(c.isascii() and (c.isalnum() or c in "-._") for c in host):
            raise ValueError(f"{host!r} is not a host name or address (in {value!r})")
        host = host or "::"
    if not port_text.isascii() or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"the port must be a number from 0 to 65535, got {port_text!r} (in {value!r})")
    return host, int(port_text)


def grpc_address(host: str, port: int) -> str:
    """The address as gRPC's add_*_port takes it (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen_address(value: str | None) -> str | None:
    if value is None:
        return None
    parse_listen_address(value)
    return value.strip()


def _socket_path(value: Path) -> Path:
    if not value.is_absolute():
        raise ValueError(f"the control socket must be an absolute path, got {str(value)!r}")
    if len(str(value).encode()) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"the control socket path {str(value)!r} is longer than {MAX_SOCKET_PATH_BYTES} "
                         "bytes, the most a Unix socket address holds")
    return value


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


class TcpConfig(_Section):
    """The control API over TCP: only with TLS and a bearer token (all of them, or none)."""

    listen_address: Annotated[str | None, AfterValidator(_listen_address)] = Field(
        None, description="host:port, [v6]:port or :port (every interface). Unset: no TCP listener.")
    tls_cert_file: Path | None = Field(None, description="Server certificate chain (PEM).")
    tls_key_file: Path | None = Field(None, description="Private key of the certificate (PEM).")
    client_ca_file: Path | None = Field(None, description="CA bundle (PEM) that client certificates must "
                                                          "chain to; set it to require mutual TLS.")
    token_file: Path | None = Field(None, description="File holding the bearer token clients must send "
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


class ControlConfig(_Section):
    enabled: bool = Field(True, description="Serve the control API (the `gpuscope capture` CLI needs it).")
    socket: Annotated[Path, AfterValidator(_socket_path)] = Field(
        DEFAULT_SOCKET, description="Unix socket of the control API (its directory is created 0750).")
    socket_mode: Annotated[int, BeforeValidator(_octal_mode), AfterValidator(_socket_mode)] = Field(
        DEFAULT_SOCKET_MODE, description="Permissions of the socket (octal); who may connect may capture.")
    tcp: TcpConfig = TcpConfig()
