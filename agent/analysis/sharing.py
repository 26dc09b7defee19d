"""One GPU, several processes: whether each one's kernels ran while another's did.

A capture of a GPU takes a trace of every process on it. On one time line (the traces' clocks are the
node's: Kineto's ``baseTimeNanoseconds``), a process whose kernels run at the same time as another
process's kernels on the same GPU shares the GPU's time with it: time-sliced (the default), the GPU
switches between the processes' contexts and each kernel takes longer than it would alone; under MPS
the kernels share the SMs. Either way the step of each is slower than on a GPU of its own.

Only traces known to be of one GPU are compared (the traces of one capture): two processes on two
GPUs overlap all the time and share nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuscope.analysis.findings import BOUNDS, Check, Evidence, Finding, percent
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import DEVICE_KINDS, Trace, gpu_of
from gpuscope.analysis.patterns import REMEDIES
from gpuscope.analysis.steps import find_steps


@dataclass(frozen=True, slots=True)
class DeviceTimeline:
    """A process's device activity on the node's clock, in microseconds since the Unix epoch."""

    source: str
    busy: IntervalSet
    window: tuple[float, float]  # its measured steps
    steps: int


def device_timeline(trace: Trace, source: str) -> DeviceTimeline | None:
    """None for a trace without device activity, whose clock is not the node's, or of a process that
    drives several GPUs (its other GPUs' kernels share nothing with this GPU's other processes)."""
    if not trace.has_device or trace.epoch_ns is None:
        return None
    gpus = {gpu_of(trace.tracks[track]) for kind in DEVICE_KINDS
            for track in set(trace.spans[kind].track)}
    if len(gpus) != 1:
        return None
    steps = find_steps(trace).steps
    offset = trace.epoch_ns / 1e3
    busy = IntervalSet.merge((offset + spans.start[i], offset + spans.start[i] + spans.dur[i])
                             for spans in (trace.spans[kind] for kind in DEVICE_KINDS)
                             for i in range(len(spans)))
    return DeviceTimeline(source, busy, (offset + steps[0].start, offset + steps[-1].end), len(steps))


def shared_gpu(timelines: list[DeviceTimeline | None]) -> list[tuple[Finding | None, Check | None]]:
    """For each trace (in order): the finding when other processes' kernels overlapped its own, and
    the check as measured; (None, None) for a trace that cannot be compared."""
    known = [t for t in timelines if t is not None]
    out: list[tuple[Finding | None, Check | None]] = []
    for timeline in timelines:
        others = [t for t in known if t is not timeline]
        if timeline is None or not others:
            out.append((None, None))
            continue
        out.append(_compare(timeline, others))
    return out


def _compare(own: DeviceTimeline, others: list[DeviceTimeline]) -> tuple[Finding | None, Check]:
    a, b = own.window
    length = b - a
    if length <= 0:
        return None, Check("shared_gpu", 0.0, BOUNDS["shared_gpu"].moderate)
    rows = []
    overlapping = IntervalSet.empty()
    for other in others:
        overlap = own.busy.intersection(other.busy)
        time = overlap.covered(a, b)
        if time > 0:
            rows.append((other, time, other.busy.covered(a, b)))
            overlapping = overlapping.union(overlap)
    share = overlapping.covered(a, b) / length
    check = Check("shared_gpu", round(share, 4), BOUNDS["shared_gpu"].moderate,
                  note=f"{len(others)} other process(es) traced")
    severity = BOUNDS["shared_gpu"].severity(share)
    if severity is None:
        return None, check
    other_busy = IntervalSet.merge(span for other in others for span in other.busy).covered(a, b) / length
    summary = (f"another process's kernels ran on this GPU at the same time as this process's "
               f"{percent(share)} of the step time (the other processes kept the GPU busy "
               f"{percent(other_busy)} of it): the GPU's time is shared, so each of this process's "
               "kernels takes longer than on a GPU of its own")
    evidence = tuple(Evidence(other.source, other.steps, round(time / 1e3, 3),
                              detail=f"busy {percent(busy / length)} of this process's step time")
                     for other, time, busy in sorted(rows, key=lambda row: -row[1]))
    return Finding("shared_gpu", severity, round(share, 4), None, summary, evidence,
                   REMEDIES["shared_gpu"]), check
