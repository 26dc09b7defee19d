"""The sampler over the simulated NVML: the real pynvml wrappers and the real boundary run."""

from __future__ import annotations

import ctypes.util
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml import boundary, decoding, gpm
from gpuscope.nvml.boundary import Nvml
from gpuscope.nvml.readings import DeviceReadings
from gpuscope.sampling.read_guard import ReadGuard
from gpuscope.sampling.sampler import PLAIN_READINGS, Sampler
from gpuscope.simulate import Simulation, load_scenario
from gpuscope.simulate.loader import parse_scenario
from gpuscope.snapshot import GpuReading, Snapshot


class ManualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1.0)


def make_sampler(clock: ManualClock, **kwargs: float) -> Sampler:
    return Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                   retry_initial_seconds=1.0, retry_max_seconds=4.0, **kwargs)


@pytest.fixture
def simulate(clock: ManualClock) -> Iterator[object]:
    """simulate(name_or_yaml) installs a scenario on the manual clock; uninstalled after the test."""
    sims: list[Simulation] = []

    def start(name: str, text: str | None = None, spawn: bool = True) -> Simulation:
        scenario = parse_scenario(text, source=name) if text is not None else load_scenario(name)
        sim = Simulation(scenario, clock=clock, spawn_processes=spawn)
        sim.install()
        sims.append(sim)
        return sim

    yield start
    for sim in sims:
        sim.uninstall()


def ticks(sampler: Sampler, clock: ManualClock, until: float, step: float = 1.0) -> Snapshot:
    snap = sampler.tick()
    while clock.now + step <= until:
        clock.now += step
        snap = sampler.tick()
    return snap


def test_healthy_node_readings_and_process_mapping(simulate, clock: ManualClock) -> None:
    sim = simulate("healthy")
    sampler = make_sampler(clock)
    first = sampler.tick()
    clock.now += 1.0
    snap = sampler.tick()
    assert snap.nvml_up and snap.driver_version
    assert [g.index for g in snap.gpus] == [0, 1, 2, 3]
    helper_pids = set(sim.helper_pids.values())
    for gpu in snap.gpus:
        assert gpu.up and gpu.uuid.startswith("GPU-") and gpu.name and gpu.pci_bus_id
        assert gpu.utilization_ratio is not None and gpu.utilization_ratio >= 0.85
        assert 5 <= len(gpu.utilization_samples) <= 7  # ~6 driver samples per second
        assert gpu.memory_total_bytes and gpu.memory_used_bytes
        assert gpu.memory_used_bytes < gpu.memory_total_bytes
        assert gpu.memory_reserved_bytes is not None
        assert gpu.power_watts and gpu.power_limit_watts and gpu.power_watts <= gpu.power_limit_watts
        assert gpu.temperature_celsius and gpu.sm_clock_hertz and gpu.sm_clock_hertz > 1e8
        assert gpu.sm_active_ratio is not None  # H100: GPM present from the second tick on
        assert gpu.pcie_tx_bytes_total is not None and gpu.ecc_uncorrected_errors_total == 0
        assert gpu.clock_event_reasons is not None and not gpu.clock_event_reasons - {"gpu_idle"}
        assert gpu.idle_dips_total == 0
        (proc,) = gpu.compute_processes
        assert proc.pid in helper_pids and proc.host_visible
        assert proc.name == f"train-rank{gpu.index}"
        assert proc.user and proc.sm_utilization_ratio is not None and proc.sm_utilization_ratio > 0.5
        assert proc.cmdline is None  # not collected unless opted in
    # Energy is a counter: it grew by about the power over the one second between the ticks.
    for before, after in zip(first.gpus, snap.gpus, strict=True):
        assert before.energy_joules_total is not None and after.energy_joules_total is not None
        grown = after.energy_joules_total - before.energy_joules_total
        assert 0.5 * (after.power_watts or 0) < grown < 1.5 * (after.power_watts or 0)
    assert first.gpus[0].sm_active_ratio is None  # GPM needs two samples


def test_input_bound_gpu_counts_idle_dips(simulate, clock: ManualClock) -> None:
    simulate("input-bound")
    sampler = make_sampler(clock)
    snap = ticks(sampler, clock, until=clock.now + 20)
    dips = {g.index: g.idle_dips_total for g in snap.gpus}
    assert any(d and d >= 10 for d in dips.values()), dips  # one dip per step over ~20 s
    bound = max(snap.gpus, key=lambda g: g.idle_dips_total or 0)
    assert bound.utilization_ratio is not None and bound.utilization_ratio < 0.8


def test_lost_gpu_goes_down_alone_is_logged_once_and_comes_back(
        simulate, clock: ManualClock, caplog: pytest.LogCaptureFixture) -> None:
    simulate("gpu-lost")
    sampler = make_sampler(clock)
    caplog.set_level(logging.INFO, logger="gpuscope")
    snap = ticks(sampler, clock, until=15)
    assert all(g.up for g in snap.gpus)
    snap = ticks(sampler, clock, until=30)
    assert [g.up for g in snap.gpus] == [True, False, True, True]
    lost = snap.gpus[1]
    assert lost.uuid and lost.utilization_ratio is None and lost.processes == ()
    assert all(g.utilization_ratio for g in snap.gpus if g.index != 1)  # the others keep reporting
    assert sum("is lost" in r.getMessage() for r in caplog.records) == 1
    snap = ticks(sampler, clock, until=45)
    assert all(g.up for g in snap.gpus)
    assert sum("readable again" in r.getMessage() for r in caplog.records) == 1


def test_xid_events_are_counted_per_gpu(simulate, clock: ManualClock) -> None:
    simulate("gpu-lost")
    sampler = make_sampler(clock)
    ticks(sampler, clock, until=21)  # the scenario raises Xid 79 on GPU 1 at 20 s
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        snap = sampler.tick()
        if snap.gpus[1].xid_errors:
            break
        time.sleep(0.05)
    sampler.stop()
    assert dict(snap.gpus[1].xid_errors) == {79: 1}
    assert all(not g.xid_errors for g in snap.gpus if g.index != 1)


FAILING_POWER = """
name: failing-power
duration: 1m
gpus:
  - utilization: 0.9
    failures: [{function: nvmlDeviceGetPowerUsage, from: 3s, to: 8s}]
  - utilization: 0.9
"""


def test_a_failing_reading_is_absent_counted_and_logged_once(
        simulate, clock: ManualClock, caplog: pytest.LogCaptureFixture) -> None:
    simulate("failing-power", FAILING_POWER)
    sampler = make_sampler(clock)
    caplog.set_level(logging.INFO, logger="gpuscope")
    snap = ticks(sampler, clock, until=7)  # 1..7 s: failing from 3 s, five ticks
    assert snap.gpus[0].power_watts is None
    assert snap.gpus[0].energy_joules_total is not None  # the other readings of that GPU are unaffected
    assert snap.gpus[1].power_watts is not None
    assert snap.sample_errors == {"power": 5}
    warnings = [r for r in caplog.records if "power failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    snap = ticks(sampler, clock, until=10)
    assert snap.gpus[0].power_watts is not None
    assert sum("works again" in r.getMessage() for r in caplog.records) == 1


def test_unsupported_readings_are_absent_not_zero(simulate, clock: ManualClock) -> None:
    simulate("legacy")
    sampler = make_sampler(clock)
    first = sampler.tick()
    clock.now += 2.0
    snap = sampler.tick()
    gpu = snap.gpus[0]
    assert gpu.up
    assert gpu.sm_active_ratio is None and gpu.tensor_active_ratio is None  # no GPM before Hopper
    assert gpu.ecc_uncorrected_errors_total is None
    # No PCIe byte counters: the throughput API is integrated into a counter instead.
    assert first.gpus[0].pcie_tx_bytes_total == 0.0
    assert gpu.pcie_tx_bytes_total is not None and gpu.pcie_tx_bytes_total > 0


def test_mig_gpu_reports_what_nvml_gives(simulate, clock: ManualClock) -> None:
    simulate("mig")
    sampler = make_sampler(clock)
    snap = ticks(sampler, clock, until=4)
    mig = [g for g in snap.gpus if g.mig_enabled]
    assert len(mig) == 1 and all(g.up for g in snap.gpus)
    gpu = mig[0]
    assert gpu.utilization_samples == () and gpu.idle_dips_total is None
    assert gpu.sm_active_ratio is None
    assert gpu.memory_used_bytes is not None and gpu.power_watts is not None
    assert all(p.sm_utilization_ratio is None for p in gpu.processes)


UNMAPPABLE = """
name: foreign-pid
duration: 1m
gpus:
  - utilization: 0.9
    processes: [{name: elsewhere, pid: 4194999, memory: 1GiB}, {name: here, spawn: true, memory: 2GiB}]
"""


def test_a_pid_without_host_details_is_reported_not_dropped(simulate, clock: ManualClock) -> None:
    simulate("foreign-pid", UNMAPPABLE)
    snap = ticks(make_sampler(clock), clock, until=3)
    procs = {p.memory_used_bytes: p for p in snap.gpus[0].processes}
    foreign, here = procs[2**30], procs[2 * 2**30]
    assert foreign.pid == 4194999 and not foreign.host_visible and foreign.name is None
    assert here.host_visible and here.name == "here"


def test_no_driver_then_driver_appears_with_backoff(simulate, clock: ManualClock,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    simulate("no-driver")
    caplog.set_level(logging.DEBUG, logger="gpuscope")
    sampler = make_sampler(clock)
    tries = []
    original = sampler._nvml.init

    def counting_init() -> None:
        tries.append(clock.now)
        original()

    sampler._nvml.init = counting_init  # type: ignore[method-assign]
    snap = sampler.tick()
    assert not snap.nvml_up and snap.gpus == ()
    for _ in range(20):  # half-second ticks; the driver appears at 5 s, the retry after it at 8 s
        clock.now += 0.5
        snap = sampler.tick()
        if snap.nvml_up:
            break
    assert snap.nvml_up and len(snap.gpus) == 2
    assert tries == [1.0, 2.0, 4.0, 8.0]  # back-off doubles: 1 s, 2 s, 4 s; never once per tick
    hints = [r for r in caplog.records if "NVML is not available" in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == logging.WARNING


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has NVML")
def test_real_pynvml_without_a_driver_reports_nvml_down(clock: ManualClock) -> None:
    snap = make_sampler(clock).tick()
    assert not snap.nvml_up and snap.gpus == () and snap.driver_version is None


def test_field_by_field_fallbacks_read_what_the_struct_fast_path_reads(
        simulate, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """pynvml's structures are decoded with struct at the offsets ctypes gives; with another pynvml
    whose types are laid out otherwise, each field is read by name instead. Both must agree."""
    simulate("demo", spawn=False)
    start = clock.now

    def read_twice() -> list[DeviceReadings]:
        clock.now = start
        nvml = Nvml(clock=clock)
        nvml.init()
        devices = nvml.devices()
        first = [nvml.read(device) for device in devices]  # primes the cursors and GPM's first sample
        clock.now += 1.0
        return first + [nvml.read(device) for device in devices]

    fast = read_twice()
    for module, name in ((boundary, "_MEMORY_LAYOUT"), (boundary, "_UTILIZATION_LAYOUT"),
                         (boundary, "PCIE_FIELD_LAYOUT"), (decoding, "_FIELD_VALUE_LAYOUT"),
                         (decoding, "_PROCESS_SAMPLE_LAYOUT"), (decoding, "_SAMPLE_UINT_LAYOUT")):
        monkeypatch.setattr(module, name, None)
    monkeypatch.setattr(decoding, "_SAMPLE_LAYOUTS", {})
    monkeypatch.setattr(gpm, "_RESULTS", {})
    slow = read_twice()
    assert slow == fast
    second = fast[len(fast) // 2:]
    assert all(r.memory_total_bytes and r.new_utilization_samples for r in second)
    assert any(r.sm_active_ratio is not None for r in second) and any(r.pcie is not None for r in second)
    assert any(r.new_process_samples for r in second)


def test_each_reading_reaches_the_snapshot_plainly_or_derived() -> None:
    """A DeviceReadings field named like a GpuReading field is copied as it is; the others are what
    the sampler derives the Snapshot's values from, so none may share a Snapshot field's name."""
    derived = {"new_utilization_samples", "utilization_samples_from_history", "rate_utilization_ratio",
               "energy_counter_joules", "clock_event_mask", "pcie", "nvml_processes", "new_process_samples",
               "process_samples_from_history", "gpm_interval_seconds", "mig_readings"}
    readings = {f.name for f in dataclasses.fields(DeviceReadings)}
    assert set(PLAIN_READINGS) == readings - derived
    assert not derived & {f.name for f in dataclasses.fields(GpuReading)}


def test_a_failed_enumeration_is_retried_never_up_with_no_gpus(simulate, clock: ManualClock,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """nvmlDeviceGetCount fails for the first 5 s (a driver settling at boot): NVML is reported down,
    not up with 0 GPUs, and enumeration is tried again with the init back-off."""
    simulate("count-fails", """
name: count-fails
driver: {count_fails_until: 5s}
gpus: [{utilization: 0.9}, {utilization: 0.9}]
""", spawn=False)
    caplog.set_level(logging.DEBUG, logger="gpuscope")
    sampler = make_sampler(clock)
    seen = []
    for _ in range(20):
        snap = sampler.tick()
        seen.append((clock.now, snap.nvml_up, len(snap.gpus)))
        clock.now += 0.5
    assert all(not up and gpus == 0 for now, up, gpus in seen if now < 5)
    assert not any(up and gpus == 0 for _, up, gpus in seen), "never NVML up with no GPUs"
    assert seen[-1][1:] == (True, 2)  # tried at 1, 2 and 4 s (failed), then at 8 s: enumerated
    warnings = [r.levelno for r in caplog.records if "cannot list the GPUs" in r.getMessage()]
    assert warnings == [logging.WARNING]  # once per outage, not once per try
    assert any("available after 3 failed attempt(s)" in r.getMessage() for r in caplog.records)


HANGING = """
name: hanging
gpus:
  - {utilization: 0.9}
  - {utilization: 0.9, failures: [{function: nvmlDeviceGetMemoryInfo_v2, from: 1s, to: 4s, error: hang}]}
  - {utilization: 0.9}
loop: false
"""


def test_a_gpu_whose_call_hangs_goes_down_alone_and_comes_back() -> None:
    """GPU 1's NVML calls block from 1 s to 4 s (a stuck driver): it is reported down within
    stuck_after and counted, GPUs 0 and 2 keep fresh values all along, and GPU 1 is read again once
    the call returns. Real threads and the real clock: the hang blocks a real thread."""
    simulation = Simulation(parse_scenario(HANGING, source="hanging"), spawn_processes=False)
    simulation.install()
    sampler = Sampler(Nvml(), ProcessInspector(host_pid_namespace=True), interval_seconds=0.1,
                      stuck_after_seconds=0.5)
    snapshots: list[Snapshot] = []
    sampler.add_listener(snapshots.append)
    try:
        sampler.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (snapshots and snapshots[-1].nvml_stuck_calls_total
                                                   and snapshots[-1].gpus[1].up):
            time.sleep(0.05)
        stuck = [s for s in snapshots if s.gpus and not s.gpus[1].up]
        assert stuck, "GPU 1 was never reported down"
        assert all(s.gpus[0].up and s.gpus[2].up for s in snapshots if s.gpus)
        gaps = [b.monotonic - a.monotonic for a, b in itertools.pairwise(snapshots)]
        assert max(gaps) < 0.5 + 0.1 + 0.3, "the other GPUs kept a fresh snapshot while GPU 1 hung"
        assert snapshots[-1].gpus[1].up and snapshots[-1].nvml_stuck_calls_total == 1
        assert sampler.is_alive()
        started = time.monotonic()
    finally:
        sampler.stop()
        simulation.uninstall()
    assert time.monotonic() - started < 1.5


def test_a_sampler_stuck_as_a_whole_is_not_alive_and_its_snapshot_is_stale() -> None:
    """What /-/healthy and /metrics read: no tick completes (here a listener blocks the thread)."""
    simulation = Simulation(parse_scenario("name: one\ngpus: [{utilization: 0.5}]\n", source="one"),
                            spawn_processes=False)
    simulation.install()
    release = threading.Event()
    sampler = Sampler(Nvml(), ProcessInspector(host_pid_namespace=True), interval_seconds=0.1,
                      unhealthy_after_seconds=0.5)
    sampler.add_listener(lambda snapshot: release.wait(10) and None)
    try:
        sampler.start()
        time.sleep(0.2)
        assert sampler.is_alive() and not sampler.snapshot_is_stale()
        deadline = time.monotonic() + 5
        while sampler.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sampler.is_alive() and sampler.snapshot_is_stale()
        release.set()
        deadline = time.monotonic() + 5
        while not sampler.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sampler.is_alive()
    finally:
        release.set()
        sampler.stop()
        simulation.uninstall()


def test_read_guard_says_when_the_read_in_progress_becomes_stuck() -> None:
    guard = ReadGuard(stuck_after_seconds=3.0)
    generation = guard.next_generation()
    assert guard.stuck_at() is None  # no read in progress
    guard.begin(generation, 2, now=100.0)
    assert guard.stuck_at() == 103.0
    assert guard.stuck(102.9) is None and guard.stuck_at() == 103.0
    assert guard.end(generation, 2)
    assert guard.stuck_at() is None
    guard.begin(generation + 7, 1, now=200.0)  # a thread given up on: not the read in progress
    assert guard.stuck_at() is None
    guard.begin(generation, 1, now=200.0)
    assert guard.stuck(203.0) == (1, generation + 1)
    assert guard.stuck_at() is None and guard.held(1)  # given up on: nothing in progress until the next


def test_the_watchdog_sleeps_stuck_after_and_gives_up_on_a_read_when_it_becomes_stuck() -> None:
    """While no read hangs, the watchdog wakes about once per stuck_after (not twice); a read that
    hangs is given up on about stuck_after after it began (not up to a period later). Generous bounds:
    real threads on a shared machine."""
    simulation = Simulation(parse_scenario("name: three\ngpus: [{utilization: 0.9}, {utilization: 0.9}, "
                                           "{utilization: 0.9}]\n", source="three"), spawn_processes=False)
    simulation.install()
    stuck_after = 1.0
    sampler = Sampler(Nvml(), ProcessInspector(host_pid_namespace=True), interval_seconds=0.1,
                      stuck_after_seconds=stuck_after)
    hang, release = threading.Event(), threading.Event()
    hung_at: list[float] = []
    given_up_at: list[float] = []
    read, start_thread = sampler._nvml.read, sampler._start_thread

    def hanging_read(device: boundary.NvmlDevice, **which: bool) -> DeviceReadings | None:
        if device.identity.index == 1 and hang.is_set() and not hung_at:
            hung_at.append(time.monotonic())
            release.wait(10)
        return read(device, **which)

    def recording_start_thread(generation: int) -> None:
        given_up_at.append(time.monotonic())
        start_thread(generation)

    rounds: list[float] = []
    watch_once = sampler.watch_once

    def counted_watch_once() -> float:  # the watchdog thread wakes only to run a round
        rounds.append(time.monotonic())
        return watch_once()

    sampler._nvml.read = hanging_read  # type: ignore[method-assign]
    sampler._start_thread = recording_start_thread  # type: ignore[method-assign]
    sampler.watch_once = counted_watch_once  # type: ignore[method-assign]
    try:
        sampler.start()
        given_up_at.clear()  # the first sampler thread's start
        assert sampler._watchdog is not None
        time.sleep(0.2)
        before = len(rounds)
        time.sleep(4 * stuck_after)
        woken = len(rounds) - before
        assert woken <= 6, f"the watchdog woke {woken} times in {4 * stuck_after:g} s"  # 8 at stuck_after/2
        hang.set()
        deadline = time.monotonic() + 10
        while not given_up_at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hung_at and given_up_at, "the hanging read was never given up on"
        took = given_up_at[0] - hung_at[0]
        assert stuck_after - 0.01 <= took < stuck_after + 0.4, f"given up on after {took:.3f} s"
    finally:
        release.set()
        sampler.stop()
        simulation.uninstall()
