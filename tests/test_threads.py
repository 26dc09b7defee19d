"""A long-lived thread that dies is logged, fails its source and makes the agent not ready."""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_snapshot

from gpuscope.exporters.health import SourceHealthCollector
from gpuscope.health import SourceHealth
from gpuscope.threads import OnDemandThread, start_thread
from gpuscope.web.server import AgentHttpServer


def test_a_thread_that_dies_is_logged_and_fails_its_source_for_good(caplog: pytest.LogCaptureFixture) -> None:
    health = SourceHealth()
    health.record("nvml", success=True, duration_seconds=0.001)

    def buggy() -> None:
        raise KeyError("a bug no loop foresaw")

    with caplog.at_level(logging.ERROR, logger="gpuscope.threads"):
        start_thread("gpuscope-xid", buggy, health=health, source="nvml").join(timeout=5)
    assert "the gpuscope-xid thread died" in caplog.text and "KeyError" in caplog.text
    assert health.dead_threads() == ["gpuscope-xid"]
    health.record("nvml", success=True, duration_seconds=0.002)  # the sampler goes on reporting...
    assert health.runs()["nvml"].success is False  # ... but the source stays failed
    families = {f.name: f for f in SourceHealthCollector(health).collect()}
    assert {s.labels["collector"]: s.value for s in families["gpuscope_collector_success"].samples} == {
        "nvml": 0.0}


def test_a_thread_that_ends_normally_is_not_dead() -> None:
    health = SourceHealth()
    done = threading.Event()
    start_thread("gpuscope-pods", done.set, health=health, source="pods").join(timeout=5)
    assert done.is_set() and health.dead_threads() == [] and health.runs() == {}


def test_ready_names_a_dead_thread() -> None:
    health = SourceHealth()
    source = FakeSource(make_snapshot(monotonic=time.monotonic()))
    server = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(), source=source, health=health)
    server.start()
    try:
        url = f"http://127.0.0.1:{server.bound_address[1]}/-/ready"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
        health.thread_died("gpuscope-alertmanager", "alerts")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(url, timeout=5)
        assert caught.value.code == 503
        assert b"the gpuscope-alertmanager thread(s) died" in caught.value.read()
    finally:
        server.stop()


def test_threads_are_named_in_the_kernel_too() -> None:
    """``top -H`` and /proc/PID/task/TID/comm show which of the agent's threads uses the CPU."""
    seen: list[str] = []
    done = threading.Event()

    def body() -> None:
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())
        done.set()

    start_thread("gpuscope-analysis-worker", body).join(5)
    assert done.is_set()
    assert seen == ["gs-analysis-wor"]  # the kernel keeps 15 bytes


def test_an_on_demand_thread_starts_with_its_first_job_once_allowed() -> None:
    ran = threading.Event()
    worker = OnDemandThread("gpuscope-job", ran.set)
    worker.wake()  # not allowed yet: nothing starts
    assert worker.thread is None
    worker.allow()
    assert worker.thread is None  # no job yet
    worker.wake()
    assert worker.thread is not None
    worker.join(5)
    assert ran.is_set()
    first = worker.thread
    worker.wake()
    assert worker.thread is first  # one thread, however many jobs
    later = OnDemandThread("gpuscope-job", ran.set)
    later.allow(pending=True)  # jobs already queued: started at once
    assert later.thread is not None
    later.forbid()
    again = OnDemandThread("gpuscope-job", ran.set)
    again.forbid()
    again.wake()
    assert again.thread is None
