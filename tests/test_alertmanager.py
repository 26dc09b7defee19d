"""AlertmanagerNotifier against a real Alertmanager (Debian's prometheus-alertmanager) on loopback.

Alertmanager runs with a single route to a receiver that notifies nobody, clustering off, storage in
the test's temporary directory. The tests read back what it holds through its own API
(``GET /api/v2/alerts``). A few tests that need an HTTP peer misbehaving on purpose (refusing, never
answering) use a bare socket or a tiny local server instead.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from agent_process import free_port, http_get, run_ready_server

from gpuscope.alerts.alertmanager import (
    ENDS_AT_RESEND_INTERVALS,
    AlertmanagerNotifier,
    alertmanager_endpoint,
    instance_label,
)
from gpuscope.alerts.config import AlertmanagerConfig
from gpuscope.alerts.inhibition import EQUAL_LABELS, INHIBITS
from gpuscope.alerts.model import Alert, Transition, TransitionState

pytestmark = pytest.mark.e2e

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
HOSTNAME = "node-7"
INSTANCE = "node-7:9847"
CONFIG = """\
route:
  receiver: "null"
  group_wait: 1h
receivers:
  - name: "null"
"""


def require_alertmanager() -> str:
    if ALERTMANAGER is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus-alertmanager is not installed; scripts/test.sh installs it")
        pytest.skip("prometheus-alertmanager is not installed (scripts/test.sh installs it)")
    return ALERTMANAGER


@contextmanager
def run_alertmanager(directory: Path, port: int, config_text: str = CONFIG) -> Iterator[str]:
    """An Alertmanager on 127.0.0.1:port with this configuration until the block ends; yields its
    base URL."""
    binary = require_alertmanager()
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "alertmanager.yml"
    config.write_text(config_text)
    argv = [binary, f"--config.file={config}", f"--storage.path={directory / 'data'}",
            "--cluster.listen-address=", f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with run_ready_server(argv, f"http://127.0.0.1:{port}", directory / "alertmanager.log", "alertmanager",
                          timeout=30) as base:
        yield base


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_alertmanager(tmp_path_factory.mktemp("alertmanager"), free_port()) as base:
        yield base


# -- helpers -----------------------------------------------------------------------------------------


class FakeAlertSource:
    def __init__(self) -> None:
        self.current: list[Alert] = []

    def alerts(self) -> list[Alert]:
        return list(self.current)

    def transition_counts(self) -> Mapping[tuple[str, TransitionState], int]:
        return {}


def make_transition(name: str, state: TransitionState, *, gpu: int = 1, at: float | None = None,
                    labels: Mapping[str, str] | None = None) -> Transition:
    now = time.time() if at is None else at
    return Transition(
        name=name, gpu=gpu, uuid=f"GPU-{gpu:08d}-test", severity="warning", hostname=HOSTNAME,
        previous={"pending": None, "firing": "pending", "resolved": "firing", "inactive": "pending",
                  "inhibited": "firing"}[state],
        state=state, at=now, active_since=now - 120, values={"mean_utilization": 0.55, "processes": 1.0},
        summary=f"GPU {gpu} mean utilization 55% < 80% over 2m", labels=labels or {},
    )


def make_alert(name: str, *, gpu: int = 1) -> Alert:
    now = time.time()
    return Alert(name=name, gpu=gpu, uuid=f"GPU-{gpu:08d}-test", severity="critical", state="firing",
                 hostname=HOSTNAME, active_since=now - 60, firing_since=now - 30, values={"xid": 79.0},
                 summary=f"GPU {gpu} fell off the bus (Xid 79)")


@contextmanager
def notifier_for(url: str, source: FakeAlertSource | None = None, **options: Any,
                 ) -> Iterator[AlertmanagerNotifier]:
    resend = options.pop("resend_interval", 60.0)
    config = AlertmanagerConfig(url=url, resend_interval=resend, timeout=options.pop("timeout", 2.0))
    notifier = AlertmanagerNotifier(config, source or FakeAlertSource(), hostname=HOSTNAME, instance=INSTANCE,
                                    **options)
    notifier.start()
    try:
        yield notifier
    finally:
        notifier.stop()


def active_alerts(base: str, alertname: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"active": "true", "filter": f'alertname="{alertname}"'})
    status, body = http_get(f"{base}/api/v2/alerts?{query}")
    assert status == 200, body
    alerts: list[dict[str, Any]] = json.loads(body)
    return alerts


T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], what: str, timeout: float = 10.0,
               diagnostics: Callable[[], str] = lambda: "") -> T:
    """The first truthy result of ``predicate``, polled until ``timeout``; the failure names ``what``
    and appends ``diagnostics()`` (e.g. the tails of the servers' logs)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{diagnostics()}")
        time.sleep(0.05)


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# -- against a real Alertmanager ---------------------------------------------------------------------


def test_firing_transition_is_listed_with_its_labels(alertmanager: str) -> None:
    with notifier_for(alertmanager) as notifier:
        firing = make_transition("GpuLowUtilization", "firing", labels={"job_id": "train-42"})
        notifier(firing)
        (alert,) = wait_until(lambda: active_alerts(alertmanager, "GpuLowUtilization"), "the alert")
    assert alert["labels"] == {
        "alertname": "GpuLowUtilization", "gpu": "1", "uuid": "GPU-00000001-test", "severity": "warning",
        "instance": INSTANCE, "hostname": HOSTNAME, "job_id": "train-42",
    }
    assert alert["annotations"] == {"summary": firing.summary,
                                    "description": "mean_utilization=0.55, processes=1"}
    assert alert["status"]["state"] == "active"
    assert abs(parse_time(alert["startsAt"]) - firing.active_since) < 0.01
    ends_in = parse_time(alert["endsAt"]) - time.time()
    assert 60 * ENDS_AT_RESEND_INTERVALS - 15 < ends_in <= 60 * ENDS_AT_RESEND_INTERVALS
    assert alert["generatorURL"] == f"http://{INSTANCE}/api/v1/alerts"
    # (Alertmanager lists the alert a moment before the worker has read its answer.)
    wait_until(lambda: notifier.pushes == 1 and notifier.queued == 0, "the push to complete")
    assert notifier.errors == 0


def test_resolved_transition_ends_the_alert(alertmanager: str) -> None:
    with notifier_for(alertmanager) as notifier:
        notifier(make_transition("GpuSharedByProcesses", "firing", gpu=2))
        wait_until(lambda: active_alerts(alertmanager, "GpuSharedByProcesses"), "the firing alert")
        notifier(make_transition("GpuSharedByProcesses", "resolved", gpu=2))
        wait_until(lambda: not active_alerts(alertmanager, "GpuSharedByProcesses"), "the alert to resolve")
        wait_until(lambda: notifier.pushes == 2, "the push to complete")


def test_pending_and_inactive_transitions_are_not_pushed(alertmanager: str) -> None:
    with notifier_for(alertmanager) as notifier:
        notifier(make_transition("GpuBusyButStalled", "pending", gpu=3))
        notifier(make_transition("GpuBusyButStalled", "inactive", gpu=3))
        notifier(make_transition("GpuUtilizationSkew", "firing", gpu=3))  # a marker that comes after
        wait_until(lambda: active_alerts(alertmanager, "GpuUtilizationSkew"), "the marker alert")
        assert active_alerts(alertmanager, "GpuBusyButStalled") == []
        wait_until(lambda: notifier.pushes == 1, "the push to complete")
        time.sleep(0.1)
        assert notifier.pushes == 1


def test_resend_keeps_firing_alerts_alive(alertmanager: str) -> None:
    source = FakeAlertSource()
    source.current = [make_alert("GpuXidError", gpu=4)]
    resend = 0.25  # endsAt = now + 1 s: without re-sends Alertmanager would resolve it within 1 s
    with notifier_for(alertmanager, source, resend_interval=resend) as notifier:
        # No transition at all: the periodic re-send alone delivers what the source says is firing.
        (first,) = wait_until(lambda: active_alerts(alertmanager, "GpuXidError"), "the re-sent alert")
        assert first["labels"]["severity"] == "critical"
        assert abs(parse_time(first["startsAt"]) - source.current[0].active_since) < 0.01
        # Six re-sends later (1.25 s or more) the first push's endsAt (1 s ahead) is long past: the
        # alert is still active only because each re-send moved endsAt on.
        pushes = notifier.pushes
        wait_until(lambda: notifier.pushes >= pushes + 6, "six more re-sends")
        (later,) = active_alerts(alertmanager, "GpuXidError")
        assert parse_time(later["endsAt"]) > parse_time(first["endsAt"]) + 0.75
        assert parse_time(later["startsAt"]) == parse_time(first["startsAt"])
        # The agent stops re-sending (it died, or the alert vanished with its GPU): Alertmanager
        # resolves the alert by itself once endsAt passes.
        source.current = []
        wait_until(lambda: not active_alerts(alertmanager, "GpuXidError"), "the alert to time out", 5.0)


def test_invalid_extra_labels_are_left_out_not_refused(alertmanager: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpuscope.alerts.alertmanager"), notifier_for(
            alertmanager) as notifier:
        labels = {"bad-name": "x", "__reserved": "y", "alertname": "Spoofed", "empty": "", "ok": "1"}
        notifier(make_transition("GpuThrottled", "firing", gpu=5, labels=labels))
        (alert,) = wait_until(lambda: active_alerts(alertmanager, "GpuThrottled"), "the alert")
    assert alert["labels"]["ok"] == "1"
    assert alert["labels"]["alertname"] == "GpuThrottled"
    assert not {"bad-name", "__reserved", "empty"} & set(alert["labels"])
    assert "bad-name" in caplog.text
    assert notifier.errors == 0 and notifier.dropped == 0


def test_alertmanager_down_then_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    require_alertmanager()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with caplog.at_level(logging.DEBUG, logger="gpuscope.alerts.alertmanager"), notifier_for(
            base, retry_initial_seconds=0.05, retry_max_seconds=0.2) as notifier:
        started = time.monotonic()
        notifier(make_transition("GpuFrequentIdleDips", "firing", gpu=6))
        assert time.monotonic() - started < 0.05, "the listener must not wait for the network"
        wait_until(lambda: notifier.errors >= 3, "retries")
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, "an outage is logged once"
        assert notifier.queued == 1
        with run_alertmanager(tmp_path / "am", port):
            (alert,) = wait_until(lambda: active_alerts(base, "GpuFrequentIdleDips"), "delivery after start")
            assert alert["labels"]["gpu"] == "6"
            wait_until(lambda: notifier.queued == 0, "the queue to empty")
            wait_until(lambda: "reachable again" in caplog.text, "the recovery to be logged")


# -- misbehaving peers (no Alertmanager needed) ------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    status = 200
    bodies: list[Any] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        payload = json.loads(self.rfile.read(length))
        type(self).bodies.append((self.path, self.headers["Content-Type"], payload))
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"answer")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def recorder(status: int) -> Iterator[tuple[str, list[Any]]]:
    class Handler(_Recorder):
        pass

    Handler.status, Handler.bodies = status, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/prefix/", Handler.bodies
    finally:
        server.shutdown()
        server.server_close()


def test_payload_shape_and_path_prefix() -> None:
    with recorder(200) as (url, bodies), notifier_for(url) as notifier:
        transition = make_transition("GpuLowUtilization", "resolved", at=1_700_000_000.0)
        notifier(transition)
        wait_until(lambda: bodies, "a push")
    ((path, content_type, payload),) = bodies
    assert (path, content_type) == ("/prefix/api/v2/alerts", "application/json")
    assert payload == [{
        "labels": {"alertname": "GpuLowUtilization", "gpu": "1", "uuid": "GPU-00000001-test",
                   "severity": "warning", "instance": INSTANCE, "hostname": HOSTNAME},
        "annotations": {"summary": transition.summary, "description": "mean_utilization=0.55, processes=1"},
        "startsAt": "2023-11-14T22:11:20.000Z",
        "endsAt": "2023-11-14T22:13:20.000Z",
        "generatorURL": f"http://{INSTANCE}/api/v1/alerts",
    }]


def test_the_latest_state_of_an_alert_replaces_an_undelivered_one() -> None:
    with recorder(200) as (url, bodies):
        notifier = AlertmanagerNotifier(AlertmanagerConfig(url=url), FakeAlertSource(), hostname=HOSTNAME,
                                        instance=INSTANCE)
        notifier(make_transition("GpuLowUtilization", "firing"))
        notifier(make_transition("GpuLowUtilization", "resolved"))
        notifier(make_transition("GpuLowUtilization", "firing", gpu=2))
        assert notifier.queued == 2
        notifier.start()
        try:
            wait_until(lambda: bodies, "a push")
        finally:
            notifier.stop()
    ((_, _, payload),) = bodies
    assert [(a["labels"]["gpu"], parse_time(a["endsAt"]) < time.time()) for a in payload] == [
        ("1", True), ("2", False)]


def test_refused_payload_is_dropped_not_retried(caplog: pytest.LogCaptureFixture) -> None:
    with recorder(400) as (url, bodies), notifier_for(url, retry_initial_seconds=0.01) as notifier:
        notifier(make_transition("GpuLowUtilization", "firing"))
        wait_until(lambda: notifier.dropped == 1, "the refusal")
        time.sleep(0.2)
        assert len(bodies) == 1
        assert notifier.queued == 0
    assert "refused" in caplog.text


def test_server_errors_are_retried() -> None:
    with recorder(503) as (url, bodies), notifier_for(url, retry_initial_seconds=0.01,
                                                      retry_max_seconds=0.02) as notifier:
        notifier(make_transition("GpuLowUtilization", "firing"))
        wait_until(lambda: len(bodies) >= 3, "retries")
        assert notifier.queued == 1 and notifier.errors >= 2


def test_queue_is_bounded_dropping_the_oldest(caplog: pytest.LogCaptureFixture) -> None:
    notifier = AlertmanagerNotifier(AlertmanagerConfig(url="http://127.0.0.1:1"), FakeAlertSource(),
                                    hostname=HOSTNAME, instance=INSTANCE, max_pending=3)
    with caplog.at_level(logging.WARNING, logger="gpuscope.alerts.alertmanager"):
        for gpu in range(10):
            notifier(make_transition("GpuLowUtilization", "firing", gpu=gpu))
    assert (notifier.queued, notifier.dropped) == (3, 7)
    assert len(caplog.records) == 1


def test_stop_is_prompt_while_a_push_hangs() -> None:
    # A peer that accepts the connection (the kernel's backlog) and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with notifier_for(url, timeout=30.0) as notifier:
            notifier(make_transition("GpuLowUtilization", "firing"))
            time.sleep(0.2)  # the push is in flight
            started = time.monotonic()
            notifier.stop()
            assert time.monotonic() - started < 2.0
            started = time.monotonic()
            notifier(make_transition("GpuLowUtilization", "resolved"))  # still harmless after stop
            assert time.monotonic() - started < 0.05


@pytest.mark.parametrize(("url", "endpoint"), [
    ("http://alertmanager:9093", "http://alertmanager:9093/api/v2/alerts"),
    ("http://alertmanager:9093/", "http://alertmanager:9093/api/v2/alerts"),
    ("https://am.example.org/alertmanager/", "https://am.example.org/alertmanager/api/v2/alerts"),
    ("http://[::1]:9093", "http://[::1]:9093/api/v2/alerts"),
    ("HTTP://AM:9093", "http://am:9093/api/v2/alerts"),
])
def test_endpoint_from_base_url(url: str, endpoint: str) -> None:
    assert alertmanager_endpoint(url) == endpoint


@pytest.mark.parametrize("url", [
    None, "", "alertmanager:9093", "ftp://am:9093", "file:///etc/passwd", "http://", "http://:9093",
    "http://user:pw@am:9093", "http://am:9093/?x=1", "http://am:9093/#frag", "http://am:9093/a/../b",
    "http://am:9093/..", "http://am:9093/%2e%2e/x", "http://am:9093/a/./b", "http://am:99999",
    "http://am:9093/a b", "http://am:9093/a\\b", "http://am:9093//x",
])
def test_bad_urls_are_refused_with_a_hint(url: str | None) -> None:
    with pytest.raises(ValueError, match=r"Alertmanager URL|alertmanager\.url"):
        alertmanager_endpoint(url)
    with pytest.raises(ValueError):
        AlertmanagerNotifier(AlertmanagerConfig(url=url), FakeAlertSource(), hostname=HOSTNAME,
                             instance=INSTANCE)


def test_refused_resend_waits_for_the_next_interval() -> None:
    source = FakeAlertSource()
    source.current = [make_alert("GpuXidError")]
    with recorder(400) as (url, bodies), notifier_for(url, source, resend_interval=0.2) as notifier:
        started = time.monotonic()
        wait_until(lambda: len(bodies) >= 4, "four re-sends")
        # One per interval, refused or not: a refusal does not make it retry at once.
        assert time.monotonic() - started >= 3 * 0.2
        wait_until(lambda: notifier.errors >= 4, "the refusals to be counted")


@pytest.mark.parametrize(("host", "port", "expected"), [
    ("", 9847, "node-7:9847"), ("0.0.0.0", 9847, "node-7:9847"), ("::", 9847, "node-7:9847"),
    ("127.0.0.1", 1234, "127.0.0.1:1234"), ("::1", 9847, "[::1]:9847"),
    ("gpu7.example.org", 80, "gpu7.example.org:80"),
])
def test_instance_label(host: str, port: int, expected: str) -> None:
    assert instance_label(host, port, HOSTNAME) == expected


# -- inhibition ---------------------------------------------------------------------------------------

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "alertmanager" / "alertmanager.yml"


def test_a_firing_alert_that_becomes_inhibited_ends_and_is_not_resent(alertmanager: str) -> None:
    source = FakeAlertSource()
    with notifier_for(alertmanager, source, resend_interval=0.2) as notifier:
        notifier(make_transition("GpuFrequentIdleDips", "firing", gpu=2))
        wait_until(lambda: active_alerts(alertmanager, "GpuFrequentIdleDips"), "the firing alert")
        notifier(replace(make_transition("GpuFrequentIdleDips", "inhibited", gpu=2),
                         inhibited_by="GpuHeldIdle"))
        # The source still lists it (its state machine goes on), muted: the resends leave it out.
        source.current = [replace(make_alert("GpuFrequentIdleDips", gpu=2), inhibited_by="GpuHeldIdle")]
        wait_until(lambda: not active_alerts(alertmanager, "GpuFrequentIdleDips"), "the alert to end")
        time.sleep(0.6)  # three resend intervals: nothing brings it back
        assert active_alerts(alertmanager, "GpuFrequentIdleDips") == []


def test_only_the_inhibition_of_a_firing_alert_is_queued() -> None:
    config = AlertmanagerConfig(url="http://127.0.0.1:9/", resend_interval=60.0, timeout=1.0)
    notifier = AlertmanagerNotifier(config, FakeAlertSource(), hostname=HOSTNAME, instance=INSTANCE)
    muted = replace(make_transition("GpuLowUtilization", "inhibited"), inhibited_by="GpuHeldIdle")
    notifier(replace(muted, previous="pending"))  # never pushed while pending: nothing to end
    assert len(notifier._pending) == 0
    notifier(muted)
    (queued,) = notifier._pending.values()
    assert queued is muted


def test_the_shipped_alertmanager_configuration_inhibits_as_the_agent_does(tmp_path: Path) -> None:
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    shipped: dict[str, set[str]] = {}
    for rule in config["inhibit_rules"]:
        (source,) = rule["source_matchers"]
        (targets,) = rule["target_matchers"]
        assert source.startswith("alertname=") and targets.startswith("alertname=~"), rule
        shipped[source.split("=", 1)[1].strip('"')] = set(targets.split("=~", 1)[1].strip('"').split("|"))
        assert rule["equal"] == ["instance", *EQUAL_LABELS]
    assert shipped == {name: set(muted) for name, muted in INHIBITS.items()}

    def alert(name: str, gpu: str, **labels: str) -> dict[str, Any]:
        return {"labels": {"alertname": name, "instance": "node-7:9847", "gpu": gpu, "severity": "warning",
                           **labels},
                "annotations": {"summary": name}, "generatorURL": "http://node-7:9847/"}

    with run_alertmanager(tmp_path, free_port(), SHIPPED_CONFIG.read_text()) as base:
        alerts = [alert("GpuHeldIdle", "0", pid="4242"), alert("GpuLowUtilization", "0"),
                  alert("GpuSharedByProcesses", "0"), alert("GpuLowUtilization", "1"),
                  alert("GpuXidError", "0"), alert("GpuHeldIdle", "3", gpu_instance="1"),
                  alert("GpuLowUtilization", "3", gpu_instance="1"), alert("GpuLowUtilization", "3",
                                                                          gpu_instance="2")]
        request = urllib.request.Request(f"{base}/api/v2/alerts", data=json.dumps(alerts).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200

        def states() -> dict[tuple[str, str, str], str] | None:
            status, body = http_get(f"{base}/api/v2/alerts")
            found = {(a["labels"]["alertname"], a["labels"]["gpu"], a["labels"].get("gpu_instance", "")):
                     a["status"]["state"] for a in json.loads(body)}
            return found if status == 200 and len(found) == len(alerts) and "suppressed" in found.values() \
                else None

        seen = wait_until(states, "Alertmanager to list the alerts with their inhibition")
    assert seen == {
        ("GpuHeldIdle", "0", ""): "active", ("GpuLowUtilization", "0", ""): "suppressed",
        ("GpuSharedByProcesses", "0", ""): "suppressed", ("GpuLowUtilization", "1", ""): "active",
        ("GpuXidError", "0", ""): "active", ("GpuHeldIdle", "3", "1"): "active",
        ("GpuLowUtilization", "3", "1"): "suppressed", ("GpuLowUtilization", "3", "2"): "active",
    }
