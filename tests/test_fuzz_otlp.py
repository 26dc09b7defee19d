"""Property-based tests of what the OTLP export reads from outside: the ``OTEL_EXPORTER_OTLP_*``
variables (gpuscope.otlp.target), the endpoints people write, and a receiver's ``Retry-After``
(gpuscope.otlp.transport).

Fuzzed: every variable set to arbitrary text, or to headers built as the specification writes them
(percent-encoded values, white space, empty entries); endpoints from arbitrary text and from URL
parts; Retry-After as arbitrary text, numbers and HTTP dates.

Asserted: resolving either gives a target whose URL is one the transport can use (http or https, a
host, the metrics path for HTTP) or raises ConfigError naming a variable or key; no problem ever
shows a header's value; headers written by the specification's rules are read back as written;
Retry-After is None or a delay within 0 and its cap, never an exception.
"""

from __future__ import annotations

import email.utils
import urllib.parse

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuscope.common.config_types import ConfigError
from gpuscope.otlp.config import OtlpConfig
from gpuscope.otlp.target import endpoint_url, parse_headers, resolve_target
from gpuscope.otlp.transport import MAX_RETRY_AFTER_SECONDS, retry_after_seconds

FUZZ = settings(max_examples=150)  # and tests/conftest.py\'s profile
SECRET = "Zq8secretZq8"
SUFFIXES = ("ENDPOINT", "PROTOCOL", "HEADERS", "TIMEOUT", "COMPRESSION", "CERTIFICATE", "CLIENT_KEY",
            "CLIENT_CERTIFICATE")
VARIABLES = [f"OTEL_EXPORTER_OTLP_{infix}{suffix}" for infix in ("", "METRICS_") for suffix in SUFFIXES]
TOKEN_CHARS = st.characters(codec="ascii", categories=("L", "N"), include_characters="-_.")


@FUZZ
@given(st.dictionaries(st.sampled_from(VARIABLES), st.text(max_size=60)), st.booleans())
@example({"OTEL_EXPORTER_OTLP_HEADERS": "a=" + SECRET + ",=x"}, False)
@example({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://[::1]:4318"}, True)
def test_any_environment_resolves_or_is_refused_by_name(env: dict[str, str], grpc: bool) -> None:
    env = {name: value.replace("\x00", "") for name, value in env.items()}
    config = OtlpConfig(enabled=True, protocol="grpc") if grpc else OtlpConfig(enabled=True)
    try:
        target = resolve_target(config, env)
    except ConfigError as err:
        assert err.problems and all(p.split(":", 1)[0] in VARIABLES or p.startswith("otlp.")
                                    for p in err.problems), err.problems
        assert SECRET not in str(err)
        return
    parts = urllib.parse.urlsplit(target.url)
    assert parts.scheme in ("http", "https") and parts.hostname
    if target.protocol == "http/protobuf":
        assert parts.path.startswith("/")
    else:
        assert parts.path == ""
    for name, value in target.headers:
        assert name and value and not any(c in value for c in "\r\n\x00")


header_names = st.text(TOKEN_CHARS, min_size=1, max_size=12)
header_values = st.text(st.characters(exclude_categories=("Cs", "Cc")), min_size=1, max_size=20).filter(
    lambda v: v.strip() == v)


@FUZZ
@given(st.lists(st.tuples(header_names, header_values), min_size=1, max_size=5))
def test_headers_written_by_the_specifications_rules_read_back(pairs: list[tuple[str, str]]) -> None:
    text = " , ".join(f"{name} = {urllib.parse.quote(value, safe='')}" for name, value in pairs)
    assert parse_headers(text) == pairs


@FUZZ
@given(st.text(max_size=80), st.booleans(), st.booleans())
@example("http://collector", False, False)
@example("https://u@collector:4318/x", False, False)
@example("http://collector:99999", True, False)
def test_any_endpoint_is_a_usable_url_or_a_value_error(raw: str, grpc: bool, as_base: bool) -> None:
    try:
        url = endpoint_url(raw, grpc=grpc, as_base=as_base)
    except ValueError as err:
        assert str(err)
        return
    parts = urllib.parse.urlsplit(url)
    assert parts.scheme in ("http", "https") and parts.hostname and parts.username is None
    assert not parts.query and not parts.fragment
    assert (parts.path == "") if grpc else parts.path.endswith("/v1/metrics") or not as_base


@FUZZ
@given(st.one_of(st.text(max_size=40), st.integers(-10, 10**9).map(str),
                 st.floats(0, 4e9).map(lambda t: email.utils.formatdate(t, usegmt=True))))
@example("Wed, 21 Oct 2015 07:28:00 GMT")
@example("-1")
def test_retry_after_is_a_bounded_delay_or_none(value: str) -> None:
    delay = retry_after_seconds(value, now=1.5e9)
    assert delay is None or 0.0 <= delay <= MAX_RETRY_AFTER_SECONDS
