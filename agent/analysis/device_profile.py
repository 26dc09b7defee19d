"""What the device was busy with: its time by kernel class and by the framework operation that
launched each kernel.

A kernel is tied to its operation through the trace's CUDA correlation id: the id of a kernel (or
copy) on the device is the id of the launch call on a host thread (``cudaLaunchKernel``,
``cuLaunchKernelEx``, ``cudaMemcpyAsync`` ...); the operation is the outermost operator open on that
thread when the call was made (``aten::conv2d``; on the autograd thread,
``autograd::engine::evaluate_function: IndexBackward0``), annotations such as ``Optimizer.step#...``
left out. A kernel without a launch in the trace (or a trace without correlation ids), or launched
as part of a CUDA graph (``cuGraphLaunch``: XLA's compiled programs, a captured PyTorch graph), is its
own operation: the operation around a graph's launch names the whole program, while XLA's kernels are
named after the fused operations they run.

Device time is the sum of the kernels' and copies' durations within the steps: kernels that overlap on
several streams each count, so the classes add up to the device's total, not to the step time.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any

from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.kernels import KERNEL_CLASSES, OPTIMIZER_KERNEL, KernelClass, classify, short_name
from gpuscope.analysis.model import DEVICE_KINDS, Kind, Trace, gpu_of
from gpuscope.analysis.steps import OPTIMIZER_PREFIX

MAX_OPS = 8  # operations kept in a profile, by device time
MAX_UNMATCHED = 5  # unclassified kernels named in a profile, by device time
SMALL_GRID_FILL = 1.0  # fewer thread blocks than SMs: part of the GPU has nothing to run
# A launch of a whole CUDA graph: its kernels are not the work of the operation around the call.
GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch|hipGraphLaunch)")


@dataclass(slots=True)
class KernelStat:
    """One kernel name's time within the steps, and what it was part of."""

    cls: KernelClass
    count: int = 0
    us: float = 0.0
    small_us: float = 0.0  # in launches with fewer blocks than SMs
    small_count: int = 0
    optimizer_us: float = 0.0  # launched by the optimizer's step
    ops: dict[str, float] = field(default_factory=dict)  # by the operation that launched it

    @property
    def op(self) -> str:
        return max(self.ops, key=self.ops.__getitem__) if self.ops else ""


@dataclass(slots=True)
class OpStat:
    """One operation's kernels within the steps."""

    count: int = 0
    us: float = 0.0
    by_class: dict[str, float] = field(default_factory=dict)
    by_class_count: dict[str, int] = field(default_factory=dict)
    by_kernel: dict[str, float] = field(default_factory=dict)

    def top_kernel(self, cls: str | None = None, classes: dict[str, KernelStat] | None = None) -> str:
        """Its kernel with the most time (of one class)."""
        names = [name for name in self.by_kernel
                 if cls is None or (classes is not None and classes[name].cls == cls)]
        return max(names, key=self.by_kernel.__getitem__) if names else ""


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Times in microseconds, as measured; ``to_json`` rounds them for people."""

    device_us: float  # device time within the steps (overlapping streams each counted)
    class_us: dict[str, float]  # of it, per kernel class (KERNEL_CLASSES)
    attributed_us: float  # of it, tied to a framework operation
    devices: int  # GPUs with activity in the trace (a process may drive several)
    kernels: int  # kernels and copies within the steps
    small_grids: float | None  # share in kernels with fewer blocks than SMs; None when unknown
    op_stats: dict[str, OpStat] = field(repr=False, compare=False)
    kernel_stats: dict[str, KernelStat] = field(repr=False, compare=False)

    @property
    def optimizer_us(self) -> float:
        return sum(stat.optimizer_us for stat in self.kernel_stats.values())

    @property
    def classes(self) -> dict[str, float]:
        """Each kernel class's share of the device time."""
        return {cls: us / self.device_us for cls, us in self.class_us.items()}

    def unmatched_kernels(self) -> list[tuple[str, float]]:
        """The kernels no row of the taxonomy names, with the most time first: (name, device share)."""
        rows = sorted(((name, stat.us) for name, stat in self.kernel_stats.items() if stat.cls == "other"),
                      key=lambda kv: -kv[1])[:MAX_UNMATCHED]
        return [(name, us / self.device_us) for name, us in rows if us > 0]

    def to_json(self) -> dict[str, Any]:
        total = self.device_us
        ranked = sorted(self.op_stats.items(), key=lambda kv: -kv[1].us)[:MAX_OPS]
        ops = []
        for name, stat in ranked:
            kernel = stat.top_kernel()
            ops.append({"name": name, "kernels": stat.count, "time_ms": round(stat.us / 1e3, 3),
                        "share": round(stat.us / total, 4), "kernel": kernel,
                        "kernel_class": self.kernel_stats[kernel].cls})
        return {"device_ms": round(total / 1e3, 3), "devices": self.devices, "kernels": self.kernels,
                "classes": {cls: round(share, 4) for cls, share in self.classes.items()},
                "optimizer": round(self.optimizer_us / total, 4),
                "small_grids": None if self.small_grids is None else round(self.small_grids, 4),
                "attributed": round(self.attributed_us / total, 4), "ops": ops,
                # What the taxonomy could not classify: how much the class shares above leave unsaid.
                "unmatched": round(self.class_us.get("other", 0.0) / total, 4),
                "unmatched_kernels": [{"name": short_name(name, 60), "share": round(share, 4)}
                                      for name, share in self.unmatched_kernels()]}


def device_profile(trace: Trace, window: tuple[float, float]) -> DeviceProfile | None:
    """The profile of the device events that start within ``window``; None without any."""
    return _Profiler(trace, window).run()


class _Profiler:
    def __init__(self, trace: Trace, window: tuple[float, float]) -> None:
        self.trace = trace
        self.window = window

    def run(self) -> DeviceProfile | None:
        trace = self.trace
        a, b = self.window
        launches = Launches(trace, self.window)
        operators = OutermostOperators(trace)
        optimizer = self._optimizer_spans()
        optimizer_ops = operators.inside(optimizer)
        names = trace.names
        kernels: dict[str, KernelStat] = {}
        ops: dict[str, OpStat] = {}
        total = attributed_us = filled_us = 0.0
        count = 0
        gpus: set[int] = set()  # device tracks, told apart by GPU below
        for kind in DEVICE_KINDS:
            spans = trace.spans[kind]
            for i in range(len(spans)):
                start = spans.start[i]
                if not a <= start < b:
                    continue
                dur, name = spans.dur[i], names[spans.name[i]]
                stat = kernels.get(name)
                if stat is None:
                    stat = kernels[name] = KernelStat(classify(kind, name))
                total += dur
                count += 1
                launch = launches.of_operation(spans.corr[i]) if spans.corr[i] >= 0 else None
                gpus.add(spans.track[i])
                op = operators.around(*launch) if launch is not None else None
                if op is not None:
                    attributed_us += dur
                else:
                    op = name
                stat.count += 1
                stat.us += dur
                stat.ops[op] = stat.ops.get(op, 0.0) + dur
                # The optimizer's by where it was launched, or by the operation that launched it when
                # that ran inside an optimizer step elsewhere in the trace (at the recording's start the
                # host is steps ahead of the device: the step that launched the first kernels is not in
                # it); by its name only when neither is known (a GradScaler's or clip_grad_norm_'s
                # multi-tensor kernels are not the optimizer's).
                if launch is not None:
                    in_optimizer = optimizer.covered(launch[0], launch[0] + 1e-3) > 0 or op in optimizer_ops
                else:
                    in_optimizer = kind is Kind.KERNEL and OPTIMIZER_KERNEL.search(name) is not None
                if in_optimizer:
                    stat.optimizer_us += dur
                # A collective runs one block per channel by design: never a grid to enlarge.
                if kind is Kind.KERNEL and spans.fill[i] >= 0 and stat.cls != "collective":
                    filled_us += dur
                    if spans.fill[i] < SMALL_GRID_FILL:
                        stat.small_us += dur
                        stat.small_count += 1
                entry = ops.get(op)
                if entry is None:
                    entry = ops[op] = OpStat()
                entry.count += 1
                entry.us += dur
                entry.by_class[stat.cls] = entry.by_class.get(stat.cls, 0.0) + dur
                entry.by_class_count[stat.cls] = entry.by_class_count.get(stat.cls, 0) + 1
                entry.by_kernel[name] = entry.by_kernel.get(name, 0.0) + dur
        if not count or total <= 0:
            return None
        class_us: dict[str, float] = dict.fromkeys(KERNEL_CLASSES, 0.0)
        for stat in kernels.values():
            class_us[stat.cls] += stat.us
        kernel_us = sum(us for cls, us in class_us.items() if cls not in ("memcpy", "memset"))
        small_us = sum(stat.small_us for stat in kernels.values())
        devices = len({gpu_of(trace.tracks[track]) for track in gpus})
        return DeviceProfile(
            device_us=total, class_us=class_us, attributed_us=attributed_us, devices=max(devices, 1),
            kernels=count,
            # Known for most of the kernels' time, or not at all: a trace without grid sizes says nothing.
            small_grids=small_us / filled_us if kernel_us and filled_us >= 0.5 * kernel_us else None,
            op_stats=ops, kernel_stats=kernels)

    def _optimizer_spans(self) -> IntervalSet:
        ops, names = self.trace.spans[Kind.HOST_OP], self.trace.names
        wanted = {i for i, name in enumerate(names) if name.startswith(OPTIMIZER_PREFIX)}
        if not wanted:
            return IntervalSet.empty()
        return IntervalSet.merge((ops.start[i], ops.start[i] + ops.dur[i]) for i in range(len(ops))
                                 if ops.name[i] in wanted)


class Launches:
    """The host call that launched each correlation id: its start, end and thread. Kept as the runtime
    spans' indices sorted by correlation id (an array, searched by bisection), not a dict of them."""

    def __init__(self, trace: Trace, window: tuple[float, float]) -> None:
        runtime = self.runtime = trace.spans[Kind.RUNTIME]
        # A launch precedes its kernel, by up to the depth of the stream's queue: a second is generous.
        earliest, end = window[0] - 1e6, window[1]
        first, last = bisect_left(runtime.start, earliest), bisect_left(runtime.start, end)
        corr = runtime.corr
        self.order = array("q", sorted((i for i in range(first, last) if corr[i] >= 0),
                                       key=corr.__getitem__))
        self.keys = array("q", (corr[i] for i in self.order))
        self.graph_launches = {i for i, name in enumerate(trace.names) if GRAPH_LAUNCH.match(name)}

    def get(self, correlation: int) -> tuple[float, int] | None:
        """The launch call's start and thread."""
        i = self._index(correlation)
        return None if i < 0 else (self.runtime.start[i], self.runtime.track[i])

    def of_operation(self, correlation: int) -> tuple[float, int] | None:
        """The launch call's start and thread where it launched one operation's work, not a CUDA
        graph's."""
        i = self._index(correlation)
        if i < 0 or self.runtime.name[i] in self.graph_launches:
            return None
        return self.runtime.start[i], self.runtime.track[i]

    def end(self, correlation: int) -> float | None:
        """When the launch call returned."""
        i = self._index(correlation)
        return None if i < 0 else self.runtime.start[i] + self.runtime.dur[i]

    def _index(self, correlation: int) -> int:
        at = bisect_left(self.keys, correlation)
        if at < len(self.keys) and self.keys[at] == correlation:
            return self.order[at]
        return -1


class OutermostOperators:
    """The outermost operator open on a thread at a time (annotations left out), by binary search over
    each thread's top-level operators."""

    def __init__(self, trace: Trace) -> None:
        ops, skip = trace.spans[Kind.HOST_OP], trace.annotations
        self.names = trace.names
        tops: dict[int, tuple[array[float], array[float], array[int]]] = {}
        for i in range(len(ops)):
            if ops.name[i] in skip:
                continue
            start, end = ops.start[i], ops.start[i] + ops.dur[i]
            starts, ends, names = tops.setdefault(ops.track[i], (array("d"), array("d"), array("I")))
            if starts and start < ends[-1]:
                # Nested in the current top, unless it starts with it and lasts longer (a parent
                # written after its first child, both at the same microsecond).
                if start == starts[-1] and end > ends[-1]:
                    ends[-1], names[-1] = end, ops.name[i]
                continue
            starts.append(start)
            ends.append(end)
            names.append(ops.name[i])
        self.tops = tops

    def inside(self, spans: IntervalSet) -> set[str]:
        """The names of the top-level operators that start within ``spans``."""
        found: set[int] = set()
        for starts, _, names in self.tops.values():
            for start, name in zip(starts, names, strict=True):
                if name not in found and spans.covered(start, start + 1e-3) > 0:
                    found.add(name)
        return {self.names[name] for name in found}

    def around(self, at: float, track: int) -> str | None:
        found = self.tops.get(track)
        if found is None:
            return None
        starts, ends, names = found
        i = bisect_right(starts, at) - 1
        if i >= 0 and ends[i] >= at:
            return self.names[names[i]]
        return None
