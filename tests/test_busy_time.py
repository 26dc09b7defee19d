"""Busy time and energy by owner: the integration of driver samples into counters, and why it exists.

The unit tests feed the integrators plain samples (sample periods, gaps, duplicates, the driver's
buffer at start, the rate fallback, processes, GPM, the energy split). The sampler tests run the real
sampler over the simulated driver on a manual clock (missed and late ticks, restarts, a lost GPU,
exited processes). The end-to-end test shows what the counter is for: a real Prometheus scraping every
5 s gets a GPU's mean utilization right from rate() of the counter, where the gauge it scrapes is
tens of points off.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from agent_process import http_get, run_agent
from test_e2e_prometheus import run_prometheus

from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import Nvml
from gpuscope.sampling.busy_time import (
    DEFAULT_SAMPLE_PERIOD_US,
    GpmActiveTime,
    GpuBusyTime,
    ProcessBusyTime,
    SampleIntegrator,
    SamplePeriod,
)
from gpuscope.sampling.energy_split import EnergySplit
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation
from gpuscope.simulate.loader import parse_scenario
from gpuscope.snapshot import GpuReading, Snapshot

PERIOD_US = 166_667  # the simulated driver's sample period (1/6 s), as a real H100's
T0 = 1_700_000_000_000_000  # a driver timestamp


def stream(start_us: int, values: list[float], period_us: int = PERIOD_US) -> list[tuple[int, float]]:
    """Samples one period apart from ``start_us`` (the first sample's timestamp)."""
    return [(start_us + i * period_us, v) for i, v in enumerate(values)]


# -- one stream of samples -----------------------------------------------------------------------------


def test_each_sample_counts_its_value_times_the_time_since_the_previous_one() -> None:
    integrator, period = SampleIntegrator(), SamplePeriod()
    integrator.skip([(T0, 1.0)], period)  # where counting starts
    added = integrator.add([(T0 + 150_000, 1.0), (T0 + 350_000, 0.5), (T0 + 525_000, 0.0)], period)
    assert added == pytest.approx(0.15 * 1.0 + 0.2 * 0.5 + 0.175 * 0.0)
    assert integrator.total == pytest.approx(0.25) and integrator.last_us == T0 + 525_000


def test_a_sample_without_a_predecessor_counts_the_nominal_period() -> None:
    integrator, period = SampleIntegrator(), SamplePeriod()
    assert integrator.add([(T0, 0.9)], period) == pytest.approx(0.9 * DEFAULT_SAMPLE_PERIOD_US / 1e6)
    # Once the spacing of the driver's samples is known, that is the nominal period.
    learnt = SamplePeriod()
    SampleIntegrator().skip(stream(T0, [0.0] * 4, period_us=250_000), learnt)
    assert learnt.nominal_us == 250_000
    assert SampleIntegrator().add([(T0, 1.0)], learnt) == pytest.approx(0.25)


def test_a_gap_without_samples_counts_one_nominal_period_and_the_rest_as_idle() -> None:
    integrator, period = SampleIntegrator(), SamplePeriod()
    integrator.skip(stream(T0, [1.0, 1.0]), period)
    # 10 s without samples (the GPU had no context), then busy again.
    after = T0 + PERIOD_US + 10_000_000
    added = integrator.add(stream(after, [1.0, 1.0]), period)
    assert added == pytest.approx(2 * PERIOD_US / 1e6)


def test_timer_jitter_within_the_tolerance_is_one_period_and_tiles_time_exactly() -> None:
    integrator, period = SampleIntegrator(), SamplePeriod()
    integrator.skip([(T0, 1.0)], period)
    spacings = [166_666, 166_667, 170_000, 163_334, 166_667, 200_000]  # a late timer, then an early one
    timestamps = [T0 + sum(spacings[:i + 1]) for i in range(len(spacings))]
    integrator.add([(ts, 1.0) for ts in timestamps], period)
    assert integrator.total == pytest.approx((timestamps[-1] - T0) / 1e6)


def test_a_gpu_sampling_once_a_second_is_weighted_by_its_own_period() -> None:
    integrator, period = SampleIntegrator(), SamplePeriod()
    spacings = [1_004_000, 998_000, 1_003_000, 995_000]  # NVML's longest period, with timer jitter
    timestamps = [T0 + sum(spacings[:i]) for i in range(len(spacings) + 1)]
    integrator.skip([(timestamps[0], 1.0)], period)
    integrator.add([(ts, 1.0) for ts in timestamps[1:]], period)
    assert integrator.total == pytest.approx((timestamps[-1] - T0) / 1e6)


def test_a_spacing_no_driver_samples_at_does_not_become_the_period() -> None:
    integrator, period = SampleIntegrator(), SamplePeriod()
    integrator.skip([(T0, 1.0), (T0 + 10_000, 1.0)], period)  # 10 ms: not a sample period
    assert period.nominal_us == DEFAULT_SAMPLE_PERIOD_US
    integrator.add(stream(T0 + 10_000 + PERIOD_US, [1.0] * 3), period)
    assert integrator.total == pytest.approx(3 * PERIOD_US / 1e6)


def test_a_sample_read_again_is_not_counted_again() -> None:
    integrator, period = SampleIntegrator(), SamplePeriod()
    integrator.skip([(T0, 0.0)], period)
    first = stream(T0 + PERIOD_US, [1.0, 1.0, 1.0])
    integrator.add(first, period)
    # The next read overlaps the last one (a cursor that did not move) and repeats a timestamp.
    again = [*first[1:], first[-1], (first[-1][0] + PERIOD_US, 1.0)]
    assert integrator.add(again, period) == pytest.approx(PERIOD_US / 1e6)
    assert integrator.total == pytest.approx(4 * PERIOD_US / 1e6)


def test_missed_ticks_lose_nothing_while_the_driver_holds_the_samples() -> None:
    samples = stream(T0, [0.95, 0.95, 0.05, 0.95, 0.05, 0.05, 0.95, 0.95, 0.95, 0.05, 0.95, 0.95])
    every_tick, period = SampleIntegrator(), SamplePeriod()
    every_tick.skip(samples[:1], period)
    for i in range(1, len(samples), 2):
        every_tick.add(samples[i:i + 2], period)
    late, period = SampleIntegrator(), SamplePeriod()
    late.skip(samples[:1], period)
    late.add(samples[1:], period)  # one tick, after five were missed
    assert late.total == pytest.approx(every_tick.total)
    assert late.total == pytest.approx(sum(v for _, v in samples[1:]) * PERIOD_US / 1e6)


# -- a GPU -----------------------------------------------------------------------------------------------


def test_the_drivers_buffer_at_start_is_not_counted_so_a_restart_counts_nothing_twice() -> None:
    buffer = stream(T0, [1.0] * 120)  # 20 s from before the agent started
    busy = GpuBusyTime()
    assert busy.add_samples(buffer, from_history=True) == 0.0
    assert busy.total == 0.0
    # The first new sample is weighted by its spacing from the last one in the buffer.
    newer = stream(buffer[-1][0] + PERIOD_US, [0.5] * 6)
    assert busy.add_samples(newer, from_history=False) == pytest.approx(6 * 0.5 * PERIOD_US / 1e6)


def test_an_empty_buffer_at_start_leaves_the_first_sample_its_nominal_period() -> None:
    busy = GpuBusyTime()
    busy.add_samples((), from_history=True)  # an idle GPU at start
    busy.add_samples([(T0, 1.0)], from_history=False)
    assert busy.total == pytest.approx(DEFAULT_SAMPLE_PERIOD_US / 1e6)


def test_without_samples_the_rate_times_the_elapsed_time_stands_in() -> None:
    busy = GpuBusyTime()
    assert busy.add_rate(0.8, 10.0) == 0.0  # the first reading starts the count
    assert busy.add_rate(0.5, 12.0) == pytest.approx(1.0)
    assert busy.add_rate(0.25, 13.0) == pytest.approx(0.25)
    # Down from 13 s to 40 s: the gap is not counted, neither as busy nor at all.
    busy.interrupted()
    assert busy.add_rate(1.0, 40.0) == 0.0
    assert busy.add_rate(1.0, 41.0) == pytest.approx(1.0)
    assert busy.total == pytest.approx(2.25)


# -- processes ---------------------------------------------------------------------------------------------


def test_each_process_is_integrated_on_its_own_and_forgotten_when_it_exits() -> None:
    busy = ProcessBusyTime()
    history = {1: stream(T0, [0.9] * 6), 2: stream(T0, [0.1] * 6)}
    assert busy.update(history, {1, 2}, from_history=True) == {1: 0.0, 2: 0.0}
    newer = T0 + 6 * PERIOD_US
    totals = busy.update({1: stream(newer, [0.6] * 6), 2: stream(newer, [0.3] * 3)}, {1, 2},
                         from_history=False)
    assert totals == pytest.approx({1: 6 * 0.6 * PERIOD_US / 1e6, 2: 3 * 0.3 * PERIOD_US / 1e6})
    # Pid 2 exited; pid 3 is new (its first sample counts one nominal period); pid 4's samples come
    # from a process NVML does not list (gone already): not counted, no state kept.
    later = newer + 6 * PERIOD_US
    totals = busy.update({1: stream(later, [1.0]), 3: stream(later, [1.0]), 4: stream(later, [1.0])},
                         {1, 3}, from_history=False)
    assert set(totals) == {1, 3} and len(busy) == 2
    assert totals[3] == pytest.approx(PERIOD_US / 1e6)
    # A listed process without new samples ran no kernels: its total stays.
    assert busy.update({}, {1, 3}, from_history=False) == totals
    assert busy.update({}, set(), from_history=False) == {} and len(busy) == 0


def test_per_process_state_is_bounded_by_the_processes_alive() -> None:
    busy = ProcessBusyTime()
    busy.update({}, set(), from_history=True)
    for pid in range(10_000, 20_000):  # ten thousand short-lived processes, two at a time
        busy.update({pid: [(T0 + pid, 1.0)]}, {pid, pid + 1}, from_history=False)
        assert len(busy) == 2


# -- GPM ------------------------------------------------------------------------------------------------


def test_gpm_ratios_times_the_interval_each_covers() -> None:
    gpm = GpmActiveTime()
    gpm.add(None, None, None)  # the first tick: one GPM sample, no interval yet
    assert (gpm.sm_seconds, gpm.tensor_seconds) == (None, None)
    gpm.add(0.5, 0.25, 1.0)
    gpm.add(0.8, None, 2.5)  # a late tick covers a longer interval; tensor failed this time
    gpm.add(0.3, 0.1, None)  # ratios without an interval (none taken): nothing added
    assert gpm.sm_seconds == pytest.approx(0.5 + 2.0)
    assert gpm.tensor_seconds == pytest.approx(0.25)


# -- energy by owner -------------------------------------------------------------------------------------


def check_split_adds_up(split: EnergySplit, before: tuple[float, dict[int, float]], delta: float) -> None:
    idle_before, by_pid_before = before
    parts = sum(split.by_pid[pid] - by_pid_before.get(pid, 0.0) for pid in split.by_pid)
    assert parts + split.idle_total - idle_before == pytest.approx(delta, rel=1e-12)


def state(split: EnergySplit) -> tuple[float, dict[int, float]]:
    return split.idle_total, dict(split.by_pid)


def test_energy_is_split_by_busy_time_and_the_rest_is_idle() -> None:
    split = EnergySplit()
    split.update(1000.0, 0.0, {1: 0.0, 2: 0.0})  # the first reading: where the split starts
    assert split.by_pid == {1: 0.0, 2: 0.0} and split.idle_total == 0.0
    before = state(split)
    split.update(1400.0, 2.0, {1: 1.0, 2: 0.5})  # 400 J over 2 s: pid 1 busy half of it, pid 2 a quarter
    assert split.by_pid == pytest.approx({1: 200.0, 2: 100.0})
    assert split.idle_total == pytest.approx(100.0)
    check_split_adds_up(split, before, 400.0)


def test_overlapping_processes_are_scaled_to_the_whole_and_never_more() -> None:
    split = EnergySplit()
    split.update(0.0, 0.0, {1: 0.0, 2: 0.0})
    split.update(600.0, 1.0, {1: 0.9, 2: 0.6})  # MPS: 1.5 busy seconds in 1 s
    assert split.by_pid == pytest.approx({1: 360.0, 2: 240.0})
    assert split.idle_total == 0.0  # never below: a counter does not go back
    for i in range(2, 1000):  # rounding never makes idle energy go back either
        idle = split.idle_total
        split.update(600.0 * i + 0.1 * i, float(i), {1: 0.9 * i + 1e-9 * i, 2: 0.6 * i})
        assert split.idle_total >= idle


def test_without_process_samples_all_energy_is_idle() -> None:
    split = EnergySplit()
    split.update(50.0, 0.0, {})
    split.update(350.0, 1.0, {})
    assert split.idle_total == pytest.approx(300.0) and split.by_pid == {}


def test_energy_in_an_interval_of_no_length_is_idle_so_nothing_is_lost() -> None:
    split = EnergySplit()
    split.update(0.0, 5.0, {1: 0.0})
    split.update(10.0, 5.0, {1: 0.5})  # a clock that did not move
    assert split.by_pid == {1: 0.0} and split.idle_total == pytest.approx(10.0)


def test_a_failed_energy_reading_leaves_the_interval_to_the_next_one() -> None:
    split = EnergySplit()
    split.update(0.0, 0.0, {1: 0.0})
    split.update(None, 1.0, {1: 1.0})  # the energy call failed: nothing split yet
    assert split.by_pid == {1: 0.0}
    split.update(800.0, 2.0, {1: 1.0})  # 2 s, busy 1 s of them
    assert split.by_pid[1] == pytest.approx(400.0) and split.idle_total == pytest.approx(400.0)


def test_an_exited_process_is_forgotten() -> None:
    split = EnergySplit()
    split.update(0.0, 0.0, {1: 0.0, 2: 0.0})
    split.update(100.0, 1.0, {1: 0.5, 2: 0.5})
    split.update(200.0, 2.0, {1: 1.5})  # pid 2 exited: its last interval went to idle
    assert set(split.by_pid) == {1}
    assert split.by_pid[1] == pytest.approx(150.0) and split.idle_total == pytest.approx(0.0)


# -- the sampler over the simulated driver ----------------------------------------------------------------


class ManualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


# 95% for 1.5 s, 5% for 0.5 s: a whole number of the simulated driver's 1/6 s samples in each part,
# so the sampled wave's mean is the wave's mean.
BUSY_LEVEL, IDLE_LEVEL, BUSY_FRACTION, WAVE_PERIOD = 0.95, 0.05, 0.75, 2.0
WAVE_MEAN = BUSY_FRACTION * BUSY_LEVEL + (1 - BUSY_FRACTION) * IDLE_LEVEL  # 0.725
WAVE = (f"{{pattern: steps, period: {WAVE_PERIOD}s, busy_fraction: {BUSY_FRACTION}, "
        f"busy_level: {BUSY_LEVEL}, idle_level: {IDLE_LEVEL}}}")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(2.0)


@pytest.fixture
def simulate(clock: ManualClock) -> Iterator[Any]:
    sims: list[Simulation] = []

    def start(text: str) -> Simulation:
        sim = Simulation(parse_scenario(text, source="test"), clock=clock, spawn_processes=False)
        sim.install()
        sims.append(sim)
        return sim

    yield start
    for sim in sims:
        sim.uninstall()


def make_sampler(clock: ManualClock) -> Sampler:
    return Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock)


def run(sampler: Sampler, clock: ManualClock, until: float,
        steps: list[float] | None = None) -> list[Snapshot]:
    """Tick now, then after each step (cycling through ``steps``, 1 s by default) until ``until``."""
    snapshots = [sampler.tick()]
    steps = steps or [1.0]
    i = 0
    while clock.now < until - 1e-9:
        clock.now = min(until, clock.now + steps[i % len(steps)])
        i += 1
        snapshots.append(sampler.tick())
    return snapshots


def gpu(snapshot: Snapshot, index: int = 0) -> GpuReading:
    return snapshot.gpus[index]


def busy(snapshot: Snapshot, index: int = 0) -> float:
    value = gpu(snapshot, index).busy_seconds_total
    assert value is not None
    return value


def test_the_counter_holds_every_second_of_a_square_wave(simulate: Any, clock: ManualClock) -> None:
    simulate(f"gpus: [{{utilization: {WAVE}, processes: [{{name: train, pid: 4242}}]}}]")
    sampler = make_sampler(clock)
    snapshots = run(sampler, clock, until=42.0)
    first = snapshots[0]
    assert busy(first) == 0.0  # the driver's buffer from before the start is not counted
    # From 2 s to 42 s, twenty whole periods.
    assert busy(snapshots[-1]) == pytest.approx(WAVE_MEAN * 40.0, abs=1e-5)
    # Over any whole period, whatever the phase; the gauge, over one tick's second, ranges widely.
    for a, b in zip(snapshots[1:], snapshots[3:], strict=False):
        assert (busy(b) - busy(a)) / WAVE_PERIOD == pytest.approx(WAVE_MEAN, abs=1e-5)
    gauges = [gpu(s).utilization_ratio or 0.0 for s in snapshots[1:]]
    assert max(gauges) - min(gauges) > 0.3
    (process,) = gpu(snapshots[-1]).processes
    assert process.busy_seconds_total == pytest.approx(WAVE_MEAN * 40.0, abs=1e-5)


def times_called(monkeypatch: pytest.MonkeyPatch, clock: ManualClock, function: str) -> list[float]:
    """The clock's time at each call of pynvml's ``function`` from now on."""
    times: list[float] = []
    original = getattr(pynvml, function)

    def counted(*args: Any) -> Any:
        times.append(clock.now)
        return original(*args)

    monkeypatch.setattr(pynvml, function, counted)
    return times


def test_samples_read_every_samples_interval_lose_nothing(simulate: Any, clock: ManualClock,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(f"gpus: [{{utilization: {WAVE}, processes: [{{name: train, pid: 4242}}]}}]")
    reads = times_called(monkeypatch, clock, "nvmlDeviceGetSamples")
    sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                      samples_interval_seconds=5.0)
    start = clock.now
    snapshots = run(sampler, clock, until=start + 40.0, steps=[0.98, 1.02])  # a timer's ticks
    assert reads == pytest.approx([start + 5.0 * n for n in range(9)], abs=0.05)
    # Every sample the driver took is counted at the next read: the total is the wave's, exactly.
    assert busy(snapshots[-1]) == pytest.approx(WAVE_MEAN * 40.0, abs=1e-5)
    between = [s for s in snapshots if all(abs(clock_at - s.monotonic) > 0.05 for clock_at in reads)]
    assert len(between) == len(snapshots) - len(reads)
    # Between reads, the gauge is the driver's current rate and the busy counter waits.
    assert all(gpu(s).utilization_samples == () and gpu(s).utilization_ratio is not None for s in between)
    totals = [busy(s) for s in snapshots]
    assert sum(1 for a, b in itertools.pairwise(totals) if a != b) == len(reads) - 1
    (process,) = gpu(snapshots[-1]).processes
    assert process.busy_seconds_total == pytest.approx(WAVE_MEAN * 40.0, abs=1e-5)  # read every tick


def test_late_and_missed_ticks_count_the_same(simulate: Any, clock: ManualClock) -> None:
    simulate(f"gpus: [{{utilization: {WAVE}, processes: [{{name: train, pid: 4242}}]}}]")
    sampler = make_sampler(clock)
    # Ticks 0.3 s to 7 s apart (late, several missed), never more than the driver's 20 s buffer.
    snapshots = run(sampler, clock, until=62.0, steps=[0.3, 2.7, 7.0, 1.1, 0.5, 5.4])
    assert busy(snapshots[-1]) == pytest.approx(WAVE_MEAN * 60.0, abs=1e-5)
    (process,) = gpu(snapshots[-1]).processes
    assert process.busy_seconds_total == pytest.approx(WAVE_MEAN * 60.0, abs=1e-5)


def test_a_restarted_agent_starts_at_zero_and_counts_nothing_twice(simulate: Any, clock: ManualClock) -> None:
    simulate(f"gpus: [{{utilization: {WAVE}}}]")
    before = make_sampler(clock)
    run(before, clock, until=20.0)
    before.stop(timeout=0.0)
    clock.now = 30.0  # the agent was down 10 s; the driver's buffer holds samples from before
    after = make_sampler(clock)
    snapshots = run(after, clock, until=50.0)
    assert busy(snapshots[0]) == 0.0
    assert busy(snapshots[-1]) == pytest.approx(WAVE_MEAN * 20.0, abs=1e-5)


def test_a_lost_gpu_adds_neither_the_gap_nor_twice(simulate: Any, clock: ManualClock) -> None:
    simulate("""
gpus:
  - utilization: 0.9
    lost: [{from: 10s, to: 20s}]
  - utilization: 0.9
    lost: [{from: 10s, to: 20s}]
    failures: [{function: nvmlDeviceGetSamples, error: not_supported}]
""")
    sampler = make_sampler(clock)
    snapshots = run(sampler, clock, until=30.0)
    assert [s.gpus[0].up for s in snapshots].count(False) == 10
    # GPU 0 (samples): up from 2 s to 10 s and from 20 s to 30 s; the first sample after the gap
    # counts one sample period, not the ten seconds since the one before.
    assert busy(snapshots[-1], 0) == pytest.approx(0.9 * 18.0, abs=1e-5)
    # GPU 1 (no samples: the rate): the first tick after the gap starts the count again.
    assert gpu(snapshots[0], 1).utilization_samples == ()
    assert busy(snapshots[-1], 1) == pytest.approx(0.9 * (8.0 + 10.0 - 1.0), abs=1e-5)


def test_gpm_seconds_follow_the_activity_the_gpm_intervals_cover(simulate: Any, clock: ManualClock) -> None:
    simulate(f"gpus: [{{utilization: {WAVE}, gpm: {{sm_active: 0.8, tensor_active: 0.5}}}}]")
    sampler = make_sampler(clock)
    snapshots = run(sampler, clock, until=42.0, steps=[1.0, 0.5, 2.5])
    assert gpu(snapshots[0]).sm_active_seconds_total is None  # one GPM sample: no interval yet
    # The first GPM interval starts with the first tick, as the busy counter does.
    last = gpu(snapshots[-1])
    assert last.sm_active_seconds_total == pytest.approx(0.8 * WAVE_MEAN * 40.0, abs=1e-4)
    assert last.tensor_active_seconds_total == pytest.approx(0.5 * WAVE_MEAN * 40.0, abs=1e-4)


# Train's kernels run 40% of the time (half of the GPU's 80%), eval's 20% until it stops at 20 s.
TRAIN_AND_EVAL = """
gpus:
  - utilization: {level: 0.8}
    processes:
      - {name: train, pid: 5001, sm_share: 0.5}
      - {name: eval, pid: 5002, sm_share: 0.25, stop: 20s}
"""


def check_energy_adds_up_every_tick(snapshots: list[Snapshot]) -> None:
    """From each snapshot to the next, the processes' energy and the idle energy add up to the GPU's."""
    for earlier, later in itertools.pairwise(snapshots):
        a, b = gpu(earlier), gpu(later)
        assert a.energy_joules_total is not None and b.energy_joules_total is not None
        assert a.idle_energy_joules_total is not None and b.idle_energy_joules_total is not None
        before = {p.pid: p.energy_joules_total or 0.0 for p in a.processes}
        parts = sum((p.energy_joules_total or 0.0) - before.get(p.pid, 0.0) for p in b.processes)
        delta = b.energy_joules_total - a.energy_joules_total
        assert parts + b.idle_energy_joules_total - a.idle_energy_joules_total == pytest.approx(delta)


def test_the_energy_counter_is_read_every_energy_interval_and_its_total_held_between_reads(
        simulate: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(TRAIN_AND_EVAL)
    reads = times_called(monkeypatch, clock, "nvmlDeviceGetTotalEnergyConsumption")
    sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                      energy_interval_seconds=10.0)
    # Ticks a little early and late, as a timer's are: still one read per 10 s, not one per 11.
    start = clock.now
    snapshots = run(sampler, clock, until=start + 40.0, steps=[0.98, 1.02])
    assert reads == pytest.approx([start + 10.0 * n for n in range(5)], abs=0.05)
    totals = [gpu(s).energy_joules_total for s in snapshots]
    assert None not in totals  # held between reads, never missing from a snapshot
    assert sum(1 for a, b in itertools.pairwise(totals) if a != b) == len(reads) - 1
    check_energy_adds_up_every_tick(snapshots)
    # The read at 10 s splits the ten seconds since the first one as per-tick reads would have.
    at_10 = next(s for s in snapshots if gpu(s).energy_joules_total != totals[0])
    by_pid = {p.pid: p.energy_joules_total or 0.0 for p in gpu(at_10).processes}
    spent = (gpu(at_10).energy_joules_total or 0.0) - (totals[0] or 0.0)
    assert by_pid[5001] / spent == pytest.approx(0.4, abs=0.01)
    assert by_pid[5002] / spent == pytest.approx(0.2, abs=0.01)


def test_energy_splits_among_processes_and_idle_and_adds_up_every_tick(simulate: Any,
                                                                       clock: ManualClock) -> None:
    simulate(TRAIN_AND_EVAL)
    sampler = make_sampler(clock)
    snapshots = run(sampler, clock, until=40.0)
    check_energy_adds_up_every_tick(snapshots)
    # Until eval stops, train's kernels run 40% of the time (half of the GPU's 80%), eval's 20%:
    # 40% and 20% of the energy.
    at_19 = gpu(snapshots[17])
    by_pid = {p.pid: p.energy_joules_total or 0.0 for p in at_19.processes}
    spent = (at_19.energy_joules_total or 0.0) - (gpu(snapshots[0]).energy_joules_total or 0.0)
    assert by_pid[5001] / spent == pytest.approx(0.4, abs=0.01)
    assert by_pid[5002] / spent == pytest.approx(0.2, abs=0.01)


def test_an_exited_process_leaves_the_snapshot_and_the_samplers_memory(simulate: Any,
                                                                        clock: ManualClock) -> None:
    simulate("""
gpus:
  - utilization: {level: 0.8}
    processes:
      - {name: train, pid: 5001}
      - {name: short, pid: 5002, stop: 10s}
""")
    sampler = make_sampler(clock)
    snapshots = run(sampler, clock, until=20.0)
    assert {p.pid for p in gpu(snapshots[5]).processes} == {5001, 5002}
    assert {p.pid for p in gpu(snapshots[-1]).processes} == {5001}
    state = sampler._states[0]  # what the sampler keeps per process: only the processes alive
    assert len(state.process_busy) == 1 and set(state.energy_split.by_pid) == {5001}


def test_a_gpu_without_processes_is_not_asked_for_process_samples_yet_counts_a_later_one(
        simulate: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    simulate("""
gpus:
  - utilization: {level: 0.8}
    processes:
      - {name: early, pid: 5001, stop: 3500ms, sm_share: 1.0}
      - {name: late, pid: 5002, start: 8s, sm_share: 1.0}
""")
    calls: list[float] = []
    real = pynvml.nvmlDeviceGetProcessUtilization

    def counted(handle: Any, cursor: int) -> Any:
        calls.append(clock.now)
        return real(handle, cursor)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", counted)
    sampler = make_sampler(clock)
    assert clock.now == 2.0  # the fixture's clock: ticks at 2, 3, ... 15
    snapshots = run(sampler, clock, until=15.0)
    # Asked while early is listed (2, 3 s), at the first tick without it (4 s: the cursor moves past
    # its last samples), not while nothing is listed (5-7 s), then every tick with late there.
    assert calls == [2.0, 3.0, 4.0, *[float(t) for t in range(8, 16)]]
    assert [p.pid for p in gpu(snapshots[4]).processes] == []
    (late,) = gpu(snapshots[-1]).processes
    assert late.pid == 5002 and late.busy_seconds_total is not None
    # Its kernels ran 80% of the time from 8 s on: all its samples counted, none of early's.
    assert late.busy_seconds_total == pytest.approx(0.8 * 7, abs=0.8 * 2 * PERIOD_US / 1e6)
    # Its energy is what the GPU used while it ran, in proportion to its busy time: nothing of the
    # ticks before it came.
    before, at_end = gpu(snapshots[6]), gpu(snapshots[-1])  # 8 s (its first tick), 15 s
    assert late.energy_joules_total is not None
    assert before.energy_joules_total is not None and at_end.energy_joules_total is not None
    assert late.energy_joules_total <= at_end.energy_joules_total - before.energy_joules_total + 1e-6


def test_a_library_answering_success_without_samples_is_read_as_none(
        simulate: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A size probe that answers SUCCESS with no samples (where a driver answers NOT_FOUND) makes
    pynvml raise an error whose code is SUCCESS: that is no samples, not a failed reading, and an idle
    GPU is then not asked every tick."""
    simulate("""
gpus:
  - utilization: {level: 0.8}
""")
    calls: list[float] = []
    real = pynvml.nvmlDeviceGetProcessUtilization

    def like_nvidias_mock(handle: Any, cursor: int) -> Any:
        calls.append(clock.now)
        try:
            return real(handle, cursor)
        except pynvml.NVMLError_NotFound:
            raise pynvml.NVMLError(pynvml.NVML_SUCCESS) from None

    monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", like_nvidias_mock)
    sampler = make_sampler(clock)
    snapshots = run(sampler, clock, until=8.0)
    assert calls == [2.0]  # read (none), then skipped while the GPU lists no process
    assert all("process_utilization" not in s.sample_errors for s in snapshots)


# -- a real Prometheus scraping every 5 s -----------------------------------------------------------------

SCRAPE_SECONDS = 5  # 2.5 wave periods: successive scrapes see the wave at different phases
RATE_WINDOW = "40s"  # eight scrapes


def instant(base: str, promql: str) -> list[dict[str, Any]]:
    status, body = http_get(f"{base}/api/v1/query?query={urllib.parse.quote(promql)}")
    assert status == 200, body
    data = json.loads(body)
    assert data["status"] == "success", data
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def one_value(base: str, promql: str) -> float:
    (series,) = instant(base, promql)
    return float(series["value"][1])


@pytest.mark.e2e
def test_rate_of_the_counter_gets_the_mean_right_where_the_scraped_gauge_does_not(tmp_path: Path) -> None:
    (tmp_path / "wave.yaml").write_text(f"""
name: square-wave
description: One GPU 95% busy for 1.5 s and 5% for 0.5 s, over and over.
duration: 10m
gpus:
  - utilization: {WAVE}
    gpm: {{sm_active: 0.8}}
    processes: [{{name: train-step, spawn: true, memory: 40GiB}}]
""")
    args = ("--simulate", str(tmp_path / "wave.yaml"), "--sample-interval", "500ms")
    # The utilization samples read every tick, so that the gauge covers the last half second only (read
    # every 5 s, the gauge after a read is their mean over 5 s: two and a half periods of the wave).
    with run_agent(tmp_path, *args, env={"GPUSCOPE_NVML__SAMPLES_INTERVAL": "0s"}) as agent:
        config = (f"global:\n  scrape_interval: {SCRAPE_SECONDS}s\n"
                  "scrape_configs:\n  - job_name: gpuscope\n"
                  f"    static_configs:\n      - targets: ['127.0.0.1:{agent.port}']\n")
        with run_prometheus(tmp_path / "prometheus", config) as prometheus:
            base = prometheus.base
            deadline = time.monotonic() + 120
            while not instant(base, "count_over_time(gpu_busy_seconds_total[45s]) >= 9"):
                assert time.monotonic() < deadline, "Prometheus did not collect 45 s of scrapes"
                time.sleep(1.0)

            busy = one_value(base, f"rate(gpu_busy_seconds_total[{RATE_WINDOW}])")
            process = one_value(base, f"rate(gpu_process_busy_seconds_total[{RATE_WINDOW}])")
            sm_active = one_value(base, f"rate(gpu_sm_active_seconds_total[{RATE_WINDOW}])")
            (gauge,) = instant(base, "gpu_utilization_ratio[45s]")  # every scraped value
            scraped = [float(value) for _, value in gauge["values"]]
            energy = one_value(base, f"increase(gpu_energy_joules_total[{RATE_WINDOW}])")
            owned = one_value(base, f"sum(increase(gpu_process_energy_joules_total[{RATE_WINDOW}])) + "
                                    f"sum(increase(gpu_idle_energy_joules_total[{RATE_WINDOW}]))")

    counter_error = abs(busy - WAVE_MEAN)
    gauge_errors = [abs(value - WAVE_MEAN) for value in scraped]
    report = f"rate {busy:.3f}, gauge as scraped {[round(v, 2) for v in scraped]}, true mean {WAVE_MEAN}"
    assert counter_error < 0.03, report
    assert abs(process - WAVE_MEAN) < 0.03, report
    assert abs(sm_active - 0.8 * WAVE_MEAN) < 0.03, f"SM active {sm_active:.3f}; {report}"
    # The gauge covers the last half second only: as scraped, it is off by tens of points.
    assert max(gauge_errors) > 0.15, report
    assert max(gauge_errors) > 5 * counter_error, report
    # Every joule the GPU used is someone's, or idle.
    assert math.isclose(owned, energy, rel_tol=1e-6), (owned, energy)
