"""The agent's rules on a GPU in MIG mode: GpuLowUtilization, GpuHeldIdle and GpuAllocatedUnused judge
each MIG device (its busy share from its busy-seconds counter, its memory, its pods and the processes
on it), one alert per device, named by its labels; and a capture an alert on a device triggers
profiles the processes on that device only."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from snapshots import GIB, MIB, FakeSource, gpu_uuid, make_gpu, make_process, make_snapshot, mig_uuid
from test_alert_rules import feed, gpu, history_for

from gpuscope.alerts.alertmanager import AlertmanagerNotifier
from gpuscope.alerts.config import AlertmanagerConfig
from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.model import InstanceKey, Transition
from gpuscope.alerts.rules.allocated_unused import AllocatedUnusedRule
from gpuscope.alerts.rules.held_idle import HeldIdleRule
from gpuscope.alerts.rules.low_utilization import LowUtilizationRule
from gpuscope.alerts.rules.shared_by_processes import SharedByProcessesRule
from gpuscope.capture.config import CaptureConfig, StaticTarget
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.capture.policy import CapturePolicy
from gpuscope.capture.service import CaptureRequest, CaptureService, on_mig_device
from gpuscope.capture.store import CaptureStore
from gpuscope.capture.targets import TargetResolver
from gpuscope.snapshot import GpuReading, MigReading, PodContainer, ProcessReading, SlurmJob

MIG_GPU = 2
A, B = InstanceKey(MIG_GPU, mig_uuid(MIG_GPU, 0)), InstanceKey(MIG_GPU, mig_uuid(MIG_GPU, 1))
WHERE_A = "GPU 2 MIG instance 3g.40gb (GPU instance 1, compute instance 0)"
LABELS_A = {"gpu_instance": "1", "compute_instance": "0", "mig_profile": "3g.40gb", "mig_uuid": A.uuid}
LABELS_B = {"gpu_instance": "2", "compute_instance": "0", "mig_profile": "3g.40gb", "mig_uuid": B.uuid}
POD_A = (PodContainer("research", "finetune-7", "trainer"),)
POD_B = (PodContainer("team-b", "serve-0", "server"),)


def on_device(n: int, pid: int, **overrides: Any) -> ProcessReading:
    """A compute process on MIG device ``n`` of the MIG GPU (GPU instance n + 1): NVML gives no
    utilization per process there, and may not give its memory."""
    fields: dict[str, Any] = {"memory_used_bytes": None, "sm_utilization_ratio": None,
                              "busy_seconds_total": None, "energy_joules_total": None}
    fields.update(overrides)
    return make_process(pid, gpu_instance=n + 1, compute_instance=0, **fields)


def device(n: int, t: float, *, rate: float | None = 0.0, memory: int = 0,
           pods: tuple[PodContainer, ...] = ()) -> MigReading:
    """MIG device ``n`` at time ``t``, busy ``rate`` of the time since the agent started (None: GPM does
    not measure it); GPM has nothing on the first tick."""
    return MigReading(index=n, gpu_instance=n + 1, compute_instance=0, uuid=mig_uuid(MIG_GPU, n),
                      profile="3g.40gb", memory_used_bytes=memory, memory_total_bytes=40 * GIB - 512 * MIB,
                      sm_active_ratio=rate, busy_seconds_total=None if rate is None or t == 0 else rate * t,
                      pods=pods)


def mig_node(a: dict[str, Any] | None, b: dict[str, Any] | None = None) -> Any:
    """Two busy GPUs and the MIG GPU 2, whose devices 0 and 1 are ``a`` and ``b`` (device() keywords,
    and ``processes``: those on the device, or a function of time); None: no such device."""
    def build(t: float) -> list[GpuReading]:
        devices, processes = [], []
        for n, spec in enumerate([a, b]):
            if spec is None:
                continue
            readings = dict(spec)
            on_it = readings.pop("processes", ())
            processes += on_it(t) if callable(on_it) else on_it
            devices.append(device(n, t, **readings))
        mig = make_gpu(MIG_GPU, mig_enabled=True, utilization_ratio=None, utilization_samples=(),
                       busy_seconds_total=None, sm_active_ratio=None, idle_dips_total=None,
                       clock_event_reasons=frozenset(), mig_devices=tuple(devices),
                       processes=tuple(processes))
        return [gpu(0), gpu(1), mig]
    return build


# ------------------------------------------------------------------------ GpuLowUtilization

LOW = LowUtilizationRule.configured(window=120.0, threshold=0.80, hysteresis=0.05)


def test_low_utilization_judges_each_mig_device_and_fires_on_the_low_one() -> None:
    h = history_for(LOW)
    feed(h, 150, mig_node({"rate": 0.3, "processes": (on_device(0, 9200),)},
                          {"rate": 0.95, "processes": (on_device(1, 9300),)}))
    assert LOW.evaluate(h, frozenset()) == {}  # the GPUs: 0 and 1 busy, 2 without utilization
    found = LOW.evaluate_instances(h, frozenset())
    assert list(found) == [A]
    c = found[A]
    assert c.gpu == MIG_GPU and c.labels == LABELS_A
    assert c.values == {"mean_utilization": pytest.approx(0.3), "threshold": 0.8}
    assert c.summary == f"{WHERE_A} runs a job but was busy 30.0% of the last 2m (below 80%)"


def test_low_utilization_of_a_mig_device_needs_a_job_and_a_busy_counter() -> None:
    h = history_for(LOW)
    feed(h, 150, mig_node({"rate": None, "processes": (on_device(0, 9200),)},  # no GPM: not judged
                          {"rate": 0.0}))  # no job on it
    assert LOW.evaluate_instances(h, frozenset()) == {}
    h = history_for(LOW)
    feed(h, 150, mig_node({"rate": 0.3, "processes": lambda t: ()},
                          {"rate": 0.1, "processes": (on_device(1, 9300),)}))
    assert list(LOW.evaluate_instances(h, frozenset())) == [B]


def test_low_utilization_of_a_mig_device_holds_by_its_hysteresis_per_device() -> None:
    h = history_for(LOW)
    feed(h, 150, mig_node({"rate": 0.82, "processes": (on_device(0, 9200),)},
                          {"rate": 0.82, "processes": (on_device(1, 9300),)}))
    assert LOW.evaluate_instances(h, frozenset()) == {}  # 82 % >= 80 %: does not start
    found = LOW.evaluate_instances(h, frozenset({A}))  # A active: holds below 85 %; B does not start
    assert list(found) == [A]
    assert found[A].summary == (f"{WHERE_A} runs a job and was busy 82.0% of the last 2m: no longer below "
                                "80%, but the alert holds until it reaches 85%")
    assert LOW.evaluate_instances(h, frozenset({1})) == {}  # the GPU's alert is not the device's


def test_a_mig_devices_busy_share_waits_for_its_counter_to_cover_the_window() -> None:
    h = history_for(LOW)
    # GPM's counter starts at 40 s (the device was just created, or GPM had no sample before).
    node = mig_node({"rate": 0.3, "processes": (on_device(0, 9200),)})

    def late(t: float) -> list[GpuReading]:
        gpus = node(t)
        mig = gpus[2]
        if t < 40:
            gpus[2] = make_gpu(MIG_GPU, **{**_fields(mig), "mig_devices": (device(0, t, rate=None),)})
        return gpus

    feed(h, 130, late)
    assert LOW.evaluate_instances(h, frozenset()) == {}  # 89 s of the 120 s window: less than 80 %
    feed(h, 10, late, start=130.0)
    found = LOW.evaluate_instances(h, frozenset())
    assert list(found) == [A] and found[A].values["mean_utilization"] == pytest.approx(0.3)


def _fields(reading: GpuReading) -> dict[str, Any]:
    return {name: getattr(reading, name) for name in GpuReading.__dataclass_fields__ if name != "index"}


# ------------------------------------------------------------------------ GpuHeldIdle

HELD = HeldIdleRule.configured(window=60.0, threshold=0.05, hysteresis=0.05, min_memory=GIB)


def test_held_idle_fires_on_the_idle_mig_device_whose_memory_is_held() -> None:
    h = history_for(HELD)
    idle = {"rate": 0.01, "memory": 21 * GIB, "pods": POD_A, "processes": (on_device(0, 9200),)}
    feed(h, 70, mig_node(idle, {"rate": 0.6, "memory": 30 * GIB, "processes": (on_device(1, 9300),)}))
    assert HELD.evaluate(h, frozenset()) == {}  # the GPU itself has no utilization to judge
    found = HELD.evaluate_instances(h, frozenset())
    assert list(found) == [A]
    c = found[A]
    assert c.labels == LABELS_A
    assert c.values == {"mean_utilization": pytest.approx(0.01), "threshold": 0.05,
                        "memory_held_bytes": 21 * GIB, "holding_processes": 1.0}
    assert c.summary == (f"{WHERE_A} was busy 1.0% of the last 1m (below 5%) but is held by python3 (pid "
                         "9200, user alice, on it for 1m), 21.0 GiB of its memory in use; the kubelet "
                         "allocated it to pod research/finetune-7 (container trainer)")


def test_held_idle_on_mig_needs_the_counter_the_memory_and_a_process_the_whole_window() -> None:
    cases = [
        {"rate": None, "memory": 21 * GIB, "processes": (on_device(0, 9200),)},  # GPM does not measure it
        {"rate": 0.0, "memory": 512 * MIB, "processes": (on_device(0, 9200),)},  # below min_memory
        {"rate": 0.0, "memory": 21 * GIB},  # no process on it (the other device's does not count)
    ]
    for a in cases:
        h = history_for(HELD)
        small = (on_device(1, 9300, memory_used_bytes=GIB // 2),)
        feed(h, 70, mig_node(a, {"rate": 0.0, "processes": small}))
        assert HELD.evaluate_instances(h, frozenset()) == {}, a
    h = history_for(HELD)
    late = mig_node({"rate": 0.0, "memory": 21 * GIB, "processes": (on_device(0, 9201),)})
    early = mig_node({"rate": 0.0, "memory": 21 * GIB, "processes": (on_device(0, 9200),)})
    feed(h, 70, lambda t: late(t) if t >= 30 else early(t))  # another process for the last 40 s
    assert HELD.evaluate_instances(h, frozenset()) == {}


def test_held_idle_on_mig_hysteresis_and_process_memory_where_nvml_gives_it() -> None:
    h = history_for(HELD)
    holder = on_device(0, 9200, memory_used_bytes=20 * GIB, name="ipykernel")
    feed(h, 70, mig_node({"rate": 0.07, "memory": 21 * GIB, "processes": (holder,)}))
    assert HELD.evaluate_instances(h, frozenset()) == {}  # 7 % >= 5 %
    found = HELD.evaluate_instances(h, frozenset({A}))
    assert found[A].summary == (f"{WHERE_A} was busy 7.0% of the last 1m and is held by ipykernel (pid "
                                "9200, user alice, 20.0 GiB, on it for 1m), 21.0 GiB of its memory in use: "
                                "no longer below 5%, but the alert holds until it reaches 10%")


# ------------------------------------------------------------------------ GpuAllocatedUnused

UNUSED = AllocatedUnusedRule.configured(window=60.0)


def test_allocated_unused_fires_on_the_mig_device_its_pod_does_not_use() -> None:
    h = history_for(UNUSED)
    feed(h, 70, mig_node({"rate": 0.0, "pods": POD_A},
                         {"rate": 0.5, "pods": POD_B, "processes": (on_device(1, 9300),)}))
    assert UNUSED.evaluate(h, frozenset()) == {}  # the kubelet allocated devices, not the GPU
    found = UNUSED.evaluate_instances(h, frozenset())
    assert list(found) == [A]
    c = found[A]
    assert c.labels == LABELS_A and c.values == {"unused_seconds": 69.0, "pods": 1.0}
    assert c.summary == (f"{WHERE_A} is allocated to pod research/finetune-7 (container trainer), but no "
                         "process has held a context on it for 1m")


def test_allocated_unused_on_mig_trusts_gpm_over_a_missing_process() -> None:
    h = history_for(UNUSED)
    # A: busy by GPM though no process is listed on it (the listing missed it): not unused.
    # B: GPM does not measure it (before Hopper): judged by its processes alone.
    feed(h, 70, mig_node({"rate": 0.4, "pods": POD_A}, {"rate": None, "pods": POD_B}))
    assert list(UNUSED.evaluate_instances(h, frozenset())) == [B]
    # A process on A at 30 s: within the window.
    h = history_for(UNUSED)
    brief = {"rate": 0.0, "pods": POD_A, "processes": lambda t: (on_device(0, 1),) if t == 30 else ()}
    feed(h, 70, mig_node(brief))
    assert UNUSED.evaluate_instances(h, frozenset()) == {}


# ------------------------------------------------------------------------ GpuSharedByProcesses

def test_processes_on_different_mig_devices_do_not_share_a_gpu_those_on_one_do() -> None:
    rule = SharedByProcessesRule.configured()
    h = history_for(rule)
    one_each = mig_node({"processes": (on_device(0, 9200),)}, {"processes": (on_device(1, 9300),)})
    feed(h, 2, one_each)
    assert rule.evaluate(h, frozenset()) == {} and rule.evaluate_instances(h, frozenset()) == {}
    feed(h, 1, mig_node({"processes": (on_device(0, 9200), on_device(0, 9201, name="worker"),
                                       on_device(0, 9202, name="nvidia-cuda-mps-server"))},
                        {"processes": (on_device(1, 9300),)}), start=2.0)
    assert rule.evaluate(h, frozenset()) == {}
    found = rule.evaluate_instances(h, frozenset())
    assert list(found) == [A] and found[A].labels == LABELS_A
    assert found[A].summary == (f"{WHERE_A} is shared by 2 compute processes (python3, worker), more than "
                                "the 1 allowed")


# ------------------------------------------------------------------------ the engine and outputs

def drive(engine: AlertEngine, seconds: int, build: Any, start: float = 0.0) -> list[Transition]:
    out: list[Transition] = []
    for i in range(seconds):
        t = start + i
        out += engine.observe(make_snapshot(gpus=build(t), monotonic=t, timestamp=1.7e9 + t))
    return out


AT_ONCE = AllocatedUnusedRule.configured(window=60.0, for_=0.0, clear_for=0.0)


def test_two_unused_mig_devices_make_two_alerts_and_a_destroyed_one_resolves(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = AlertEngine([AT_ONCE], hostname="node")
    transitions = drive(engine, 70, mig_node({"rate": 0.0, "pods": POD_A}, {"rate": 0.0, "pods": POD_B}))
    parent = gpu_uuid(MIG_GPU)
    assert [(t.gpu, t.uuid, t.state, t.labels) for t in transitions] == [
        (MIG_GPU, parent, "firing", LABELS_A), (MIG_GPU, parent, "firing", LABELS_B)]
    alerts = engine.alerts()
    assert [(a.gpu, a.uuid, a.labels["mig_uuid"]) for a in alerts] == [(MIG_GPU, parent, A.uuid),
                                                                      (MIG_GPU, parent, B.uuid)]
    assert alerts[0].summary.startswith(WHERE_A + " is allocated to pod research/finetune-7")
    # Alertmanager tells them apart by their labels.
    notifier = AlertmanagerNotifier(AlertmanagerConfig(url="http://127.0.0.1:1"), engine, hostname="node",
                                    instance="node:9400")
    keys = {notifier._key(a) for a in alerts}
    assert len(keys) == 2 and all(("gpu", "2") in k and ("gpu_instance", "") not in k for k in keys)
    # Device A destroyed (the GPU still read): its alert resolves; B's keeps firing.
    with caplog.at_level(logging.INFO, logger="gpuscope.alerts.engine"):
        (resolved,) = drive(engine, 1, mig_node(None, {"rate": 0.0, "pods": POD_B}), start=70.0)
    assert (resolved.state, resolved.labels) == ("resolved", LABELS_A)
    assert [a.labels["mig_uuid"] for a in engine.alerts()] == [B.uuid]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gpuscope.alerts.engine"]
    assert line.startswith(f"alert GpuAllocatedUnused resolved on GPU 2 MIG device {A.uuid}: its condition "
                           f"no longer holds (last evidence: {WHERE_A} is allocated")


def test_mig_device_alerts_keep_their_state_while_the_gpu_is_down_or_its_devices_unknown() -> None:
    engine = AlertEngine([AT_ONCE], hostname="node")
    both = mig_node({"rate": 0.0, "pods": POD_A}, {"rate": 0.0, "pods": POD_B})
    assert len(drive(engine, 70, both)) == 2
    # The MIG devices could not be listed this tick (a failed reading): they stand as last listed.
    failed = make_snapshot(gpus=mig_node(None)(70.0), monotonic=70.0, timestamp=1.7e9 + 70,
                           sample_errors={"mig_devices": 1})
    assert engine.observe(failed) == []
    assert drive(engine, 2, both, start=71.0) == []
    assert len(engine.alerts()) == 2

    def down(t: float) -> list[GpuReading]:
        return [gpu(0), gpu(1), make_gpu(MIG_GPU, up=False, mig_enabled=True, utilization_ratio=None,
                                         processes=(), mig_devices=())]

    assert drive(engine, 3, down, start=73.0) == []  # not judged while down
    assert len(engine.alerts()) == 2
    # Read again: the ticks it was down may have had a process on a device (as for a whole GPU).
    assert [t.state for t in drive(engine, 1, both, start=76.0)] == ["resolved", "resolved"]


LOW_NOW = LowUtilizationRule.configured(window=120.0, for_=0.0, clear_for=0.0)


@pytest.mark.parametrize("devices_kept", [False, True])
def test_a_tick_the_mig_gpu_is_down_does_not_restart_its_devices_job_counts(devices_kept: bool) -> None:
    """The down tick carries the devices' points forward (as a down GPU's point has no utilization):
    every window after it still sees the job that ran on device A. (A down tick used to restart the
    count, and for a window after it the job fraction was negative: the alert resolved, and the
    device went unjudged for that long.) The sampler reports a down GPU's MIG devices as last read,
    or none: the same either way."""
    build = mig_node({"rate": 0.3, "processes": (on_device(0, 9200),)})

    def down(t: float) -> list[GpuReading]:
        gpus = build(t)
        mig = gpus[2]
        gpus[2] = replace(mig, up=False, processes=(), mig_devices=mig.mig_devices if devices_kept else ())
        return gpus

    engine = AlertEngine([LOW_NOW], hostname="node")
    assert [(t.state, t.labels) for t in drive(engine, 150, build)] == [("firing", LABELS_A)]
    assert drive(engine, 1, down, start=150.0) == []  # down: not judged, the alert kept
    h = engine.history
    for t in range(151, 300):
        assert drive(engine, 1, build, start=float(t)) == [], t
        window = h.window(MIG_GPU, 120.0)
        assert window is not None
        fraction, share = window.instance_activity(h.instances(MIG_GPU)[A.uuid])
        assert 119 / 120 - 1e-9 <= fraction <= 1.0, t  # the down tick had no job; every other one did
        assert share == pytest.approx(0.3, abs=0.005), t
    assert [a.labels for a in engine.alerts()] == [LABELS_A]


def test_mig_devices_that_cannot_be_listed_are_not_judged_and_keep_their_alerts() -> None:
    """A failed listing leaves the MIG devices of an up GPU unknown (the reading has none, and the
    sampler counts the failure): their busy counters stand still, which is no evidence of idleness.
    The rules do not judge them then, and their alerts keep their state; the ticks count as ticks
    with a job on a device where a process of the GPU ran in it as last listed."""
    both = mig_node({"rate": 0.85, "processes": (on_device(0, 9200),)},  # 85 %: not low
                    {"rate": 0.3, "processes": (on_device(1, 9300),)})  # 30 %: low
    engine = AlertEngine([LOW_NOW], hostname="node")
    assert [(t.state, t.labels) for t in drive(engine, 150, both)] == [("firing", LABELS_B)]
    for t in range(150, 180):
        listing_failed = replace(both(t)[2], mig_devices=())  # the processes were read
        snapshot = make_snapshot(gpus=[gpu(0), gpu(1), listing_failed], monotonic=float(t),
                                 timestamp=1.7e9 + t, sample_errors={"mig_devices": t - 149})
        assert engine.observe(snapshot) == [], t  # A's counter frozen at 85 % of 150 s: not judged
        assert engine.history.mig_unknown == {MIG_GPU}
        assert LOW.evaluate_instances(engine.history, frozenset()) == {}
    assert [a.labels for a in engine.alerts()] == [LABELS_B]
    # Listed again: A was busy 85 % all along, B is still low; the ticks between had their jobs.
    assert drive(engine, 30, both, start=180.0) == []
    assert engine.history.mig_unknown == frozenset()
    assert [a.labels for a in engine.alerts()] == [LABELS_B]
    # The devices listed as none without a failure (destroyed): their alerts resolve.
    assert [(t.state, t.labels) for t in drive(engine, 1, mig_node(None), start=210.0)] == [
        ("resolved", LABELS_B)]


def test_an_alert_on_a_mig_device_names_the_slurm_jobs_on_that_device_only() -> None:
    engine = AlertEngine([LowUtilizationRule.configured(window=60.0, for_=0.0)], hostname="node")
    job = SlurmJob("4242", "0", uid=1000)
    batch = on_device(1, 9300, slurm_job=SlurmJob("77", "batch"), user=None)
    transitions = drive(engine, 70, mig_node({"rate": 0.2, "processes": (on_device(0, 9200, slurm_job=job),)},
                                             {"rate": 0.3, "processes": (batch,)}))
    assert [t.summary for t in transitions] == [
        f"{WHERE_A} runs a job but was busy 20.0% of the last 1m (below 80%); Slurm job 4242.0 (user alice) "
        "on it",
        "GPU 2 MIG instance 3g.40gb (GPU instance 2, compute instance 0) runs a job but was busy 30.0% of "
        "the last 1m (below 80%); Slurm job 77.batch on it"]


# ------------------------------------------------------------------------ captures

def test_a_capture_for_an_alert_on_a_mig_device_targets_the_processes_on_that_device(tmp_path: Path) -> None:
    procs = (on_device(0, 9200, host_visible=False), on_device(0, 9201, host_visible=False),
             on_device(1, 9300, host_visible=False))
    reading = mig_node({"rate": 0.1, "processes": procs[:2]}, {"rate": 0.9, "processes": procs[2:]})(10.0)[2]
    assert [p.pid for p in on_mig_device(reading, A.uuid).processes] == [9200, 9201]
    assert [p.pid for p in on_mig_device(reading, B.uuid).processes] == [9300]
    assert on_mig_device(reading, None) is reading  # an alert on the GPU: all of its processes
    assert on_mig_device(reading, "MIG-gone") is None

    config = CaptureConfig.model_validate({"store": {"root": str(tmp_path / "captures")}})
    store = CaptureStore(tmp_path / "captures", quota_bytes=config.store.quota_bytes)
    service = CaptureService(store=store, policy=CapturePolicy(config),
                             resolver=TargetResolver(profiler_ports=[], static_targets=[]), backends={},
                             snapshots=FakeSource(make_snapshot(gpus=[reading])), hostname="node",
                             deadline_margin_s=5.0)
    asked: list[CaptureRequest] = []
    service.submit = asked.append  # type: ignore[assignment,method-assign]
    firing = Transition(name="GpuLowUtilization", gpu=MIG_GPU, uuid=reading.uuid, severity="warning",
                        hostname="node", previous=None, state="firing", at=1.7e9, active_since=1.7e9,
                        values={}, summary="", labels=LABELS_A)
    service.on_transition(firing)
    (request,) = asked
    assert request.mig_uuid == A.uuid and request.gpu == MIG_GPU
    del service.submit
    service.start()
    try:
        record = service.submit(request).result(timeout=30)
    finally:
        service.stop()
        store.close()
    # No endpoint for them (not visible from here), but the capture was of A's processes, not B's.
    assert record.outcome == "unreachable" and record.pids == (9200, 9201)


def _capture(root: Path, reading: GpuReading, *requests: CaptureRequest,
             static: list[StaticTarget] | None = None) -> list[CaptureRecord]:
    """The records of ``requests`` (one after another, no cooldown between them) by a capture service
    whose snapshot holds ``reading`` and whose config names ``static`` targets; no backend is
    installed: a capture that reached a target fails there."""
    config = CaptureConfig.model_validate({"store": {"root": str(root)}, "cooldown": "0s",
                                           "rules": {"GpuHeldIdle": True}})
    store = CaptureStore(root, quota_bytes=config.store.quota_bytes)
    service = CaptureService(store=store, policy=CapturePolicy(config),
                             resolver=TargetResolver(profiler_ports=[], static_targets=static or []),
                             backends={}, snapshots=FakeSource(make_snapshot(gpus=[reading])),
                             hostname="node", deadline_margin_s=5.0)
    service.start()
    try:
        return [service.submit(r).result(timeout=30) for r in requests]
    finally:
        service.stop()
        store.close()


def _alert(**fields: Any) -> CaptureRequest:
    return CaptureRequest(Trigger("alert", alertname="GpuLowUtilization"), gpu=MIG_GPU, **fields)


def test_a_mig_device_capture_never_falls_back_to_a_static_target_of_the_gpu(tmp_path: Path) -> None:
    """A ProfilerService named for the GPU (``capture.targets``) profiles whoever listens there: on a
    MIG GPU another tenant's job. A device's processes without an endpoint are unreachable; a device
    gone, or without a process, is refused, naming it."""
    procs = (on_device(0, 9200, host_visible=False), on_device(1, 9300, host_visible=False))
    reading = mig_node({"rate": 0.1, "processes": procs[:1]}, {"rate": 0.9})(10.0)[2]
    static = [StaticTarget(address="10.0.0.9:6009", gpu=MIG_GPU),
              StaticTarget(address="10.0.0.8:6009", all=True)]
    on_a, on_b, gone, whole = _capture(tmp_path / "up", reading, _alert(mig_uuid=A.uuid),
                                       _alert(mig_uuid=B.uuid), _alert(mig_uuid="MIG-gone"), _alert(),
                                       static=static)
    assert (on_a.outcome, on_a.pids, on_a.targets) == ("unreachable", (9200,), ())
    assert on_a.error is not None and f"the processes on MIG device {A.uuid}" in on_a.error
    assert (on_b.outcome, on_b.targets) == ("refused", ())
    assert on_b.error == f"MIG device {B.uuid} of GPU 2 runs no compute process now: nothing to capture"
    assert (gone.outcome, gone.targets) == ("refused", ())
    assert gone.error is not None
    assert gone.error.startswith("MIG device MIG-gone of GPU 2 is not on the GPU now")
    # An alert on the whole GPU: its static targets (no tsl backend here, so they fail there).
    assert [t.target.address for t in whole.targets] == ["10.0.0.9:6009", "10.0.0.8:6009"]
    # A device of a GPU that cannot be read now: refused, not the GPU's static targets either.
    down = replace(reading, up=False, processes=())
    (lost,) = _capture(tmp_path / "down", down, _alert(mig_uuid=A.uuid), static=static)
    assert lost.outcome == "refused" and lost.error is not None and "cannot be read" in lost.error


def test_a_capture_of_a_gpu_instance_takes_the_processes_of_its_compute_instances(tmp_path: Path) -> None:
    """An Alertmanager alert from the PromQL rules that names a GPU instance but no MIG device
    (GpuHeldIdle, GpuSharedByProcesses): the processes of all of its compute instances, no others."""
    def ci(gpu_instance: int, compute_instance: int, index: int) -> MigReading:
        return MigReading(index=index, gpu_instance=gpu_instance, compute_instance=compute_instance,
                          uuid=mig_uuid(MIG_GPU, index), profile="3g.40gb")

    devices = (ci(1, 0, 0), ci(1, 1, 1), ci(2, 0, 2))
    processes = tuple(make_process(pid, gpu_instance=gi, compute_instance=c, host_visible=False)
                      for pid, gi, c in [(9200, 1, 0), (9201, 1, 1), (9300, 2, 0)])
    reading = make_gpu(MIG_GPU, mig_enabled=True, utilization_ratio=None, mig_devices=devices,
                       processes=processes)
    static = [StaticTarget(address="10.0.0.9:6009", gpu=MIG_GPU)]
    webhook = Trigger("webhook", alertname="GpuHeldIdle")
    one, other, missing, device = _capture(
        tmp_path / "captures", reading, CaptureRequest(webhook, gpu=MIG_GPU, gpu_instance=1),
        CaptureRequest(webhook, uuid=reading.uuid, gpu_instance=2),
        CaptureRequest(webhook, gpu=MIG_GPU, gpu_instance=5),
        CaptureRequest(webhook, gpu=MIG_GPU, gpu_instance=1, mig_uuid=mig_uuid(MIG_GPU, 1)), static=static)
    assert (one.outcome, one.pids, one.targets) == ("unreachable", (9200, 9201), ())
    assert (other.outcome, other.pids) == ("unreachable", (9300,))
    assert missing.outcome == "refused" and missing.error is not None
    assert missing.error.startswith("GPU instance 5 of GPU 2 is not on the GPU now")
    assert (device.outcome, device.pids) == ("unreachable", (9201,))  # the device, where it is named
