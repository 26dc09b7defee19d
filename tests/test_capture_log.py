"""The capture service's log lines name what was captured: the GPU when there is one, never "GPU None"."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_control_api import PROFILER, one_gpu_snapshot, running_node

NO_SUCH_PID = 4_194_305  # above Linux's largest pid_max: no process has it


def service_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpuscope.capture.service"]


def test_capture_log_lines_name_the_gpu_only_when_there_is_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuscope.capture.service")
    with running_node(tmp_path, snapshot=one_gpu_snapshot()) as node, node.client() as client:
        by_target = client.capture(target=PROFILER, duration_s=0.1)
        by_gpu = client.capture(gpu=0, duration_s=0.1)
        by_pid = client.capture(pid=NO_SUCH_PID, duration_s=0.1)
    assert [r["outcome"] for r in (by_target, by_gpu, by_pid)] == ["captured", "captured", "unreachable"]
    assert by_pid["error"].startswith(f"no profiling endpoint found for process {NO_SUCH_PID} ")  # no GPU
    lines = service_lines(caplog)
    assert f"capture {by_target['id']}: captured (tsl {PROFILER})" in lines, lines
    assert f"capture {by_gpu['id']}: captured (GPU 0, tsl {PROFILER})" in lines, lines
    assert any(line.startswith(f"capture not taken (pid {NO_SUCH_PID}): no profiling endpoint")
               for line in lines), lines
    assert not [line for line in lines if "None" in line], lines


def test_a_refused_capture_names_what_was_asked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuscope.capture.service")
    with running_node(tmp_path, capture={"user_hourly_budget": 1}) as node, node.client() as client:
        assert client.capture(target=PROFILER, duration_s=0.1)["outcome"] == "captured"
        refused = client.capture(target=PROFILER, duration_s=0.1)
    assert refused["outcome"] == "refused"
    lines = service_lines(caplog)
    assert any(line.startswith(f"capture refused (user, target {PROFILER}): ") for line in lines), lines
    assert not [line for line in lines if "None" in line], lines
