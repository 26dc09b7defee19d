"""The HTTP connections' threads: a connection is served at once (never queued behind a slow one),
a thread that is done serves the next connection instead of ending, and one idle for long ends."""

from __future__ import annotations

import logging
import threading

import pytest
from polling import wait_until

from gpuscope.web.workers import ConnectionWorkers


def test_jobs_one_after_the_other_share_one_thread_which_ends_when_idle() -> None:
    workers = ConnectionWorkers("gpuscope-test-http", idle_seconds=0.5)
    ran: list[str] = []
    for n in range(5):
        done = threading.Event()
        workers.submit(lambda n=n, done=done: (ran.append(threading.current_thread().name), done.set()))
        assert done.wait(5)
        wait_until(lambda: workers._idle == 1)  # back to waiting for the next
    assert ran == ["gpuscope-test-http"] * 5
    assert workers.threads == 1
    wait_until(lambda: workers.threads == 0, timeout=5)  # idle for idle_seconds: gone
    done = threading.Event()
    workers.submit(done.set)  # and a new one comes with the next job
    assert done.wait(5)
    workers.close()
    wait_until(lambda: workers.threads == 0, timeout=5)  # close() ends an idle one at once
    with pytest.raises(RuntimeError, match="closed"):
        workers.submit(done.set)


def test_a_job_never_waits_behind_a_busy_one() -> None:
    workers = ConnectionWorkers("gpuscope-test-http", idle_seconds=30)
    release = threading.Event()
    started = [threading.Event() for _ in range(3)]
    try:
        for event in started:
            workers.submit(lambda event=event: (event.set(), release.wait(10)))
        for event in started:
            assert event.wait(5)  # all three run at once, on three threads
        assert workers.threads == 3
        release.set()
        wait_until(lambda: workers.threads == 1)  # the burst is over: one waits for the next, two end
        for _ in range(3):
            quick = threading.Event()
            workers.submit(quick.set)
            assert quick.wait(5)
            wait_until(lambda: workers._idle == 1)
        assert workers.threads == 1  # it served them all
    finally:
        release.set()
        workers.close()
    wait_until(lambda: workers.threads == 0, timeout=5)


def test_a_failing_job_is_logged_and_its_thread_serves_the_next(caplog: pytest.LogCaptureFixture) -> None:
    workers = ConnectionWorkers("gpuscope-test-http", idle_seconds=30)
    try:
        with caplog.at_level(logging.ERROR, logger="gpuscope.web.workers"):
            workers.submit(lambda: 1 / 0)
            wait_until(lambda: workers._idle == 1)
        assert "a connection's handler failed" in caplog.text and "ZeroDivisionError" in caplog.text
        done = threading.Event()
        workers.submit(done.set)
        assert done.wait(5) and workers.threads == 1
    finally:
        workers.close()
