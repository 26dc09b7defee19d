"""GpuHeldIdle: a process holds a large share of a GPU's memory while the GPU does next to nothing.

The notebook kernel left open after its last cell, the crashed job's survivor, the debugging
session nobody closed: the GPU is taken (its memory is held, so nothing else fits), and idle.

On a GPU in MIG mode (no utilization of its own), each MIG device is judged instead: one with at
least ``min_memory`` of its memory in use, a compute process on it for the whole window, and a busy
share over the window (its busy-seconds counter, from GPM's graphics activity) below the threshold.
A device GPM does not measure (before Hopper, or its first seconds) is not judged.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from gpuscope.alerts.history import MIN_COVERAGE, NodeHistory
from gpuscope.alerts.model import Condition, InstanceKey
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    band_edge,
    clear_for_field,
    elapsed_text,
    for_field,
    instance_labels,
    instance_text,
    listing,
    percent,
    percent_bound,
    pods_text,
    require_reachable,
    window_field,
)
from gpuscope.common.config_types import ByteSize
from gpuscope.common.sizes import format_size
from gpuscope.snapshot import PodContainer, ProcessReading


class HeldIdleConfig(RuleConfig):
    window: WindowDuration = window_field(600.0)
    for_: ForDuration = for_field(300.0)
    clear_for: ForDuration = clear_for_field(60.0)
    threshold: float = Field(0.05, gt=0.0, le=1.0, description="Fires below this mean utilization.")
    hysteresis: float = Field(0.05, ge=0.0, le=0.5, description="Clears only at threshold + this.")
    min_memory: ByteSize = Field(2**30, ge=1, le=2**40, description=(
        "A compute process holding at least this much device memory (e.g. 1GiB) holds the GPU."))

    @model_validator(mode="after")
    def _reachable(self) -> HeldIdleConfig:
        require_reachable(self.threshold, self.hysteresis)
        return self


class HeldIdleRule(Rule[HeldIdleConfig]):
    name: ClassVar[str] = "GpuHeldIdle"
    config_model: ClassVar[type[HeldIdleConfig]] = HeldIdleConfig
    captures_by_default: ClassVar[bool] = False  # an idle GPU has nothing to trace
    span_window: ClassVar[bool] = True
    judges_instances: ClassVar[bool] = True

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        config = self.config
        window = config.window
        threshold = config.threshold
        release = band_edge(threshold, config.hysteresis)  # an active alert holds below this
        least = config.min_memory
        now = history.now
        out = {}
        for gpu in sorted(history.up):
            occupancy = history.occupancy(gpu)
            if occupancy is None or not occupancy.held_since:
                continue  # the common case of a free GPU
            span = history.span(gpu, window)
            if span is None:
                continue
            fraction, mean = span.utilization()
            if mean is None or fraction < MIN_COVERAGE:
                continue  # no utilization for most of the window (MIG): nothing to judge
            if mean >= (release if gpu in active else threshold):
                continue  # the common case of a GPU at work
            since = occupancy.held_since
            # Holders: compute processes with at least min_memory now, on the GPU for the whole window.
            holders = [p for p in occupancy.processes
                       if p.kind == "compute" and (p.memory_used_bytes or 0) >= least
                       and now - since.get(p.pid, now) >= window - 1e-9]
            if holders:
                holders.sort(key=lambda p: (-(p.memory_used_bytes or 0), p.pid))
                held = sum(p.memory_used_bytes or 0 for p in holders)
                out[gpu] = Condition(
                    gpu, {"mean_utilization": mean, "threshold": threshold, "memory_held_bytes": float(held),
                          "holding_processes": float(len(holders))},
                    self._summary(gpu, mean, release, [_holder(p, now - since[p.pid]) for p in holders],
                                  occupancy.reading.pods))
        return out

    def evaluate_instances(self, history: NodeHistory,
                           active: frozenset[InstanceKey]) -> dict[InstanceKey, Condition]:
        config = self.config
        window = config.window
        threshold = config.threshold
        release = band_edge(threshold, config.hysteresis)
        now = history.now
        out = {}
        for gpu, device in self._instances(history):
            occupancy = history.occupancy(gpu)
            if occupancy is None or not device.processes:
                continue  # a free MIG device
            since = occupancy.held_since
            # Holders: compute processes on the device, there for the whole window.
            holders = [p for p in device.processes
                       if p.kind == "compute" and now - since.get(p.pid, now) >= window - 1e-9]
            if not holders:
                continue
            mig = device.reading
            # The device's own memory in use (NVML may not say per process on MIG).
            held = (mig.memory_used_bytes if mig.memory_used_bytes is not None
                    else sum(p.memory_used_bytes or 0 for p in holders))
            if held < config.min_memory:
                continue
            span = history.span(gpu, window)
            if span is None or span.last.utilization is not None:
                continue  # too early; or the GPU has utilization of its own, judged by evaluate
            share = span.instance_busy(device, window)
            if share is None:
                continue  # not measured (no GPM) for most of the window
            key = InstanceKey(gpu, mig.uuid)
            if share >= (release if key in active else threshold):
                continue
            holders.sort(key=lambda p: (-(p.memory_used_bytes or 0), p.pid))
            who = listing([_holder(p, now - since[p.pid]) for p in holders], more="more processes")
            out[key] = Condition(
                gpu, {"mean_utilization": share, "threshold": threshold, "memory_held_bytes": float(held),
                      "holding_processes": float(len(holders))},
                self._instance_summary(instance_text(gpu, mig), share, release, who, held=held,
                                       pods=mig.pods),
                instance_labels(mig))
        return out

    def _instance_summary(self, where: str, share: float, release: float, who: str, *, held: int,
                          pods: tuple[PodContainer, ...]) -> str:
        threshold = self.config.threshold
        allocated = f"; the kubelet allocated it to {pods_text(pods)}" if pods else ""
        memory = f"{format_size(held)} of its memory in use"
        if share < threshold:
            return (f"{where} was busy {percent(share, threshold)} of the last {self._over} (below "
                    f"{percent_bound(threshold)}) but is held by {who}, {memory}{allocated}")
        return (f"{where} was busy {percent(share, threshold, release)} of the last {self._over} and is "
                f"held by {who}, {memory}: no longer below {percent_bound(threshold)}, but the alert holds "
                f"until it reaches {percent_bound(release)}{allocated}")

    def _summary(self, gpu: int, mean: float, release: float, holders: list[str],
                 pods: tuple[PodContainer, ...]) -> str:
        threshold = self.config.threshold
        who = listing(holders, more="more processes")
        allocated = f"; the kubelet allocated it to {pods_text(pods)}" if pods else ""
        if mean < threshold:
            return (f"GPU {gpu} was busy {percent(mean, threshold)} of the last {self._over} (below "
                    f"{percent_bound(threshold)}) but is held by {who}{allocated}")
        # Held by the hysteresis: no longer below the threshold, not yet back at threshold + hysteresis.
        return (f"GPU {gpu} was busy {percent(mean, threshold, release)} of the last {self._over} and is "
                f"held by {who}: no longer below {percent_bound(threshold)}, but the alert holds until it "
                f"reaches {percent_bound(release)}{allocated}")


def _holder(process: ProcessReading, seconds: float) -> str:
    """"python3 (pid 4242, user alice, 18.0 GiB, on it for 1h5m)"; a process the host cannot see
    (another PID namespace, exited) by its pid alone."""
    facts = [f"pid {process.pid}"]
    if process.user:
        facts.append(f"user {process.user}")
    if process.memory_used_bytes is not None:  # always, but on a MIG device where NVML may not say
        facts.append(format_size(process.memory_used_bytes))
    facts.append(f"on it for {elapsed_text(seconds)}")
    name = process.name or "a process the host cannot see"
    return f"{name} ({', '.join(facts)})"
