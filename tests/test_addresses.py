"""The one address parser and formatter (gpuscope.common.addresses), and the config types on them."""

from __future__ import annotations

import pytest

from gpuscope.common.addresses import AddressError, HostPort, format_host_port, parse_host_port


@pytest.mark.parametrize(("text", "expected"), [
    (":9847", HostPort("", 9847)),
    ("127.0.0.1:0", HostPort("127.0.0.1", 0)),
    ("[::1]:9847", HostPort("::1", 9847)),
    ("[fe80::1%eth0]:80", HostPort("fe80::1%eth0", 80)),
    ("localhost:9847", HostPort("localhost", 9847)),
    ("gpu-node-07.example.org:65535", HostPort("gpu-node-07.example.org", 65535)),
    ("0.0.0.0:9847", HostPort("0.0.0.0", 9847)),
    ("  :9847 ", HostPort("", 9847)),
])
def test_listen_addresses(text: str, expected: HostPort) -> None:
    assert parse_host_port(text, listen=True) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:6009", HostPort("127.0.0.1", 6009)),
    ("trainer-0.ns.svc.cluster.local:9012", HostPort("trainer-0.ns.svc.cluster.local", 9012)),
    ("worker_1.job:1", HostPort("worker_1.job", 1)),
    ("[::1]:6009", HostPort("::1", 6009)),
    ("[fd00::a:1]:65535", HostPort("fd00::a:1", 65535)),
])
def test_peer_addresses(text: str, expected: HostPort) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text", [
    "", "9847", ":", "localhost:", "localhost", ":http", ":-1", ":65536", ":99999", ":99999999", ":+80",
    ": 80", "::1:9847", "[::1]", "[::1]9847", "[::1:9847", "[127.0.0.1]:80", "[]:80", "[nothost]:80",
    "host name:80", "http://localhost:9847", "localhost:9847/metrics", ":\u0663", "h\u00f6st:1", "a,b:1",
    "-host:1", "unix:/tmp/s:1", "a" * 300 + ":1",
])
def test_refused_everywhere_with_the_value_named(text: str) -> None:
    for listen in (True, False):
        with pytest.raises(AddressError) as caught:
            parse_host_port(text, listen=listen)
        assert repr(text) in str(caught.value)


@pytest.mark.parametrize("text", [":6009", "host:0", "[::1]:0"])
def test_a_peer_needs_a_host_and_a_real_port(text: str) -> None:
    parse_host_port(text, listen=True)
    with pytest.raises(AddressError, match=r"no host|from 1 to 65535"):
        parse_host_port(text)


def test_address_errors_are_value_errors() -> None:
    assert issubclass(AddressError, ValueError)


@pytest.mark.parametrize(("host", "port", "text"), [
    ("10.0.0.7", 6009, "10.0.0.7:6009"), ("::1", 9847, "[::1]:9847"), ("node-3", 1, "node-3:1"),
    ("fe80::1%eth0", 80, "[fe80::1%eth0]:80"),
])
def test_format_puts_ipv6_in_brackets_and_round_trips(host: str, port: int, text: str) -> None:
    assert format_host_port(host, port) == text == str(HostPort(host, port))
    assert parse_host_port(text) == HostPort(host, port)
