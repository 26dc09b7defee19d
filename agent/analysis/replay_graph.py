"""One GPU's trace as a dependency graph that can be replayed: what each event waited for, with the
time it took measured from the trace.

Nodes, each with its measured start and duration:

- host calls: the CUDA runtime calls of each host thread (launches, copies, the rest), and the host
  operations that started device work, in order on their thread. The host work between two calls
  (the framework's operators, Python, the DataLoader) is the lag of the edge from one call to the
  next: it keeps its measured length.
- synchronisations: the calls that block the host until the device is done (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, a blocking ``cudaMemcpy``; the wait inside
  ``.item()`` or ``nonzero``). They wait for the device work launched before them that had not ended
  when they were called; the streams are read from the trace: work that ended after the call returned
  was not waited for.
- device work: kernels, copies and memsets, in order on their stream, each tied to the host call that
  launched it by its CUDA correlation id.

Every edge carries a lag, and a node starts at the latest of its edges' ends plus lags. For the edge
that held the node back in the trace (the binding one) the lag is the measured delay, for the others
at most that, so a replay of the unmodified graph puts every node where the trace has it; a fix
changes durations, lags or edges, and the replay says what follows. The lags of the edges that did not
bind are the graph's typical ones (the median launch latency, the median gap between queued kernels):
what the edge would take if it became the binding one.

A trace without device work or CUDA calls (a CPU run) has only host nodes: each thread's outermost
operations, and each step's start on the thread that marks the steps. The input pipeline's operations
are not nodes: their time is host work between the nodes around them, as on a GPU trace.

Cross-thread order is inferred: a host call after a long pause on its thread that follows another
thread's call ending in that pause (the main thread waiting for the autograd engine's backward pass,
the autograd thread started by ``backward()``, a PjRt worker given a transfer) waits for that call;
of the pause, only the time the thread's traced operations cover is its own work.
"""

from __future__ import annotations

import re
import statistics
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import DEVICE_KINDS, Kind, Trace
from gpuscope.analysis.patterns import INPUT_OP, LAUNCH_RUNTIME, SYNC_RUNTIME
from gpuscope.analysis.steps import Steps, find_steps

HOST, SYNC, DEVICE = 0, 1, 2
EPSILON_US = 1e-3
CROSS_THREAD_PAUSE_US = 50.0  # a pause on a thread shorter than this is its own work, not a wait
# A launch call longer than this, while device work ended within it, waited for room in the launch
# queue (about a thousand launches deep): a launch costs a few microseconds.
QUEUE_WAIT_US = 50.0
ENQUEUE_RUNTIME = re.compile(r"^(cudaMemsetAsync|cudaMemcpyAsync|cuMemsetD\w*Async|cuMemcpy\w*Async)")
DEFAULT_LAUNCH_LATENCY_US = 5.0  # when no kernel in the trace waited for its launch
DEFAULT_DEVICE_GAP_US = 1.0  # when no kernel in the trace was queued behind another


@dataclass(frozen=True, slots=True)
class Assumption:
    """What a prediction rests on: the fix (or ``replay`` for the graph itself) and what it takes as
    given, in words a report prints."""

    fix: str
    text: str


@dataclass
class StepGraph:
    """The nodes in columns (index = node), the edges as per-node columns: a node has at most one
    predecessor on its track, one launch (device work), one cross-thread predecessor (host calls) and
    the device work a synchronisation waits for."""

    trace: Trace
    steps: Steps
    kind: array[int] = field(default_factory=lambda: array("b"))
    track: array[int] = field(default_factory=lambda: array("i"))
    name: array[int] = field(default_factory=lambda: array("I"))
    start: array[float] = field(default_factory=lambda: array("d"))
    dur: array[float] = field(default_factory=lambda: array("d"))
    prev: array[int] = field(default_factory=lambda: array("q"))  # on the same thread or stream; -1
    prev_lag: array[float] = field(default_factory=lambda: array("d"))
    launch: array[int] = field(default_factory=lambda: array("q"))  # device work: its launch call; -1
    launch_lag: array[float] = field(default_factory=lambda: array("d"))
    cross: array[int] = field(default_factory=lambda: array("q"))  # host calls: another thread's; -1
    cross_lag: array[float] = field(default_factory=lambda: array("d"))
    # Synchronisation (or launch that found the queue full) -> the device work it waited for.
    waits: dict[int, list[int]] = field(default_factory=dict)
    sync_overhead: dict[int, float] = field(default_factory=dict)  # its cost without waiting
    sync_tail: dict[int, float] = field(default_factory=dict)  # from the device's end to its return
    # An order in which every edge's source comes first; ``~i``: the end of synchronisation i.
    order: list[int] = field(default_factory=list)
    host_tracks: list[int] = field(default_factory=list)
    launch_latency: float = DEFAULT_LAUNCH_LATENCY_US
    device_gap: float = DEFAULT_DEVICE_GAP_US
    linked: int = 0  # device nodes tied to a launch call
    assumptions: list[Assumption] = field(default_factory=list)
    # The least a step can take whatever the replay says (a background loader's own time per step),
    # microseconds; a fix sets it.
    floor_us: float = 0.0
    # Per host thread: the host work a fix took out after the thread's last node (an input wait the
    # trace ends in, with no call after it), microseconds.
    tail_cut: dict[int, float] = field(default_factory=dict)
    # Per host thread: the host work a fix took out between the first step's start and the thread's
    # first node (an input wait the trace starts with), microseconds.
    head_cut: dict[int, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.start)

    def copy(self) -> StepGraph:
        """A copy whose columns a fix may change (the trace and the order are shared)."""
        return StepGraph(
            self.trace, self.steps, self.kind, self.track, self.name, array("d", self.start),
            array("d", self.dur), self.prev, array("d", self.prev_lag), array("q", self.launch),
            array("d", self.launch_lag), array("q", self.cross), array("d", self.cross_lag),
            {k: list(v) for k, v in self.waits.items()}, dict(self.sync_overhead), dict(self.sync_tail),
            self.order, self.host_tracks, self.launch_latency, self.device_gap, self.linked,
            list(self.assumptions), self.floor_us, dict(self.tail_cut), dict(self.head_cut))

    def assume(self, fix: str, text: str) -> None:
        self.assumptions.append(Assumption(fix, text))

    def end(self, i: int) -> float:
        return self.start[i] + self.dur[i]

    def _add(self, kind: int, track: int, name: int, start: float, dur: float) -> int:
        self.kind.append(kind)
        self.track.append(track)
        self.name.append(name)
        self.start.append(start)
        self.dur.append(dur)
        for column in (self.prev, self.launch, self.cross):
            column.append(-1)
        for lag in (self.prev_lag, self.launch_lag, self.cross_lag):
            lag.append(0.0)
        return len(self.start) - 1


def build_graph(trace: Trace) -> StepGraph:
    """The graph of a trace's first GPU (a process that drives several is read one GPU at a time)."""
    devices = trace.active_devices
    if len(devices) > 1:
        trace = trace.of_device(devices[0])
    graph = StepGraph(trace, find_steps(trace))
    by_corr = _host_calls(graph)
    _device_work(graph, by_corr)
    _lags(graph)
    _synchronisations(graph)
    _queue_waits(graph)
    _cross_thread(graph)
    # A synchronisation starts with its thread and ends after the device work it waits for (so does a
    # launch that waited for room in the queue): its end is a second event (``~i``), at its measured end.
    events = [(graph.start[i], 1, i) for i in range(len(graph))]
    events.extend((graph.end(i), 0, ~i) for i in graph.waits)
    events.sort()
    graph.order = [i for _, _, i in events]
    if not graph.linked and any(kind == DEVICE for kind in graph.kind):
        graph.assume("replay", "the trace ties no device work to its launch (no correlation ids): the "
                     "device keeps its measured gaps, and a change on the host does not move it")
    return graph


def _host_calls(graph: StepGraph) -> dict[int, int]:
    """The runtime calls, and the host operations that started device work (an XSpace transfer's host
    side carries its correlation id), as host nodes in order on their thread (a call nested in another,
    a driver call under a runtime one, is part of it); returns the node of each correlation id. A trace
    with neither (a CPU run) gets its host operations instead (``_host_operations``)."""
    trace = graph.trace
    runtime, ops, names = trace.spans[Kind.RUNTIME], trace.spans[Kind.HOST_OP], trace.names
    sync_names = {i for i, name in enumerate(names) if SYNC_RUNTIME.match(name)}
    calls = [(runtime.start[i], runtime.dur[i], runtime.track[i], runtime.name[i], runtime.corr[i])
             for i in range(len(runtime))]
    calls.extend((ops.start[i], ops.dur[i], ops.track[i], ops.name[i], ops.corr[i])
                 for i in range(len(ops)) if ops.corr[i] >= 0)
    if not calls and not trace.has_device:
        calls = _host_operations(trace)
    calls.sort(key=lambda call: (call[0], -call[1]))
    last: dict[int, int] = {}
    by_corr: dict[int, int] = {}
    for start, dur, track, name, corr in calls:
        before = last.get(track, -1)
        if before >= 0 and start < graph.end(before) - EPSILON_US:
            if corr >= 0:
                by_corr.setdefault(corr, before)
            continue
        node = graph._add(SYNC if name in sync_names else HOST, track, name, start, dur)
        graph.prev[node] = before
        last[track] = node
        if corr >= 0:
            by_corr[corr] = node
    graph.host_tracks = sorted(last)
    return by_corr


def _host_operations(trace: Trace) -> list[tuple[float, float, int, int, int]]:
    """A trace without device work or runtime calls (a CPU run) depends on nothing but each thread's
    order: its nodes are the outermost host operations of each thread (the step's computation, the
    optimizer's step ...), nested ones being part of them. The input pipeline's operations (a
    DataLoader's ``__next__`` and what runs inside it) are not nodes: as on a GPU trace, where they
    launch nothing, their time is host work between the nodes around them, which is what a fix that
    moves the input off the step's thread (``prefetch_input``) takes out."""
    ops, names = trace.spans[Kind.HOST_OP], trace.names
    inputs = {i for i, name in enumerate(names) if INPUT_OP.search(name)}
    order = sorted(range(len(ops)), key=lambda i: (ops.start[i], -ops.dur[i]))
    open_until: dict[int, float] = {}  # per thread: the end of its outermost operation, or input span
    found = []
    for i in order:
        start, dur, track = ops.start[i], ops.dur[i], ops.track[i]
        if start < open_until.get(track, float("-inf")) - EPSILON_US:
            continue
        open_until[track] = start + dur
        if ops.name[i] not in inputs:
            found.append((start, dur, track, ops.name[i], -1))
    # Each step's start, a node of no duration on the thread that marks it: the first step's input
    # wait is then host work after a node too, not time before the thread's first node (which a
    # replay keeps where it was).
    steps = trace.spans[Kind.STEP]
    found.extend((steps.start[i], 0.0, steps.track[i], steps.name[i], -1) for i in range(len(steps))
                 if not trace.tracks[steps.track[i]].startswith("GPU "))
    return found


def _device_work(graph: StepGraph, by_corr: dict[int, int]) -> None:
    trace = graph.trace
    items: list[tuple[float, float, int, int, int]] = []
    for kind in DEVICE_KINDS:
        spans = trace.spans[kind]
        items.extend((spans.start[i], spans.dur[i], spans.track[i], spans.name[i], spans.corr[i])
                     for i in range(len(spans)))
    items.sort()
    last: dict[int, int] = {}
    for start, dur, track, name, corr in items:
        node = graph._add(DEVICE, track, name, start, dur)
        graph.prev[node] = last.get(track, -1)
        last[track] = node
        launch = by_corr.get(corr, -1) if corr >= 0 else -1
        if launch >= 0 and graph.start[launch] <= start:
            graph.launch[node] = launch
            graph.linked += 1


def _lags(graph: StepGraph) -> None:
    """The measured lag on each binding edge, the typical one (at most the measured delay) on the rest."""
    latencies, gaps = [], []
    binding_launch = set()
    for i in range(len(graph)):
        if graph.kind[i] != DEVICE:
            continue
        launch, prev = graph.launch[i], graph.prev[i]
        if launch >= 0 and (prev < 0 or graph.end(launch) > graph.end(prev)):
            binding_launch.add(i)  # the device had run out of work before the launch returned
            if prev >= 0:  # a stream's first work may have waited for anything before the recording
                latencies.append(graph.start[i] - graph.start[launch])
        elif prev >= 0:
            gaps.append(graph.start[i] - graph.end(prev))
    if latencies:
        graph.launch_latency = statistics.median(latencies)
    if gaps:
        graph.device_gap = statistics.median(gaps)
    for i in range(len(graph)):
        prev, start = graph.prev[i], graph.start[i]
        if graph.kind[i] != DEVICE:
            if prev >= 0:
                graph.prev_lag[i] = max(0.0, start - graph.end(prev))
            continue
        launch = graph.launch[i]
        # Negative where the next kernel starts before the last one ends (a programmatic dependent
        # launch; clocks rounded to the microsecond): kept, or the replay would drift.
        since_prev = start - graph.end(prev) if prev >= 0 else 0.0
        since_launch = start - graph.start[launch] if launch >= 0 else 0.0
        if i in binding_launch:
            graph.launch_lag[i] = since_launch
            graph.prev_lag[i] = min(since_prev, max(graph.device_gap, 0.0))
        else:
            graph.prev_lag[i] = since_prev
            graph.launch_lag[i] = min(since_launch, graph.launch_latency)


def _synchronisations(graph: StepGraph) -> None:
    """What each synchronisation waited for: per stream, the last device work launched before it was
    called (a blocking copy's own copy included), if that ended before the call returned."""
    device = [i for i in range(len(graph)) if graph.kind[i] == DEVICE and graph.launch[i] >= 0]
    device.sort(key=lambda i: graph.start[graph.launch[i]])
    launch_starts = [graph.start[graph.launch[i]] for i in device]
    syncs = [i for i in range(len(graph)) if graph.kind[i] == SYNC]
    last_on_stream: dict[int, int] = {}
    cursor = 0
    for sync in sorted(syncs, key=graph.start.__getitem__):
        start, end = graph.start[sync], graph.end(sync)
        stop = bisect_right(launch_starts, start + EPSILON_US, lo=cursor)
        for i in device[cursor:stop]:
            last_on_stream[graph.track[i]] = i
        cursor = stop
        waited = [i for i in last_on_stream.values() if graph.end(i) <= end + EPSILON_US]
        device_end = max((graph.end(i) for i in waited), default=float("-inf"))
        graph.waits[sync] = waited
        if device_end > start:  # the host waited: what followed the device's end is the call's own
            tail = max(0.0, end - device_end)
            graph.sync_tail[sync] = tail
            graph.sync_overhead[sync] = min(graph.dur[sync], tail)
        else:
            graph.sync_overhead[sync] = graph.dur[sync]
            graph.sync_tail[sync] = 0.0


def _queue_waits(graph: StepGraph) -> None:
    """A launch that blocked because the launch queue was full returns when the device frees a slot:
    it waits for the device work that ended last within the call (the work a queue's depth of launches
    earlier), and takes the typical launch's time when the queue has room."""
    # Calls that enqueue work, whether or not the trace recorded the work (a host far ahead of the
    # device launches work that runs after the recording ends).
    names = graph.trace.names
    enqueuing = {i for i, name in enumerate(names)
                 if LAUNCH_RUNTIME.match(name) or ENQUEUE_RUNTIME.match(name)}
    launches = {graph.launch[i] for i in range(len(graph))
                if graph.kind[i] == DEVICE and graph.launch[i] >= 0}
    launches.update(i for i in range(len(graph)) if graph.kind[i] == HOST and graph.name[i] in enqueuing)
    if not launches:
        return
    typical = statistics.median(graph.dur[i] for i in launches)
    device = sorted((graph.end(i), i) for i in range(len(graph)) if graph.kind[i] == DEVICE)
    device_ends = [end for end, _ in device]
    for i in sorted(launches):
        if graph.kind[i] != HOST or graph.dur[i] <= QUEUE_WAIT_US:
            continue
        start, end = graph.start[i], graph.end(i)
        j = bisect_right(device_ends, end + EPSILON_US) - 1
        if j < 0 or device_ends[j] <= start:
            continue  # no device work ended within it: a slow call, not a full queue
        waited = device[j][1]
        graph.waits[i] = [waited]
        graph.sync_tail[i] = max(0.0, end - device_ends[j])
        graph.sync_overhead[i] = min(graph.dur[i], max(typical, graph.sync_tail[i]))


def _cross_thread(graph: StepGraph) -> None:
    """A host call after a pause of its thread waits for the last call of another thread that ended in
    the pause. The thread's own work in the pause is the time its traced operations cover there: the
    rest of the pause was waiting (the main thread during the backward pass, a worker thread idle
    until given work)."""
    if len(graph.host_tracks) < 2:
        return
    host = [i for i in range(len(graph)) if graph.kind[i] != DEVICE]
    ends = sorted((graph.end(i), i) for i in host)
    end_times = [e for e, _ in ends]
    busy = _operations_by_thread(graph.trace)
    for i in host:
        prev = graph.prev[i]
        if prev < 0:
            continue
        pause_from, at = graph.end(prev), graph.start[i]
        if at - pause_from < CROSS_THREAD_PAUSE_US:
            continue
        j = bisect_right(end_times, at) - 1
        lo = bisect_left(end_times, pause_from)
        while j >= lo and graph.track[ends[j][1]] == graph.track[i]:
            j -= 1
        if j < lo:
            continue
        other = ends[j][1]
        lag = at - graph.end(other)
        graph.cross[i] = other
        graph.cross_lag[i] = lag
        own = busy[graph.track[i]].covered(pause_from, at) if graph.track[i] in busy else 0.0
        graph.prev_lag[i] = min(graph.prev_lag[i], lag, own)


def _operations_by_thread(trace: Trace) -> dict[int, IntervalSet]:
    ops = trace.spans[Kind.HOST_OP]
    spans: dict[int, list[tuple[float, float]]] = {}
    for i in range(len(ops)):
        spans.setdefault(ops.track[i], []).append((ops.start[i], ops.start[i] + ops.dur[i]))
    return {track: IntervalSet.merge(found) for track, found in spans.items()}
