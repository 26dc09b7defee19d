"""The fixes a finding proposes, as changes to a trace's dependency graph, and what replaying them
predicts: the step time before and after, and the share of it won back.

Each fix returns a changed copy of the graph and adds what it assumes to ``graph.assumptions``
(``Assumption``: the fix's name and the text), so that a report can say on what its estimate rests.
"""

from __future__ import annotations

import re
import statistics
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuscope.analysis.device_profile import OutermostOperators
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.kernel_taxonomy import LOG_SOFTMAX, classify_name, without_parameters
from gpuscope.analysis.model import Kind, Trace
from gpuscope.analysis.patterns import INPUT_OP, INPUT_PYTHON
from gpuscope.analysis.replay import replay, step_time
from gpuscope.analysis.replay_graph import (
    DEFAULT_LAUNCH_LATENCY_US,
    DEVICE,
    EPSILON_US,
    HOST,
    SYNC,
    Assumption,
    StepGraph,
    build_graph,
)
from gpuscope.analysis.tensor_core_speedups import speedup_for

Fix = Callable[[StepGraph], StepGraph]
NEVER = float("-inf")
MEMORY_BOUND = frozenset({"softmax", "elementwise", "reduction"})  # the kernel classes fusion merges
BACKWARD_FUNCTION = re.compile(r"evaluate_function: (\w+?)Backward\d*$")
# A kernel that starts this long (beyond the typical gap between queued kernels) after a collective
# ended, and no sooner than its stream and launch let it, waited for that collective.
WAIT_SLACK_US = 5.0


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


def prefetch_input(graph: StepGraph, workers: int = 1, pattern: re.Pattern[str] = INPUT_OP,
                   python: re.Pattern[str] = INPUT_PYTHON) -> StepGraph:
    """input_bound: the input wait (``DataLoader.__next__``, ``IteratorGetNext``, a pipeline's
    ``preprocess`` ...: the operations ``pattern`` names and the Python frames ``python`` names, as the
    diagnosis measures the wait) leaves the step's thread: ``workers`` background loaders prepare the
    next batches while the device runs this one. Its time is taken out of the host work between the
    calls it lies in, and the step is no shorter than the loaders' time per step (each as fast as the
    step's thread was, in parallel)."""
    if workers < 1:
        raise ValueError(f"prefetch_input: workers must be >= 1, not {workers}")
    spans = _host_spans(graph.trace, lambda name: pattern.search(name) is not None,
                        python=lambda name: python.search(name) is not None)
    fixed = _shorten_host_work(graph, spans, "input_bound", f"the input wait runs in {workers} background "
                               "loader(s) that prefetch")
    steps = graph.steps.steps
    if steps:
        per_step = sum(s.covered(steps[0].start, steps[-1].end) for s in spans.values()) / len(steps)
        fixed.floor_us = max(fixed.floor_us, per_step / workers)
        fixed.assume("input_bound", f"the loaders need {per_step / 1e3:.1f} ms a step, "
                     f"{per_step / workers / 1e3:.1f} ms with {workers}; the step is no shorter than that")
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
    """The device work launched by operation ``op`` (the outermost operator open when its launch was
    called, as the device profile names it) takes ``factor`` times its time (0: removed). The host's
    launches of it stay."""
    if factor < 0:
        raise ValueError(f"scale_op: factor must be >= 0, not {factor}")
    fixed = graph.copy()
    scaled = 0
    before = 0.0
    for nodes in op_calls(graph, {op}).values():
        for i in nodes:
            before += fixed.dur[i]
            fixed.dur[i] *= factor
            scaled += 1
    fixed.assume(
        "costly_op", f"{scaled} kernels of {op} ({before / 1e3:.1f} ms) take {factor:g}x their time; "
        "their launches and the host's time stay")
    return fixed


class NotModelled(Exception):
    """A fix the replay cannot model on this trace; the message says why, in a report's words."""


def replace_with_dense(graph: StepGraph, op: str) -> StepGraph:
    """costly_op: each call of the data-dependent operation ``op``, and of its autograd counterpart
    (``aten::index`` for ``IndexBackward0`` and the reverse), becomes one elementwise pass over the
    same tensor, as its dense formulation does (``torch.where``, a multiplication by the mask: it reads
    the tensor and the mask and writes the result once). A pass is priced at the trace's own
    elementwise kernels' time (the median by time: half of their time is in kernels no longer than
    it, the passes over the model's activations), and never more than the call took. The launches
    and the host's time stay."""
    ops = {op, *autograd_counterparts(graph.trace, op)}
    calls = op_calls(graph, ops)
    if not calls:
        raise NotModelled(f"no device work of {op} in the replayed trace")
    replaced = {i for nodes in calls.values() for i in nodes}
    price = elementwise_pass_us(graph, replaced)
    if price is None:
        raise NotModelled("the trace has no elementwise kernel to price a dense pass by")
    fixed = graph.copy()
    before = after = 0.0
    for nodes in calls.values():
        took = sum(graph.dur[i] for i in nodes)
        before += took
        after += _one_pass(fixed, nodes, min(took, price))
    fixed.assume(
        "costly_op", f"{len(calls)} calls of {' and '.join(sorted(ops))} ({before / 1e3:.1f} ms, "
        f"{len(replaced)} kernels) become one elementwise pass each, as a dense formulation (torch.where, "
        f"a multiplication by the mask) over the same tensor: {price:.0f} us a pass, the trace's median "
        f"elementwise kernel by time ({after / 1e3:.1f} ms in all); their launches and the host's time "
        "stay")
    return fixed


def fuse_op(graph: StepGraph, op: str) -> StepGraph:
    """dominant_op: each call of the memory-bound operation ``op`` makes one pass over its data, as a
    fused kernel does (it reads the call's inputs and writes its outputs once): the call's softmax,
    elementwise and reduction kernels take together the time of the longest of them, the pass over
    the most data. Its matrix kernels and copies keep their time, the launches stay. An operation that
    already runs one such kernel a call gains nothing here: fused with its neighbours, its pass would
    merge into theirs, which this does not count."""
    calls = op_calls(graph, {op})
    if not calls:
        raise NotModelled(f"no device work of {op} in the replayed trace")
    names = graph.trace.names
    fixed = graph.copy()
    before = after = 0.0
    for nodes in calls.values():
        passes = [i for i in nodes if classify_name(names[graph.name[i]]) in MEMORY_BOUND]
        if passes:
            before += sum(graph.dur[i] for i in passes)
            after += _one_pass(fixed, passes, max(graph.dur[i] for i in passes))
    fixed.assume(
        "dominant_op", f"the memory-bound kernels of {len(calls)} calls of {op} ({before / 1e3:.1f} ms) make "
        f"one pass a call, as one fused kernel, as long as each call's longest ({after / 1e3:.1f} ms in "
        "all); its other kernels, the launches and the host's time stay")
    return fixed


def fuse_attention(graph: StepGraph, ops: Sequence[str]) -> StepGraph:
    """dominant_op, unfused attention: a fused attention kernel (FlashAttention, PyTorch's
    scaled_dot_product_attention) computes the softmax on chip between its two matrix products and never
    writes the score matrix: the attention softmax kernels of ``ops`` leave the device (the loss's
    log-softmax stays); the batched matrix products keep their time, as do the scaling and masking
    kernels of other operations, which the trace does not tie to the attention."""
    names = graph.trace.names
    fixed = graph.copy()
    removed, before = 0, 0.0
    for nodes in op_calls(graph, set(ops)).values():
        for i in nodes:
            name = names[graph.name[i]]
            if classify_name(name) == "softmax" and not LOG_SOFTMAX.search(without_parameters(name)):
                before += fixed.dur[i]
                fixed.dur[i] = 0.0
                removed += 1
    if not removed:
        raise NotModelled("no attention softmax kernel of the operations in the replayed trace")
    fixed.assume(
        "dominant_op", f"{removed} attention softmax kernels ({before / 1e3:.1f} ms) run inside a fused "
        "attention kernel, the score matrix never written; the batched matrix products keep their time")
    return fixed


def use_tensor_cores(graph: StepGraph) -> StepGraph:
    """tensor_cores_idle: the fp32 matrix and convolution kernels on the SIMT cores run on the tensor
    cores (autocast to bf16/fp16), the factor of the GPU's architecture faster (``tensor_core_speedups``,
    by the compute capability the trace records), and never shorter than the trace's shortest device
    work (what any kernel costs on this GPU: a kernel of a few microseconds is bound by that, not by
    its arithmetic). The kernels of no other class change; the launches stay."""
    capability = graph.trace.compute_capability
    speedup = speedup_for(capability)
    if speedup is None or capability is None:
        reason = ("the trace does not record the GPU's compute capability" if capability is None else
                  f"no tensor-core speed-up is known for compute capability {capability[0]}.{capability[1]}")
        raise NotModelled(reason)
    factor = speedup.factor
    names = graph.trace.names
    shortest = min((graph.dur[i] for i in range(len(graph)) if graph.kind[i] == DEVICE and graph.dur[i] > 0),
                   default=0.0)
    fixed = graph.copy()
    moved, before, after = 0, 0.0, 0.0
    for i in range(len(fixed)):
        if fixed.kind[i] == DEVICE and classify_name(names[fixed.name[i]]) == "fp32_matmul":
            took = fixed.dur[i]
            fixed.dur[i] = max(took / factor, min(took, shortest))
            before += took
            after += fixed.dur[i]
            moved += 1
    fixed.assume(
        "tensor_cores_idle", f"{moved} fp32 matrix kernels ({before / 1e3:.1f} ms) run {factor:.1f}x faster "
        f"on the tensor cores ({speedup.architecture}, {capability[0]}.{capability[1]}: half the "
        f"{speedup.ratio:g}x of {speedup.source}), none shorter than the trace's shortest "
        f"kernel ({shortest:.1f} us): {after / 1e3:.1f} ms; kernels bound by memory gain less, about 2x")
    return fixed


def overlap_communication(graph: StepGraph) -> StepGraph:
    """communication_wait: the collectives run on their own stream beside the compute, each as soon as
    it is launched and the previous collective is done (as with DDP's gradient buckets, FSDP's
    prefetch): the compute no longer waits for them, on its stream nor on another (a kernel that
    started as a collective ended, later than its own stream let it, waited for it). The step is no
    shorter than the compute alone (the replay) nor the communication alone (a floor)."""
    names = graph.trace.names
    collective = [i for i in range(len(graph))
                  if graph.kind[i] == DEVICE and classify_name(names[graph.name[i]]) == "collective"]
    if not collective:
        raise NotModelled("no collective kernel in the replayed trace")
    fixed = graph.copy()
    fixed.prev = array("q", graph.prev)
    is_collective = set(collective)
    gap = max(fixed.device_gap, 0.0)
    latency = _compute_launch_latency(graph, is_collective)
    last_collective: dict[int, int] = {}
    for i in collective:  # in order of start on each stream: the nodes were added so
        fixed.prev[i] = last_collective.get(graph.track[i], -1)
        fixed.prev_lag[i] = gap if fixed.prev[i] >= 0 else 0.0
        fixed.launch_lag[i] = min(fixed.launch_lag[i], latency)
        if fixed.prev[i] < 0 and fixed.launch[i] < 0:
            fixed.prev[i] = graph.prev[i]  # nothing else to start it by: it keeps its place
            fixed.prev_lag[i] = graph.prev_lag[i]
        last_collective[graph.track[i]] = i
    ends = sorted(graph.end(i) for i in collective)
    freed = 0
    for i in range(len(fixed)):
        if fixed.kind[i] != DEVICE or i in is_collective:
            continue
        prev = graph.prev[i]
        if prev in is_collective:  # behind a collective on its stream: behind the compute before it
            while prev >= 0 and prev in is_collective:
                prev = graph.prev[prev]
            fixed.prev[i] = prev
            fixed.prev_lag[i] = gap
            freed += 1
        elif _after_collective(graph, i, ends, latency):
            fixed.prev_lag[i] = min(fixed.prev_lag[i], gap)
            fixed.launch_lag[i] = min(fixed.launch_lag[i], latency)
            freed += 1
    steps = graph.steps.steps
    if steps:
        first, last = steps[0].start, steps[-1].end
        alone = sum(graph.dur[i] for i in collective if first <= graph.start[i] < last) / len(steps)
        fixed.floor_us = max(fixed.floor_us, alone)
        floor = f"; the step is no shorter than the communication alone ({alone / 1e3:.1f} ms a step)"
    else:
        floor = ""
    fixed.assume(
        "communication_wait", f"{len(collective)} collective kernels run on their own stream beside the "
        f"compute as soon as they are launched (as with gradient buckets or prefetching); {freed} compute "
        f"kernels no longer wait for them{floor}")
    return fixed


def _compute_launch_latency(graph: StepGraph, collective: set[int]) -> float:
    """The median delay from launch to start of the compute kernels that waited for their launch (the
    device had run out of work): the graph's launch latency counts the collectives', which a wait for
    the compute (an event) delays."""
    delays = [graph.start[i] - graph.start[graph.launch[i]] for i in range(len(graph))
              if graph.kind[i] == DEVICE and i not in collective and graph.launch[i] >= 0
              and graph.prev[i] >= 0 and graph.end(graph.launch[i]) > graph.end(graph.prev[i])]
    return statistics.median(delays) if delays else min(graph.launch_latency, DEFAULT_LAUNCH_LATENCY_US)


def _after_collective(graph: StepGraph, i: int, ends: list[float], latency: float) -> bool:
    """Whether device work ``i`` started as a collective on another stream ended, later than the work
    before it on its own stream and its launch let it: it waited for the collective (an event)."""
    start = graph.start[i]
    at = bisect_right(ends, start + EPSILON_US) - 1
    if at < 0 or start - ends[at] > max(graph.device_gap, 0.0) + WAIT_SLACK_US:
        return False
    ready = graph.end(graph.prev[i]) if graph.prev[i] >= 0 else NEVER
    launch = graph.launch[i]
    if launch >= 0:
        ready = max(ready, graph.start[launch] + latency)
    return ends[at] > ready + EPSILON_US


def op_calls(graph: StepGraph, ops: set[str]) -> dict[tuple[int, int], list[int]]:
    """The device work of each call of the operations ``ops``: by (thread, call), the device nodes
    whose launch call ran inside that outermost operator (as the device profile attributes kernels). A
    kernel with no launch in the trace is its own operation, named after itself, one call each."""
    operators = OutermostOperators(graph.trace)
    wanted = {i for i, name in enumerate(operators.names) if name in ops}
    calls: dict[tuple[int, int], list[int]] = {}
    if not wanted:
        return calls
    for i in range(len(graph)):
        if graph.kind[i] != DEVICE:
            continue
        launch = graph.launch[i]
        if launch < 0:
            if graph.name[i] in wanted:
                calls[(-1, i)] = [i]
            continue
        track, at = graph.track[launch], graph.start[launch]
        tops = operators.tops.get(track)
        if tops is None:
            continue
        starts, ends, top_names = tops
        j = bisect_right(starts, at) - 1
        if j >= 0 and ends[j] >= at and top_names[j] in wanted:
            calls.setdefault((track, j), []).append(i)
    return calls


def autograd_counterparts(trace: Trace, op: str) -> list[str]:
    """The forward operator of a backward function and the reverse, among the trace's operations:
    ``autograd::engine::evaluate_function: IndexPutBackward0`` and ``aten::index_put_``."""
    backward = BACKWARD_FUNCTION.search(op)
    key = _snake(backward.group(1)) if backward else op.removeprefix("aten::").rstrip("_")
    found = []
    for name in trace.names:
        if backward is None:  # a forward operator: its backward functions
            other = BACKWARD_FUNCTION.search(name)
            matches = other is not None and _snake(other.group(1)) == key
        else:  # a backward function: its forward operator
            matches = name.startswith("aten::") and name[6:].rstrip("_") == key
        if matches and name != op:
            found.append(name)
    return found


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def elementwise_pass_us(graph: StepGraph, excluded: set[int]) -> float | None:
    """The median by time of the elementwise kernels not in ``excluded``: half of their time is spent
    in kernels no longer than it. None without any."""
    names = graph.trace.names
    durations = sorted(graph.dur[i] for i in range(len(graph))
                       if graph.kind[i] == DEVICE and i not in excluded
                       and classify_name(names[graph.name[i]]) == "elementwise" and graph.dur[i] > 0)
    total = sum(durations)
    if total <= 0:
        return None
    seen = 0.0
    for dur in durations:
        seen += dur
        if seen >= total / 2:
            return dur
    return durations[-1]


def _one_pass(fixed: StepGraph, nodes: list[int], took: float) -> float:
    """The work of ``nodes`` as one pass of ``took`` microseconds: the first node keeps it, the rest
    take none (their places on the stream and their launches stay)."""
    first = min(nodes, key=fixed.start.__getitem__)
    for i in nodes:
        fixed.dur[i] = took if i == first else 0.0
    return took


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


def _host_spans(trace: Trace, wanted: Callable[[str], bool],
                python: Callable[[str], bool] | None = None) -> dict[int, IntervalSet]:
    """The host operations whose name ``wanted`` accepts, and the Python frames ``python`` accepts,
    merged per thread."""
    names = trace.names
    by_track: dict[int, list[tuple[float, float]]] = {}
    for kind, accepts in ((Kind.HOST_OP, wanted), (Kind.PYTHON, python)):
        if accepts is None:
            continue
        spans = trace.spans[kind]
        accepted = {i for i, name in enumerate(names) if accepts(name)}
        for i in range(len(spans)):
            if spans.name[i] in accepted:
                start = spans.start[i]
                by_track.setdefault(spans.track[i], []).append((start, start + spans.dur[i]))
    return {track: IntervalSet.merge(spans) for track, spans in by_track.items()}


def _shorten_host_work(graph: StepGraph, spans: dict[int, IntervalSet], fix: str,
                       assumption: str) -> StepGraph:
    """The host work between consecutive calls on each thread less the time ``spans`` cover in it; the
    lag of a cross-thread wait less what they cover on the thread waited for (its work before it let
    the other go); and what they cover before a thread's first node, from the first step's start (a
    trace that starts with an input wait), and after its last node, up to the last step's end (one that
    ends in one), as the thread's ``head_cut`` and ``tail_cut``."""
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
    steps = graph.steps.steps
    if steps:  # the host work before each thread's first node and after its last, within the steps
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i in range(len(fixed)):
            if fixed.kind[i] != DEVICE:
                first.setdefault(fixed.track[i], i)
                last[fixed.track[i]] = i
        for track, i in first.items():
            covered = spans.get(track)
            cut = covered.covered(steps[0].start, graph.start[i]) if covered is not None else 0.0
            if cut > 0:
                fixed.head_cut[track] = fixed.head_cut.get(track, 0.0) + cut
                removed += cut
        for track, i in last.items():
            covered = spans.get(track)
            cut = covered.covered(graph.end(i), steps[-1].end) if covered is not None else 0.0
            if cut > 0:
                fixed.tail_cut[track] = fixed.tail_cut.get(track, 0.0) + cut
                removed += cut
    fixed.assume(fix, f"{assumption} ({removed / 1e3:.1f} ms of host work taken out)")
    return fixed
