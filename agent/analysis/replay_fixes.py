"""The fixes a finding proposes, as changes to a trace's dependency graph, and what replaying them
predicts: the step time before and after, and the share of it won back.

Each fix returns a changed copy of the graph and adds what it assumes to ``graph.assumptions``
(``Assumption``: the fix's name and the text), so that a report can say on what its estimate rests.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuscope.analysis.device_profile import OutermostOperators
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.kernel_taxonomy import classify_name
from gpuscope.analysis.model import Kind, Trace
from gpuscope.analysis.patterns import INPUT_OP
from gpuscope.analysis.replay import replay, step_time
from gpuscope.analysis.replay_graph import DEVICE, HOST, SYNC, Assumption, StepGraph, build_graph

Fix = Callable[[StepGraph], StepGraph]
NEVER = float("-inf")


def remove_host_syncs(graph: StepGraph) -> StepGraph:
    """host_sync: the host no longer waits in its synchronisations (the value it read is kept on the
    device, the data-dependent shape made static), so it runs ahead. Each call keeps its own cost, the
    device work it waited for stays, in its order on its stream."""
    fixed = graph.copy()
    syncs = [i for i in fixed.waits if fixed.kind[i] == SYNC]
    removed = sum(1 for i in syncs if fixed.waits[i])
    for sync in syncs:
        fixed.waits[sync] = []
    fixed.assume(
        "host_sync", f"{removed} synchronisations no longer wait for the device (each keeps its own cost); "
        "the device work they waited for still runs, in order on its stream")
    return fixed


def close_launch_gaps(graph: StepGraph) -> StepGraph:
    """launch_bound: the work between two synchronisations is captured and replayed as one CUDA graph:
    the host's dispatch between its CUDA calls (operators, launches) leaves the step, except the input
    wait; each kernel waits only for the previous work on its stream, with the trace's typical gap
    between queued kernels; the first kernel after a synchronisation (or a thread's first) still waits
    for its launch, and the host still waits in its synchronisations."""
    fixed = graph.copy()
    first_after: set[int] = set()
    blocked: dict[int, bool] = {}  # per thread: a synchronisation since its last launch
    for i in graph.order:
        if i < 0:
            blocked[graph.track[~i]] = True
            continue
        if graph.kind[i] == DEVICE and graph.launch[i] >= 0:
            thread = graph.track[graph.launch[i]]
            if blocked.get(thread, True):
                first_after.add(i)
                blocked[thread] = False
    queued = 0
    for i in range(len(fixed)):
        if fixed.kind[i] != DEVICE or fixed.launch[i] < 0 or i in first_after:
            continue
        fixed.launch_lag[i] = NEVER
        if fixed.prev[i] >= 0:
            fixed.prev_lag[i] = min(fixed.prev_lag[i], max(fixed.device_gap, 0.0))
        queued += 1
    inputs = _host_spans(graph.trace, lambda name: INPUT_OP.search(name) is not None)
    captured = 0.0
    for i in range(len(fixed)):
        prev = fixed.prev[i]
        if fixed.kind[i] != HOST or prev < 0 or fixed.kind[prev] != HOST:
            continue
        waiting = inputs.get(fixed.track[i])
        kept = waiting.covered(graph.end(prev), graph.start[i]) if waiting is not None else 0.0
        captured += fixed.dur[i] + fixed.prev_lag[i] - min(kept, fixed.prev_lag[i])
        fixed.prev_lag[i] = min(kept, fixed.prev_lag[i])
        fixed.dur[i] = 0.0
        if i in fixed.waits:  # a launch that waited for room in the queue: one graph launch does not
            fixed.waits[i] = []
            fixed.sync_overhead[i] = 0.0
    fixed.assume(
        "launch_bound", f"{queued} kernels run back to back on their stream ({fixed.device_gap:.1f} us "
        "apart, the trace's median between queued kernels), as from a CUDA graph; the host's dispatch "
        f"between CUDA calls with no synchronisation between them is captured ({captured / 1e3:.1f} ms "
        "taken out, input waits kept); the first kernel after each synchronisation still waits for its "
        "launch")
    return fixed


def prefetch_input(graph: StepGraph, workers: int = 1, pattern: re.Pattern[str] = INPUT_OP) -> StepGraph:
    """input_bound: the input wait (``DataLoader.__next__``, ``IteratorGetNext`` ...) leaves the step's
    thread: ``workers`` background loaders prepare the next batches while the device runs this one.
    Its time is taken out of the host work between the calls it lies in, and the step is no shorter
    than the loaders' time per step (each as fast as the step's thread was, in parallel)."""
    if workers < 1:
        raise ValueError(f"prefetch_input: workers must be >= 1, not {workers}")
    spans = _host_spans(graph.trace, lambda name: pattern.search(name) is not None)
    fixed = _shorten_host_work(graph, spans, "input_bound", f"the input wait runs in {workers} background "
                               "loader(s) that prefetch")
    steps = graph.steps.steps
    if steps:
        per_step = sum(s.covered(steps[0].start, steps[-1].end) for s in spans.values()) / len(steps)
        fixed.floor_us = max(fixed.floor_us, per_step / workers)
        fixed.assume("input_bound", f"the loaders need {per_step / 1e3:.1f} ms a step, "
                     f"{per_step / workers / 1e3:.1f} ms with {workers}: the step is no shorter")
    return fixed


def overlap_untraced_host(graph: StepGraph) -> StepGraph:
    """host_bound: the host time outside any traced operation on the thread that dispatches the steps
    (Python between calls: a generator that makes the next batch, logging) overlaps the device's work,
    as when it moves out of the step's critical path (prefetching, asynchronous logging, a compiled
    step). Every host thread's, when the trace marks no dispatching thread."""
    traced = _host_spans(graph.trace, lambda name: True)
    dispatching = graph.steps.track
    tracks = [dispatching] if dispatching in graph.host_tracks else graph.host_tracks
    untraced: dict[int, IntervalSet] = {}
    for track in tracks:
        own = [i for i in range(len(graph)) if graph.kind[i] != DEVICE and graph.track[i] == track]
        if own:
            whole = IntervalSet.merge([(graph.start[own[0]], graph.end(own[-1]))])
            untraced[track] = whole.difference(traced.get(track, IntervalSet.empty()))
    return _shorten_host_work(graph, untraced, "host_bound", "the host time outside traced operations on "
                              "the dispatching thread overlaps the device's work")


def scale_op(graph: StepGraph, op: str, factor: float = 0.0) -> StepGraph:
    """costly_op: the device work launched by operation ``op`` (the outermost operator open when its
    launch was called, as the device profile names it) takes ``factor`` times its time (0: removed,
    as when a dense formulation replaces it). The host's launches of it stay."""
    if factor < 0:
        raise ValueError(f"scale_op: factor must be >= 0, not {factor}")
    fixed = graph.copy()
    operators = OutermostOperators(graph.trace)
    scaled = 0
    before = 0.0
    for i in range(len(fixed)):
        launch = fixed.launch[i]
        if fixed.kind[i] != DEVICE or launch < 0:
            continue
        if operators.around(graph.start[launch], graph.track[launch]) == op:
            before += fixed.dur[i]
            fixed.dur[i] *= factor
            scaled += 1
    fixed.assume(
        "costly_op", f"{scaled} kernels of {op} ({before / 1e3:.1f} ms) take {factor:g}x their time; "
        "their launches and the host's time stay")
    return fixed


def remove_layout_conversions(graph: StepGraph) -> StepGraph:
    """layout_conversion: the kernels that convert tensors between layouts (NCHW/NHWC, transposes)
    leave the device, as when the model and its inputs keep one layout (channels_last). Only those
    kernels: the convolutions around them keep their time; their launches stay."""
    fixed = graph.copy()
    names = graph.trace.names
    removed, before = 0, 0.0
    for i in range(len(fixed)):
        if fixed.kind[i] == DEVICE and classify_name(names[fixed.name[i]]) == "layout":
            before += fixed.dur[i]
            fixed.dur[i] = 0.0
            removed += 1
    fixed.assume("layout_conversion", f"{removed} layout-conversion kernels ({before / 1e3:.1f} ms) no "
                 "longer run (one layout throughout); the work around them and the launches stay")
    return fixed


@dataclass(frozen=True, slots=True)
class Prediction:
    """The mean step time before and after the fixes, microseconds, and what they assume."""

    before_us: float
    after_us: float
    assumptions: tuple[Assumption, ...]

    @property
    def speedup(self) -> float:
        return self.before_us / self.after_us if self.after_us > 0 else float("inf")

    @property
    def won_back(self) -> float:
        """The share of the step time the fixes win back."""
        return 1 - self.after_us / self.before_us if self.before_us > 0 else 0.0


def predict(trace: Trace | StepGraph, fixes: Sequence[Fix]) -> Prediction:
    """Replay the trace as it is and with ``fixes`` applied in order."""
    graph = trace if isinstance(trace, StepGraph) else build_graph(trace)
    before = step_time(graph, replay(graph))
    fixed = graph
    for fix in fixes:
        fixed = fix(fixed)
    after = step_time(fixed, replay(fixed))
    return Prediction(before, after, tuple(fixed.assumptions))


def _host_spans(trace: Trace, wanted: Callable[[str], bool]) -> dict[int, IntervalSet]:
    """The host operations whose name ``wanted`` accepts, merged per thread."""
    ops, names = trace.spans[Kind.HOST_OP], trace.names
    accepted = {i for i, name in enumerate(names) if wanted(name)}
    by_track: dict[int, list[tuple[float, float]]] = {}
    for i in range(len(ops)):
        if ops.name[i] in accepted:
            by_track.setdefault(ops.track[i], []).append((ops.start[i], ops.start[i] + ops.dur[i]))
    return {track: IntervalSet.merge(spans) for track, spans in by_track.items()}


def _shorten_host_work(graph: StepGraph, spans: dict[int, IntervalSet], fix: str,
                       assumption: str) -> StepGraph:
    """The host work between consecutive calls on each thread less the time ``spans`` cover in it; the
    lag of a cross-thread wait less what they cover on the thread waited for (its work before it let
    the other go)."""
    fixed = graph.copy()
    removed = 0.0
    for i in range(len(fixed)):
        if fixed.kind[i] == DEVICE:
            continue
        prev, other = fixed.prev[i], fixed.cross[i]
        covered = spans.get(fixed.track[i])
        if prev >= 0 and covered is not None:
            cut = covered.covered(graph.end(prev), graph.start[i])
            if cut > 0:
                fixed.prev_lag[i] = max(0.0, fixed.prev_lag[i] - cut)
                removed += cut
        covered = spans.get(fixed.track[other]) if other >= 0 else None
        if covered is not None:
            cut = covered.covered(graph.end(other), graph.start[i])
            fixed.cross_lag[i] = max(0.0, fixed.cross_lag[i] - cut)
    fixed.assume(fix, f"{assumption} ({removed / 1e3:.1f} ms of host work taken out)")
    return fixed
