"""Replay a trace's dependency graph (``replay_graph``) and say what its steps would take.

The replay recomputes every node's start and end from its edges: a host call starts when the previous
call on its thread has ended plus the host work between them (and when the other thread's call it
waits for has ended); device work starts when its launch call has started plus the launch latency and
when the previous work on its stream has ended; a synchronisation (and a launch that found the launch
queue full) ends at the later of its own cost and the end of the device work it waits for plus the
time it takes to return. Unchanged, the graph
replays to the trace's own times; with a fix applied (``replay_fixes``) it says what the fix buys.

A step's replayed time runs from one boundary to the next, where a boundary is the later of the
host's (the step marker, on the thread that marks the steps) and the end of the device work launched
before it: once the host runs ahead of the device (a synchronisation removed), the steps are as long as
the device's work in them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from gpuscope.analysis.model import Trace
from gpuscope.analysis.replay_graph import DEVICE, StepGraph, build_graph

NEVER = float("-inf")


@dataclass(frozen=True, slots=True)
class Replayed:
    """Replayed starts and ends, by node."""

    start: array[float]
    end: array[float]


def replay(graph: StepGraph) -> Replayed:
    n = len(graph)
    rstart, rend = array("d", bytes(8 * n)), array("d", bytes(8 * n))
    kind, prev, launch, cross = graph.kind, graph.prev, graph.launch, graph.cross
    prev_lag, launch_lag, cross_lag = graph.prev_lag, graph.launch_lag, graph.cross_lag
    dur, start = graph.dur, graph.start
    for i in graph.order:
        if i < 0:  # the end of a synchronisation
            s = ~i
            finish = rstart[s] + graph.sync_overhead[s]
            tail = graph.sync_tail[s]
            for w in graph.waits.get(s, ()):
                finish = max(finish, rend[w] + tail)
            rend[s] = finish
            continue
        t = NEVER
        p = prev[i]
        if p >= 0:
            t = rend[p] + prev_lag[i]
        if kind[i] == DEVICE:
            at = launch[i]
            if at >= 0 and launch_lag[i] > NEVER:
                t = max(t, rstart[at] + launch_lag[i])
        else:
            c = cross[i]
            if c >= 0:
                t = max(t, rend[c] + cross_lag[i])
        if t == NEVER:
            t = start[i]  # a root: the first event of its thread or stream
        rstart[i] = t
        if i not in graph.waits:
            rend[i] = t + dur[i]
    return Replayed(rstart, rend)


def boundaries(graph: StepGraph, replayed: Replayed | None = None) -> list[float]:
    """The steps' boundaries on the host (each step's start, then the last one's end), measured
    (``replayed`` None) or replayed."""
    steps = graph.steps.steps
    if not steps:
        return []
    marks = [steps[0].start, *(step.end for step in steps)]
    if replayed is None:
        return marks
    track = graph.steps.track
    on_track = [i for i in range(len(graph)) if graph.kind[i] != DEVICE and graph.track[i] == track]
    starts = [graph.start[i] for i in on_track]
    return [_host_time(graph, replayed, on_track, starts, mark) for mark in marks]


def _host_time(graph: StepGraph, replayed: Replayed, on_track: list[int], starts: list[float],
               mark: float) -> float:
    """Where a measured time on the marking thread lands in the replay: within a call, moved as its
    start; between two calls, at the same fraction of the time between them (which a fix may have
    shortened)."""
    at = bisect_right(starts, mark) - 1
    if at < 0:  # before the thread's first node: later by what a fix took out before it
        cut = graph.head_cut.get(graph.track[on_track[0]], 0.0) if on_track else 0.0
        return mark + min(cut, starts[0] - mark) if on_track else mark
    i = on_track[at]
    if mark < graph.end(i):
        return mark + replayed.start[i] - graph.start[i]
    if at + 1 == len(on_track):  # after the thread's last node: less what a fix took out of that tail
        tail = graph.steps.steps[-1].end - graph.end(i)
        cut = min(graph.tail_cut.get(graph.track[i], 0.0), tail)
        scale = (tail - cut) / tail if tail > 0 else 1.0
        return replayed.end[i] + (mark - graph.end(i)) * scale
    following = on_track[at + 1]
    gap = graph.start[following] - graph.end(i)
    scale = (replayed.start[following] - replayed.end[i]) / gap if gap > 0 else 0.0
    return replayed.end[i] + (mark - graph.end(i)) * scale


def device_span(graph: StepGraph, replayed: Replayed | None = None) -> float:
    """From the first start to the last end of the device work that ran within the steps (as measured),
    measured or replayed; 0 without any. The work that ran, not the work the steps launched: a host a
    launch queue ahead of the device launches work that runs after the recording ends."""
    marks = boundaries(graph)
    if not marks:
        return 0.0
    first, last = marks[0], marks[-1]
    lo, hi = float("inf"), float("-inf")
    starts, ends = (graph.start, None) if replayed is None else (replayed.start, replayed.end)
    for i in range(len(graph)):
        if graph.kind[i] == DEVICE and first <= graph.start[i] < last:
            lo = min(lo, starts[i])
            hi = max(hi, graph.end(i) if ends is None else ends[i])
    return hi - lo if hi > lo else 0.0


def step_times(graph: StepGraph, replayed: Replayed | None = None) -> list[float]:
    """Each step's time in microseconds, measured or replayed."""
    marks = boundaries(graph, replayed)
    return [b - a for a, b in pairwise(marks)]


def step_time(graph: StepGraph, replayed: Replayed) -> float:
    """The replayed mean step time: the host's (its step markers, replayed), and no less than the
    device's work for a step as the replay compresses or stretches it, nor than the floor a fix set: a
    host that runs ahead waits for the device in the end (a full launch queue, a synchronisation at the
    next step).

    The device's work for a step is its replayed span over the steps it measured: the steps' own length
    where the device was busy throughout or ran past their end; where it sat idle part of the steps
    (for input, say), the span it had, so that a fix that takes that idle time out is not held back by
    it. Device work not tied to its launches keeps its measured times, and with them the steps' pace."""
    host = max(mean(step_times(graph, replayed)), graph.floor_us)
    measured_span = device_span(graph)
    if measured_span <= 0:
        return host
    measured = step_times(graph)
    covered = max(measured_span, sum(measured)) if graph.linked else measured_span
    device = mean(measured) * device_span(graph, replayed) / covered
    return max(host, device)


def mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


@dataclass(frozen=True, slots=True)
class Fidelity:
    """A trace's measured and replayed mean step time, microseconds."""

    measured_us: float
    replayed_us: float
    steps: int
    linked: bool  # device work tied to its launches

    @property
    def error(self) -> float:
        return abs(self.replayed_us - self.measured_us) / self.measured_us if self.measured_us else 0.0


def fidelity(trace: Trace) -> Fidelity:
    """How well the unmodified replay reproduces the trace's step time."""
    graph = build_graph(trace)
    measured = [step.duration for step in graph.steps.steps]
    return Fidelity(mean(measured), step_time(graph, replay(graph)), len(measured), graph.linked > 0)
