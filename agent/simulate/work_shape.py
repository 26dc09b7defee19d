"""How busy a simulated GPU process keeps its own CPU thread: the scenario's utilization pattern, as
steps of real work and real waiting.

The simulator gives each helper process a *work spec* (JSON, ``work_spec``) made from the scenario:
the process's own pattern, or the patterns of its GPU's phases times the process's share of the GPU.
The helper turns it into steps (``WorkShape.step_at``): a ``steps`` pattern gives steps of its
period, busy for the pattern's mean level over the step and then idle (an input-bound job: compute,
then wait for the next batch); ``steady`` and ``ramp`` give steps of ``STEP_S``, busy for the level's
share of each. Steps lie on the pattern's own grid, counted from the start of its phase, so a helper
is busy when the simulated GPU is.

The simulated GPU's side of a step (``device_until``, ``fill``) is what the helper's traces show as
kernels: the GPU runs the process's kernels for the busy part of the step; on a GPU shared by several
processes, time-sliced, each process's kernels stretch over the others' slices, so they run for the
GPU's busy part, not the process's share; and a phase whose GPM SM activity is low (a busy-but-stalled
GPU) runs kernels with fewer thread blocks than the GPU has SMs.

Noise is left out: the real work and the real waits jitter on their own. This module imports nothing
outside the standard library, so that helper processes start without pydantic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuscope.simulate.scenario import GpuSpec, ProcessSpec

STEP_S = 0.1  # a step of a steady or ramping pattern: 20 of them in a 2-second capture
FULL_FILL = 2.0  # thread blocks per SM of a kernel that fills the GPU
STALLED_SM_ACTIVE = 0.5  # GPM SM activity per unit of utilization under which kernels leave SMs empty
DEFAULT_SM_ACTIVE = 0.85  # the scenario's GPM default


@dataclass(frozen=True, slots=True)
class Step:
    """One step in scenario seconds: busy from ``start`` to ``busy_until``, idle until ``end``; the
    simulated GPU runs this process's kernels from ``start`` to ``device_until``, ``fill`` thread
    blocks per SM."""

    start: float
    busy_until: float
    end: float
    active: bool = True  # False: the process does not run at all now (before its start, after its stop)
    device_until: float | None = None  # None: until busy_until
    fill: float = FULL_FILL


@dataclass(frozen=True, slots=True)
class _Phase:
    start: float
    pattern: Mapping[str, Any]
    share: float
    sm_active: float = DEFAULT_SM_ACTIVE


class WorkShape:
    """The steps of one helper process at any scenario time (``work_spec``'s output)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        try:
            self.period: float | None = None if spec.get("loop") is None else float(spec["loop"])
            self.start = float(spec.get("start", 0.0))
            self.stop: float | None = None if spec.get("stop") is None else float(spec["stop"])
            self.shared = bool(spec.get("shared", False))
            self.phases = sorted((_Phase(float(p["from"]), dict(p["pattern"]), float(p.get("share", 1.0)),
                                         float(p.get("sm_active", DEFAULT_SM_ACTIVE)))
                                  for p in spec.get("phases", ())), key=lambda p: p.start)
            for phase in self.phases:
                _mean_level(phase.pattern, 0.0, STEP_S)  # an unknown pattern fails here, not mid-capture
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"invalid work spec: {err}") from None
        if self.period is not None and not self.period > 0:
            raise ValueError(f"invalid work spec: loop must be positive, got {self.period}")

    def step_at(self, t: float) -> Step:
        """The step under way at scenario time ``t`` (seconds since the scenario started)."""
        loop_start = 0.0 if self.period is None else math.floor(t / self.period) * self.period
        tau = t - loop_start
        if not self.phases or tau < self.start or (self.stop is not None and tau >= self.stop):
            return Step(t, t, t + STEP_S, active=False)
        index = max((i for i, p in enumerate(self.phases) if p.start <= tau), default=0)
        phase = self.phases[index]
        step_s = _step_length(phase.pattern)
        u = max(0.0, tau - phase.start)  # the pattern's own time
        first = math.floor(u / step_s) * step_s
        gpu_level = _mean_level(phase.pattern, first, step_s)
        level = gpu_level * phase.share
        start = loop_start + phase.start + first
        end = start + step_s
        # A step ends early where the next phase begins or the scenario loops.
        if index + 1 < len(self.phases):
            end = min(end, loop_start + self.phases[index + 1].start)
        if self.period is not None:
            end = min(end, loop_start + self.period)
        end = max(end, t + 1e-6)
        busy_until = min(end, start + step_s * min(1.0, max(0.0, level)))
        device_level = gpu_level if self.shared else level
        device_until = min(end, start + step_s * min(1.0, max(0.0, device_level)))
        fill = phase.sm_active if phase.sm_active < STALLED_SM_ACTIVE else FULL_FILL
        return Step(start, busy_until, end, device_until=device_until, fill=fill)


def _step_length(pattern: Mapping[str, Any]) -> float:
    if pattern.get("pattern") == "steps":
        return max(0.001, float(pattern["period"]))
    return STEP_S


def _mean_level(pattern: Mapping[str, Any], u: float, length: float) -> float:
    """The pattern's mean level over [u, u + length) of its own time (noise left out)."""
    kind = pattern.get("pattern", "steady")
    if kind == "steady":
        return float(pattern["level"])
    if kind == "steps":
        busy = float(pattern["busy_fraction"])
        busy_level, idle_level = float(pattern.get("busy_level", 1.0)), float(pattern.get("idle_level", 0.0))
        return busy * busy_level + (1 - busy) * idle_level
    if kind == "ramp":
        start, end, over = float(pattern["start"]), float(pattern["end"]), float(pattern["over"])
        middle = min(1.0, max(0.0, (u + length / 2) / over))
        return start + (end - start) * middle
    raise ValueError(f"unknown pattern {kind!r}")


def work_spec(gpu: GpuSpec, process: ProcessSpec, period: float | None) -> dict[str, Any]:
    """The work spec (JSON-ready) of ``process``, one of ``gpu``'s, for its helper process: its own
    pattern, or its share of the GPU's (``period``: the scenario's loop, None if it does not loop)."""
    if process.utilization is not None:
        phases: Sequence[dict[str, Any]] = [
            {"from": process.start, "pattern": process.utilization.model_dump(), "share": 1.0,
             "sm_active": gpu.gpm.sm_active}]
    else:
        from gpuscope.simulate.timeline import resolve_phases  # the simulator's side only: pydantic

        share = process.sm_share if process.sm_share is not None else 1.0 / len(gpu.processes)
        phases = [{"from": phase.start, "pattern": phase.utilization.model_dump(), "share": share,
                   "sm_active": phase.gpm.sm_active} for phase in resolve_phases(gpu)]
    shared = process.utilization is None and sum(p.kind == "compute" for p in gpu.processes) > 1
    return {"loop": period, "start": process.start, "stop": process.stop, "shared": shared,
            "phases": list(phases)}
