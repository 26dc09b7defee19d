"""The Xid watcher waits in NVML's event wait on its own thread. With a library whose wait polls (its
thread wakes many times while it waits, as in NVIDIA's mock library), that thread ends and the sampler
checks for Xid events without waiting once a tick, under its watchdog like a GPU read."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import pytest
from polling import wait_until

from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml import xid
from gpuscope.nvml.boundary import Nvml
from gpuscope.nvml.xid import POLL_MAX_EVENTS, XidWatcher
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation
from gpuscope.simulate.loader import parse_scenario
from gpuscope.snapshot import Snapshot


class SpinningNvml:
    """An event wait that wakes 200 times a second for its timeout (a library that polls); queued events
    are returned by a wait without timeout, which blocks while ``hang`` is set."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.calls: list[int] = []
        self.freed: list[object] = []
        self.lock = threading.Lock()
        self.hang = threading.Event()
        self.release = threading.Event()

    def xid_event_set(self, devices: list[Any]) -> object:
        return object()

    def free_event_set(self, event_set: object) -> None:
        self.freed.append(event_set)

    def wait_xid(self, event_set: object, devices: list[Any], timeout_ms: int) -> tuple[int, int] | None:
        with self.lock:
            self.calls.append(timeout_ms)
        if timeout_ms == 0:
            if self.hang.is_set():
                self.release.wait(10)
            with self.lock:
                return self.events.pop(0) if self.events else None
        end = time.monotonic() + 1.2
        while time.monotonic() < end:  # wakes every 5 ms, as a library that polls inside its wait does
            time.sleep(0.005)
        return None


class BlockingNvml(SpinningNvml):
    """An event wait that sleeps until an event comes or its timeout ends, as a driver's does: one call
    that lets the interpreter's lock go for its whole wait (``post`` wakes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = threading.Lock()
        self.wake.acquire()

    def post(self, *events: tuple[int, int]) -> None:
        with self.lock:
            self.events += events
        if self.wake.locked():
            self.wake.release()

    def wait_xid(self, event_set: object, devices: list[Any], timeout_ms: int) -> tuple[int, int] | None:
        with self.lock:
            self.calls.append(timeout_ms)
            if self.events:
                return self.events.pop(0)
        self.wake.acquire(timeout=timeout_ms / 1000)
        with self.lock:
            return self.events.pop(0) if self.events else None


def test_a_polling_event_wait_ends_the_thread_and_each_poll_counts_what_came() -> None:
    nvml = SpinningNvml()
    watcher = XidWatcher(nvml, [])  # type: ignore[arg-type]
    assert watcher.start()
    thread = watcher._thread
    assert thread is not None
    wait_until(lambda: watcher.polling)  # the first wait spins: the thread ends
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert nvml.calls == [xid._WAIT_MS]  # nothing asked since: the sampler's ticks ask from now on
    with nvml.lock:
        nvml.events += [(1, 79), (1, 79), (0, 48)]
    watcher.poll()  # drains what came, without waiting
    assert watcher.counts(1) == {79: 2} and watcher.counts(0) == {48: 1}
    assert nvml.calls[1:] == [0, 0, 0, 0]
    with nvml.lock:
        nvml.events += [(2, 13)] * (POLL_MAX_EVENTS + 6)  # a storm: one poll takes a bounded share
    watcher.poll()
    assert watcher.counts(2) == {13: POLL_MAX_EVENTS}
    watcher.poll()
    assert watcher.counts(2) == {13: POLL_MAX_EVENTS + 6}
    watcher.stop(timeout=0)
    assert len(nvml.freed) == 1
    calls = len(nvml.calls)
    watcher.poll()  # stopped: asks nothing of a freed event set
    assert len(nvml.calls) == calls


def test_the_event_set_is_not_freed_under_a_poll_in_flight() -> None:
    nvml = SpinningNvml()
    watcher = XidWatcher(nvml, [])  # type: ignore[arg-type]
    assert watcher.start()
    wait_until(lambda: watcher.polling)
    nvml.hang.set()
    stuck = threading.Thread(target=watcher.poll, daemon=True)
    stuck.start()
    wait_until(lambda: len(nvml.calls) == 2)
    watcher.stop(timeout=0)
    assert nvml.freed == []  # the stuck call still uses it
    nvml.release.set()
    stuck.join(timeout=5)
    watcher.stop(timeout=0)  # the sampler asks again once NVML is shut down
    assert len(nvml.freed) == 1


def test_a_driver_event_wait_keeps_its_thread_while_other_threads_keep_the_interpreter_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads spinning in Python make the waiting thread wait for the interpreter's lock on its way
    back from each wait; those waits are not the library's wake-ups."""
    monkeypatch.setattr(xid, "_WAIT_MS", 1200)
    nvml = BlockingNvml()
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(range(1000))

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(4)]
    for spinner in spinners:
        spinner.start()
    watcher = XidWatcher(nvml, [])  # type: ignore[arg-type]
    try:
        assert watcher.start()
        thread = watcher._thread
        assert thread is not None
        wait_until(lambda: len(nvml.calls) >= 3)  # two whole waits went by, each woken once
        assert thread.is_alive() and not watcher.polling
        nvml.post((3, 94), (3, 94))
        wait_until(lambda: watcher.counts(3) == {94: 2})
        assert set(nvml.calls) == {1200}
    finally:
        done.set()
        watcher.stop(timeout=2)
        for spinner in spinners:
            spinner.join(timeout=2)
    assert not thread.is_alive() and len(nvml.freed) == 1


class ManualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


XIDS = """
name: xid-polling
gpus:
  - {utilization: 0.9}
  - {utilization: 0.9, xid: [{at: 5s, code: 79}, {at: 6s, code: 79}, {at: 6s, code: 48}]}
  - {utilization: 0.9}
loop: false
"""


def xid_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpuscope-xid"]


def test_with_a_polling_library_the_sampler_ticks_count_the_xids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated library's event wait polls the scenario clock while an Xid can come: the watcher's
    thread ends, and each tick counts the Xids that came before it, in that tick's snapshot."""
    # Found polling after one 2.5 s wait (the simulator's wait wakes 50 times a second), not 10 s.
    monkeypatch.setattr(xid, "_WAIT_MS", 2500)
    clock = ManualClock(1.0)
    simulation = Simulation(parse_scenario(XIDS, source="xid-polling"), clock=clock, spawn_processes=False)
    simulation.install()
    sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock)
    try:
        assert sampler.tick().nvml_up
        watcher = sampler._xid
        assert watcher is not None
        wait_until(lambda: watcher.polling)
        wait_until(lambda: not xid_threads(), timeout=2)
        clock.now = 5.5
        assert sampler.tick().gpus[1].xid_errors == {79: 1}  # no waiting: counted by the tick itself
        clock.now = 7.0
        snap = sampler.tick()
        assert snap.gpus[1].xid_errors == {79: 2, 48: 1}
        assert not snap.gpus[0].xid_errors and not snap.gpus[2].xid_errors
        assert not xid_threads()
    finally:
        sampler.stop()
        simulation.uninstall()


def test_a_hung_xid_check_is_given_up_on_and_the_gpus_keep_reporting(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The check hangs as a GPU read can: the watchdog gives its thread up after stuck_after, a new
    sampler thread carries on reading every GPU, the check is not made again until the stuck one
    returns, and then it is. Real threads and the real clock."""
    monkeypatch.setattr(xid, "_WAIT_MS", 2500)  # found polling after one wait, as above
    caplog.set_level(logging.INFO, logger="gpuscope")
    simulation = Simulation(parse_scenario(XIDS.replace("at: 5s", "at: 1h").replace("at: 6s", "at: 2h"),
                                           source="xid-polling"), spawn_processes=False)
    simulation.install()
    sampler = Sampler(Nvml(), ProcessInspector(host_pid_namespace=True), interval_seconds=0.1,
                      stuck_after_seconds=0.5)
    checks: list[float] = []  # when each check (a wait without timeout) started
    hang, release = threading.Event(), threading.Event()
    wait_xid = sampler._nvml.wait_xid

    def hanging_wait_xid(event_set: Any, devices: Any, timeout_ms: int) -> tuple[int, int] | None:
        if timeout_ms == 0:
            checks.append(time.monotonic())
            if hang.is_set():
                release.wait(10)
        return wait_xid(event_set, devices, timeout_ms)

    monkeypatch.setattr(sampler._nvml, "wait_xid", hanging_wait_xid)
    snapshots: list[Snapshot] = []
    sampler.add_listener(snapshots.append)
    try:
        sampler.start()
        wait_until(lambda: len(checks) >= 3)  # polling: one check a tick
        hang.set()
        hung_from = len(checks)
        wait_until(lambda: snapshots[-1].nvml_stuck_calls_total == 1)
        given_up_at = len(snapshots)
        wait_until(lambda: len(snapshots) >= given_up_at + 10)  # a second of ticks while it hangs
        assert len(checks) == hung_from + 1, "no check while the stuck one holds"
        given_up = [s for s in snapshots if s.nvml_stuck_calls_total]
        assert all(g.up for s in snapshots for g in s.gpus) and all(len(s.gpus) == 3 for s in given_up)
        gaps = [b.monotonic - a.monotonic for a, b in itertools.pairwise(snapshots)]
        assert max(gaps) < 0.5 + 0.1 + 0.3, "the GPUs kept a fresh snapshot while the check hung"
        assert "Xid event check has not returned for 0.5s" in caplog.text
        release.set()
        wait_until(lambda: len(checks) >= hung_from + 4)  # checked again from the next tick
        assert "Xid event check that was stuck returned" in caplog.text
        assert sampler.stuck_calls_total == 1 and sampler.is_alive()
        started = time.monotonic()
    finally:
        release.set()
        sampler.stop()
        simulation.uninstall()
    assert time.monotonic() - started < 1.5
