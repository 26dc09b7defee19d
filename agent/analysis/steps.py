"""Where the training steps of a trace begin and end.

In order of trust:

1. ``markers``: the framework's own step spans (PyTorch's ``ProfilerStep#N``, TensorFlow's and
   JAX's ``StepTraceAnnotation``), as the readers found them.
2. ``optimizer``: PyTorch annotates every optimizer step (``Optimizer.step#SGD.step``); a trace
   taken on demand has no ``ProfilerStep`` but has these, one per iteration. A step runs from the end
   of one to the end of the next, so it holds the input, forward and backward passes that led to it.
3. ``periodic``: the top-level host operation that repeats (at least 3 times, never overlapping
   itself) and takes the most time, e.g. JAX's ``PjitFunction(train_step)``: a step starts at each.
4. ``whole``: the trace as one step, when nothing repeats.

Only whole steps count: a step at either edge shorter than half the median was cut by the start or the
end of the recording, and would skew every share.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import pairwise

from gpuscope.analysis.model import Kind, Trace

MIN_REPEATS = 3
OPTIMIZER_PREFIX = "Optimizer.step#"


@dataclass(frozen=True, slots=True)
class Step:
    start: float  # microseconds
    end: float
    number: int  # the framework's step number, or the position among the steps found (from 0)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Steps:
    steps: tuple[Step, ...]
    method: str  # markers, optimizer, periodic or whole
    marker: str = ""  # the name the boundaries come from
    track: int = -1  # the thread whose events mark them (the one that dispatches the steps); -1: none

    @property
    def time(self) -> float:
        return sum(step.duration for step in self.steps)


def find_steps(trace: Trace) -> Steps:
    found = _from_markers(trace) or _from_optimizer(trace) or _periodic(trace)
    if found is None:
        return Steps((Step(0.0, trace.end, 0),), "whole")
    return Steps(_whole_only(found.steps), found.method, found.marker, found.track)


def _whole_only(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """Without the steps at either edge that are shorter than half the median: cut by the start or the
    end of the recording (a last ``ProfilerStep`` of a few microseconds, when the profiler stopped)."""
    if len(steps) < 2:
        return steps
    floor = statistics.median(step.duration for step in steps) / 2
    first, last = 0, len(steps)
    while last - first > 1 and steps[first].duration < floor:
        first += 1
    while last - first > 1 and steps[last - 1].duration < floor:
        last -= 1
    return steps[first:last]


def _from_markers(trace: Trace) -> Steps | None:
    spans = trace.spans[Kind.STEP]
    if not len(spans):
        return None
    # Nested or duplicated annotations (a step marked on two threads) would count time twice: keep the
    # outermost, in order.
    steps: list[Step] = []
    for i in range(len(spans)):
        start, end = spans.start[i], spans.start[i] + spans.dur[i]
        if steps and start < steps[-1].end:
            continue
        number = trace.step_numbers[i] if trace.step_numbers[i] >= 0 else len(steps)
        steps.append(Step(start, end, int(number)))
    # Steps the device marks (an XSpace GPU plane's Steps line) name no host thread that dispatches them.
    track = -1 if trace.tracks[spans.track[0]].startswith("GPU ") else spans.track[0]
    return Steps(tuple(steps), "markers", trace.names[spans.name[0]], track)


def _from_optimizer(trace: Trace) -> Steps | None:
    ops = trace.spans[Kind.HOST_OP]
    ends = [ops.start[i] + ops.dur[i] for i in range(len(ops))
            if trace.names[ops.name[i]].startswith(OPTIMIZER_PREFIX)]
    if len(ends) < 2:
        return None
    first = next(i for i in range(len(ops)) if trace.names[ops.name[i]].startswith(OPTIMIZER_PREFIX))
    ends.sort()
    return Steps(tuple(Step(a, b, n) for n, (a, b) in enumerate(pairwise(ends))),
                 "optimizer", trace.names[ops.name[first]], ops.track[first])


def _periodic(trace: Trace) -> Steps | None:
    ops = trace.spans[Kind.HOST_OP]
    # Top-level operations per thread: not inside another operation of the same thread.
    open_until: dict[int, float] = {}
    starts: dict[int, list[float]] = {}
    tracks: dict[int, int] = {}
    time: dict[int, float] = {}
    overlapping: set[int] = set()
    last_end: dict[int, float] = {}
    for i in range(len(ops)):
        start, end, track, name = ops.start[i], ops.start[i] + ops.dur[i], ops.track[i], ops.name[i]
        if start < open_until.get(track, float("-inf")):
            continue
        open_until[track] = end
        if start < last_end.get(name, float("-inf")):
            overlapping.add(name)  # on several threads at once: not a step of one loop
        last_end[name] = end
        starts.setdefault(name, []).append(start)
        tracks.setdefault(name, track)
        time[name] = time.get(name, 0.0) + ops.dur[i]
    candidates = [name for name, s in starts.items() if len(s) >= MIN_REPEATS and name not in overlapping]
    if not candidates:
        return None
    best = max(candidates, key=lambda name: time[name])
    bounds = starts[best]
    steps = tuple(Step(a, b, n) for n, (a, b) in enumerate(pairwise(bounds)))
    return Steps(steps, "periodic", trace.names[best], tracks[best])
