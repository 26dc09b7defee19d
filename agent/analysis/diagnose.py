"""A trace's steps, and the findings that say where their time went.

Every share is of the measured steps' wall time (from the first whole step's start to the last one's
end). The checklist is read in an expert's order: first, is the device idle, and why; then, what is
it busy with (``busy_findings``).

Device idle time within the steps is attributed once, in this order: waiting for input, behind a
host-device synchronisation, in short gaps between kernels (launch overhead) or under the framework's
dispatch, while the thread that dispatches the steps runs no traced operation (host-bound: untraced
Python), anything else (idle between steps). Exposed communication (collective kernels with no
computation beside them) is device time, counted apart. The thresholds of each finding are in
``findings``: nothing is reported below them, so a healthy trace gets no finding, and its report
lists what was checked.

On a trace without device activity (a CPU run) only what the host shows is measured: the time spent
waiting for input, and host-device synchronisation points counted per step.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gpuscope.analysis.busy_findings import BusyContext, busy_findings
from gpuscope.analysis.coverage import Coverage, coverage
from gpuscope.analysis.device_profile import Launches, device_profile
from gpuscope.analysis.evidence import MAX_EVIDENCE, EvidenceFinder
from gpuscope.analysis.findings import (
    BOUNDS,
    FINDING_KINDS,
    HEALTHY,
    IDLE_BOUNDS,
    INCONCLUSIVE,
    SEVERITIES,
    SYNCS_PER_STEP,
    UNREADABLE,
    Check,
    Evidence,
    Finding,
    Severity,
    percent,
    rank,
    verdict_of,
)
from gpuscope.analysis.host_waits import host_caused_gaps, outermost, sync_events_in
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import DEVICE_KINDS, Kind, Trace
from gpuscope.analysis.patterns import (
    COLLECTIVE_KERNEL,
    DISPATCH_OP,
    INPUT_OP,
    INPUT_PYTHON,
    LAUNCH_RUNTIME,
)
from gpuscope.analysis.remedies import remedy_for
from gpuscope.analysis.steps import Step, Steps, find_steps

HIGH = IDLE_BOUNDS.high
MODERATE = IDLE_BOUNDS.moderate
SHORT_GAP_US = 1000.0  # a device gap this short between two kernels is launch overhead, not a stall
SHORT_KERNEL_US = 50.0
STEP_NUMBER = re.compile(r"#\d+$")


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
    checks: tuple[Check, ...] = field(default_factory=tuple)  # the checklist as measured
    device_profile: dict[str, Any] | None = None  # what the device was busy with (DeviceProfile.to_json)
    unreadable: str = ""  # why nothing could be diagnosed; "" when the trace was read
    partial: tuple[str, ...] = ()  # what the trace misses that a verdict rests on
    conclusive: bool = True  # without a finding, the trace shows enough to call it healthy

    @property
    def verdict(self) -> str:
        """The first finding that holds the step back; ``healthy`` when none does and the trace shows
        enough to say so, ``inconclusive`` when it does not, ``unreadable`` when nothing was read."""
        if self.unreadable:
            return UNREADABLE
        found = verdict_of(self.findings)
        return INCONCLUSIVE if found == HEALTHY and not self.conclusive else found

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        data["checks"] = [{**asdict(check), "passed": check.passed} for check in self.checks]
        return data


def diagnose(trace: Trace) -> Diagnosis:
    """The diagnosis of a trace, its GPUs' activity taken together (see ``diagnose_devices``)."""
    steps = find_steps(trace)
    return _Analysis(trace, steps).run()


def diagnose_devices(trace: Trace) -> list[Diagnosis]:
    """One diagnosis per GPU with activity in the trace (a process that drives several GPUs: one
    GPU's work does not fill another's idle time), or one for a trace of one GPU or none."""
    active = trace.active_devices
    if len(active) < 2:
        return [diagnose(trace)]
    steps = find_steps(trace)
    return [_Analysis(trace.of_device(gpu), steps).run() for gpu in active]


class _Analysis:
    def __init__(self, trace: Trace, steps: Steps) -> None:
        self.trace = trace
        self.steps = steps
        self.window = (steps.steps[0].start, steps.steps[-1].end) if steps.steps else (0.0, 0.0)
        self.time = max(self.window[1] - self.window[0], 0.0)
        self.n = len(steps.steps)
        self.limits: list[str] = []
        self.breakdown: dict[str, float] = {}
        self.checks: list[Check] = []
        self.profile: dict[str, Any] | None = None
        self.evidence = EvidenceFinder(trace, self.window)
        self._busy_set = IntervalSet.empty()
        self.conclusive = True

    # ---------------------------------------------------------------- the whole

    def run(self) -> Diagnosis:
        trace = self.trace
        seen = coverage(trace, self.window, self.n)
        if not seen.readable:
            return self._unreadable(seen)
        busy = self._busy()
        findings = self._on_device(busy) if busy is not None else self._on_host()
        if seen.partial:
            # What was seen holds, but not as the whole story: no finding is severe on part of a trace.
            findings = [replace(f, severity=seen.cap)
                        if SEVERITIES.index(f.severity) < SEVERITIES.index(seen.cap) else f for f in findings]
            self.limits.extend(seen.partial)
            self.conclusive = False
        if self.steps.method == "whole":
            self.limits.append("No repeating step found: the whole trace is analysed as one step.")
            self._note_start_up()
        elif self.steps.method != "markers":
            self.limits.append(f"Steps inferred from {self.steps.marker!r} ({self.steps.method}): the "
                               "framework marked none.")
        if not trace.has_stacks:
            self.limits.append("No Python stacks in the trace: call sites are not shown (torch.profiler "
                               "with_stack=True; python_tracer_level=1 for TensorFlow and JAX).")
        findings.sort(key=rank)
        order = {kind: i for i, kind in enumerate(FINDING_KINDS)}
        return Diagnosis(
            source=trace.source, format=trace.format, framework=trace.framework, device=trace.has_device,
            events=trace.events_read, steps=self.n, step_method=self.steps.method,
            step_marker=self.steps.marker, mean_step_ms=round(self.steps.time / max(self.n, 1) / 1e3, 3),
            breakdown={k: round(v, 4) for k, v in self.breakdown.items()}, findings=tuple(findings),
            limits=tuple(self.limits), checks=tuple(sorted(self.checks, key=lambda c: order[c.kind])),
            device_profile=self.profile, partial=seen.partial, conclusive=self.conclusive)

    def _unreadable(self, seen: Coverage) -> Diagnosis:
        trace = self.trace
        return Diagnosis(
            source=trace.source, format=trace.format, framework=trace.framework, device=trace.has_device,
            events=trace.events_read, steps=0, step_method=self.steps.method, step_marker="",
            mean_step_ms=0.0, breakdown={}, findings=(), limits=(seen.unreadable,),
            unreadable=seen.unreadable, conclusive=False)

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
        input_idle = IntervalSet.merge(self._matching(INPUT_OP, INPUT_PYTHON)).intersection(idle)
        sync_events = sync_events_in(self.trace, self._in_steps)
        behind = IntervalSet.merge(self._gaps_behind(busy, sync_events))
        sync_idle = behind.intersection(idle).difference(input_idle)
        gaps = [(s, e) for step in self.steps.steps for s, e in busy.gaps(step.start, step.end)
                if e - s <= SHORT_GAP_US and s > step.start and e < step.end]
        # A gap is the launches' when the host was behind: the next kernel's launch call returned after
        # the device ran out of work. A bubble between kernels already queued is the device's own.
        launches = Launches(self.trace, self.window)
        host_gaps, queued = host_caused_gaps(self.trace, launches, gaps)
        short_gaps = IntervalSet.merge(host_gaps)
        queued_gaps = IntervalSet.merge(queued)
        dispatching = self._merge_named((Kind.HOST_OP,), lambda name: bool(DISPATCH_OP.match(name)))
        dispatch_idle = dispatching.intersection(idle).difference(input_idle).difference(sync_idle)
        launch_idle = short_gaps.difference(input_idle).difference(sync_idle).union(dispatch_idle)
        track = self._dispatch_track()
        untraced = self._untraced(track)
        host_idle = untraced.intersection(idle).difference(input_idle).difference(sync_idle).difference(
            launch_idle)
        rest = idle.difference(input_idle).difference(sync_idle).difference(launch_idle).difference(
            host_idle).difference(queued_gaps)
        # What is left is between steps where the device's idle gap spans a step's start; inside a step,
        # idle time while the step's threads run traced operations is the host's (it is slower than the
        # device), and the rest has no cause the trace shows.
        edges = sorted({edge for step in self.steps.steps for edge in (step.start, step.end)})
        between = IntervalSet.merge(gap for gap in idle
                                    if bisect_left(edges, gap[0]) < len(edges)
                                    and edges[bisect_left(edges, gap[0])] <= gap[1])
        other_idle = rest.intersection(between)
        # Inside a step, as between kernels: the host's only when the next work was launched after the
        # device ran out of it; with it queued, the device waits on a dependency (another stream, an
        # event, a peer's collective), whatever the host is doing meanwhile.
        host_inside, queued_inside = host_caused_gaps(self.trace, launches,
                                                       list(rest.difference(between)))
        queued_gaps = queued_gaps.union(IntervalSet.merge(queued_inside))
        inside = IntervalSet.merge(host_inside)
        host_busy = inside.intersection(self._thread_time(track, (Kind.HOST_OP, Kind.PYTHON)))
        # Nothing but launch calls open on the host: the launches are what the device waits for.
        launch_idle = launch_idle.union(inside.difference(host_busy).intersection(
            self._thread_time(track, (Kind.RUNTIME,))))
        unexplained = inside.difference(host_busy).difference(launch_idle)
        comm = self._merge_named(DEVICE_KINDS, lambda name: bool(COLLECTIVE_KERNEL.search(name)))
        compute = busy.difference(comm) if len(comm) else busy
        exposed_comm = comm.difference(self._merge_named(
            DEVICE_KINDS, lambda name: not COLLECTIVE_KERNEL.search(name)))

        share = self._share
        if self.trace.has_device:
            self.breakdown = {"busy": share(busy), "compute": share(compute),
                              "communication": share(exposed_comm), "input": share(input_idle),
                              "host_sync": share(sync_idle), "launch_gaps": share(launch_idle),
                              "host_untraced": share(host_idle), "host_busy": share(host_busy),
                              "queued_gaps": share(queued_gaps), "between_steps": share(other_idle),
                              "other_idle": share(unexplained)}
        else:  # XLA on the CPU: no kernels to launch, no collectives
            self.breakdown = {"busy": share(busy), "input": share(input_idle),
                              "dispatch": share(launch_idle), "host_untraced": share(host_idle),
                              "host_busy": share(host_busy), "between_steps": share(other_idle),
                              "other_idle": share(unexplained)}
        found = [
            self._input_finding(share(input_idle), input_idle),
            self._host_bound_finding(host_idle, host_busy, track, busy),
            self._sync_finding(sync_events, share(sync_idle), behind),
            self._launch_finding(share(launch_idle), launch_idle, dispatching),
            self._comm_finding(share(exposed_comm)) if self.trace.has_device else None,
            self._idle_finding(share(other_idle), other_idle),
        ]
        if share(queued_gaps) >= MODERATE:
            self.limits.append(f"The device idles {percent(share(queued_gaps))} of the step time with its "
                               "next work already queued: it waits on a dependency (another stream, an "
                               "event, a collective's peers), not on this host.")
            self.conclusive = False
        if share(unexplained) >= MODERATE:
            self.limits.append(f"The device idles {percent(share(unexplained))} of the step time inside the "
                               "steps with no cause the trace shows (no input, synchronisation, launch or "
                               "host work beside it): another stream, process or rank it waits for.")
            self.conclusive = False
        for kind, value in (("input_bound", share(input_idle)),
                            ("host_bound", share(host_idle) + share(host_busy)),
                            ("launch_bound", share(launch_idle)),
                            ("communication_wait", share(exposed_comm)),
                            ("idle_between_steps", share(other_idle))):
            if kind != "communication_wait" or self.trace.has_device:
                self.checks.append(Check(kind, round(value, 4), BOUNDS[kind].moderate))
        findings = [f for f in found if f is not None]
        if self.trace.has_device:
            findings += self._busy_with_what(share(busy))
        return findings

    def _busy_with_what(self, busy_share: float) -> list[Finding]:
        profile = device_profile(self.trace, self.window)
        if profile is None:
            return []
        self.profile = profile.to_json()
        findings, checks = busy_findings(BusyContext(profile, self.n, self.time, busy_share,
                                                     self.trace.compute_capability, self.trace.framework))
        self.checks += checks
        return findings

    def _dispatch_track(self) -> int:
        """The thread that dispatches the steps: the one whose events mark them, or else the one that
        launches the most kernels; -1 when the trace shows none."""
        if self.steps.track >= 0:
            return self.steps.track
        runtime, names = self.trace.spans[Kind.RUNTIME], self.trace.names
        launches: dict[int, int] = {}
        for i in range(len(runtime)):
            if LAUNCH_RUNTIME.match(names[runtime.name[i]]):
                launches[runtime.track[i]] = launches.get(runtime.track[i], 0) + 1
        return max(launches, key=launches.__getitem__) if launches else -1

    def _untraced(self, track: int) -> IntervalSet:
        """The steps' time in which no thread that drives the device runs a traced event: the thread
        that dispatches the steps and every thread that launches kernels (PyTorch's backward runs on
        the autograd engine's thread while the main one waits in untraced code), none with an
        operation, Python function or runtime call open. A span longer than any step wraps the loop
        (``<module>``, an outer annotation) and says nothing of what runs inside."""
        if track < 0:
            return IntervalSet.empty()
        return IntervalSet.merge([self.window]).difference(
            self._thread_time(track, (Kind.HOST_OP, Kind.PYTHON, Kind.RUNTIME)))

    def _thread_time(self, track: int, kinds: tuple[Kind, ...]) -> IntervalSet:
        """The time in which a thread that drives the device has an event of these kinds open."""
        if track < 0:
            return IntervalSet.empty()
        tracks = {track} | self._launching_tracks()
        longest = max(step.duration for step in self.steps.steps)
        wrapper = longest if self.n > 1 else float("inf")
        limit = min(wrapper, 0.9 * self.time)
        covered = IntervalSet.empty()
        for kind in kinds:
            spans = self.trace.spans[kind]
            covered = covered.union(IntervalSet.from_sorted(
                (spans.start[i], spans.start[i] + spans.dur[i]) for i in range(len(spans))
                if spans.track[i] in tracks and spans.dur[i] < limit))
        return covered

    def _launching_tracks(self) -> set[int]:
        """The threads that launch kernels within the steps."""
        runtime, names = self.trace.spans[Kind.RUNTIME], self.trace.names
        launch = {i for i, name in enumerate(names) if LAUNCH_RUNTIME.match(name)}
        a, b = self.window
        return {runtime.track[i] for i in range(bisect_left(runtime.start, a), bisect_left(runtime.start, b))
                if runtime.name[i] in launch}

    # ---------------------------------------------------------------- without a device

    def _on_host(self) -> list[Finding]:
        self.limits.append("No device activity in the trace (a CPU run, or CUDA activity not recorded): "
                           "device idle time, kernel launches and communication cannot be measured; "
                           "synchronisation points are counted, not timed.")
        input_set = IntervalSet.merge(self._matching(INPUT_OP, INPUT_PYTHON))
        self.breakdown = {"input": self._share(input_set)}
        self.checks.append(Check("input_bound", round(self._share(input_set), 4),
                                 BOUNDS["input_bound"].moderate))
        sync_events = sync_events_in(self.trace, self._in_steps)
        self.checks.append(Check("host_sync", round(len(sync_events) / max(self.n, 1), 2), SYNCS_PER_STEP,
                                 unit="per_step"))
        found = [self._input_finding(self._share(input_set), input_set),
                 self._sync_finding(sync_events, None, IntervalSet.empty())]
        return [f for f in found if f is not None]

    # ---------------------------------------------------------------- findings

    def _input_finding(self, share: float, waiting: IntervalSet) -> Finding | None:
        severity = BOUNDS["input_bound"].severity(share)
        if severity is None:
            return None
        evidence = self.evidence.rows(self._indices(INPUT_OP, INPUT_PYTHON), waiting)
        where = ("the device waits" if self.trace.has_device
                 else "the compiled computation waits" if self._busy_kind() else "each step waits")
        return Finding("input_bound", severity, round(share, 4), None,
                       f"{percent(share)} of the step time {where} for input", evidence,
                       self._remedy("input_bound"))

    def _host_bound_finding(self, untraced_idle: IntervalSet, host_busy: IntervalSet, track: int,
                            busy: IntervalSet) -> Finding | None:
        share = self._share(untraced_idle) + self._share(host_busy)
        severity = BOUNDS["host_bound"].severity(share)
        if severity is None:
            return None
        if self._share(host_busy) > self._share(untraced_idle):
            return Finding(
                "host_bound", severity, round(share, 4), None,
                f"the device idles {percent(share)} of the step time inside the steps while the host runs "
                "the steps' own operations: the host takes longer to issue the work than the device takes "
                "to run it", self._host_overlap(host_busy.union(untraced_idle)), self._remedy("host_work"))
        n = max(self.n, 1)
        step_ms = self.time / n / 1e3
        untraced_ms = self._covered(untraced_idle) / n / 1e3
        busy_ms = self._covered(busy) / n / 1e3
        thread = self.trace.tracks[track]
        device = "device" if self.trace.has_device else "compiled computation"
        # The steps' own markers are numbered (ProfilerStep#12): the evidence names them without it.
        marker = STEP_NUMBER.sub("", self.steps.marker) or "the steps"
        what = "runs" if self.steps.method == "markers" else "dispatches"
        summary = (f"the {device} idles {percent(share)} of the step time while the thread that {what} "
                   f"{marker} (every {step_ms:.1f} ms) runs no traced operation: {untraced_ms:.1f} ms "
                   f"of untraced host time per step against {busy_ms:.1f} ms of {device} work per step. "
                   "This is Python the profiler does not trace; in a step(next(batches)) loop, the input "
                   "pipeline")
        kernels = sum(1 for kind in DEVICE_KINDS for s in self.trace.spans[kind].start
                      if self.window[0] <= s < self.window[1])
        evidence = [Evidence(f"no traced operation on {thread}", self.n, round(untraced_ms * n, 3),
                             detail=f"{untraced_ms:.1f} ms per step with the {device} idle")]
        if self.steps.marker:
            evidence.insert(0, Evidence(marker, self.n, round(self._marker_ms(), 3),
                                        detail=f"{what} a step every {step_ms:.1f} ms"))
        evidence.append(Evidence(f"{device} work", kernels or self.n, round(busy_ms * n, 3),
                                 detail=f"{busy_ms:.1f} ms per step"))
        return Finding("host_bound", severity, round(share, 4), None, summary, tuple(evidence),
                       self._remedy("host_bound"))

    def _marker_ms(self) -> float:
        """The time in the steps' marking events: the steps themselves, or the dispatch operation."""
        if self.steps.method == "markers":
            return self.steps.time / 1e3
        ops, names = self.trace.spans[Kind.HOST_OP], self.trace.names
        a, b = self.window
        return sum(ops.dur[i] for i in range(bisect_left(ops.start, a), bisect_left(ops.start, b))
                   if names[ops.name[i]] == self.steps.marker) / 1e3

    def _sync_finding(self, events: list[tuple[float, float, str, int]], share: float | None,
                      behind: IntervalSet) -> Finding | None:
        per_step = len(events) / max(self.n, 1)
        if share is not None:
            self.checks.append(Check("host_sync", round(per_step, 2), SYNCS_PER_STEP, unit="per_step",
                                     note=f"device idle behind them {percent(share)}"))
        if not events or not self.n:
            return None
        severity: Severity | None
        if share is None:
            if per_step < SYNCS_PER_STEP:
                return None
            severity = "moderate"
            summary = (f"{per_step:.1f} host-device synchronisation points per step (each stalls a GPU "
                       "until the host reads the value back; their cost cannot be timed on this trace)")
        elif (severity := BOUNDS["host_sync"].severity(share)) is not None:
            summary = (f"{per_step:.1f} host-device synchronisation points per step; the device idles "
                       f"behind them {percent(share)} of the step time")
        elif per_step >= SYNCS_PER_STEP and (blocked := self._share(IntervalSet.merge(
                (s, e) for s, e, _, _ in events))) >= BOUNDS["host_sync"].moderate:
            # The device stays busy: the work queued before each sync outlasts the host's wait. The host
            # cannot run ahead of the device, though: any hiccup on the host becomes device idle time.
            severity = "low"
            summary = (f"{per_step:.1f} host-device synchronisation points per step; the device stays busy "
                       f"through them, but the host is blocked in them {percent(blocked)} of the step time "
                       "and cannot run ahead: any delay on the host becomes device idle time")
        else:
            return None
        counts: dict[str, list[tuple[float, float, int]]] = {}
        for start, end, name, track in events:
            counts.setdefault(name, []).append((start, end, track))
        evidence = []
        for name, spans in sorted(counts.items(), key=lambda kv: -len(kv[1]))[:MAX_EVIDENCE]:
            if len(behind) and severity != "low":  # each gap once, however many of this name ended in it
                gaps = set(self._gaps_behind(self._busy_set, [(a, b, name, t) for a, b, t in spans]))
                time = sum(behind.covered(*gap) for gap in gaps)
            else:
                time = sum(e - s for s, e, _ in spans)
            evidence.append(Evidence(name, len(spans), round(time / 1e3, 3),
                                     self.evidence.site_of(name, spans)))
        return Finding("host_sync", severity, round(share, 4) if share is not None else None,
                       round(per_step, 2), summary, tuple(evidence), self._remedy("host_sync"))

    def _launch_finding(self, share: float, gaps: IntervalSet, dispatching: IntervalSet) -> Finding | None:
        severity = BOUNDS["launch_bound"].severity(share)
        if severity is None:
            return None
        kernels = self.trace.spans[Kind.KERNEL]
        durations = [kernels.dur[i] for i in self._in_steps(Kind.KERNEL)]
        if not durations:  # a compiled computation on the CPU: the framework's dispatch around it
            dispatch = [(Kind.HOST_OP, i) for i in self._in_steps(Kind.HOST_OP)
                        if DISPATCH_OP.match(self.trace.names[self.trace.spans[Kind.HOST_OP].name[i]])]
            return Finding("launch_bound", severity, round(share, 4), None,
                           f"the computation waits {percent(share)} of the step time while the framework "
                           f"dispatches it ({self._covered(gaps) / max(self.n, 1) / 1e3:.2f} ms per step)",
                           self.evidence.rows(dispatch, gaps), self._remedy("launch_bound"))
        median = statistics.median(durations)
        launches = [i for i in self._in_steps(Kind.RUNTIME)
                    if LAUNCH_RUNTIME.match(self.trace.names[self.trace.spans[Kind.RUNTIME].name[i]])]
        runtime = self.trace.spans[Kind.RUNTIME]
        launching = IntervalSet.merge((runtime.start[i], runtime.start[i] + runtime.dur[i]) for i in launches)
        launching = launching.union(dispatching)
        if median > SHORT_KERNEL_US and launching.intersection(gaps).total < 0.5 * gaps.total:
            return None  # the gaps are not the host launching short kernels
        per_step = len(durations) / self.n
        evidence = self.evidence.rows(self._in_steps(Kind.KERNEL), None, kind=Kind.KERNEL, by_count=True)
        return Finding("launch_bound", severity, round(share, 4), round(per_step, 1),
                       f"{per_step:.0f} kernels per step with a median of {median:.1f} us; the device "
                       f"idles {percent(share)} of the step time in gaps under {SHORT_GAP_US / 1e3:g} ms "
                       f"between them ({len(launches) / self.n:.0f} launch calls per step)",
                       evidence, self._remedy("launch_bound"))

    def _comm_finding(self, share: float) -> Finding | None:
        severity = BOUNDS["communication_wait"].severity(share)
        if severity is None:
            return None
        indices = [i for i in self._in_steps(Kind.KERNEL)
                   if COLLECTIVE_KERNEL.search(self.trace.names[self.trace.spans[Kind.KERNEL].name[i]])]
        return Finding("communication_wait", severity, round(share, 4), None,
                       f"collective communication runs with no computation beside it {percent(share)} "
                       "of the step time", self.evidence.rows(indices, None, kind=Kind.KERNEL),
                       self._remedy("communication_wait"))

    def _idle_finding(self, share: float, idle: IntervalSet) -> Finding | None:
        severity = BOUNDS["idle_between_steps"].severity(share)
        if severity is None:
            return None
        if self.n < 2:
            # One step has no "between": its idle time with no cause found is first-call overhead,
            # compilation, or work the profiler did not trace; nothing to call healthy either.
            self.limits.append(f"The device idles {percent(share)} of the only step with no cause found "
                               "(start-up or first-call overhead, compilation, untraced work): capture "
                               "several steps to tell.")
            self.conclusive = False
            return None
        return Finding("idle_between_steps", severity, round(share, 4), None,
                       f"the device idles {percent(share)} of the step time between steps while the host "
                       "runs traced work that is not input, synchronisation or launch",
                       self._host_overlap(idle),
                       self._remedy("idle_between_steps"))

    def _host_overlap(self, idle: IntervalSet) -> tuple[Evidence, ...]:
        """What the host was doing while the device idled. A span longer than any step wraps the loop
        (``<module>``, a benchmark's outer annotation): what ran inside it is the evidence."""
        longest = max(step.duration for step in self.steps.steps)
        return self.evidence.host_overlap(idle, min(longest if self.n > 1 else float("inf"),
                                                    0.9 * self.time))

    # ---------------------------------------------------------------- helpers

    def _remedy(self, kind: str) -> str:
        """The remedy for the framework that wrote the trace and the GPU it ran on."""
        return remedy_for(kind, framework=self.trace.framework, capability=self.trace.compute_capability)

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
        # A wait shows as nested frames (enumerate(DataLoader) > __next__ > _next_data > ...): each
        # counts once, as its outermost frame.
        return outermost(self.trace, out)

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


__all__ = ["FINDING_KINDS", "HIGH", "MODERATE", "Diagnosis", "Evidence", "Finding", "Step", "diagnose",
           "diagnose_devices"]
