"""Network addresses as people write them: ``host:port``, ``[v6]:port``, and for a listener ``:port``.

One parser and one formatter for every place an address is read (the HTTP and control listeners,
profiler targets, the CLI's agents) or written (gRPC targets, the ``instance`` label), so that a
``host:port`` means the same thing everywhere and IPv6 always travels in brackets.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from dataclasses import dataclass

MAX_HOST_NAME_CHARS = 253
# Labels of letters, digits, '-' and '_' (some resolvers allow it), dot-separated, an optional final
# dot; dotted IPv4 addresses fit this too.
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,62}(?:\.[A-Za-z0-9_-]{1,63})*\.?")
LISTEN_FORMS = "':PORT', 'HOST:PORT' or '[IPV6]:PORT', e.g. ':9847' or '127.0.0.1:9847'"
PEER_FORMS = "'HOST:PORT' or '[IPV6]:PORT', e.g. '10.0.0.7:6009' or '[fd00::7]:6009'"


class AddressError(ValueError):
    """An address that is not one of the accepted forms; the message names it and says why."""


@dataclass(frozen=True, slots=True)
class HostPort:
    """A parsed address. ``host`` is a name, an IPv4 address or a bare IPv6 address (no brackets);
    for a listener, ``""`` means every interface."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_host_port(self.host, self.port)


def parse_host_port(text: str, *, listen: bool = False) -> HostPort:
    """Parse ``HOST:PORT`` or ``[IPV6]:PORT``. With ``listen``, ``:PORT`` (host ``""``: every interface)
    and port 0 (any free port) are accepted too; otherwise the port is 1-65535. Surrounding spaces are
    ignored. AddressError names the value and what is wrong with it."""
    value = text.strip()
    forms = LISTEN_FORMS if listen else PEER_FORMS
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise AddressError(f"invalid address {text!r}: expected {forms}")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"invalid address {text!r}: {host!r} in brackets is not an IPv6 "
                               "address") from None
    else:
        host, colon, port_text = value.rpartition(":")
        if not colon:
            raise AddressError(f"invalid address {text!r}: no port; expected {forms}")
        if ":" in host:
            raise AddressError(f"invalid address {text!r}: put an IPv6 address in brackets, "
                               "e.g. '[::1]:9847'")
        if not host and not listen:
            raise AddressError(f"invalid address {text!r}: no host; expected {forms}")
        if host and (len(host) > MAX_HOST_NAME_CHARS or not _HOST_NAME.fullmatch(host)):
            raise AddressError(f"invalid address {text!r}: {host!r} is not a host name or an IP address")
    lowest = 0 if listen else 1
    if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5
            and lowest <= int(port_text) <= 65535):
        raise AddressError(f"invalid address {text!r}: the port must be a number from {lowest} to 65535")
    return HostPort(host, int(port_text))


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[::1]:9847``), as gRPC targets, URLs and
    Prometheus ``instance`` labels write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class HttpUrl:
    """An http(s) URL a push is sent to: its parts, and its ``host[:port]`` as a URL writes it."""

    parts: urllib.parse.SplitResult
    netloc: str


def split_http_url(url: str, example: str, *, credentials: str = "") -> HttpUrl:
    """``url`` checked as a base to push to: ValueError saying what is wrong (not a URL, a scheme
    other than http or https, no host, credentials in it, a query or a fragment), with ``example``
    (``e.g. http://host:port``); ``credentials`` says where they go instead."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise ValueError(f"not a URL: {err} ({example})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"the scheme must be http or https ({example})")
    if not parts.hostname:
        raise ValueError(f"no host ({example})")
    if parts.username is not None or parts.password is not None:
        instead = f": {credentials}" if credentials else ""
        raise ValueError(f"credentials in the URL are not supported{instead}")
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        raise ValueError(f"no query or fragment allowed ({example})")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return HttpUrl(parts, host if port is None else f"{host}:{port}")
