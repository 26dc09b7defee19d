"""Where the host holds the device back, counted once each: the gaps it causes by launching late, the
calls in which it waits for the device, and the outermost frame of a nested wait.

- A gap between two kernels is the host's when the next kernel's launch call returned after the
  device ran out of work: the device had nothing queued. A gap before a kernel that was launched
  long before is the device's own (scheduling, a dependency between streams): 1-2 microseconds
  between kernels already queued are no launch overhead.
- A blocking call is one synchronisation point however many of the operations nested in it wait
  too: ``.item()`` shows as ``aten::is_nonzero`` around ``aten::_local_scalar_dense``.
- A wait recorded as nested frames (``enumerate(DataLoader)`` > ``__next__`` > ``_next_data``) is one
  wait, named by its outermost frame.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

from gpuscope.analysis.device_profile import Launches
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import DEVICE_KINDS, Kind, Trace
from gpuscope.analysis.patterns import SYNC_OPS, SYNC_RUNTIME
from gpuscope.analysis.steps import OPTIMIZER_PREFIX

Gap = tuple[float, float]
SyncEvent = tuple[float, float, str, int]  # start, end, name, thread
EPSILON_US = 1e-3  # a nanosecond: trace times are exact to it


def host_caused_gaps(trace: Trace, launches: Launches, gaps: Iterable[Gap]) -> tuple[list[Gap], list[Gap]]:
    """The gaps split into those the host caused and those with the next kernel already queued. A gap
    whose next kernel has no launch in the trace (XLA's, a trace without correlation ids) is counted
    as the host's, as nothing shows otherwise."""
    host: list[Gap] = []
    queued: list[Gap] = []
    for gap in gaps:
        end = _launch_end_of_next(trace, launches, gap[1])
        (queued if end is not None and end <= gap[0] + EPSILON_US else host).append(gap)
    return host, queued


def _launch_end_of_next(trace: Trace, launches: Launches, at: float) -> float | None:
    """When the launch of the device event that starts at ``at`` returned; None when unknown."""
    for kind in DEVICE_KINDS:
        spans = trace.spans[kind]
        i = bisect_left(spans.start, at - EPSILON_US)
        while i < len(spans) and spans.start[i] <= at + EPSILON_US:
            end = launches.end(spans.corr[i]) if spans.corr[i] >= 0 else None
            if end is not None:
                return end
            i += 1
    return None


def sync_events_in(trace: Trace, in_steps: Callable[[Kind], list[int]]) -> list[SyncEvent]:
    """Each synchronisation in the steps, once: the operations that wait for the device (the outermost
    of nested ones), and the CUDA calls that wait outside them (``torch.cuda.synchronize()``). With
    device activity in the trace, an operation counts only when it called the CUDA runtime (a copy or
    a synchronisation): ``.item()`` of a tensor on the CPU does not wait for the device."""
    names = trace.names
    ops, runtime = trace.spans[Kind.HOST_OP], trace.spans[Kind.RUNTIME]
    sync_ops = [(Kind.HOST_OP, i) for i in in_steps(Kind.HOST_OP) if names[ops.name[i]] in SYNC_OPS]
    events = [(ops.start[i], ops.start[i] + ops.dur[i], names[ops.name[i]], ops.track[i])
              for _, i in outermost(trace, sync_ops)]
    if trace.has_device:
        events = [e for e in events if _calls_runtime(trace, e)]
    else:
        # Without the device's side nothing tells a read of a CPU tensor from one of a GPU's, but an
        # optimizer's own reads are of its step counters, which live on the CPU (AdamW reads one per
        # parameter): they are not counted.
        optimizer = IntervalSet.merge((ops.start[i], ops.start[i] + ops.dur[i]) for i in range(len(ops))
                                      if names[ops.name[i]].startswith(OPTIMIZER_PREFIX))
        events = [e for e in events if optimizer.covered(e[0], e[1]) < e[1] - e[0]]
    inside = IntervalSet.merge((s, e) for s, e, _, _ in events)
    for i in in_steps(Kind.RUNTIME):
        name = names[runtime.name[i]]
        start, end = runtime.start[i], runtime.start[i] + runtime.dur[i]
        if SYNC_RUNTIME.match(name) and inside.covered(start, end) < 0.5 * (end - start):
            events.append((start, end, name, runtime.track[i]))
    return events


def _calls_runtime(trace: Trace, event: SyncEvent) -> bool:
    start, end, _, track = event
    runtime = trace.spans[Kind.RUNTIME]
    i = bisect_right(runtime.start, start)
    while i < len(runtime) and runtime.start[i] < end:
        if runtime.track[i] == track:
            return True
        i += 1
    return False


def outermost(trace: Trace, indices: list[tuple[Kind, int]]) -> list[tuple[Kind, int]]:
    """Those of the (kind, index) spans that no other of them encloses on the same thread."""
    def bounds(item: tuple[Kind, int]) -> tuple[int, float, float]:
        spans = trace.spans[item[0]]
        return spans.track[item[1]], spans.start[item[1]], spans.start[item[1]] + spans.dur[item[1]]

    ordered = sorted(indices, key=lambda item: (bounds(item)[0], bounds(item)[1], -bounds(item)[2]))
    kept: list[tuple[Kind, int]] = []
    open_track, open_end = -1, float("-inf")
    for item in ordered:
        track, start, end = bounds(item)
        if track == open_track and end <= open_end + EPSILON_US and start < open_end:
            continue  # inside the wait already kept
        kept.append(item)
        if track != open_track or end > open_end:
            open_track, open_end = track, end
    return kept
