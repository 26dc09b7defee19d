"""GpuAllocatedUnused: the kubelet gave the GPU to a pod, and no process has used it since.

A pod that requested a GPU it never opens (a CPU-only step of a pipeline, a wrong device index, a
container that crashed before CUDA started and waits to be restarted): the scheduler counts the GPU
as taken, so nothing else can have it, and no process holds a context on it.
"""

from __future__ import annotations

from typing import ClassVar

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    clear_for_field,
    elapsed_text,
    for_field,
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
