"""The otlp section and the OTEL_EXPORTER_OTLP_* variables: defaults, precedence (the section over the
metrics-specific variable over the general one), errors that name their key or variable and never
show a header's value, and the missing extra."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

from gpuscope.common.config_types import ConfigError
from gpuscope.config import load_settings
from gpuscope.otlp.config import OtlpConfig
from gpuscope.otlp.proto import load_protos
from gpuscope.otlp.target import ENVIRONMENT, parse_headers, resolve_target

SECRET = "s3cr3t-t0ken-value"


def write(tmp_path: Path, text: str, name: str = "gpuscope.yml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config(**values: Any) -> OtlpConfig:
    return OtlpConfig.model_validate({"enabled": True, **values})


def test_off_by_default_with_the_documented_defaults() -> None:
    settings = load_settings()
    assert settings.otlp.enabled is False
    target = resolve_target(settings.otlp, {})
    assert target.url == "http://localhost:4318/v1/metrics" and target.protocol == "http/protobuf"
    assert target.timeout_seconds == 10.0 and target.compression == "gzip" and target.headers == ()
    assert settings.otlp.interval == 10.0 and settings.otlp.max_queue == 60


@pytest.mark.parametrize(("yaml", "key"), [
    ("otlp:\n  interval: 0s\n", "otlp.interval"),
    ("otlp:\n  max_queue: 0\n", "otlp.max_queue"),
    ("otlp:\n  protocol: http/json\n", "otlp.protocol"),
    ("otlp:\n  endpoint: ftp://collector:4318\n", "otlp.endpoint"),
    ("otlp:\n  endpoint: http://user:pw@collector:4318\n", "otlp.endpoint"),
    ("otlp:\n  headers:\n    Authorization: {file: /a, env: B}\n", "otlp.headers.Authorization"),
    ("otlp:\n  headers:\n    Authorization: plain-value\n", "otlp.headers.Authorization"),
    ("otlp:\n  headers:\n    'bad name': {env: TOKEN}\n", "otlp.headers"),
    ("otlp:\n  tls:\n    cert_file: /etc/cert.pem\n", "otlp.tls"),
    ("otlp:\n  intervall: 5s\n", "otlp.intervall"),
])
def test_bad_input_names_the_key(tmp_path: Path, yaml: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, yaml))
    assert any(p.startswith(f"{key}: ") for p in caught.value.problems), caught.value.problems


def test_the_environment_alone_sets_the_target(tmp_path: Path) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/prefix/",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "2500", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
           "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=team%20a, authorization=Bearer%20" + SECRET,
           "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/ca.pem",
           "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/etc/c.pem",
           "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/etc/k.pem"}
    target = resolve_target(config(), env)
    assert target.url == "https://collector:4318/prefix/v1/metrics"  # the signal's path appended
    assert target.timeout_seconds == 2.5 and target.compression == "gzip"
    assert dict(target.headers) == {"x-tenant": "team a", "authorization": "Bearer " + SECRET}
    assert (str(target.ca_file), str(target.cert_file), str(target.key_file)) == (
        "/etc/ca.pem", "/etc/c.pem", "/etc/k.pem")
    assert SECRET not in repr(target)


def test_the_metrics_variables_win_over_the_general_ones() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4318",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://specific:4318/custom/path",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1000", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "3000",
           "OTEL_EXPORTER_OTLP_HEADERS": "a=general,b=general",
           "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "b=specific"}
    target = resolve_target(config(), env)
    assert target.url == "http://specific:4318/custom/path"  # a signal's own endpoint is used as it is
    assert target.timeout_seconds == 3.0
    assert dict(target.headers) == {"a": "general", "b": "specific"}


def test_the_section_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = write(tmp_path, SECRET + "\n", "token")
    monkeypatch.setenv("TENANT", "team-b")
    env = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://from-env:4318/v1/metrics",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TIMEOUT": "1000",
           "OTEL_EXPORTER_OTLP_HEADERS": "authorization=from-env,x-other=kept", "TENANT": "team-b"}
    headers = {"Authorization": {"file": str(token)}, "X-Tenant": {"env": "TENANT"}}
    section = config(endpoint="http://from-config:4318", protocol="http/protobuf", timeout="4s",
                     headers=headers)
    target = resolve_target(section, env)
    assert target.url == "http://from-config:4318/v1/metrics"  # a URL without a path gets the signal's
    assert target.protocol == "http/protobuf" and target.timeout_seconds == 4.0
    assert dict(target.headers) == {"Authorization": SECRET, "x-other": "kept", "X-Tenant": "team-b"}


def test_grpc_endpoints_are_scheme_host_and_port() -> None:
    assert resolve_target(config(protocol="grpc"), {}).url == "http://localhost:4317"
    target = resolve_target(config(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                       "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"})
    assert (target.protocol, target.url, target.secure) == ("grpc", "https://collector:4317", True)


@pytest.mark.parametrize(("env", "variable"), [
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
    ({"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "OTEL_EXPORTER_OTLP_COMPRESSION"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "authorization" + SECRET}, "OTEL_EXPORTER_OTLP_HEADERS"),
    ({"OTEL_EXPORTER_OTLP_CLIENT_KEY": "/etc/k.pem"}, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"),
])
def test_bad_variables_are_named_and_secrets_not_shown(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_target(config(), env)
    assert caught.value.source == ENVIRONMENT
    assert any(p.startswith(f"{variable}: ") for p in caught.value.problems), caught.value.problems
    assert SECRET not in str(caught.value)


def test_unreadable_header_sources_are_named_without_their_value(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as caught:
        resolve_target(config(headers={"Authorization": {"file": str(missing)},
                                       "X-Key": {"env": "UNSET_VAR"}}), {})
    problems = caught.value.problems
    assert any(p.startswith("otlp.headers.Authorization.file: cannot read") for p in problems), problems
    assert any(p.startswith("otlp.headers.X-Key.env: the variable UNSET_VAR") for p in problems), problems
    broken = write(tmp_path, f"{SECRET}\r\ninjected: 1", "broken")
    with pytest.raises(ConfigError) as caught:
        resolve_target(config(headers={"Authorization": {"file": str(broken)}}), {})
    assert "line break" in str(caught.value) and SECRET not in str(caught.value)


def test_tls_needs_https() -> None:
    with pytest.raises(ConfigError, match=r"otlp\.tls: .*plain http"):
        resolve_target(config(endpoint="http://collector:4318", tls={"ca_file": "/etc/ca.pem"}), {})


def test_headers_are_parsed_as_the_specification_writes_them() -> None:
    assert parse_headers("a=1,b=x%3Dy , ,c = two words") == [("a", "1"), ("b", "x=y"), ("c", "two words")]
    with pytest.raises(ValueError, match="entry 2 is not key=value"):
        parse_headers("a=1,broken")


def test_a_missing_extra_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_opentelemetry(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_opentelemetry)
    with pytest.raises(ConfigError) as caught:
        load_protos()
    (problem,) = caught.value.problems
    assert problem.startswith("otlp.enabled: ") and "pip install gpuscope[otlp]" in problem


def test_the_agent_refuses_to_start_on_an_unusable_target(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "GPUSCOPE_OTLP__ENABLED": "true",
           "GPUSCOPE_OTLP__HEADERS": '{"Authorization": {"file": "%s"}}' % (tmp_path / "missing-token"),
           "GPUSCOPE_CAPTURE__STORE__ROOT": str(tmp_path / "captures"),
           "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / "control.sock")}
    run = subprocess.run([sys.executable, "-m", "gpuscope", "run", "--simulate", "demo",
                          "--web.listen-address", "127.0.0.1:0"], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 2, run.stderr
    assert "otlp.headers.Authorization.file: cannot read" in run.stderr and "Traceback" not in run.stderr
    check = subprocess.run([sys.executable, "-m", "gpuscope", "config", "check",
                            str(write(tmp_path, "otlp:\n  endpoint: collector:4318\n"))],
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 2 and "otlp.endpoint: the scheme must be http or https" in check.stderr
