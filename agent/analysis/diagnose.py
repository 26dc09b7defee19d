"""A trace's steps, and the findings that say where their time went.

Every share is of the measured steps' wall time (from the first whole step's start to the last one's
end). Device idle time within it is attributed once, in this order: waiting for input, behind a
host-device synchronisation, in short gaps between kernels (launch overhead), anything else (idle
between steps). Exposed communication (collective kernels with no computation beside them) is device
time, counted apart. A finding is reported from MODERATE (5%) of the time and is severe from HIGH
(20%): TensorFlow's input-pipeline analysis uses the same bounds for "moderately" and "highly"
input-bound. Nothing is reported below them: a healthy trace gets no finding.

On a trace without device activity (a CPU run) only what the host shows is measured: the time spent
waiting for input, and host-device synchronisation points counted per step.
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import DEVICE_KINDS, Kind, Trace
from gpuscope.analysis.patterns import (
    COLLECTIVE_KERNEL,
    DISPATCH_OP,
    FINDING_KINDS,
    INPUT_OP,
    INPUT_PYTHON,
    LAUNCH_RUNTIME,
    LIBRARY_FRAME,
    REMEDIES,
    SYNC_OPS,
    SYNC_RUNTIME,
)
from gpuscope.analysis.steps import Step, Steps, find_steps

Severity = Literal["high", "moderate"]
HIGH = 0.20
MODERATE = 0.05
SHORT_GAP_US = 1000.0  # a device gap this short between two kernels is launch overhead, not a stall
SHORT_KERNEL_US = 50.0
SYNCS_PER_STEP = 1.0  # on a trace without device: this many synchronisation points per step is a finding
MAX_EVIDENCE = 5
_SITE_SCAN = 20_000  # Python frames looked at, backwards, for one call site
_SITE_SAMPLES = 50  # events of one name whose call site is looked up


@dataclass(frozen=True, slots=True)
class Evidence:
    name: str  # an operation, kernel or Python function
    count: int  # occurrences in the measured steps
    time_ms: float  # its time (for input and idle: the device idle time behind it) in the steps
    site: str = ""  # the Python call site outside library code, when the trace has stacks


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    severity: Severity
    share: float | None  # of the steps' time; None where it cannot be measured (CPU traces)
    per_step: float | None  # occurrences per step, where counting is the measure
    summary: str
    evidence: tuple[Evidence, ...]
    remedy: str


@dataclass(frozen=True, slots=True)
class Diagnosis:
    source: str
    format: str
    framework: str
    device: bool  # the trace has device activity
    events: int
    steps: int
    step_method: str  # markers, optimizer, periodic, whole
    step_marker: str
    mean_step_ms: float
    breakdown: dict[str, float]  # shares of the steps' time
    findings: tuple[Finding, ...]
    limits: tuple[str, ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> str:
        return self.findings[0].kind if self.findings else "healthy"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        return data


def diagnose(trace: Trace) -> Diagnosis:
    steps = find_steps(trace)
    return _Analysis(trace, steps).run()


class _Analysis:
    def __init__(self, trace: Trace, steps: Steps) -> None:
        self.trace = trace
        self.steps = steps
        self.window = (steps.steps[0].start, steps.steps[-1].end) if steps.steps else (0.0, 0.0)
        self.time = max(self.window[1] - self.window[0], 0.0)
        self.n = len(steps.steps)
        self.limits: list[str] = []
        self.breakdown: dict[str, float] = {}
        self._busy_set = IntervalSet.empty()

    # ---------------------------------------------------------------- the whole

    def run(self) -> Diagnosis:
        trace = self.trace
        findings: list[Finding] = []
        if self.time > 0:
            busy = self._busy()
            findings = self._on_device(busy) if busy is not None else self._on_host()
        else:
            self.limits.append("The trace holds no step time to analyse.")
        if self.steps.method == "whole":
            self.limits.append("No repeating step found: the whole trace is analysed as one step.")
            self._note_start_up()
        elif self.steps.method != "markers":
            self.limits.append(f"Steps inferred from {self.steps.marker!r} ({self.steps.method}): the "
                               "framework marked none.")
        if not trace.has_stacks:
            self.limits.append("No Python stacks in the trace: call sites are not shown (torch.profiler "
                               "with_stack=True; python_tracer_level=1 for TensorFlow and JAX).")
        findings.sort(key=lambda f: (f.severity != "high", -(f.share if f.share is not None else MODERATE),
                                     FINDING_KINDS.index(f.kind)))
        return Diagnosis(
            source=trace.source, format=trace.format, framework=trace.framework, device=trace.has_device,
            events=trace.events_read, steps=self.n, step_method=self.steps.method,
            step_marker=self.steps.marker, mean_step_ms=round(self.steps.time / max(self.n, 1) / 1e3, 3),
            breakdown={k: round(v, 4) for k, v in self.breakdown.items()}, findings=tuple(findings),
            limits=tuple(self.limits))

    def _note_start_up(self) -> None:
        """A trace whose device starts working late in it recorded start-up (CUDA context creation,
        compilation, warm-up), not training steps: say so, as its idle time says nothing of the job."""
        busy = self._busy()
        if busy is None or not len(busy) or self.time <= 0:
            return
        first = busy.starts[0] - self.window[0]
        if first > 0.25 * self.time:
            self.limits.append(f"The device's first activity comes {first / 1e6:.1f} s into the trace: it "
                               "recorded start-up (CUDA context creation, compilation, warm-up) rather "
                               "than training steps; capture again once the job runs its steps.")

    def _busy(self) -> IntervalSet | None:
        """The device's busy time: its kernels and copies, or XLA's computations on a CPU run."""
        if self.trace.has_device:
            return self._merge(*DEVICE_KINDS)
        if self.trace.count(Kind.CPU_COMPUTE):
            return self._merge(Kind.CPU_COMPUTE)
        return None

    # ---------------------------------------------------------------- with a device

    def _on_device(self, busy: IntervalSet) -> list[Finding]:
        self._busy_set = busy
        a, b = self.window
        idle = IntervalSet.merge([(a, b)]).difference(busy)
        input_spans = self._matching(INPUT_OP, INPUT_PYTHON)
        input_idle = IntervalSet.merge(input_spans).intersection(idle)
        inferred = False
        if not len(input_spans) and not self.trace.has_stacks:
            input_idle, inferred = self._untraced_step_heads(busy, idle), True
        sync_events = self._sync_events()
        behind = IntervalSet.merge(self._gaps_behind(busy, sync_events))
        sync_idle = behind.intersection(idle).difference(input_idle)
        short_gaps = IntervalSet.merge(
            (s, e) for step in self.steps.steps for s, e in busy.gaps(step.start, step.end)
            if e - s <= SHORT_GAP_US and s > step.start and e < step.end)
        dispatching = self._merge_named((Kind.HOST_OP,), lambda name: bool(DISPATCH_OP.match(name)))
        dispatch_idle = dispatching.intersection(idle).difference(input_idle).difference(sync_idle)
        launch_idle = short_gaps.difference(input_idle).difference(sync_idle).union(dispatch_idle)
        other_idle = idle.difference(input_idle).difference(sync_idle).difference(launch_idle)
        comm = self._merge_named(DEVICE_KINDS, lambda name: bool(COLLECTIVE_KERNEL.search(name)))
        compute = busy.difference(comm) if len(comm) else busy
        exposed_comm = comm.difference(self._merge_named(
            DEVICE_KINDS, lambda name: not COLLECTIVE_KERNEL.search(name)))

        share = self._share
        if self.trace.has_device:
            self.breakdown = {"busy": share(busy), "compute": share(compute),
                              "communication": share(exposed_comm), "input": share(input_idle),
                              "host_sync": share(sync_idle), "launch_gaps": share(launch_idle),
                              "other_idle": share(other_idle)}
        else:  # XLA on the CPU: no kernels to launch, no collectives
            self.breakdown = {"busy": share(busy), "input": share(input_idle),
                              "dispatch": share(launch_idle), "other_idle": share(other_idle)}
        findings = []
        finding = self._input_finding(share(input_idle), input_idle, inferred)
        findings += [finding] if finding else []
        finding = self._sync_finding(sync_events, share(sync_idle), behind)
        findings += [finding] if finding else []
        finding = self._launch_finding(share(launch_idle), launch_idle, dispatching)
        findings += [finding] if finding else []
        finding = self._comm_finding(share(exposed_comm))
        findings += [finding] if finding else []
        finding = self._idle_finding(share(other_idle), other_idle)
        findings += [finding] if finding else []
        return findings

    def _untraced_step_heads(self, busy: IntervalSet, idle: IntervalSet) -> IntervalSet:
        """Without input markers or Python stacks: the idle time at the start of each step before its
        first computation, less the framework's own operations (dispatch, compilation). In a loop of
        ``batch = next(data); state = step(state, batch)`` that is the wait for ``next``."""
        host = self._merge(Kind.HOST_OP)
        heads = []
        for step in self.steps.steps:
            gaps = busy.gaps(step.start, step.end)
            if gaps and gaps[0][0] == step.start and gaps[0][1] < step.end:
                heads.append(gaps[0])
        return IntervalSet.merge(heads).difference(host).intersection(idle)

    # ---------------------------------------------------------------- without a device

    def _on_host(self) -> list[Finding]:
        self.limits.append("No device activity in the trace (a CPU run, or CUDA activity not recorded): "
                           "device idle time, kernel launches and communication cannot be measured; "
                           "synchronisation points are counted, not timed.")
        input_set = IntervalSet.merge(self._matching(INPUT_OP, INPUT_PYTHON))
        self.breakdown = {"input": self._share(input_set)}
        findings = []
        finding = self._input_finding(self._share(input_set), input_set, False)
        findings += [finding] if finding else []
        finding = self._sync_finding(self._sync_events(), None, IntervalSet.empty())
        findings += [finding] if finding else []
        return findings

    # ---------------------------------------------------------------- findings

    def _input_finding(self, share: float, waiting: IntervalSet, inferred: bool) -> Finding | None:
        severity = _severity(share)
        if severity is None:
            return None
        if inferred:
            evidence: tuple[Evidence, ...] = (Evidence(
                "host time before each step's first computation (no input markers or Python stacks in "
                "the trace: inferred)", self.n, round(self._covered(waiting) / 1e3, 3)),)
        else:
            evidence = self._evidence(self._indices(INPUT_OP, INPUT_PYTHON), waiting)
        where = ("the device waits" if self.trace.has_device
                 else "the compiled computation waits" if self._busy_kind() else "each step waits")
        return Finding("input_bound", severity, round(share, 4), None,
                       f"{_percent(share)} of the step time {where} for input"
                       f"{' (inferred)' if inferred else ''}", evidence, REMEDIES["input_bound"])

    def _sync_finding(self, events: list[tuple[float, float, str, int]], share: float | None,
                      behind: IntervalSet) -> Finding | None:
        if not events or not self.n:
            return None
        per_step = len(events) / self.n
        if share is None:
            if per_step < SYNCS_PER_STEP:
                return None
            severity: Severity = "moderate"
            summary = (f"{per_step:.1f} host-device synchronisation points per step (each stalls a GPU "
                       "until the host reads the value back; their cost cannot be timed on this trace)")
        else:
            found = _severity(share)
            if found is None:
                return None
            severity = found
            summary = (f"{per_step:.1f} host-device synchronisation points per step; the device idles "
                       f"behind them {_percent(share)} of the step time")
        counts: dict[str, list[tuple[float, float, int]]] = {}
        for start, end, name, track in events:
            counts.setdefault(name, []).append((start, end, track))
        evidence = []
        for name, spans in sorted(counts.items(), key=lambda kv: -len(kv[1]))[:MAX_EVIDENCE]:
            if len(behind):  # each gap once, however many synchronisations of this name ended in it
                gaps = set(self._gaps_behind(self._busy_set, [(a, b, name, t) for a, b, t in spans]))
                time = sum(behind.covered(*gap) for gap in gaps)
            else:
                time = sum(e - s for s, e, _ in spans)
            evidence.append(Evidence(name, len(spans), round(time / 1e3, 3), self._site_of(name, spans)))
        return Finding("host_sync", severity, round(share, 4) if share is not None else None,
                       round(per_step, 2), summary, tuple(evidence), REMEDIES["host_sync"])

    def _launch_finding(self, share: float, gaps: IntervalSet, dispatching: IntervalSet) -> Finding | None:
        severity = _severity(share)
        if severity is None:
            return None
        kernels = self.trace.spans[Kind.KERNEL]
        durations = [kernels.dur[i] for i in self._in_steps(Kind.KERNEL)]
        if not durations:  # a compiled computation on the CPU: the framework's dispatch around it
            dispatch = [(Kind.HOST_OP, i) for i in self._in_steps(Kind.HOST_OP)
                        if DISPATCH_OP.match(self.trace.names[self.trace.spans[Kind.HOST_OP].name[i]])]
            return Finding("launch_bound", severity, round(share, 4), None,
                           f"the computation waits {_percent(share)} of the step time while the framework "
                           f"dispatches it ({self._covered(gaps) / max(self.n, 1) / 1e3:.2f} ms per step)",
                           self._evidence(dispatch, gaps), REMEDIES["launch_bound"])
        median = statistics.median(durations)
        launches = [i for i in self._in_steps(Kind.RUNTIME)
                    if LAUNCH_RUNTIME.match(self.trace.names[self.trace.spans[Kind.RUNTIME].name[i]])]
        runtime = self.trace.spans[Kind.RUNTIME]
        launching = IntervalSet.merge((runtime.start[i], runtime.start[i] + runtime.dur[i]) for i in launches)
        launching = launching.union(dispatching)
        if median > SHORT_KERNEL_US and launching.intersection(gaps).total < 0.5 * gaps.total:
            return None  # the gaps are not the host launching short kernels
        per_step = len(durations) / self.n
        evidence = self._evidence(self._in_steps(Kind.KERNEL), None, kind=Kind.KERNEL, by_count=True)
        return Finding("launch_bound", severity, round(share, 4), round(per_step, 1),
                       f"{per_step:.0f} kernels per step with a median of {median:.1f} us; the device "
                       f"idles {_percent(share)} of the step time in gaps under {SHORT_GAP_US / 1e3:g} ms "
                       f"between them ({len(launches) / self.n:.0f} launch calls per step)",
                       evidence, REMEDIES["launch_bound"])

    def _comm_finding(self, share: float) -> Finding | None:
        severity = _severity(share)
        if severity is None:
            return None
        indices = [i for i in self._in_steps(Kind.KERNEL)
                   if COLLECTIVE_KERNEL.search(self.trace.names[self.trace.spans[Kind.KERNEL].name[i]])]
        return Finding("communication_wait", severity, round(share, 4), None,
                       f"collective communication runs with no computation beside it {_percent(share)} "
                       "of the step time", self._evidence(indices, None, kind=Kind.KERNEL),
                       REMEDIES["communication_wait"])

    def _idle_finding(self, share: float, idle: IntervalSet) -> Finding | None:
        severity = _severity(share)
        if severity is None:
            return None
        # What the host was doing meanwhile: its outermost operations and Python frames by overlap.
        overlap: dict[str, list[float]] = {}
        # A span longer than any step wraps the loop (``<module>``, a benchmark's outer annotation):
        # what ran inside it is the evidence, not the wrapper.
        longest = max(step.duration for step in self.steps.steps)
        for kind in (Kind.HOST_OP, Kind.PYTHON):
            spans = self.trace.spans[kind]
            open_until: dict[int, float] = {}
            for i in range(len(spans)):
                start, end = spans.start[i], spans.start[i] + spans.dur[i]
                if start < open_until.get(spans.track[i], float("-inf")) or (
                        spans.dur[i] > longest and self.n > 1) or spans.dur[i] >= 0.9 * self.time:
                    continue
                open_until[spans.track[i]] = end
                covered = idle.covered(start, end)
                if covered > 0:
                    entry = overlap.setdefault(self.trace.names[spans.name[i]], [0, 0.0])
                    entry[0] += 1
                    entry[1] += covered
        evidence = tuple(Evidence(name, int(count), round(time / 1e3, 3))
                         for name, (count, time) in sorted(overlap.items(), key=lambda kv: -kv[1][1])
                         [:MAX_EVIDENCE])
        return Finding("idle_between_steps", severity, round(share, 4), None,
                       f"the device idles {_percent(share)} of the step time with no input, "
                       "synchronisation or launch to explain it", evidence, REMEDIES["idle_between_steps"])

    # ---------------------------------------------------------------- helpers

    def _share(self, intervals: IntervalSet) -> float:
        return self._covered(intervals) / self.time if self.time else 0.0

    def _covered(self, intervals: IntervalSet) -> float:
        return intervals.covered(*self.window)

    def _busy_kind(self) -> bool:
        return self.trace.has_device or bool(self.trace.count(Kind.CPU_COMPUTE))

    def _merge(self, *kinds: Kind) -> IntervalSet:
        return IntervalSet.merge((s, s + d) for kind in kinds
                                 for s, d in zip(self.trace.spans[kind].start, self.trace.spans[kind].dur,
                                                 strict=True))

    def _merge_named(self, kinds: Iterable[Kind], keep: Callable[[str], bool]) -> IntervalSet:
        names = self.trace.names
        wanted = [keep(name) for name in names]
        return IntervalSet.merge((spans.start[i], spans.start[i] + spans.dur[i])
                                 for spans in (self.trace.spans[k] for k in kinds)
                                 for i in range(len(spans)) if wanted[spans.name[i]])

    def _indices(self, op_pattern: Any, python_pattern: Any) -> list[tuple[Kind, int]]:
        out = []
        for kind, pattern in ((Kind.HOST_OP, op_pattern), (Kind.PYTHON, python_pattern)):
            names = self.trace.names
            matching = {i for i, name in enumerate(names) if pattern.search(name)}
            if not matching:
                continue
            spans = self.trace.spans[kind]
            out += [(kind, i) for i in range(len(spans)) if spans.name[i] in matching]
        return out

    def _matching(self, op_pattern: Any, python_pattern: Any) -> list[tuple[float, float]]:
        return [(self.trace.spans[k].start[i], self.trace.spans[k].start[i] + self.trace.spans[k].dur[i])
                for k, i in self._indices(op_pattern, python_pattern)]

    def _in_steps(self, kind: Kind) -> list[int]:
        spans = self.trace.spans[kind]
        a, b = self.window
        return [i for i in range(len(spans)) if a <= spans.start[i] < b]

    def _gaps_behind(self, busy: IntervalSet,
                     events: list[tuple[float, float, str, int]]) -> list[tuple[float, float]]:
        """The device gaps the synchronisations caused: a gap that began while the host waited in one
        (the device drained during it) and lasted until the host launched again. A gap that began
        before (the device was already idle) is not the synchronisation's doing."""
        gaps = []
        for start, end, _, _ in events:
            gap = busy.gap_around(end)
            if gap is not None and gap[0] >= start:
                gaps.append(gap)
        return gaps

    def _sync_events(self) -> list[tuple[float, float, str, int]]:
        """(start, end, name, track) of each synchronisation in the steps: the operations that wait for
        the device, and the CUDA calls that do outside them (torch.cuda.synchronize()). With device
        activity in the trace, an operation counts only when it called the CUDA runtime (a copy or a
        synchronisation): ``.item()`` of a tensor on the CPU does not wait for the device."""
        names = self.trace.names
        ops, runtime = self.trace.spans[Kind.HOST_OP], self.trace.spans[Kind.RUNTIME]
        events = [(ops.start[i], ops.start[i] + ops.dur[i], names[ops.name[i]], ops.track[i])
                  for i in self._in_steps(Kind.HOST_OP) if names[ops.name[i]] in SYNC_OPS]
        if self.trace.has_device:
            events = [e for e in events if self._calls_runtime(*e)]
        inside = IntervalSet.merge((s, e) for s, e, _, _ in events)
        for i in self._in_steps(Kind.RUNTIME):
            name = names[runtime.name[i]]
            start, end = runtime.start[i], runtime.start[i] + runtime.dur[i]
            if SYNC_RUNTIME.match(name) and inside.covered(start, end) < 0.5 * (end - start):
                events.append((start, end, name, runtime.track[i]))
        return events

    def _calls_runtime(self, start: float, end: float, _: str, track: int) -> bool:
        runtime = self.trace.spans[Kind.RUNTIME]
        i = bisect_right(runtime.start, start)
        while i < len(runtime) and runtime.start[i] < end:
            if runtime.track[i] == track:
                return True
            i += 1
        return False

    def _evidence(self, indices: Iterable[Any], weight: IntervalSet | None, *, kind: Kind | None = None,
                  by_count: bool = False) -> tuple[Evidence, ...]:
        """The names of these events with their counts and time (or time within ``weight``), largest
        first, with a call site each."""
        totals: dict[str, list[Any]] = {}
        a, b = self.window
        for item in indices:
            k, i = (kind, item) if kind is not None else item
            spans = self.trace.spans[k]
            start, end = spans.start[i], spans.start[i] + spans.dur[i]
            if not a <= start < b:
                continue
            entry = totals.setdefault(self.trace.names[spans.name[i]], [0, 0.0, []])
            entry[0] += 1
            entry[1] += weight.covered(start, end) if weight is not None else end - start
            if len(entry[2]) < _SITE_SAMPLES:
                entry[2].append((start, end, spans.track[i]))
        ranked = sorted(totals.items(), key=lambda kv: -(kv[1][0] if by_count else kv[1][1]))[:MAX_EVIDENCE]
        return tuple(Evidence(name, count, round(time / 1e3, 3), self._site_of(name, samples))
                     for name, (count, time, samples) in ranked)

    def _site_of(self, name: str, samples: list[tuple[float, float, int]]) -> str:
        """The most frequent innermost Python frame outside library code that encloses these events."""
        python = self.trace.spans[Kind.PYTHON]
        if not len(python):
            return ""
        sites: dict[str, int] = {}
        for start, end, track in samples[:_SITE_SAMPLES]:
            site = self._caller(name, start, end, track) or self._callee(name, start, end, track)
            if site:
                sites[site] = sites.get(site, 0) + 1
        return max(sites, key=sites.__getitem__) if sites else ""

    def _caller(self, name: str, start: float, end: float, track: int) -> str:
        """The innermost user frame around the event."""
        python, names = self.trace.spans[Kind.PYTHON], self.trace.names
        i = bisect_right(python.start, start)
        for j in range(i - 1, max(i - 1 - _SITE_SCAN, -1), -1):
            if python.track[j] != track or python.start[j] + python.dur[j] < end:
                continue
            frame = names[python.name[j]]
            if frame != name and not LIBRARY_FRAME.search(frame):
                return frame
        return ""

    def _callee(self, name: str, start: float, end: float, track: int) -> str:
        """The outermost user frame inside the event (a capture that began inside the caller records
        no caller): "calls gen.py:4 batches" for a ``next`` on a generator."""
        python, names = self.trace.spans[Kind.PYTHON], self.trace.names
        first = max(bisect_right(python.start, start) - 1, 0)
        for j in range(first, min(first + _SITE_SCAN, len(python))):
            if python.start[j] >= end:
                break
            if python.track[j] != track or python.start[j] < start or python.start[j] + python.dur[j] > end:
                continue
            frame = names[python.name[j]]
            if frame != name and not LIBRARY_FRAME.search(frame):
                return f"calls {frame}"
        return ""


def _severity(share: float) -> Severity | None:
    if share >= HIGH:
        return "high"
    if share >= MODERATE:
        return "moderate"
    return None


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%"


__all__ = ["FINDING_KINDS", "HIGH", "MODERATE", "Diagnosis", "Evidence", "Finding", "Step", "diagnose"]
