"""The fake NVML library, exercised through the real pynvml wrappers with a manual scenario clock."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import pynvml
import pytest

from gpuscope.simulate import Simulation
from gpuscope.simulate.loader import parse_scenario

SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


Start = Callable[..., Simulation]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def start(clock: ManualClock) -> Iterator[Start]:
    """start(yaml, spawn=False, init=True): install a scenario; always uninstalled afterwards."""
    sims: list[Simulation] = []

    def _start(text: str, *, spawn: bool = False, init: bool = True) -> Simulation:
        sim = Simulation(parse_scenario(text, source="test.yaml"), clock=clock, spawn_processes=spawn)
        sims.append(sim)
        sim.install()
        if init:
            pynvml.nvmlInit()
        return sim

    yield _start
    for sim in sims:
        sim.uninstall()


def handle(index: int) -> object:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def addr(h: object) -> int | None:
    return ctypes.cast(h, ctypes.c_void_p).value


def gpm_metrics(h: object, first: object, second: object, ids: list[int]) -> list[tuple[int, float]]:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(ids)
    request.sample1, request.sample2 = first, second
    for i, metric in enumerate(ids):
        request.metrics[i].metricId = metric
    pynvml.nvmlGpmMetricsGet(request)
    return [(request.metrics[i].nvmlReturn, request.metrics[i].value) for i in range(len(ids))]


# -------------------------------------------------------------------- identity and lifecycle


def test_identity(start: Start) -> None:
    start("driver: {version: '555.1'}\ngpus: [{name: GPU A}, {name: GPU B, pci_bus_id: '00000000:9A:00.0'}]")
    assert pynvml.nvmlSystemGetDriverVersion() == "555.1"
    assert pynvml.nvmlDeviceGetCount() == 2
    h0, h1 = handle(0), handle(1)
    assert addr(h0) != addr(h1) and addr(h0) == addr(handle(0))
    assert [pynvml.nvmlDeviceGetName(h) for h in (h0, h1)] == ["GPU A", "GPU B"]
    assert pynvml.nvmlDeviceGetIndex(h1) == 1
    uuids = {pynvml.nvmlDeviceGetUUID(h) for h in (h0, h1)}
    assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids)
    pci = pynvml.nvmlDeviceGetPciInfo_v3(h1)
    assert (pci.busId, pci.bus, pci.domain) == ("00000000:9A:00.0", 0x9A, 0)
    assert pynvml.nvmlDeviceGetMigMode(h0) == [0, 0]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        handle(2)


def test_every_c_function_is_emulated() -> None:
    from gpuscope.simulate.fake_nvml import FakeNvmlLib
    from gpuscope.simulate.scenario import DEVICE_FUNCTIONS

    system = {"nvmlInitWithFlags", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion",
              "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlGpmSampleAlloc",
              "nvmlGpmSampleFree", "nvmlGpmMetricsGet", "nvmlEventSetCreate", "nvmlEventSetWait_v2",
              "nvmlEventSetFree"}
    for name in DEVICE_FUNCTIONS | system:
        assert callable(getattr(FakeNvmlLib, name)), name


def test_calls_need_init_and_unknown_functions_are_missing(start: Start) -> None:
    start("gpus: [{}]", init=False)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetFanSpeed(handle(0))  # a real wrapper whose C function the fake lacks
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_driver_absent_until_available(start: Start, clock: ManualClock) -> None:
    start("driver: {available_after: 5s}\ngpus: [{}, {}]", init=False)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    clock.t = 5.5
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 2


def test_driver_never_loads(start: Start, clock: ManualClock) -> None:
    start("driver: {available_after: never}", init=False)
    clock.t = 1e6
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


def test_uninstall_restores_pynvml(clock: ManualClock) -> None:
    sim = Simulation(parse_scenario("gpus: [{}]"), clock=clock)
    sim.install()
    pynvml.nvmlInit()
    pynvml.nvmlDeviceGetCount()
    assert pynvml._nvmlGetFunctionPointer_cache
    sim.uninstall()
    assert pynvml.nvmlLib is None and not pynvml._nvmlGetFunctionPointer_cache
    sim.uninstall()  # idempotent


def test_second_simulation_is_refused(start: Start, clock: ManualClock) -> None:
    start("gpus: [{}]")
    other = Simulation(parse_scenario("gpus: [{}]"), clock=clock)
    with pytest.raises(RuntimeError, match="another Simulation"):
        other.install()


def test_default_clock_counts_from_install() -> None:
    with Simulation(parse_scenario("gpus: [{utilization: 1}]")) as sim:
        assert 0 <= sim.now() < 5
        pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() == 1


# -------------------------------------------------------------------- utilization samples


def test_sample_cursor(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 0.5, processes: [{name: p, pid: 7}]}]")
    h = handle(0)
    clock.t = 2.0
    value_type, samples = pynvml.nvmlDeviceGetSamples(h, SAMPLES, 0)
    assert value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    stamps = [s.timeStamp for s in samples]
    assert len(samples) == 12 and stamps == sorted(set(stamps))
    assert {s.sampleValue.uiVal for s in samples} == {50}
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the last timestamp
        pynvml.nvmlDeviceGetSamples(h, SAMPLES, stamps[-1])
    clock.t = 2.5
    _, newer = pynvml.nvmlDeviceGetSamples(h, SAMPLES, stamps[-1])
    assert len(newer) == 3 and all(s.timeStamp > stamps[-1] for s in newer)


def test_sample_buffer_is_bounded(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 0.5, processes: [{name: p, pid: 7}]}]")
    clock.t = 100.0
    _, samples = pynvml.nvmlDeviceGetSamples(handle(0), SAMPLES, 0)
    assert len(samples) == 120  # about the last 20 s, like the driver


def test_input_bound_pattern_dips_every_step(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: {pattern: steps, period: 1s, busy_fraction: 0.5, busy_level: 0.95},"
          " processes: [{name: p, pid: 7}]}]")
    clock.t = 10.0
    _, samples = pynvml.nvmlDeviceGetSamples(handle(0), SAMPLES, 0)
    values = [s.sampleValue.uiVal for s in samples]
    assert len(values) == 60
    for step in range(10):  # every 1 s step: three busy samples, then three at ~0
        assert values[step * 6: step * 6 + 6] == [95, 95, 95, 0, 0, 0]


def test_idle_gpu_records_no_samples(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 0}]")
    clock.t = 5.0
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetSamples(handle(0), SAMPLES, 0)
    assert pynvml.nvmlDeviceGetUtilizationRates(handle(0)).gpu == 0


def test_noise_stays_in_bounds_and_is_deterministic(start: Start, clock: ManualClock) -> None:
    start("seed: 3\ngpus: [{utilization: {level: 0.9, noise: 0.05}, processes: [{name: p, pid: 7}]}]")
    clock.t = 20.0
    first = [s.sampleValue.uiVal for s in pynvml.nvmlDeviceGetSamples(handle(0), SAMPLES, 0)[1]]
    again = [s.sampleValue.uiVal for s in pynvml.nvmlDeviceGetSamples(handle(0), SAMPLES, 0)[1]]
    assert first == again and len(set(first)) > 3 and all(85 <= v <= 95 for v in first)
    assert 88 <= pynvml.nvmlDeviceGetUtilizationRates(handle(0)).gpu <= 92


def test_phases_change_behaviour_and_loop(start: Start, clock: ManualClock) -> None:
    start("duration: 20s\ngpus: [{utilization: 0.3, processes: [{name: p, pid: 7}],"
          " phases: [{from: 10s, utilization: {pattern: ramp, start: 0.5, end: 1.0, over: 5s}}]}]")
    h = handle(0)
    clock.t = 5.0
    assert pynvml.nvmlDeviceGetUtilizationRates(h).gpu == 30
    clock.t = 17.0  # ramp finished: holds 1.0
    assert pynvml.nvmlDeviceGetUtilizationRates(h).gpu == 100
    clock.t = 25.0  # looped: 5 s into the next run
    assert pynvml.nvmlDeviceGetUtilizationRates(h).gpu == 30


# -------------------------------------------------------------------- memory, power, clocks


def test_memory_info_versions(start: Start, clock: ManualClock) -> None:
    start("gpus: [{memory: {total: 80GiB, reserved: 512MiB, base_used: 1GiB},"
          " processes: [{name: a, pid: 7, memory: 10GiB}, {name: b, pid: 8, memory: 5GiB, start: 10s}]}]")
    gib = 1024**3
    h = handle(0)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert (v2.total, v2.reserved, v2.used) == (80 * gib, gib // 2, 11 * gib)
    assert v2.free == v2.total - v2.reserved - v2.used
    clock.t = 11.0
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    assert v1.used == 16 * gib + gib // 2 and v1.free == v1.total - v1.used


def test_energy_integrates_power_and_stays_monotonic(start: Start, clock: ManualClock) -> None:
    start("duration: 5s\ngpus: [{utilization: 1.0, power: {limit_w: 700, idle_w: 100, busy_w: 600}}]")
    h = handle(0)
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 600_000
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
    readings = []
    for t in [0.0, 0.1, 1.0, 4.9, 5.0, 7.5, 12.0]:  # across loops too
        clock.t = t
        readings.append(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
    assert readings == sorted(readings)
    assert readings[-1] == pytest.approx(600 * 12.0 * 1000, rel=1e-6)


def test_power_cap_phase_sets_reason_and_slows_clock(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 1.0, phases: [{from: 10s, power: {limit_w: 310}}],"
          " processes: [{name: p, pid: 7}]}]")
    h = handle(0)
    cap = pynvml.nvmlClocksEventReasonSwPowerCap
    assert not pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) & cap
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 2619
    clock.t = 12.0
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 310_000
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) & cap
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == round(1980 * 310 / 620)


def test_explicit_reasons_temperature_and_idle(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 1.0, temperature: {idle_c: 30, busy_c: 80},"
          " phases: [{from: 10s, clock_event_reasons: [hw_thermal_slowdown]}, {from: 20s, utilization: 0}]}]")
    h = handle(0)
    clock.t = 8.0
    assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 80
    clock.t = 12.0
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    clock.t = 30.0
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 345
    assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 30


# -------------------------------------------------------------------- PCIe, ECC, GPM


def test_pcie_counters_and_throughput(start: Start, clock: ManualClock) -> None:
    start("gpus: [{pcie: {tx_bytes_per_s: 1MiB, rx_bytes_per_s: 4MiB}},"
          " {pcie: {counters: false, tx_bytes_per_s: 2MiB, rx_bytes_per_s: 8MiB}}]")
    fields = [pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
    clock.t = 10.0
    tx, rx = pynvml.nvmlDeviceGetFieldValues(handle(0), fields)
    assert (tx.nvmlReturn, rx.nvmlReturn) == (pynvml.NVML_SUCCESS, pynvml.NVML_SUCCESS)
    assert (tx.value.ullVal, rx.value.ullVal) == (10 * 2**20, 40 * 2**20)
    clock.t = 20.0
    assert pynvml.nvmlDeviceGetFieldValues(handle(0), fields)[0].value.ullVal == 20 * 2**20
    legacy = pynvml.nvmlDeviceGetFieldValues(handle(1), fields)
    assert [v.nvmlReturn for v in legacy] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 2
    assert pynvml.nvmlDeviceGetPcieThroughput(handle(1), pynvml.NVML_PCIE_UTIL_TX_BYTES) == 2048
    assert pynvml.nvmlDeviceGetPcieThroughput(handle(1), pynvml.NVML_PCIE_UTIL_RX_BYTES) == 8192


def test_ecc(start: Start) -> None:
    start("gpus: [{ecc: {uncorrected_volatile: 3}}, {ecc: {supported: false}}]")
    args = (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    assert pynvml.nvmlDeviceGetTotalEccErrors(handle(0), *args) == 3
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTotalEccErrors(handle(1), *args)


def test_gpm_busy_but_stalled(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 0.9, gpm: {sm_active: 0.2, sm_occupancy: 0.1, tensor_active: 0.05,"
          " dram_active: 0.5}, pcie: {tx_bytes_per_s: 3MiB}}, {gpm: {supported: false}}]")
    h = handle(0)
    assert pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    clock.t = 1.0
    pynvml.nvmlGpmSampleGet(h, first)
    clock.t = 2.0
    pynvml.nvmlGpmSampleGet(h, second)
    ids = [pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
           pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
           pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC]
    got = gpm_metrics(h, first, second, ids)
    assert [r for r, _ in got] == [pynvml.NVML_SUCCESS] * 5 + [pynvml.NVML_ERROR_NOT_SUPPORTED]
    assert [round(v, 6) for _, v in got[:5]] == [18.0, 9.0, 4.5, 45.0, 3.0]
    assert pynvml.nvmlDeviceGetUtilizationRates(h).gpu == 90
    pynvml.nvmlGpmSampleFree(first)
    pynvml.nvmlGpmSampleFree(second)
    assert pynvml.nvmlGpmQueryDeviceSupport(handle(1)).isSupportedDevice == 0
    sample = pynvml.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmSampleGet(handle(1), sample)


# -------------------------------------------------------------------- MIG, lost GPUs, failures


def test_mig_gpu(start: Start, clock: ManualClock) -> None:
    start("gpus: [{mig: true, utilization: 0.7, processes: [{name: a, pid: 7, memory: 4GiB}]}]")
    h = handle(0)
    clock.t = 3.0
    assert pynvml.nvmlDeviceGetMigMode(h) == [1, 1]
    for call in (lambda: pynvml.nvmlDeviceGetSamples(h, SAMPLES, 0),
                 lambda: pynvml.nvmlDeviceGetUtilizationRates(h),
                 lambda: pynvml.nvmlDeviceGetProcessUtilization(h, 0),
                 lambda: pynvml.nvmlGpmSampleGet(h, pynvml.nvmlGpmSampleAlloc())):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice  # GPM per GPU instance: below
    assert pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used == 4 * 1024**3
    assert pynvml.nvmlDeviceGetPowerUsage(h) > 0
    (proc,) = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert (proc.pid, proc.gpuInstanceId, proc.computeInstanceId) == (7, 1, 0)


def test_mig_devices_by_index_with_their_own_handles(start: Start, clock: ManualClock) -> None:
    start("""gpus:
  - mig: true
    mig_devices: [{profile: 3g.40gb, utilization: 0.5}, {profile: 1g.10gb}]
    processes: [{name: a, pid: 7, memory: 4GiB, mig_device: 1}, {name: b, pid: 8, memory: 1GiB}]
  - {}""")
    parent = handle(0)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    first, second = (pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, i) for i in (0, 1))
    with pytest.raises(pynvml.NVMLError_NotFound):  # an empty slot
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 2)
    assert [(pynvml.nvmlDeviceGetGpuInstanceId(m), pynvml.nvmlDeviceGetComputeInstanceId(m)) for m in
            (first, second)] == [(1, 0), (2, 0)]
    assert pynvml.nvmlDeviceGetName(second).endswith(" MIG 1g.10gb")
    assert pynvml.nvmlDeviceGetUUID(second).startswith("MIG-")
    assert pynvml.nvmlDeviceGetMemoryInfo(second).used == 4 * 1024**3
    assert pynvml.nvmlDeviceGetMemoryInfo(first).used == 1024**3  # pid 8 names no MIG device: the first
    with pytest.raises(pynvml.NVMLError_NotSupported):  # nothing per instance but ids, name, memory
        pynvml.nvmlDeviceGetUtilizationRates(first)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # a GPU's handle is no MIG device's
        pynvml.nvmlDeviceGetGpuInstanceId(parent)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMaxMigDeviceCount(handle(1))
    samples = [pynvml.nvmlGpmSampleAlloc() for _ in range(2)]
    pynvml.nvmlGpmMigSampleGet(parent, 1, samples[0])
    clock.t = 2.0
    pynvml.nvmlGpmMigSampleGet(parent, 1, samples[1])
    got = gpm_metrics(parent, samples[0], samples[1], [pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
                                                        pynvml.NVML_GPM_METRIC_SM_UTIL,
                                                        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC])
    assert [r for r, _ in got] == [pynvml.NVML_SUCCESS, pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED]
    assert got[0][1] == pytest.approx(50.0) and got[1][1] == pytest.approx(50.0 * 0.85)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlGpmMigSampleGet(parent, 3, samples[0])


def test_health_counters_and_nvlink(start: Start, clock: ManualClock) -> None:
    start("""gpus:
  - utilization: 1.0
    clock_event_reasons: [sw_thermal_slowdown]
    health: {row_remap_pending: true, remapped_rows_uncorrectable: 2, pcie_replays: 9,
             pcie_errors: {fatal: 1}}
    nvlink: {links: 4, down: [3], errors: {replay: 6}, errors_link: 2, tx_bytes_per_s: 1GiB}
  - {}""")
    h, plain = handle(0), handle(1)
    clock.t = 10.0
    thermal = pynvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL)
    assert thermal.violationTime == pytest.approx(10e9, rel=0.02)  # the reason held for the whole 10 s
    assert pynvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_POWER).violationTime == 0
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 2, 1, 0)
    assert pynvml.nvmlDeviceGetPcieReplayCounter(h) == 9
    assert [pynvml.nvmlDeviceGetNvLinkState(h, link) for link in range(4)] == [1, 1, 1, 0]
    assert pynvml.nvmlDeviceGetNvLinkErrorCounter(h, 2, pynvml.NVML_NVLINK_ERROR_DL_REPLAY) == 6
    assert pynvml.nvmlDeviceGetNvLinkErrorCounter(h, 0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY) == 0
    tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    values = pynvml.nvmlDeviceGetFieldValues(h, [(tx, 0xFFFFFFFF), (tx, 0), (tx, 3),
                                                 pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
                                                 pynvml.NVML_FI_DEV_REMAPPED_PENDING,
                                                 pynvml.NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR])
    total, link0, down_link = (v.value.ullVal for v in values[:3])
    assert total == pytest.approx(10 * 1024**2, rel=0.02)  # KiB: 1 GiB/s for 10 s, over all links
    assert link0 == pytest.approx(total / 3, rel=0.01)  # scope 0 (a bare field id): link 0 alone
    assert down_link == 0
    assert [v.value.ullVal for v in values[3:]] == [6, 1, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):  # no NVLink on the second GPU
        pynvml.nvmlDeviceGetNvLinkState(plain, 0)
    (links,) = pynvml.nvmlDeviceGetFieldValues(plain, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
    assert links.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_lost_window_then_recovery(start: Start, clock: ManualClock) -> None:
    start("duration: 60s\ngpus: [{utilization: 0.9}, {utilization: 0.9, lost: [{from: 20s, to: 40s}]}]")
    h0, h1 = handle(0), handle(1)
    clock.t = 25.0
    for call in (pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetName,
                 lambda h: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(h1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        handle(1)
    assert pynvml.nvmlDeviceGetPowerUsage(h0) > 0  # the others keep working
    clock.t = 40.0
    assert pynvml.nvmlDeviceGetPowerUsage(h1) > 0
    assert addr(handle(1)) == addr(h1)


def test_injected_failure_from_a_time(start: Start, clock: ManualClock) -> None:
    start("gpus: [{failures: [{function: nvmlDeviceGetPowerUsage, from: 10s},"
          " {function: nvmlDeviceGetTemperature, from: 1s, to: 2s, error: timeout}]}, {}]")
    h = handle(0)
    assert pynvml.nvmlDeviceGetPowerUsage(h) > 0
    clock.t = 1.5
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    clock.t = 10.0
    for _ in range(3):  # keeps failing: the agent must log it once, not every tick
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetPowerUsage(h)
    assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) > 0
    assert pynvml.nvmlDeviceGetPowerUsage(handle(1)) > 0


# -------------------------------------------------------------------- processes


def test_process_lists_with_spawned_helper(start: Start, clock: ManualClock) -> None:
    sim = start("""
gpus:
  - processes:
      - {name: sim-trainer, spawn: true, memory: 10GiB}
      - {name: ghost, pid: 4000001, memory: 1GiB}
      - {name: viz, pid: 4000002, kind: graphics, memory: 100MiB}
  - processes:
      - {name: sim-trainer, spawn: true, memory: 500MiB}
      - {name: late, pid: 4000003, start: 30s, stop: 40s}
""", spawn=True)
    pid = sim.helper_pids["sim-trainer"]
    assert psutil.Process(pid).name() == "sim-trainer"
    compute = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle(0))
    assert [(p.pid, p.usedGpuMemory) for p in compute] == [(pid, 10 * 1024**3), (4000001, 1024**3)]
    graphics = pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle(0))
    assert [p.pid for p in graphics] == [4000002]
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1))] == [pid]  # same helper
    clock.t = 35.0
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1))] == [pid, 4000003]
    assert pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle(1)) == []


def test_process_utilization_cursor_and_shares(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 0.8, processes: [{name: a, pid: 11, sm_share: 0.75}, {name: b, pid: 12,"
          " utilization: {pattern: steps, period: 1s, busy_fraction: 0.5, busy_level: 0.4}}]}]")
    h = handle(0)
    clock.t = 1.0
    samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert len(samples) == 12
    assert {s.smUtil for s in samples if s.pid == 11} == {60}
    assert sorted(s.smUtil for s in samples if s.pid == 12) == [0, 0, 0, 40, 40, 40]
    cursor = max(s.timeStamp for s in samples)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(h, cursor)
    clock.t = 1.2
    newer = pynvml.nvmlDeviceGetProcessUtilization(h, cursor)
    assert len(newer) == 2 and all(s.timeStamp > cursor for s in newer)


def test_uninstall_kills_helpers() -> None:
    sim = Simulation(parse_scenario(
        "gpus: [{processes: [{name: sim-a, spawn: true}, {name: sim-b, spawn: true}]}]"))
    sim.install()
    pids = list(sim.helper_pids.values())
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    sim.uninstall()
    assert not any(psutil.pid_exists(p) for p in pids)  # terminated and reaped
    assert sim.helper_pids == {}


def test_spawning_disabled_gives_impossible_pids(start: Start) -> None:
    sim = start("gpus: [{processes: [{name: sim-a, spawn: true}]}]", spawn=False)
    assert sim.helper_pids == {}
    (proc,) = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))
    assert proc.pid > 4_194_304 and not psutil.pid_exists(proc.pid)


# -------------------------------------------------------------------- events and threads


def test_xid_event_delivered(start: Start, clock: ManualClock) -> None:
    start("duration: 60s\ngpus: [{}, {xid: [{at: 30s, code: 79}]}]")
    event_set = pynvml.nvmlEventSetCreate()
    for i in range(2):
        h = handle(i)
        assert pynvml.nvmlDeviceGetSupportedEventTypes(h) & pynvml.nvmlEventTypeXidCriticalError
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    began = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 100)
    assert 0.09 <= time.monotonic() - began < 2.0  # blocks for the timeout, in wall time

    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pynvml.nvmlEventSetWait_v2(event_set, 5000)))
    waiter.start()
    time.sleep(0.05)
    clock.t = 31.0  # the scenario reaches the Xid while the waiter blocks
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    (data,) = got
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError and data.eventData == 79
    assert addr(data.device) == addr(handle(1)) and pynvml.nvmlDeviceGetIndex(data.device) == 1
    with pytest.raises(pynvml.NVMLError_Timeout):  # delivered once
        pynvml.nvmlEventSetWait_v2(event_set, 10)
    clock.t = 95.0  # the next loop's occurrence
    assert pynvml.nvmlEventSetWait_v2(event_set, 10).eventData == 79
    pynvml.nvmlEventSetFree(event_set)


def test_blocked_wait_returns_on_uninstall(clock: ManualClock) -> None:
    sim = Simulation(parse_scenario("gpus: [{}]"), clock=clock)
    sim.install()
    pynvml.nvmlInit()
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeXidCriticalError, event_set)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pynvml.nvmlEventSetWait_v2(event_set, 10_000)
        except pynvml.NVMLError as err:
            errors.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    sim.uninstall()
    waiter.join(timeout=2)
    assert not waiter.is_alive() and isinstance(errors[0], pynvml.NVMLError_Uninitialized)


def test_blocked_wait_returns_on_shutdown(start: Start) -> None:
    start("gpus: [{}]")
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeXidCriticalError, event_set)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pynvml.nvmlEventSetWait_v2(event_set, 10_000)
        except pynvml.NVMLError as err:
            errors.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    pynvml.nvmlShutdown()  # an agent stopping its Xid thread must not wait out the timeout
    waiter.join(timeout=2)
    assert not waiter.is_alive() and isinstance(errors[0], pynvml.NVMLError_Uninitialized)


def test_concurrent_callers(start: Start, clock: ManualClock) -> None:
    start("gpus: [{utilization: 0.5, processes: [{name: p, pid: 7}], xid: [{at: 1s, code: 13}]}, {}]")
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeXidCriticalError, event_set)
    failures: list[BaseException] = []
    events: list[int] = []

    def sampler() -> None:
        try:
            for i in range(200):
                clock.t = i * 0.05
                for index in range(2):
                    h = handle(index)
                    pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
                    pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
                    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        except BaseException as err:  # report into the main thread
            failures.append(err)

    def watcher() -> None:
        try:
            events.append(pynvml.nvmlEventSetWait_v2(event_set, 5000).eventData)
        except BaseException as err:
            failures.append(err)

    threads = [threading.Thread(target=target) for target in (sampler, sampler, watcher)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not failures and events == [13]
