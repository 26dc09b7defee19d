"""What a simulated process does while it is traced, and the Chrome trace of it.

For the length of a trace the helper process runs the steps of its work shape (``work_shape``): the
busy part of a step is real CPU work (SHA-256 over 64 KiB blocks, which also lets the helper's other
thread run, as hashlib releases the GIL), the idle part a real sleep, recorded as a wait for the
next batch of input. Every span is recorded with the
wall-clock times it really started and ended, and the trace lists exactly those spans, in the format
PyTorch's profiler writes (a Chrome trace: ``traceEvents`` of ``ph: "X"`` spans with ``pid``, ``tid``,
``ts`` and ``dur`` in microseconds, ``name`` and ``cat``), so the agent's Kineto backend, Perfetto and
TensorBoard read it like any PyTorch trace.

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


@dataclass(frozen=True, slots=True)
class Span:
    """One recorded span: wall-clock nanoseconds, as ``time.time_ns`` read them."""

    name: str
    category: str
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)


def compute_until(deadline: float) -> int:
    """Real CPU work until the monotonic time ``deadline``: the number of 64 KiB blocks hashed."""
    digest = hashlib.sha256()
    blocks = 0
    while time.monotonic() < deadline:
        digest.update(BLOCK)
        blocks += 1
    return blocks


class TracedWork:
    """Runs ``shape``'s steps for a while and records them. ``origin`` is the monotonic time at which
    the scenario started (scenario time = ``monotonic() - origin()``)."""

    def __init__(self, shape: WorkShape, origin: Callable[[], float], *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.shape = shape
        self._origin = origin
        self._sleep = sleep

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
                if now < busy_end:
                    started = time.time_ns()
                    blocks = compute_until(busy_end)
                    inner.append(Span("compute", "cpu_op", started, time.time_ns(),
                                      {"work": "sha256 of 64 KiB blocks", "blocks": blocks}))
                # The idle part of a simulated step is the job waiting for its next batch, named as
                # PyTorch's DataLoader annotates it, so `gpuscope explain` reads the story it tells.
                inner += self._wait(step_end, INPUT_WAIT, {"why": "the simulated GPU is idle: the job "
                                                                  "waits for its input"})
            else:
                inner += self._wait(step_end, "not running", {"why": "the scenario has not started this "
                                                                     "process, or has stopped it"})
            if inner:
                spans.append(Span(f"ProfilerStep#{number}", "user_annotation", step_start_ns, time.time_ns()))
                spans += inner
                number += 1
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
    events += [{"ph": "X", "cat": s.category, "name": s.name, "pid": pid, "tid": tid, "ts": us(s.start_ns),
                "dur": round((s.end_ns - s.start_ns) / 1000, 3), "args": s.args} for s in spans]
    # The profiler's own span over the whole recording, as Kineto writes it ("Trace" category).
    events.append({"ph": "X", "cat": "Trace", "name": f"{process_name} (simulated)", "pid": "Spans",
                   "tid": "Trace", "ts": start, "dur": round((ended_ns - started_ns) / 1000, 3),
                   "args": {"Op count": len(spans)}})
    return {"schemaVersion": 1, "deviceProperties": [], "trace_id": uuid.uuid4().hex.upper(),
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
