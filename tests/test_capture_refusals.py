"""Refused capture triggers are not silent: a user's capture leaves the alert cooldown alone, and a
trigger the agent refuses shows in `captures ls --all`, the control and HTTP APIs, the event log and
the status page, with its reason and when a capture is allowed again; the newest ones are kept."""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from snapshots import FakeSource
from test_cli_capture import cli
from test_control_api import Node, one_gpu_snapshot, running_node

from gpuscope.alert_captures.event_lines import CaptureEventLines
from gpuscope.alerts.config import EventLogConfig
from gpuscope.alerts.eventlog import AlertEventLog
from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.capture.policy import CapturePolicy
from gpuscope.capture.refusals import RefusalLog, RefusedTrigger
from gpuscope.capture.service import CaptureRequest
from gpuscope.cli.capture import _print_refused
from gpuscope.generated.agent.v1 import agent_pb2
from gpuscope.web.server import AgentHttpServer
from gpuscope.web.web_config import WebConfigWatcher

ALERT = Trigger("alert", alertname="GpuLowUtilization")


def alert_capture(node: Node, gpu: int = 0) -> CaptureRecord:
    assert node.service is not None
    return node.service.submit(CaptureRequest(ALERT, gpu=gpu)).result(timeout=30)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with running_node(tmp_path, snapshot=one_gpu_snapshot(), capture={"cooldown": "15m"}) as running:
        yield running


@contextmanager
def http_for(node: Node) -> Iterator[AgentHttpServer]:
    assert node.service is not None
    server = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(),
                             source=FakeSource(one_gpu_snapshot()), web_config=WebConfigWatcher(None),
                             captures=node.store, refusals=node.service.refusals)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def get(server: AgentHttpServer, path: str) -> tuple[int, bytes]:
    host, port = server.bound_address
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_an_alert_right_after_a_manual_capture_on_the_same_gpu_is_captured(
        node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["capture", "--gpu", "0", "--duration", "200ms", "--socket", str(node.socket)],
                         capsys)
    assert code == 0, err
    # The user is told what the capture cost them: one of their own captures of the hour.
    assert "note: this capture uses 1 of the 12 on-demand captures per hour for " in out
    assert "(capture.user_hourly_budget): 11 left; alert captures have their own budget " \
           "(capture.hourly_budget) and cooldown" in out
    record = alert_capture(node)
    assert (record.outcome, record.error) == ("captured", None)
    assert record.notice is None, "an alert's capture costs nothing it need be told of"
    assert node.service is not None and node.service.refusals.total == 0


def test_a_trigger_refused_by_the_cooldown_is_listed_everywhere(
        node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert node.service is not None
    event_log = AlertEventLog(EventLogConfig(path=str(tmp_path / "events.jsonl")))
    node.service.refusals.add_listener(CaptureEventLines(event_log).record_refusal)
    try:
        assert alert_capture(node).outcome == "captured"
        refused = alert_capture(node)
        assert refused.outcome == "refused" and "cooling down" in (refused.error or "")
        assert event_log.flush(timeout=10)
    finally:
        event_log.close()
    sock = str(node.socket)

    # Plain `captures ls`: the captures, and how many triggers were refused, pointing at --all.
    code, out, _ = cli(["captures", "ls", "--socket", sock], capsys)
    assert code == 0
    assert "1 capture trigger(s) refused since the agent started; `gpuscope captures ls --all`" in out
    assert "cooldown" not in out

    code, out, _ = cli(["captures", "ls", "--all", "--socket", sock], capsys)
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("REFUSED (UTC)"))
    assert lines[header].split()[:7] == ["REFUSED", "(UTC)", "TRIGGER", "GPU", "REASON", "NEXT", "ALLOWED"]
    row = lines[header + 1]
    assert "alert:GpuLowUtilization" in row and " cooldown " in row and "GPU 0 is cooling down" in row
    # NEXT ALLOWED and the message say the same time: one value, one wording.
    column, message = re.findall(r"at (\d\d:\d\d:\d\d) UTC", row)
    assert column == message and re.search(r"UTC \(in \d+m(\d+s)?\)", row), row

    code, out, _ = cli(["captures", "ls", "--all", "--json", "--socket", sock], capsys)
    document = json.loads(out)
    assert document["refused_count"] == 1 and len(document["captures"]) == 1
    [entry] = document["refused"]
    assert entry["reason"] == "cooldown" and entry["gpu"] == 0
    assert (entry["trigger"]["kind"], entry["trigger"]["alertname"]) == ("alert", "GpuLowUtilization")
    assert entry["allowed_at"] > entry["at"]

    # The control API: only on request (older clients see the same answer as before, plus a count).
    channel, stub = node.stub()
    with channel:
        plain = stub.ListCaptures(agent_pb2.ListCapturesRequest())
        assert plain.refused_count == 1 and not plain.refused_json
        listed = stub.ListCaptures(agent_pb2.ListCapturesRequest(include_refused=True))
    assert [r["reason"] for r in json.loads(listed.refused_json)] == ["cooldown"]

    # The event log: one line for the refusal, with its reason and when the next capture is allowed.
    lines_written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    [line] = [e for e in lines_written if e.get("event") == "capture_refused"]
    assert (line["reason"], line["name"], line["gpu"]) == ("cooldown", "GpuLowUtilization", 0)
    assert line["trigger"] == "alert"
    assert line["allowed_at"] == entry["allowed_at"] and "cooling down" in line["message"]

    # The HTTP API (opt-in) and the status page's captures section.
    with http_for(node) as server:
        status, body = get(server, "/api/v1/captures")
        assert status == 200 and "refused" not in json.loads(body) and json.loads(body)["refused_count"] == 1
        status, body = get(server, "/api/v1/captures?include_refused=1")
        assert status == 200 and [r["reason"] for r in json.loads(body)["refused"]] == ["cooldown"]
        status, body = get(server, "/api/v1/captures?include_refused=maybe")
        assert status == 400 and "include_refused must be one of" in json.loads(body)["error"]
        status, page_bytes = get(server, "/")
    page = page_bytes.decode()
    captures = page[page.index('<section id="captures">'):]
    assert "Refused triggers (newest 1 of 1 kept" in captures
    assert '<tr class="refusal">' in captures and ">cooldown</span>" in captures
    assert "next alert capture allowed in " in captures


def test_next_allowed_and_the_message_agree_however_late_they_are_listed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    wall = 1_764_335_000.0  # 13:03:20 UTC
    clock = [1000.0]
    policy = CapturePolicy(CaptureConfig(), clock=lambda: clock[0], wall_clock=lambda: wall + clock[0] - 1000)
    policy.release(policy.admit(ALERT, 0))
    clock[0] += 60
    refused = policy.admit(ALERT, 0)
    assert refused.reason.endswith("the next is allowed at 13:18:20 UTC (in 14m)")  # the reply, now
    kept = RefusedTrigger(at=wall + 60, trigger=ALERT, gpu=0, reason="cooldown",
                          message=refused.lasting_reason, allowed_at=refused.allowed_at)
    monkeypatch.setattr(time, "time", lambda: wall + 600)  # listed nine minutes later
    _print_refused([kept.to_json()], 1)
    row = capsys.readouterr().out.splitlines()[-1]
    assert "at 13:18:20 UTC (in 5m)" in row, row  # NEXT ALLOWED, as of the listing
    assert row.endswith("cooldown 15m (capture.cooldown); the next is allowed at 13:18:20 UTC"), row
    assert "14m" not in row, "no wait that was true only when the trigger was refused"
    monkeypatch.setattr(time, "time", lambda: wall + 3600)
    _print_refused([kept.to_json()], 1)
    assert " now " in capsys.readouterr().out.splitlines()[-1]


def test_only_the_newest_refusals_are_kept(tmp_path: Path) -> None:
    refusals = RefusalLog(limit=3)
    with running_node(tmp_path, snapshot=one_gpu_snapshot()) as node:
        assert node.service is not None
        node.service.refusals = refusals
        for n in range(5):  # longer than capture.max_duration: refused
            request = CaptureRequest(Trigger("user", user=f"user{n}"), gpu=0, duration_s=3600)
            assert node.service.submit(request).result(timeout=30).outcome == "refused"
    assert refusals.total == 5
    assert [r.trigger.user for r in refusals.recent()] == ["user4", "user3", "user2"]
    assert {r.reason for r in refusals.recent()} == {"duration"}
    assert [r.trigger.user for r in refusals.recent(1)] == ["user4"]


def test_a_refusal_log_needs_a_sensible_bound() -> None:
    for limit in (0, -1, 10_001, True, 2.5):
        with pytest.raises(ValueError, match="limit must be a whole number from 1 to 10000"):
            RefusalLog(limit=limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a refusal's allowed_at must be finite"):
        RefusedTrigger(at=1.0, trigger=ALERT, gpu=0, reason="cooldown", message="m", allowed_at=float("nan"))
