"""What a trace lets the diagnosis say: nothing (unreadable), part of the picture (partial), or all.

A diagnosis never calls a trace healthy that it could not read: a trace of no events of a kind the
readers know, or of no time to measure, is ``unreadable``. A trace that was read but misses part of
what a verdict rests on is partial, and says what is missing:

- GPUs the process drove (their planes are in the trace) that recorded no kernel while others did:
  the capture caught some of the devices only;
- a device that ran copies and no kernel: nothing of the model's work was recorded;
- a file that ends inside its events: the rest of the recording is missing.

- one short step: a device that ran only a handful of kernels in the only step found, a fragment
  (one call, a unit test's few launches) whose gaps and shares say nothing of a model's step.

A partial trace's findings are capped at ``moderate`` (what was seen holds, but not as the whole
story); where the device's work is missing or a fragment they are ``low`` (nothing of a step's work
to hold back). Where no finding holds, the verdict is ``inconclusive``, not ``healthy``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from gpuscope.analysis.findings import Severity
from gpuscope.analysis.model import Kind, Trace

MAX_LISTED_DEVICES = 8
# Fewer kernels than this in a trace's only step are a fragment, not a model's step: a few launches of
# a unit test or a single call, too few for their gaps or their mix to say anything. Repeated steps
# are a pattern however few kernels each runs.
MIN_KERNELS = 20


@dataclass(frozen=True, slots=True)
class Coverage:
    unreadable: str = ""  # why nothing could be read; "" when something was
    partial: tuple[str, ...] = ()  # what is missing, in words; () for a whole trace
    cap: Severity = "high"  # the most severe a finding may be on what was read

    @property
    def readable(self) -> bool:
        return not self.unreadable


def coverage(trace: Trace, window: tuple[float, float], steps: int) -> Coverage:
    """How much of the picture ``trace`` holds, given the steps the diagnosis found in it."""
    if not trace.events_read:
        skipped = ", ".join(f"{name} ({count})" for name, count in
                            sorted(trace.skipped.items(), key=lambda kv: -kv[1])[:5])
        return Coverage(unreadable="no events: the trace holds none that the analysis reads (operators, "
                                   "CUDA runtime calls, kernels, copies, Python functions)"
                                   + (f"; it holds {skipped}" if skipped else ""))
    if window[1] <= window[0]:
        return Coverage(unreadable="no steps: its events span no time to analyse")
    if not any(trace.count(kind) for kind in (Kind.HOST_OP, Kind.KERNEL, Kind.MEMCPY, Kind.MEMSET,
                                              Kind.CPU_COMPUTE, Kind.STEP)):
        return Coverage(unreadable="no operations: the trace has neither framework operations nor device "
                                   "activity (only runtime calls or Python frames)")
    partial = []
    idle_devices = [gpu for gpu, count in trace.devices.items() if not count]
    if idle_devices and trace.active_devices:
        listed = ", ".join(sorted(idle_devices, key=lambda gpu: (len(gpu), gpu))[:MAX_LISTED_DEVICES])
        more = "" if len(idle_devices) <= MAX_LISTED_DEVICES else f" and {len(idle_devices) - 8} more"
        partial.append(f"{len(idle_devices)} of the {len(trace.devices)} GPUs in the trace recorded no "
                       f"device activity ({listed}{more}): the capture caught part of the devices, or the "
                       "job uses only some of them.")
    if trace.truncated:
        partial.append("The file ends inside its events (cut off while being written or copied): the "
                       "last part of the recording is missing.")
    cap: Severity = "moderate" if partial else "high"
    starts = trace.spans[Kind.KERNEL].start
    kernels = bisect_left(starts, window[1]) - bisect_left(starts, window[0])
    if trace.has_device and trace.active_devices and not kernels:
        partial.append("The device ran no kernel in the steps (copies at most): none of the model's work "
                       "was recorded.")
        cap = "low"
    elif trace.has_device and steps < 2 and 0 < kernels < MIN_KERNELS:
        partial.append(f"The device ran {kernels} kernel(s) in one step: a fragment (a single "
                       "call, a test's few launches), too little to tell a step's bottleneck.")
        cap = "low"
    return Coverage(partial=tuple(partial), cap=cap)
