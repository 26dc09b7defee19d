"""What a simulated process does while it is traced, and the Chrome trace of it.

For the length of a trace the helper process runs the steps of its work shape (``work_shape``): the
busy part of a step is real CPU work (SHA-256 over 64 KiB blocks, which also lets the helper's other
thread run, as hashlib releases the GIL), the idle part a real sleep, recorded as a wait for the
next batch of input. Every span is recorded with the
wall-clock times it really started and ended, and the trace lists exactly those spans, in the format
PyTorch's profiler writes (a Chrome trace: ``traceEvents`` of ``ph: "X"`` spans with ``pid``, ``tid``,
``ts`` and ``dur`` in microseconds, ``name`` and ``cat``), so the agent's Kineto backend, Perfetto and
TensorBoard read it like any PyTorch trace.

The simulated GPU's side is written too, as Kineto records a real one: at the start of each step the
job launches the step's kernels (``cudaLaunchKernel`` calls inside the compute span, each tied to its
kernel by a correlation id), and the GPU runs them back to back on stream 7 for the device's part of
the step (``work_shape``: the busy part; on a shared GPU, stretched over the other processes' slices),
with as many thread blocks per SM as the scenario's GPM activity implies. The trace's device
properties are an H100's, and its clock the node's (``baseTimeNanoseconds``), so that the traces of
the processes of one GPU can be compared. ``gpuscope explain`` then reads each scenario's own story:
waits for input on the input-bound GPU, a shared GPU, kernels that leave most SMs idle on the stalled
one, nothing on a healthy one.

Outside traces the helper does no work at all, so an idle simulated node costs no CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuscope.simulate.work_shape import WorkShape

BLOCK = os.urandom(64 * 1024)  # hashed over and over in the busy part of a step
INPUT_WAIT = "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"
STREAM = 7
KERNEL_NS = 2_000_000  # a simulated kernel's length; a step's device part is cut into these
MAX_KERNELS = 64  # per step: a long device part gets longer kernels, not more of them
LAUNCH_NS = 4_000  # a cudaLaunchKernel call
# What the simulated GPU runs: a bf16 GEMM on the tensor cores (cuBLASLt's name) and an activation.
KERNELS = ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT",
           "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT",
           "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl>(int)")
DEVICE_PROPERTIES = {"id": 0, "name": "NVIDIA H100 80GB HBM3 (simulated)", "computeMajor": 9,
                     "computeMinor": 0, "numSms": 132, "totalGlobalMem": 85_017_493_504}


@dataclass(frozen=True, slots=True)
class Span:
    """One recorded span: wall-clock nanoseconds, as ``time.time_ns`` read them. A device span is on
    the simulated GPU's stream, not the helper's thread."""

    name: str
    category: str
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)
    device: bool = False


def compute_until(deadline: float) -> int:
    """Real CPU work until the monotonic time ``deadline``: the number of 64 KiB blocks hashed. At
    least one: a process the machine woke late, past its deadline, still computes before it waits
    again, as a training step does (a compute span is never empty)."""
    digest = hashlib.sha256()
    blocks = 0
    while True:
        digest.update(BLOCK)
        blocks += 1
        if time.monotonic() >= deadline:
            return blocks


class TracedWork:
    """Runs ``shape``'s steps for a while and records them. ``origin`` is the monotonic time at which
    the scenario started (scenario time = ``monotonic() - origin()``)."""

    def __init__(self, shape: WorkShape, origin: Callable[[], float], *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.shape = shape
        self._origin = origin
        self._sleep = sleep
        self._correlation = 0

    def run(self, duration_s: float) -> list[Span]:
        """Work for ``duration_s`` seconds; the spans, in the order they started."""
        spans: list[Span] = []
        finish = time.monotonic() + duration_s
        number = 0
        while (now := time.monotonic()) < finish:
            origin = self._origin()
            step = self.shape.step_at(now - origin)
            step_end = min(origin + step.end, finish)
            step_start_ns = time.time_ns()
            inner: list[Span] = []
            if step.active:
                busy_end = min(origin + step.busy_until, finish)
                device_end = min(origin + (step.device_until if step.device_until is not None
                                           else step.busy_until), finish)
                started = time.time_ns()
                if now < busy_end:
                    blocks = compute_until(busy_end)
                    inner.append(Span("compute", "cpu_op", started, max(time.time_ns(), started + LAUNCH_NS),
                                      {"work": "sha256 of 64 KiB blocks", "blocks": blocks}))
                # The idle part of a simulated step is the job waiting for its next batch, named as
                # PyTorch's DataLoader annotates it, so `gpuscope explain` reads the story it tells.
                inner += self._wait(step_end, INPUT_WAIT, {"why": "the simulated GPU is idle: the job "
                                                                  "waits for its input"})
                # The device's part is its share of the step as it really went: a step the machine
                # made late (a busy host oversleeps) does not turn into device idle time.
                planned = max(step_end - now, 1e-9)
                device_ns = int((time.time_ns() - started) * max(0.0, device_end - now) / planned)
                inner += self._kernels(started, started + device_ns, step.fill)
            else:
                inner += self._wait(step_end, "not running", {"why": "the scenario has not started this "
                                                                     "process, or has stopped it"})
            if inner:
                spans.append(Span(f"ProfilerStep#{number}", "user_annotation", step_start_ns, time.time_ns()))
                spans += inner
                number += 1
        return spans

    def _kernels(self, start_ns: int, end_ns: int, fill: float) -> list[Span]:
        """The launches at ``start_ns`` (the host queues the step's kernels up front) and the kernels the
        simulated GPU runs back to back from just after them until ``end_ns``."""
        first = start_ns + LAUNCH_NS
        if end_ns - first < KERNEL_NS // 4:
            return []
        count = max(1, min(MAX_KERNELS, (end_ns - first) // KERNEL_NS))
        length = (end_ns - first) // count
        spans = []
        for k in range(count):
            self._correlation += 1
            launch = start_ns + k * LAUNCH_NS // count
            spans.append(Span("cudaLaunchKernel", "cuda_runtime", launch, launch + LAUNCH_NS // count,
                              {"correlation": self._correlation}))
            begin = first + k * length
            spans.append(Span(KERNELS[k % len(KERNELS)], "kernel", begin, begin + length,
                              {"correlation": self._correlation, "stream": STREAM, "device": 0,
                               "blocks per SM": round(fill, 4)}, device=True))
        return spans

    def _wait(self, until: float, name: str, args: dict[str, Any]) -> list[Span]:
        left = until - time.monotonic()
        if left <= 0:
            return []
        started = time.time_ns()
        self._sleep(left)
        return [Span(name, "user_annotation", started, time.time_ns(), args)]


def chrome_trace(spans: list[Span], *, process_name: str, started_ns: int, ended_ns: int,
                 trace_name: str, pid: int | None = None, tid: int | None = None) -> dict[str, Any]:
    """The trace document PyTorch's profiler would write for these spans (one thread)."""
    pid = os.getpid() if pid is None else pid
    tid = threading.get_native_id() if tid is None else tid
    base_ns = started_ns - started_ns % 1_000_000_000

    def us(ns: int) -> float:
        return round((ns - base_ns) / 1000, 3)

    start = us(started_ns)
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "ts": start, "pid": pid, "tid": 0,
         "args": {"name": process_name}},
        {"ph": "M", "name": "process_labels", "ts": start, "pid": pid, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "thread_name", "ts": start, "pid": pid, "tid": tid,
         "args": {"name": f"thread {tid} ({process_name})"}},
    ]
    events += [{"ph": "X", "cat": s.category, "name": s.name, "pid": 0 if s.device else pid,
                "tid": STREAM if s.device else tid, "ts": us(s.start_ns),
                "dur": round((s.end_ns - s.start_ns) / 1000, 3), "args": s.args} for s in spans]
    # The profiler's own span over the whole recording, as Kineto writes it ("Trace" category).
    events.append({"ph": "X", "cat": "Trace", "name": f"{process_name} (simulated)", "pid": "Spans",
                   "tid": "Trace", "ts": start, "dur": round((ended_ns - started_ns) / 1000, 3),
                   "args": {"Op count": len(spans)}})
    device = [DEVICE_PROPERTIES] if any(s.device for s in spans) else []
    return {"schemaVersion": 1, "deviceProperties": device, "trace_id": uuid.uuid4().hex.upper(),
            "host_name": socket.gethostname(), "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns,
            "traceEvents": events, "traceName": trace_name}


def write_trace(path: Path, document: dict[str, Any]) -> None:
    """Write ``<path>.tmp`` (a new file, never through a symlink), then rename it to ``path``: the
    rename tells the agent the trace is complete, as Kineto's does."""
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(document, out, separators=(",", ":"))
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
