"""The `capture:` configuration section: defaults, sizes and durations, and bad values refused by path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from gpuscope.alerts.rules import CAPTURES_BY_DEFAULT, RULE_TYPES
from gpuscope.capture.config import (
    MAX_KINETO_SOCKET_DIR_BYTES,
    CaptureConfig,
    StaticTarget,
)
from gpuscope.common.config_types import ConfigError, format_errors
from gpuscope.config import load_settings


class Root(BaseModel):
    """The settings' shape around the section, so that error paths start at `capture`."""

    model_config = ConfigDict(extra="forbid")
    capture: CaptureConfig = CaptureConfig()


def load(capture: dict[str, Any]) -> CaptureConfig:
    return Root.model_validate({"capture": capture}).capture


def problems(capture: dict[str, Any]) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        Root.model_validate({"capture": capture})
    return format_errors(caught.value)


def test_defaults() -> None:
    config = CaptureConfig()
    assert config.enabled is True
    # The store's and Kineto's directories depend on the user (tests/test_user_paths.py); root's:
    # the system's store, the abstract @dynolog, and a trace directory under the temporary directory.
    if os.geteuid() == 0:
        assert config.store.root == Path("/var/lib/gpuscope/captures")
        assert (config.kineto.trace_dir, config.kineto.socket_dir) == (None, None)
    assert config.store.quota_bytes == 2 * 2**30
    assert (config.duration, config.max_duration, config.cooldown) == (2.0, 30.0, 900.0)
    assert config.hourly_budget == 6
    assert config.deadline_margin == 10.0
    # gRPC responses are held in memory (64 MiB); Kineto trace files are streamed from disk (1 GiB),
    # and a job may take minutes to write one after its recording.
    assert (config.max_trace_bytes, config.kineto.max_trace_bytes) == (64 * 2**20, 2**30)
    assert config.kineto.write_timeout == 300.0
    assert config.profiler_ports == [6009]
    assert config.targets == [] and config.rules == {}
    assert set(CAPTURES_BY_DEFAULT) == set(RULE_TYPES)
    assert {name for name in RULE_TYPES if config.rule_captures(name)} == {
        "GpuLowUtilization", "GpuFrequentIdleDips", "GpuUtilizationSkew", "GpuBusyButStalled"}
    assert config.rule_captures("NotARule") is False


def test_values_as_people_write_them() -> None:
    config = load({
        "store": {"root": "/data/captures", "quota_bytes": "512MiB"},
        "duration": "5s", "max_duration": "20s", "cooldown": "1h", "hourly_budget": 2,
        "deadline_margin": "30s",
        "rules": {"GpuThrottled": True, "GpuLowUtilization": False},
        "profiler_ports": [6009, 9012],
        "targets": [{"address": "10.0.0.7:6009", "gpu": 0}, {"address": "[fd00::7]:9012", "all": True},
                    {"address": "trainer-0.svc:6009", "uuid": "GPU-abc"}, {"address": "h:1", "pid": 42}],
    })
    assert config.store.root == Path("/data/captures")
    assert config.store.quota_bytes == 512 * 2**20
    assert (config.duration, config.max_duration) == (5, 20)
    assert (config.cooldown, config.deadline_margin) == (3600, 30)
    assert config.rule_captures("GpuThrottled") and not config.rule_captures("GpuLowUtilization")
    assert config.rule_captures("GpuBusyButStalled"), "rules not named keep their default"
    assert config.targets[1] == StaticTarget(address="[fd00::7]:9012", all=True)
    kineto = load({"kineto": {"trace_dir": "/run/gpuscope/kineto/traces",
                              "socket_dir": "/run/gpuscope/kineto/ipc"}}).kineto
    assert kineto.trace_dir == Path("/run/gpuscope/kineto/traces")
    assert kineto.socket_dir == Path("/run/gpuscope/kineto/ipc")
    kineto = load({"kineto": {"max_trace_bytes": "4GiB", "write_timeout": "10m"}}).kineto
    assert (kineto.max_trace_bytes, kineto.write_timeout) == (4 * 2**30, 600.0)
    assert load({"store": {"quota_bytes": "1.5GB"}}).store.quota_bytes == 1_500_000_000
    assert load({"store": {"quota_bytes": 4 * 2**20}}).store.quota_bytes == 4 * 2**20


@pytest.mark.parametrize(("capture", "expected"), [
    ({"rules": {"GpuLowUtilisation": True}},
     "capture.rules: unknown alert rule 'GpuLowUtilisation'; the rules are GpuLowUtilization"),
    ({"duration": "45s"}, "capture: duration (45s) must not be longer than max_duration (30s)"),
    ({"max_duration": "1m"}, "capture.max_duration: Input should be less than or equal to 30"),
    ({"duration": "10s", "max_duration": "5s"},
     "capture: duration (10s) must not be longer than max_duration (5s)"),
    ({"duration": 0}, "capture.duration: Input should be greater than 0"),
    ({"duration": "2 minutes"}, "capture.duration: expected a duration such as"),
    ({"cooldown": -1}, "capture.cooldown: a duration must be a finite number of seconds >= 0"),
    ({"hourly_budget": 0}, "capture.hourly_budget: Input should be greater than or equal to 1"),
    ({"store": {"quota_bytes": "2 parsecs"}}, "capture.store.quota_bytes: expected a size"),
    ({"store": {"quota_bytes": "10KiB"}}, "capture.store.quota_bytes: Input should be greater than or equal"),
    ({"store": {"quota": "1GiB"}}, "capture.store.quota: unknown key"),
    ({"profiler_ports": [0]}, "capture.profiler_ports[0]: a port must be from 1 to 65535, got 0"),
    ({"profiler_ports": [6009, 70000]},
     "capture.profiler_ports[1]: a port must be from 1 to 65535"),
    ({"profiler_ports": [6009, 6009]}, "capture.profiler_ports: a port is listed twice"),
    ({"profiler_ports": "6009"}, "capture.profiler_ports: Input should be a valid list"),
    ({"targets": [{"address": "10.0.0.7:6009"}]},
     "capture.targets[0]: name exactly one of gpu, uuid, pid or all: true"),
    ({"targets": [{"address": "10.0.0.7:6009", "gpu": 0, "all": True}]},
     "capture.targets[0]: name exactly one of gpu, uuid, pid or all: true (got gpu, all)"),
    ({"targets": [{"address": "10.0.0.7", "gpu": 0}]},
     "capture.targets[0].address: invalid address '10.0.0.7': no port"),
    ({"targets": [{"address": "fd00::7:6009", "gpu": 0}]},
     "capture.targets[0].address: invalid address 'fd00::7:6009': put an IPv6 address in brackets"),
    ({"targets": [{"address": "host:99999", "gpu": 0}]},
     "capture.targets[0].address: invalid address 'host:99999': the port must be a number from 1 to 65535"),
    ({"targets": [{"address": "host:6009", "gpu": -1}]},
     "capture.targets[0].gpu: Input should be greater than or equal to 0"),
    ({"targets": [{"address": "host:6009", "gpu": 0, "port": 1}]}, "capture.targets[0].port: unknown key"),
    ({"enable": True}, "capture.enable: unknown key"),
    ({"kineto": {"trace_dir": "kineto/traces"}},
     "capture.kineto.trace_dir: must be an absolute path: the agent and the jobs must name "
     "the same directory (got 'kineto/traces')"),
    ({"kineto": {"trace_dir": "/run/gpuscope/../tmp"}},
     "capture.kineto.trace_dir: must not contain '..'"),
    ({"kineto": {"trace_dir": "/"}}, "capture.kineto.trace_dir: must be a directory of its own"),
    ({"kineto": {"trace_dir": "/run/a\x00b"}},
     "capture.kineto.trace_dir: a path must not contain a NUL character"),
    ({"kineto": {"trace_dir": 7}}, "capture.kineto.trace_dir: Input is not a valid path"),
    ({"kineto": {"socket_dir": "ipc"}}, "capture.kineto.socket_dir: must be an absolute path"),
    ({"kineto": {"socket_dir": "/" + "s" * MAX_KINETO_SOCKET_DIR_BYTES}},
     f"capture.kineto.socket_dir: must be at most {MAX_KINETO_SOCKET_DIR_BYTES} bytes long: "
     "PyTorch binds its socket at <socket_dir>/dynoconfigclient<36-character uuid>"),
    ({"kineto": {"trace_dir": "/run/k", "socket_dir": "/run/k"}},
     "capture.kineto: trace_dir (/run/k) and socket_dir (/run/k) must be separate directories"),
    ({"kineto": {"trace_dir": "/run/k/traces", "socket_dir": "/run/k"}},
     "capture.kineto: trace_dir (/run/k/traces) and socket_dir (/run/k) must be separate"),
    ({"kineto": {"trace_dir": "/run/k", "socket_dir": "/run/k/ipc"}},
     "capture.kineto: trace_dir (/run/k) and socket_dir (/run/k/ipc) must be separate"),
    ({"kineto": {"trace_directory": "/run/k"}}, "capture.kineto.trace_directory: unknown key"),
    ({"kineto": {"max_trace_bytes": "32GiB"}},
     "capture.kineto.max_trace_bytes: must be from 1.0 MiB to 16.0 GiB (the size of a trace file on disk) "
     "(got '32GiB')"),
    ({"kineto": {"max_trace_bytes": "100KiB"}}, "capture.kineto.max_trace_bytes: must be from 1.0 MiB"),
    ({"kineto": {"max_trace_bytes": "lots"}}, "capture.kineto.max_trace_bytes: expected a size"),
    ({"kineto": {"write_timeout": "2h"}}, "capture.kineto.write_timeout: must be from 1s to 60m (got '2h')"),
    ({"kineto": {"write_timeout": "500ms"}}, "capture.kineto.write_timeout: must be from 1s to 60m"),
    ({"max_trace_bytes": "4GiB"}, "capture.max_trace_bytes: Input should be less than or equal to"),
])
def test_bad_values_are_refused_by_path(capture: dict[str, Any], expected: str) -> None:
    found = problems(capture)
    assert any(line.startswith(expected) for line in found), found


def test_kineto_directories_at_their_limits() -> None:
    longest = "/" + "s" * (MAX_KINETO_SOCKET_DIR_BYTES - 1)  # PyTorch 2.13 binds its socket under it
    assert load({"kineto": {"socket_dir": longest}}).kineto.socket_dir == Path(longest)
    # Siblings that share a prefix are separate directories.
    kineto = load({"kineto": {"trace_dir": "/run/k/ipc-traces", "socket_dir": "/run/k/ipc"}}).kineto
    assert kineto.trace_dir == Path("/run/k/ipc-traces")


def test_kineto_directories_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_CAPTURE__KINETO__TRACE_DIR", "/run/gpuscope/kineto/traces")
    monkeypatch.setenv("GPUSCOPE_CAPTURE__KINETO__SOCKET_DIR", "/run/gpuscope/kineto/ipc")
    kineto = load_settings().capture.kineto
    assert kineto.trace_dir == Path("/run/gpuscope/kineto/traces")
    assert kineto.socket_dir == Path("/run/gpuscope/kineto/ipc")
    monkeypatch.setenv("GPUSCOPE_CAPTURE__KINETO__TRACE_DIR", "traces")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert caught.value.source == "GPUSCOPE_* environment variables"
    assert caught.value.problems == ["capture.kineto.trace_dir: must be an absolute path: the "
                                     "agent and the jobs must name the same directory (got 'traces')"]
