"""End to end on simulated time: a rule fires on the GPU where a real JAX process "runs"; the agent
captures it once, stores the trace with the alert's name, and respects the cooldown next time."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from capturing import Workload
from test_alert_scenarios import ManualClock

from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.model import Transition
from gpuscope.alerts.rules import RulesConfig, build_rules
from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.model import BackendResult, CaptureTarget, StagingArea, Trigger
from gpuscope.capture.policy import CapturePolicy
from gpuscope.capture.records import record_from_bytes
from gpuscope.capture.service import CaptureRequest, CaptureService
from gpuscope.capture.store import CaptureStore
from gpuscope.capture.targets import TargetResolver
from gpuscope.capture.tsl import TslProfilerBackend
from gpuscope.generated.tsl import xplane_pb2
from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import Nvml
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation
from gpuscope.simulate.loader import parse_scenario


def scenario_for(pid: int) -> str:
    # GPU 1 is where the JAX job "runs": its real pid, at 55 % utilization (GpuLowUtilization).
    return f"""
name: capture-e2e
duration: 20m
gpus:
  - utilization: 0.95
    processes: [{{name: train-rank0, spawn: true, memory: 60GiB}}]
  - utilization: 0.55
    processes: [{{name: jax-job, pid: {pid}, memory: 40GiB}}]
"""


def test_an_alert_captures_the_jax_job_once_then_cooldown(jax_job: Workload, tmp_path: Path) -> None:
    clock = ManualClock()
    config = CaptureConfig.model_validate({"store": {"root": str(tmp_path / "captures")},
                                           "profiler_ports": [jax_job.port], "duration": "1s"})
    store = CaptureStore(tmp_path / "captures", quota_bytes=config.store.quota_bytes)
    policy = CapturePolicy(config, clock=clock)
    simulation = Simulation(parse_scenario(scenario_for(jax_job.proc.pid), source="capture-e2e"),
                            clock=clock)
    simulation.install()
    sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                      wall_clock=lambda: 1.7e9 + clock.now, hostname="sim-node")
    service = CaptureService(store=store, policy=policy,
                             resolver=TargetResolver(profiler_ports=config.profiler_ports, static_targets=[]),
                             backends={"tsl": TslProfilerBackend()}, snapshots=sampler,
                             hostname="sim-node", deadline_margin_s=config.deadline_margin)
    engine = AlertEngine(build_rules(RulesConfig()), hostname="sim-node")
    sampler.add_listener(engine.on_snapshot)
    firing: list[Transition] = []
    engine.add_listener(lambda t: firing.append(t) if t.state == "firing" else None)
    engine.add_listener(service.on_transition)
    service.start()
    try:
        while not firing and clock.now < 600:
            sampler.tick()
            clock.now += 1.0
        low = [t for t in firing if t.name == "GpuLowUtilization"]
        assert low and low[0].gpu == 1, firing
        deadline = time.monotonic() + 90  # the capture runs on the worker thread
        while not store.list() and time.monotonic() < deadline:
            time.sleep(0.1)
        captures = store.list()
        assert len(captures) == 1, (captures, service.capture_counts())
        record = captures[0]
        assert record.trigger.kind == "alert" and record.trigger.alertname == "GpuLowUtilization"
        assert record.gpu == 1 and jax_job.proc.pid in record.pids and record.outcome == "captured"
        (xplane,) = [f for f in record.files if f.endswith(".xplane.pb")]
        space = xplane_pb2.XSpace.FromString((store.path(record.id) / xplane).read_bytes())
        assert space.planes
        on_disk = record_from_bytes((store.path(record.id) / "capture.json").read_bytes())
        assert on_disk.id == record.id and on_disk.trigger.alertname == "GpuLowUtilization"

        # The next firing on that GPU, inside the 15-minute cooldown, is refused and stores nothing.
        refused_before = service.capture_counts().get(("alert", "refused"), 0)
        again = service.submit(CaptureRequest(Trigger("alert", alertname="GpuLowUtilization"), gpu=1))
        assert again.result(timeout=60).outcome == "refused"
        assert len(store.list()) == 1
        counts = service.capture_counts()
        assert counts[("alert", "captured")] == 1
        assert counts[("alert", "refused")] == refused_before + 1
    finally:
        service.stop()
        sampler.stop()
        simulation.uninstall()
        store.close()


def test_the_processes_of_one_capture_are_profiled_at_the_same_time(tmp_path: Path) -> None:
    """Two PyTorch jobs and two gRPC profilers on one GPU: the PyTorch captures (streamed from files)
    and the gRPC lane run at once (they meet at a barrier, which captures taken one after another never
    pass), while the gRPC captures, each held in memory as it arrives, run one at a time. A backend that
    raises fails its own target only."""
    barrier = threading.Barrier(3, timeout=10)
    lock = threading.Lock()
    in_memory_now: list[int] = [0, 0]  # running, most at once

    class Profiler:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                    deadline_s: float) -> BackendResult:
            if target.pid == 13:
                raise RuntimeError("a bug " + "x" * 1000)
            if self.kind == "tsl":
                with lock:
                    in_memory_now[0] += 1
                    in_memory_now[1] = max(in_memory_now)
            try:
                if self.kind == "kineto" or target.address == "127.0.0.1:6009":
                    barrier.wait()
                else:
                    time.sleep(0.2)  # the first gRPC capture is over by now, if they run in turn
                name = f"t{target.pid}"
                with staging.new_file(name, ".pt.trace.json.gz") as new:
                    new.file.write(b"{}")
                    return BackendResult("captured", files=(new.publish(),))
            except threading.BrokenBarrierError:
                return BackendResult("failed", error="captured one after the other")
            finally:
                if self.kind == "tsl":
                    with lock:
                        in_memory_now[0] -= 1

    config = CaptureConfig.model_validate({"store": {"root": str(tmp_path / "captures")}})
    store = CaptureStore(tmp_path / "captures", quota_bytes=config.store.quota_bytes)
    service = CaptureService(store=store, policy=CapturePolicy(config),
                             resolver=TargetResolver(profiler_ports=[], static_targets=[]),
                             backends={"kineto": Profiler("kineto"), "tsl": Profiler("tsl")},  # type: ignore[dict-item]
                             snapshots=SimpleNamespace(latest=lambda: None),  # type: ignore[arg-type]
                             hostname="node", deadline_margin_s=10.0)
    targets = [CaptureTarget("kineto", 11), CaptureTarget("tsl", 21, "127.0.0.1:6009"),
               CaptureTarget("kineto", 12), CaptureTarget("tsl", 22, "127.0.0.1:6010"),
               CaptureTarget("kineto", 13)]
    staging = store.begin(gpu=0, pid=None)
    try:
        outcomes = service._run_backends(targets, SimpleNamespace(duration_s=1.0),  # type: ignore[arg-type]
                                         staging)
    finally:
        store.abort(staging)
        store.close()
    assert [(o.target.pid, o.outcome) for o in outcomes] == [
        (11, "captured"), (21, "captured"), (12, "captured"), (22, "captured"), (13, "failed")]
    assert in_memory_now[1] == 1
    error = outcomes[-1].error or ""
    assert error.startswith("internal error: a bug") and len(error) <= 500
