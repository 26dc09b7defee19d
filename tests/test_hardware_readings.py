"""MIG devices, NVLink and the hardware health readings, through the real boundary and sampler over the
simulated NVML (the fake library sits under pynvml, so pynvml's own wrappers run)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from test_sampler import ManualClock, make_sampler, ticks

from gpuscope.generated.kubelet.v1 import podresources_pb2
from gpuscope.host.kubelet import gpu_allocations
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation
from gpuscope.simulate.loader import parse_scenario
from gpuscope.snapshot import PodContainer, Snapshot

Start = Callable[..., Simulation]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1.0)


@pytest.fixture
def simulate(clock: ManualClock) -> Iterator[Start]:
    """simulate(yaml) installs a scenario on the manual clock; uninstalled after the test."""
    sims: list[Simulation] = []

    def start(text: str) -> Simulation:
        sim = Simulation(parse_scenario(text, source="node"), clock=clock, spawn_processes=False)
        sim.install()
        sims.append(sim)
        return sim

    yield start
    for sim in sims:
        sim.uninstall()

_NODE = """
duration: 100s
gpus:
  - mig: enabled
    mig_devices:
      - {profile: 3g.40gb, utilization: 0.5}
      - {profile: 1g.10gb, pods: [{namespace: lab, pod: idle-notebook, container: jupyter}]}
    processes:
      - {name: a, pid: 4242, memory: 8GiB, mig_device: 0}
      - {name: b, pid: 4343, memory: 2GiB, mig_device: 1}
  - utilization: 1.0
    clock_event_reasons: [sw_power_cap]
    health: {row_remap_pending: true, remapped_rows_uncorrectable: 1, ecc_corrected: 12, pcie_replays: 3}
    nvlink: {links: 18, down: [17], errors: {replay: 4}, errors_link: 5}
  - {}
"""


def test_mig_devices_their_memory_activity_busy_time_and_processes(simulate: Start,
                                                                   clock: ManualClock) -> None:
    simulate(_NODE)
    sampler = make_sampler(clock)
    snap = ticks(sampler, clock, until=clock.now + 10.0)
    mig_gpu = snap.gpus[0]
    assert mig_gpu.mig_enabled and mig_gpu.utilization_ratio is None and mig_gpu.busy_seconds_total is None
    big, small = mig_gpu.mig_devices
    assert [(m.gpu_instance, m.compute_instance, m.profile) for m in (big, small)] == [
        (1, 0, "3g.40gb"), (2, 0, "1g.10gb")]
    assert big.uuid.startswith("MIG-") and big.uuid != small.uuid
    assert (big.memory_used_bytes, small.memory_used_bytes) == (8 * 1024**3, 2 * 1024**3)
    assert big.sm_active_ratio == pytest.approx(0.5 * 0.85)
    # Busy 0.5 of the 10 s between the first tick's GPM sample and the last one; the idle one not at all.
    assert big.busy_seconds_total == pytest.approx(5.0, rel=0.05)
    assert small.busy_seconds_total == 0.0
    assert {p.pid: (p.gpu_instance, p.compute_instance) for p in mig_gpu.processes} == {
        4242: (1, 0), 4343: (2, 0)}
    assert snap.gpus[1].mig_devices == () and all(p.gpu_instance is None for p in snap.gpus[1].processes)


def test_health_readings_repeat_between_reads_and_throttle_time_adds_up(simulate: Start,
                                                                        clock: ManualClock) -> None:
    simulate(_NODE)
    sampler = make_sampler(clock, health_interval_seconds=10.0, throttle_interval_seconds=30.0)
    first = sampler.tick()
    gpu = first.gpus[1]
    assert (gpu.row_remap_pending, gpu.row_remap_failed, gpu.health) == (True, False, "reset_required")
    assert gpu.remapped_rows_uncorrectable_total == 1
    assert (gpu.ecc_corrected_errors_total, gpu.pcie_replays_total) == (12, 3)
    assert gpu.nvlink_active_links == 17 and gpu.nvlink_errors_total == {
        "crc_flit": 0, "crc_data": 0, "replay": 4, "recovery": 0}
    assert gpu.memory_temperature_celsius is not None
    assert first.gpus[2].nvlink_active_links is None and first.gpus[2].nvlink_transmit_bytes_total is None
    assert first.gpus[2].health == "ok"
    power_at_start = gpu.clock_throttle_seconds_total["power"]
    later = ticks(sampler, clock, until=clock.now + 29.0)
    # Not read again before throttle_interval: the value read at the start is repeated.
    assert later.gpus[1].clock_throttle_seconds_total["power"] == power_at_start
    after = ticks(sampler, clock, until=clock.now + 1.0)
    # The power cap held all the while: the counter grew by the 30 s between its two reads.
    grown = after.gpus[1].clock_throttle_seconds_total["power"] - power_at_start
    assert grown == pytest.approx(30.0, rel=0.02)
    assert after.gpus[1].nvlink_transmit_bytes_total > gpu.nvlink_transmit_bytes_total  # every tick


def test_per_link_nvlink_counters_only_when_asked(simulate: Start, clock: ManualClock) -> None:
    simulate(_NODE)
    plain = make_sampler(clock).tick().gpus[1]
    assert plain.nvlink_link_bytes is None and plain.nvlink_link_errors_total is None
    per_link = make_sampler(clock, nvlink_per_link=True).tick().gpus[1]
    assert per_link.nvlink_link_bytes is not None and len(per_link.nvlink_link_bytes) == 18
    assert per_link.nvlink_link_bytes[17] == {"transmit_bytes": 0.0, "receive_bytes": 0.0}  # a link down
    assert sum(v["transmit_bytes"] for v in per_link.nvlink_link_bytes.values()) == pytest.approx(
        per_link.nvlink_transmit_bytes_total, rel=0.01)
    assert per_link.nvlink_link_errors_total[5]["replay"] == 4
    assert per_link.nvlink_link_errors_total[0]["replay"] == 0


def test_unsupported_readings_are_absent_and_not_asked_again(simulate: Start, clock: ManualClock) -> None:
    simulate("gpus: [{mig: unsupported, health: {encoder: false}}]")
    sampler = make_sampler(clock)
    gpu = ticks(sampler, clock, until=clock.now + 3.0).gpus[0]
    assert gpu.encoder_utilization_ratio is None and gpu.decoder_utilization_ratio == 0.0
    assert gpu.nvlink_active_links is None and gpu.mig_devices == ()
    assert sampler.latest() is not None and sampler.latest().sample_errors == {}


def test_kubelet_mig_device_ids_map_pods_to_instances() -> None:
    response = podresources_pb2.ListPodResourcesResponse(pod_resources=[
        podresources_pb2.PodResources(name="nb", namespace="lab", containers=[
            podresources_pb2.ContainerResources(name="jupyter", devices=[podresources_pb2.ContainerDevices(
                resource_name="nvidia.com/mig-1g.10gb", device_ids=["MIG-aaaa-0002"])])])])
    allocations = gpu_allocations(response)
    assert allocations.pods_for("MIG-aaaa-0002", -1) == (PodContainer("lab", "nb", "jupyter"),)
    assert allocations.pods_for("MIG-aaaa-0001", -1) == ()


def test_pods_on_a_simulated_mig_node_reach_their_instances(simulate: Start, clock: ManualClock) -> None:
    from gpuscope.host.pods import PodAttribution

    sim = simulate(_NODE)
    socket = sim.kubelet_socket
    assert socket is not None
    pods = PodAttribution(socket, refresh_interval=60.0, timeout=5.0, keep_for=60.0)
    try:
        pods.refresh()
        sampler = make_sampler(clock)
        sampler._pods = pods.pods_for  # as NodeSampling wires it
        small = sampler.tick().gpus[0].mig_devices[1]
        assert small.pods == (PodContainer("lab", "idle-notebook", "jupyter"),)
    finally:
        pods.stop()


def test_compute_instances_of_one_gpu_instance_share_its_profile_and_busy_time(simulate: Start,
                                                                                clock: ManualClock) -> None:
    simulate("""
gpus:
  - mig: enabled
    mig_devices:
      - {profile: 1c.3g.40gb, gpu_instance: 1, compute_instance: 0, utilization: 0.5}
      - {profile: 2c.3g.40gb, gpu_instance: 1, compute_instance: 1}
      - {profile: 3g.40gb}
    processes: [{name: a, pid: 5, memory: 3GiB, mig_device: 1}]
""")
    sampler = make_sampler(clock)
    first, second, third = ticks(sampler, clock, until=clock.now + 10.0).gpus[0].mig_devices
    assert [(m.gpu_instance, m.compute_instance, m.profile) for m in (first, second, third)] == [
        (1, 0, "3g.40gb"), (1, 1, "3g.40gb"), (3, 0, "3g.40gb")]
    # One GPU instance, one busy time: not counted once per compute instance.
    assert first.busy_seconds_total == second.busy_seconds_total == pytest.approx(5.0, rel=0.05)
    assert first.memory_used_bytes == second.memory_used_bytes == 3 * 1024**3  # the instance's memory
    assert first.uuid != second.uuid


def test_a_failed_relisting_keeps_the_devices_as_last_listed(simulate: Start, clock: ManualClock) -> None:
    simulate("""
duration: 100s
gpus:
  - mig: enabled
    mig_devices: [{profile: 3g.40gb, utilization: 1.0}]
    failures: [{function: nvmlDeviceGetMaxMigDeviceCount, from: 5s, to: 30s}]
""")
    sampler = make_sampler(clock, health_interval_seconds=1.0)
    before = ticks(sampler, clock, until=4.0).gpus[0].mig_devices
    during = ticks(sampler, clock, until=12.0)
    assert during.sample_errors.get("mig_devices", 0) > 0  # the listing failed, and is counted
    (device,) = during.gpus[0].mig_devices
    assert device.uuid == before[0].uuid and device.busy_seconds_total > before[0].busy_seconds_total


def test_health_is_read_again_as_soon_as_a_lost_gpu_is_back(simulate: Start, clock: ManualClock) -> None:
    simulate("""
duration: 100s
gpus:
  - health: {row_remap_pending: true}
    lost: [{from: 5s, to: 8s}]
""")
    sampler = make_sampler(clock, health_interval_seconds=60.0)
    assert sampler.tick().gpus[0].health == "reset_required"
    lost = ticks(sampler, clock, until=6.0).gpus[0]
    assert lost.health == "lost"
    back = ticks(sampler, clock, until=8.0).gpus[0]
    # Read at once, not 60 s after the last read: a reset may have cleared it meanwhile.
    assert back.up and back.row_remap_pending is True and back.health == "reset_required"


def test_a_lost_gpu_keeps_its_mig_devices_and_their_pods(simulate: Start, clock: ManualClock) -> None:
    simulate("""
duration: 100s
gpus:
  - mig: enabled
    mig_devices: [{profile: 3g.40gb}]
    lost: [{from: 5s, to: 8s}]
""")
    sampler = make_sampler(clock)
    up = ticks(sampler, clock, until=4.0).gpus[0]
    down = ticks(sampler, clock, until=6.0).gpus[0]
    assert not down.up and [m.uuid for m in down.mig_devices] == [m.uuid for m in up.mig_devices]


def test_per_link_error_counters_that_fail_are_absent_not_partial(simulate: Start,
                                                                  clock: ManualClock) -> None:
    simulate("""
duration: 100s
gpus:
  - nvlink: {links: 4, errors: {replay: 3}, errors_link: 1}
    failures: [{function: nvmlDeviceGetNvLinkErrorCounter, from: 5s, to: 30s}]
""")
    sampler = make_sampler(clock, health_interval_seconds=1.0, nvlink_per_link=True)
    assert sampler.tick().gpus[0].nvlink_link_errors_total[1]["replay"] == 3
    failing = ticks(sampler, clock, until=10.0).gpus[0]
    assert failing.nvlink_link_errors_total is None  # not the links that happened to answer
    assert failing.nvlink_errors_total == {"crc_flit": 0, "crc_data": 0, "replay": 3, "recovery": 0}
    again = ticks(sampler, clock, until=31.0).gpus[0]
    assert again.nvlink_link_errors_total is not None and again.nvlink_link_errors_total[1]["replay"] == 3


def test_mig_mode_switched_while_running_is_followed(simulate: Start, clock: ManualClock,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver says MIG is on from some tick (an administrator ran nvidia-smi -mig 1), then off:
    the utilization samples stop and start again, without an agent restart."""
    import pynvml

    simulate("gpus: [{utilization: 0.8}]")
    sampler = make_sampler(clock, health_interval_seconds=1.0)
    before = ticks(sampler, clock, until=3.0).gpus[0]
    assert not before.mig_enabled and before.busy_seconds_total is not None
    real = pynvml.nvmlDeviceGetMigMode
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda handle: [1, 1])
    on = ticks(sampler, clock, until=6.0).gpus[0]
    assert on.mig_enabled and on.utilization_samples == () and on.mig_devices == ()
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", real)
    off = ticks(sampler, clock, until=9.0).gpus[0]
    assert not off.mig_enabled and off.utilization_samples  # read again: not left "unsupported"
    assert off.busy_seconds_total is not None and off.busy_seconds_total > before.busy_seconds_total


def test_settings_are_read_with_the_health_readings_and_repeated_between(
        simulate: Start, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The enforced power limit, the memory clock and the uncorrected ECC count are read once per
    nvml.health_interval (an administrator's new limit shows at the next read), the readings that
    follow the load (power draw, SM clock) every tick."""
    import pynvml

    simulate("""
duration: 100s
gpus:
  - utilization: 1.0
    phases:
      - {from: 5s, power: {limit_w: 450}, clocks: {mem_mhz: 1593}}
""")
    asked: dict[str, int] = {}

    def counting(name: str) -> Callable[..., object]:
        real = getattr(pynvml, name)

        def counted(*args: object) -> object:
            asked[name] = asked.get(name, 0) + 1
            return real(*args)
        return counted

    for name in ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage"):
        monkeypatch.setattr(pynvml, name, counting(name))
    sampler = make_sampler(clock, health_interval_seconds=10.0)
    first = sampler.tick().gpus[0]
    assert (first.power_limit_watts, first.memory_clock_hertz) == (700.0, 2619e6)
    assert first.ecc_uncorrected_errors_total == 0
    before = _step(sampler, clock, 9).gpus[0]  # t = 10 s
    # The limit changed at 5 s: still the value read at the start, as the clock and ECC count are.
    assert (before.power_limit_watts, before.memory_clock_hertz) == (700.0, 2619e6)
    assert before.ecc_uncorrected_errors_total == 0
    assert before.power_watts is not None and before.power_watts <= 450.0  # the draw: every tick
    assert asked == {"nvmlDeviceGetEnforcedPowerLimit": 1, "nvmlDeviceGetPowerUsage": 10,
                     "nvmlDeviceGetTotalEccErrors": 2}  # corrected and uncorrected, once each
    after = _step(sampler, clock, 1).gpus[0]  # 10 s after the first read
    assert (after.power_limit_watts, after.memory_clock_hertz) == (450.0, 1593e6)
    assert asked["nvmlDeviceGetEnforcedPowerLimit"] == 2


def test_video_engines_are_read_every_tick_only_while_in_use(
        simulate: Start, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle decoder is read with the health readings; one in use every tick, until it is idle."""
    import pynvml

    simulate("gpus: [{utilization: 0.5}]")
    percent = [0]
    asked = [0]

    def decoder(_handle: object) -> list[int]:
        asked[0] += 1
        return [percent[0], 167_000]

    monkeypatch.setattr(pynvml, "nvmlDeviceGetDecoderUtilization", decoder)
    sampler = make_sampler(clock, health_interval_seconds=10.0)
    sampler.tick()
    idle = _step(sampler, clock, 4).gpus[0]
    assert idle.decoder_utilization_ratio == 0.0 and asked[0] == 1  # repeated between reads
    percent[0] = 40  # the decoder starts: seen at the next health read, then every tick
    assert _step(sampler, clock, 5).gpus[0].decoder_utilization_ratio == 0.0 and asked[0] == 1
    seen = _step(sampler, clock, 1).gpus[0]
    assert seen.decoder_utilization_ratio == pytest.approx(0.4) and asked[0] == 2
    percent[0] = 70
    busy = _step(sampler, clock, 2).gpus[0]
    assert busy.decoder_utilization_ratio == pytest.approx(0.7) and asked[0] == 4
    percent[0] = 0
    assert _step(sampler, clock, 1).gpus[0].decoder_utilization_ratio == 0.0 and asked[0] == 5
    _step(sampler, clock, 5)
    assert asked[0] == 5  # idle again: not read until the next health read


def _step(sampler: Sampler, clock: ManualClock, seconds: int) -> Snapshot:
    """One tick a second for ``seconds`` seconds, from a second after now."""
    for _ in range(seconds):
        clock.now += 1.0
        snapshot = sampler.tick()
    return snapshot


def test_gpm_sampled_every_gpm_interval_keeps_its_active_time_exact(
        simulate: Start, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPM sampled every 5 s: its ratios are the means since the previous sample, repeated on the ticks
    between, and the SM and tensor active seconds are those of a GPU sampled every tick."""
    import pynvml

    simulate("""
duration: 100s
gpus:
  - utilization: {pattern: steps, period: 3s, busy_fraction: 0.5, busy_level: 1.0, idle_level: 0.0}
""")
    samples = [0]
    real = pynvml.nvmlGpmSampleGet

    def counted(*args: object) -> object:
        samples[0] += 1
        return real(*args)

    every_tick = make_sampler(clock)
    every_5s = make_sampler(clock, gpm_interval_seconds=5.0)
    every_tick.tick()
    monkeypatch.setattr(pynvml, "nvmlGpmSampleGet", counted)
    first = every_5s.tick().gpus[0]
    assert first.sm_active_ratio is None and samples[0] == 1  # one sample: no ratio yet
    by_tick = []
    for _ in range(20):  # 20 s: GPM sampled again at 5, 10, 15 and 20 s after the first
        clock.now += 1.0
        monkeypatch.setattr(pynvml, "nvmlGpmSampleGet", real)
        exact = every_tick.tick().gpus[0]
        monkeypatch.setattr(pynvml, "nvmlGpmSampleGet", counted)
        by_tick.append(every_5s.tick().gpus[0])
    assert samples[0] == 5
    assert by_tick[3].sm_active_ratio is None and by_tick[4].sm_active_ratio is not None
    assert by_tick[5].sm_active_ratio == by_tick[8].sm_active_ratio == by_tick[4].sm_active_ratio
    assert by_tick[8].sm_active_seconds_total == by_tick[4].sm_active_seconds_total  # counted once
    # Both cover the same 20 s: the same busy SM-seconds (steps of 3 s against samples 5 s apart).
    last = by_tick[-1]
    assert exact.sm_active_seconds_total and 2.0 < exact.sm_active_seconds_total < 18.0
    assert last.sm_active_seconds_total == pytest.approx(exact.sm_active_seconds_total, rel=1e-6)
    assert last.tensor_active_seconds_total == pytest.approx(exact.tensor_active_seconds_total, rel=1e-6)
