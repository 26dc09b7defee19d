"""GpuAllocatedUnused: the kubelet gave the GPU to a pod, and no process has used it since.

A pod that requested a GPU it never opens (a CPU-only step of a pipeline, a wrong device index, a
container that crashed before CUDA started and waits to be restarted): the scheduler counts the GPU
as taken, so nothing else can have it, and no process holds a context on it.

On a GPU in MIG mode the kubelet allocates MIG devices, not the GPU: each MIG device is judged the same
way, by the pods allocated it and the processes on it (their GPU and compute instance). Where GPM
measures the device (Hopper and newer), one it saw busy during the window is not unused either (a
process the agent's listing missed).
"""

from __future__ import annotations

from typing import ClassVar

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, InstanceKey
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    clear_for_field,
    elapsed_text,
    for_field,
    instance_labels,
    instance_text,
    pods_text,
    window_field,
)


class AllocatedUnusedConfig(RuleConfig):
    window: WindowDuration = window_field(600.0)
    for_: ForDuration = for_field(300.0)
    clear_for: ForDuration = clear_for_field(60.0)


class AllocatedUnusedRule(Rule[AllocatedUnusedConfig]):
    name: ClassVar[str] = "GpuAllocatedUnused"
    config_model: ClassVar[type[AllocatedUnusedConfig]] = AllocatedUnusedConfig
    captures_by_default: ClassVar[bool] = False  # no process: nothing to trace
    # Reads the occupancy only: no per-tick ring. (Its window joins the span windows that space the
    # marks; at the defaults it is GpuHeldIdle's 10m.)
    span_window: ClassVar[bool] = True
    judges_instances: ClassVar[bool] = True

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        start = history.now - self.config.window + 1e-9  # the window is (now - window, now]
        out = {}
        for gpu in sorted(history.up):
            occupancy = history.occupancy(gpu)
            if occupancy is None or not occupancy.pods_since:
                continue  # the common case: not allocated, or not on Kubernetes
            last = occupancy.last_context
            if last is not None and last > start:
                continue  # a process held a context within the window (or the agent could not tell)
            # The pods that have had the GPU for the whole window (one that just got it has not had
            # its chance yet).
            pods = [pod for pod, since in occupancy.pods_since.items() if since <= start]
            if not pods:
                continue
            unused = history.now - (last if last is not None else occupancy.first_seen)
            out[gpu] = Condition(
                gpu, {"unused_seconds": unused, "pods": float(len(pods))},
                f"GPU {gpu} is allocated to {pods_text(pods)}, but no process has held a context on it "
                f"for {elapsed_text(unused)}")
        return out

    def evaluate_instances(self, history: NodeHistory,
                           active: frozenset[InstanceKey]) -> dict[InstanceKey, Condition]:
        window = self.config.window
        start = history.now - window + 1e-9
        out = {}
        for gpu, device in self._instances(history):
            if not device.pods_since:
                continue
            last = device.last_context
            if last is not None and last > start:
                continue  # a process held a context on it within the window (or the agent could not tell)
            pods = [pod for pod, since in device.pods_since.items() if since <= start]
            if not pods:
                continue
            span = history.span(gpu, window)
            share = span.instance_busy(device, window) if span is not None else None
            if share:
                continue  # GPM saw it busy: a process the listing did not show
            unused = history.now - (last if last is not None else device.first_seen)
            mig = device.reading
            out[InstanceKey(gpu, mig.uuid)] = Condition(
                gpu, {"unused_seconds": unused, "pods": float(len(pods))},
                f"{instance_text(gpu, mig)} is allocated to {pods_text(pods)}, but no process has held a "
                f"context on it for {elapsed_text(unused)}", instance_labels(mig))
        return out
