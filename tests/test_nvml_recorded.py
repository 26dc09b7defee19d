"""The NVML boundary on a real driver's answers: recordings of an NVIDIA H200 (driver 580) played back
under the real pynvml (tests/nvml_replay.py; recorded with bench/nvml_record.py).

The simulated NVML is written from the headers; these bytes are the driver's own: its struct
versions, sample value types, per-process samples, GPM results and PCIe field values. Each test
checks what the boundary decodes against an independent reading of the same GPU (nvidia-smi's,
kept in the recording) or against physics (power and energy agree), not against itself.

- ``h200_idle``: no process on the GPU;
- ``h200_busy``: one PyTorch process training an MLP whose batches are made on the CPU between
  steps, so that the GPU is busy about 60% of the time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest
from nvml_replay import ReplayLibrary, install, load_recorder, load_recording, uninstall

from gpuscope.nvml.boundary import Nvml, NvmlDevice
from gpuscope.nvml.readings import DeviceReadings
from gpuscope.simulate import Simulation
from gpuscope.simulate.loader import parse_scenario

MIB = 1 << 20
_GPM_FP_PIPES = ("fp16_active_ratio", "fp32_active_ratio", "fp64_active_ratio")


@dataclasses.dataclass
class Replayed:
    recording: dict[str, Any]
    library: ReplayLibrary
    nvml: Nvml
    devices: list[NvmlDevice]
    readings: list[list[DeviceReadings]]  # per read, per GPU


def replay(name: str) -> Iterator[Replayed]:
    yield from replay_recording(load_recording(name))


def replay_recording(recording: dict[str, Any]) -> Iterator[Replayed]:
    library = ReplayLibrary(recording)
    install(library)
    now = [0.0]
    # The H200 recordings predate the health and throttle readings: a replay asks what was asked then,
    # and each read asks for the settings (power limit, memory clock, ...) that were then read every tick.
    health = recording.get("health_readings", False)
    try:
        nvml = Nvml(clock=lambda: now[0])
        nvml.init()
        devices = nvml.devices()
        readings = []
        for _ in recording["readings"]:
            readings.append([nvml.read(device, health=health, throttle=health, settings=True)
                             for device in devices])
            now[0] += recording["read_interval_s"]
        yield Replayed(recording, library, nvml, devices, readings)
        nvml.shutdown()
    finally:
        uninstall(library)


@pytest.fixture
def idle() -> Iterator[Replayed]:
    yield from replay("h200_idle")


@pytest.fixture
def busy() -> Iterator[Replayed]:
    yield from replay("h200_busy")


def smi_gpu(recording: dict[str, Any]) -> dict[str, str]:
    row = recording["nvidia_smi"]["gpus"][0].split(", ")
    return dict(zip(["index", "uuid", "name", "pci_bus_id", "memory_total_mib", "power_limit_w", "ecc"], row,
                    strict=True))


def _keys_of(value: Any, recorded: Any) -> Any:
    """``value`` with only the dictionary keys that ``recorded`` has, at every depth (a recording
    made before a field existed, such as a process's gpu_instance, does not hold it)."""
    if isinstance(value, dict) and isinstance(recorded, dict):
        return {k: _keys_of(v, recorded[k]) for k, v in value.items() if k in recorded}
    if isinstance(value, list) and isinstance(recorded, list) and len(value) == len(recorded):
        return [_keys_of(v, r) for v, r in zip(value, recorded, strict=True)]
    return value


def check_replays_as_recorded(recording: dict[str, Any]) -> None:
    for run in replay_recording(recording):
        assert run.library.unmatched == []
        assert run.library.replayed > 0
        # What the boundary made of the same bytes when they were recorded (gpm_interval_seconds
        # is the clock's).
        for got, recorded in zip(run.readings, run.recording["readings"], strict=True):
            for reading, as_recorded in zip(got, recorded, strict=True):
                decoded = json.loads(json.dumps(dataclasses.asdict(reading)))
                decoded.pop("gpm_interval_seconds")
                expected = {k: v for k, v in as_recorded.items() if k != "gpm_interval_seconds"}
                assert _keys_of(decoded, expected) == expected
                # Readings newer than the recording: their functions were never answered, so absent. (The
                # FP pipes come with GPM's other metrics in one request, whose recorded answer held four
                # metrics: the replay's copy of it has zeros, with success, past them.)
                newer = {k: v for k, v in decoded.items() if k not in expected and k not in _GPM_FP_PIPES}
                assert all(v in (None, []) for v in newer.values()), newer


@pytest.mark.parametrize("name", ["h200_idle", "h200_busy"])
def test_every_call_the_boundary_makes_was_recorded_and_decodes_as_it_did_on_the_gpu(name: str) -> None:
    check_replays_as_recorded(load_recording(name))


class ManualClock:
    def __init__(self) -> None:
        self.now = 5.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_recorder_keeps_what_a_replay_needs_to_answer_as_the_library_did() -> None:
    # Recorded from the simulator, whose answers are known: several GPUs, processes, samples, GPM,
    # a GPU without PCIe byte counters and one that fails a reading.
    clock = ManualClock()
    simulation = Simulation(parse_scenario("""
gpus:
  - utilization: 0.7
    gpm: {sm_active: 0.6, tensor_active: 0.3}
    processes: [{name: train, pid: 4001, sm_share: 0.5}, {name: eval, pid: 4002, sm_share: 0.25}]
  - utilization: 0.2
    pcie: {counters: false, tx_bytes_per_s: 2MiB, rx_bytes_per_s: 8MiB}
    failures: [{function: nvmlDeviceGetTemperature, error: unknown}]
""", source="test"), clock=clock, spawn_processes=False)
    simulation.install()
    try:
        recording = load_recorder().record(pynvml.nvmlLib, 4, 1.0, clock=clock, sleep=clock.sleep)
    finally:
        simulation.uninstall()
    busy = recording["readings"][-1]
    assert {p["pid"] for p in busy[0]["nvml_processes"]} == {4001, 4002}
    assert busy[0]["sm_active_ratio"] == pytest.approx(0.6 * 0.7)  # GPM activity per unit of utilization
    assert busy[1]["temperature_celsius"] is None and busy[1]["pcie"]["cumulative"] is False
    check_replays_as_recorded(json.loads(json.dumps(recording)))  # as the file holds it


def test_identity_memory_and_limits_agree_with_nvidia_smi(idle: Replayed) -> None:
    smi = smi_gpu(idle.recording)
    identity = idle.devices[0].identity
    assert (identity.uuid, identity.name) == (smi["uuid"], smi["name"])
    assert identity.pci_bus_id == smi["pci_bus_id"]
    assert identity.mig_enabled is False
    assert idle.nvml.driver_version() == idle.recording["driver_version"] == "580.159.04"
    for (reading,) in idle.readings:
        assert reading.memory_total_bytes == int(smi["memory_total_mib"]) * MIB
        assert reading.memory_used_bytes is not None and reading.memory_reserved_bytes is not None
        assert reading.memory_used_bytes + reading.memory_reserved_bytes < reading.memory_total_bytes
        assert reading.power_limit_watts == float(smi["power_limit_w"])
        assert reading.ecc_uncorrected_errors_total == int(smi["ecc"])
        assert reading.temperature_celsius is not None and 15 <= reading.temperature_celsius <= 90
        assert reading.sm_clock_hertz is not None and 100e6 <= reading.sm_clock_hertz <= 2.5e9
        assert reading.memory_clock_hertz is not None and 1e9 <= reading.memory_clock_hertz <= 4e9
        assert isinstance(reading.clock_event_mask, int)


def test_an_idle_gpu_lists_no_process_and_its_samples_say_idle(idle: Replayed) -> None:
    readings = [r for (r,) in idle.readings]
    assert all(r.nvml_processes == [] for r in readings)
    assert all(r.new_process_samples == {} for r in readings)
    first, *rest = readings
    # The first read gets the driver's whole buffer (some 14 s at 5 samples a second), flagged so.
    assert first.utilization_samples_from_history
    assert first.new_utilization_samples is not None and len(first.new_utilization_samples) > 50
    for reading in rest:
        assert not reading.utilization_samples_from_history
        samples = reading.new_utilization_samples
        assert samples is not None and 4 <= len(samples) <= 6  # one second's worth
        assert all(value == 0.0 for _, value in samples)
    # GPM from the second read on: an idle SM.
    assert first.sm_active_ratio is None
    assert all(r.sm_active_ratio == 0.0 and r.tensor_active_ratio == 0.0 for r in rest)


def test_samples_arrive_in_order_once_each_at_the_drivers_period(busy: Replayed) -> None:
    stamps = [ts for (r,) in busy.readings[1:] for ts, _ in r.new_utilization_samples or ()]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    spacing_us = statistics.median(b - a for a, b in itertools.pairwise(stamps))
    assert spacing_us == pytest.approx(200_000, rel=0.05)  # an H200 samples every 200 ms
    # No sample of the first read's history comes again.
    history = busy.readings[0][0].new_utilization_samples or ()
    assert max(ts for ts, _ in history) < stamps[0]


def test_a_busy_gpu_lists_the_process_nvidia_smi_lists_with_its_memory_and_samples(busy: Replayed) -> None:
    (app,) = busy.recording["nvidia_smi"]["compute_apps_before"]
    uuid, pid, used_mib = app.split(", ")
    assert uuid == busy.devices[0].identity.uuid
    for (reading,) in busy.readings:
        (process,) = reading.nvml_processes
        assert (process.pid, process.kind) == (int(pid), "compute")
        assert process.memory_used_bytes == int(used_mib) * MIB
    # The driver keeps one per-process sample a second on this GPU; the GPU's own, five.
    for (reading,) in busy.readings[1:]:
        assert reading.new_process_samples is not None
        (rows,) = reading.new_process_samples.values()
        assert list(reading.new_process_samples) == [int(pid)] and len(rows) == 1
        assert 0.2 <= rows[0][1] <= 1.0
    utilization = [v for (r,) in busy.readings[1:] for _, v in r.new_utilization_samples or ()]
    assert 0.3 <= statistics.mean(utilization) <= 0.95  # busy, waiting for its CPU-made batches between steps


def test_gpm_sees_the_sms_busy_and_the_tensor_cores_unused_by_fp32_matmuls(busy: Replayed) -> None:
    rest = [r for (r,) in busy.readings[1:]]
    assert all(r.sm_active_ratio is not None and 0.3 <= r.sm_active_ratio <= 0.95 for r in rest)
    assert all(r.tensor_active_ratio is not None and r.tensor_active_ratio < 0.01 for r in rest)
    assert all(r.dram_active_ratio is not None and 0 < r.dram_active_ratio < 1 for r in rest)
    # GPM's SM activity and the driver's utilization samples measure the same busy GPU.
    utilization = statistics.mean(v for r in rest for _, v in r.new_utilization_samples or ())
    sm_active = statistics.mean(r.sm_active_ratio or 0.0 for r in rest)
    assert sm_active == pytest.approx(utilization, abs=0.15)


def test_energy_grows_as_the_power_readings_say_and_pcie_counters_only_grow(busy: Replayed) -> None:
    readings = [r for (r,) in busy.readings]
    energy = [r.energy_counter_joules for r in readings]
    assert all(e is not None for e in energy)
    assert energy == sorted(energy)
    interval = busy.recording["read_interval_s"]
    mean_power = statistics.mean(r.power_watts or 0.0 for r in readings)
    assert 100.0 < mean_power < 700.0
    drawn = (energy[-1] - energy[0]) / ((len(energy) - 1) * interval)  # type: ignore[operator]
    assert drawn == pytest.approx(mean_power, rel=0.2)
    pcie = [r.pcie for r in readings]
    assert all(p is not None and p.cumulative for p in pcie)
    tx = [p.tx for p in pcie if p is not None]
    rx = [p.rx for p in pcie if p is not None]
    assert tx == sorted(tx) and rx == sorted(rx)
    # The job copies each batch to the GPU: host-to-device traffic (RX for the GPU) dominates.
    assert rx[-1] - rx[0] > 5 * (tx[-1] - tx[0]) > 0


def test_xid_events_register_and_the_wait_blocks_until_its_timeout(idle: Replayed) -> None:
    event_set = idle.nvml.xid_event_set(idle.devices)
    assert event_set is not None
    assert idle.nvml.wait_xid(event_set, idle.devices, 200) is None  # a timeout: no Xid
    idle.nvml.free_event_set(event_set)
    # On the GPU, the 200 ms wait took 200 ms: this driver's wait blocks (no polling needed).
    assert idle.recording["xid_wait_200ms_took_s"] == pytest.approx(0.2, abs=0.05)


def test_a_call_never_recorded_is_reported_not_answered(idle: Replayed) -> None:
    handle = idle.devices[0].handle
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlDeviceGetTemperature(handle, 5)  # a sensor the recording never asked for
    assert idle.library.unmatched and idle.library.unmatched[-1][0] == "nvmlDeviceGetTemperature"
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetFanSpeed(handle)  # a function it never called
