"""Scenario files: the bundled ones, the schema's errors, value formats and patterns."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pynvml
import pytest

from gpuscope.common.sizes import parse_size
from gpuscope.simulate import ScenarioError, Simulation, bundled_scenarios, load_scenario
from gpuscope.simulate.loader import parse_scenario
from gpuscope.simulate.patterns import RampPattern, StepsPattern, noise_stream, noise_unit

DOCS = Path(__file__).resolve().parent.parent / "docs" / "scenarios.md"
BUNDLED = {"demo": 4, "healthy": 4, "input-bound": 4, "shared-gpu": 4, "skew": 4, "gpu-lost": 4,
           "no-driver": 2, "mig": 2, "legacy": 2, "bench-8x4": 8,
           # One scenario per alert rule (tests/test_alert_scenarios.py), 4 GPUs each.
           **{f"alert-{rule}": 4 for rule in ("low-utilization", "shared", "idle-dips", "skew", "stalled",
                                               "throttled", "xid", "held-idle", "allocated-unused")},
           "alert-row-remap": 8, "alert-hardware-errors": 4}  # the hardware rules (an HGX node of 8)


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def installed(clock: ManualClock) -> Iterator[list[Simulation]]:
    sims: list[Simulation] = []
    yield sims
    for sim in sims:
        sim.uninstall()


def run(name: str, clock: ManualClock, sims: list[Simulation], *, init_at: float = 0.0) -> Simulation:
    sim = Simulation(load_scenario(name), clock=clock, spawn_processes=False)
    sims.append(sim)
    sim.install()
    clock.t = init_at
    pynvml.nvmlInit()
    return sim


def utilization_samples(index: int, cursor: int = 0) -> list[int]:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    _, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, cursor)
    return [s.sampleValue.uiVal for s in samples]


# -------------------------------------------------------------------- bundled scenarios


def test_bundled_names() -> None:
    assert set(bundled_scenarios()) == set(BUNDLED)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_scenario_loads_and_serves_every_reading(name: str, clock: ManualClock,
                                                         installed: list[Simulation]) -> None:
    scenario = load_scenario(name)
    assert scenario.name == name and len(scenario.gpus) == BUNDLED[name] and scenario.description
    run(name, clock, installed, init_at=10.0)
    assert pynvml.nvmlDeviceGetCount() == BUNDLED[name]
    for t in (10.0, 30.0, 65.0, 150.0, 250.0):
        clock.t = t
        for i in range(BUNDLED[name]):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
            except pynvml.NVMLError_GpuIsLost:
                continue
            pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            pynvml.nvmlDeviceGetPowerUsage(h)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
            pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
            pynvml.nvmlDeviceGetComputeRunningProcesses(h)


def test_healthy_is_busy_and_unthrottled(clock: ManualClock, installed: list[Simulation]) -> None:
    run("healthy", clock, installed)
    clock.t = 120.0
    for i in range(4):
        assert min(utilization_samples(i)) >= 90
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == 0
        assert len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)) == 1


def test_input_bound_dips(clock: ManualClock, installed: list[Simulation]) -> None:
    run("input-bound", clock, installed)
    clock.t = 30.0
    values = utilization_samples(0)
    assert sum(v <= 5 for v in values) >= len(values) // 3  # near-0 in a good part of every step


def test_gpu_lost_scenario(clock: ManualClock, installed: list[Simulation]) -> None:
    run("gpu-lost", clock, installed)
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
    clock.t = 30.0
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetPowerUsage(handles[1])
    assert all(pynvml.nvmlDeviceGetPowerUsage(handles[i]) for i in (0, 2, 3))
    clock.t = 45.0
    assert pynvml.nvmlDeviceGetPowerUsage(handles[1]) > 0


def test_no_driver_scenario(clock: ManualClock, installed: list[Simulation]) -> None:
    sim = Simulation(load_scenario("no-driver"), clock=clock, spawn_processes=False)
    installed.append(sim)
    sim.install()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    clock.t = 6.0
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 2


def test_mig_and_legacy_scenarios(clock: ManualClock, installed: list[Simulation]) -> None:
    run("mig", clock, installed, init_at=5.0)
    mig, normal = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    assert pynvml.nvmlDeviceGetMigMode(mig)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetSamples(mig, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    assert pynvml.nvmlGpmQueryDeviceSupport(normal).isSupportedDevice == 1
    installed.pop().uninstall()

    run("legacy", clock, installed, init_at=5.0)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTotalEccErrors(
            h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    fields = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES])
    assert fields[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 2 * 1024 * 1024


def test_demo_shows_its_patterns(clock: ManualClock, installed: list[Simulation]) -> None:
    scenario = load_scenario("demo")
    assert sum(len(g.xid) for g in scenario.gpus) == 1
    assert all(p.spawn for g in scenario.gpus for p in g.processes)
    run("demo", clock, installed)
    h = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
    clock.t = 150.0  # GPU 0 power-capped; GPU 3 busy but stalled
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h[0]) & pynvml.nvmlClocksEventReasonSwPowerCap
    assert len(pynvml.nvmlDeviceGetComputeRunningProcesses(h[2])) == 2
    assert min(utilization_samples(1)) == 0
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(h[3], first)
    clock.t = 151.0
    pynvml.nvmlGpmSampleGet(h[3], second)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics = pynvml.NVML_GPM_METRICS_GET_VERSION, 1
    request.sample1, request.sample2 = first, second
    request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    pynvml.nvmlGpmMetricsGet(request)
    assert request.metrics[0].value < 25 and pynvml.nvmlDeviceGetUtilizationRates(h[3]).gpu >= 85
    clock.t = 200.0  # skew: GPU 3 lags
    lagging, leading = (pynvml.nvmlDeviceGetUtilizationRates(h[i]).gpu for i in (3, 0))
    assert lagging < 70 < leading


def test_bench_has_8x4_processes() -> None:
    scenario = load_scenario("bench-8x4")
    assert [len(g.processes) for g in scenario.gpus] == [4] * 8
    assert any(p.spawn for g in scenario.gpus for p in g.processes)


def test_scenarios_are_deterministic(clock: ManualClock, installed: list[Simulation]) -> None:
    runs = []
    for _ in range(2):
        run("demo", clock, installed)
        clock.t = 30.0
        runs.append(utilization_samples(1))
        installed.pop().uninstall()
        clock.t = 0.0
    assert runs[0] == runs[1]


def test_docs_example_is_valid() -> None:
    text = DOCS.read_text(encoding="utf-8")
    example = re.search(r"## Example\s+```yaml\n(.*?)```", text, re.S)
    assert example is not None
    scenario = parse_scenario(example.group(1), source="docs example")
    assert len(scenario.gpus) == 2


def test_helpers_die_with_their_parent(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a simulator killed with SIGKILL leaves no helper behind."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from gpuscope.simulate import Simulation
        from gpuscope.simulate.loader import parse_scenario
        sim = Simulation(parse_scenario("gpus: [{processes: [{name: orphan-test, spawn: true}]}]"))
        sim.install()
        print(sim.helper_pids["orphan-test"], flush=True)
        time.sleep(60)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert psutil.Process(pid).name() == "orphan-test"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break  # dead; reaped by init in its own time
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    else:
        pytest.fail("the helper outlived its parent")


# -------------------------------------------------------------------- errors


def test_unknown_name_lists_bundled() -> None:
    with pytest.raises(ScenarioError, match=r"unknown scenario.*demo.*healthy"):
        load_scenario("nonesuch")


@pytest.mark.parametrize(("text", "expected"), [
    ("gpus: [{}, {}, {utilization: {level: 1.5}}]", "gpus[2].utilization.level: must be between 0 and 1"),
    ("gpus: [{utilisation: 0.5}]", "gpus[0].utilisation: unknown key"),
    ("gpus: [{utilization: {pattern: steps, period: 0s, busy_fraction: 0.5}}]",
     "gpus[0].utilization.period: must be greater than 0"),
    ("gpus: [{utilization: {pattern: wobble}}]", "gpus[0].utilization: Input tag 'wobble'"),
    ("gpus: [{memory: {total: 80 gigs}}]", "gpus[0].memory.total: expected a size"),
    ("duration: soon", "duration: expected a duration"),
    ("gpus: [{processes: [{name: x}]}]", "gpus[0].processes[0]: 'pid' is required unless spawn: true"),
    ("gpus: [{processes: [{name: a-very-long-process-name, spawn: true}]}]", "1-15 chars"),
    ("gpus: [{failures: [{function: nvmlDeviceGetNothing}]}]", "gpus[0].failures[0].function: unknown"),
    ("gpus: [{clock_event_reasons: [too_hot]}]", "gpus[0].clock_event_reasons: unknown clock event"),
    ("gpus: [{phases: [{from: 2m}, {from: 1m}]}]", "gpus[0].phases: phases must be in increasing order"),
    ("duration: 1m\ngpus: [{xid: [{at: 2m, code: 79}]}]", "gpus[0].xid[0].at: 120s is not within"),
    ("gpus: [{lost: [{from: 20s, to: 10s}]}]", "gpus[0].lost[0]: 'to' must be after 'from'"),
    ("gpus: [{memory: {total: 1GiB}, processes: [{name: a, pid: 1, memory: 2GiB}]}]", "exceeds memory.total"),
    ("gpus: [{phases: [{from: 1s, gpm: {supported: false}}]}]",
     "gpus[0].phases[0].gpm.supported: unknown key"),
    ("gpus: [\n  {", "not valid YAML"),
    ("- 1\n- 2", "top level must be a mapping"),
])
def test_bad_scenario_names_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(str(path))
    message = str(caught.value)
    assert message.startswith(str(path)) and expected in message


def test_several_problems_one_line_each() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("seed: x\ngpus: [{typo: 1}]", source="f.yaml")
    assert caught.value.problems == [
        "seed: Input should be a valid integer, unable to parse string as an integer (got 'x')",
        "gpus[0].typo: unknown key"]
    assert str(caught.value).splitlines()[1] == "f.yaml: gpus[0].typo: unknown key"


# -------------------------------------------------------------------- value formats and patterns


def test_value_formats() -> None:
    assert parse_size("80GiB") == 80 * 1024**3 and parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096 and parse_size("512 MiB") == 512 * 1024**2
    for bad in ("-1", "12 parsecs", True, -5):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    scenario = parse_scenario("duration: 1m30s\ndriver: {available_after: 500ms}\ngpus: [{utilization: 0.5}]")
    assert scenario.duration == 90.0 and scenario.driver.available_after == 0.5
    assert scenario.gpus[0].utilization.level_at(123.0) == 0.5


def test_patterns() -> None:
    steps = StepsPattern(pattern="steps", period=2.0, busy_fraction=0.25, busy_level=0.9, idle_level=0.1)
    assert [steps.level_at(t) for t in (0.0, 0.4, 0.6, 1.9, 2.1)] == [0.9, 0.9, 0.1, 0.1, 0.9]
    ramp = RampPattern(pattern="ramp", start=0.2, end=1.0, over=10.0)
    assert [round(ramp.level_at(t), 6) for t in (0.0, 5.0, 10.0, 99.0)] == [0.2, 0.6, 1.0, 1.0]
    stream = noise_stream(1, 2, 3)
    jitter = [noise_unit(stream, k) for k in range(2000)]
    assert all(-1.0 <= j <= 1.0 for j in jitter) and abs(sum(jitter) / len(jitter)) < 0.05
    assert noise_unit(stream, 7) == noise_unit(noise_stream(1, 2, 3), 7)
    assert noise_unit(stream, 7) != noise_unit(noise_stream(1, 2, 4), 7)
