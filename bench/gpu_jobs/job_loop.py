"""What the jobs of bench/gpu_scenarios.py share: their lifetime, their step clock and their loop.

A job talks to the scenario script through its standard streams, one line each:

    info KEY VALUE...   what the job runs on (device, model, precision)
    step_ms 12.345      its own step time over the last window (about a second) of steps
    ready               once warm-up is over and one window was measured: the steady loop runs

It exits when its standard input closes (the scenario script ended, however it ended) or after
``--max-seconds``, so it never outlives the run that started it.

The clock never synchronises with the device inside the loop, which would change what the job is
made to show: on CUDA it records an event at each window's end and reads the events' elapsed time
once ``Event.query()`` says the device has passed them (a non-blocking check); elsewhere it reads
the wall clock, which over a window of many steps is the steps' rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

WINDOW_S = 1.0  # one step_ms line per window of steps this long
WARMUP_STEPS = 5  # before the first window: allocator, cuDNN/XLA autotuning, compilation


def job_arguments(description: str, names: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("job", choices=names, help="Which job to run.")
    parser.add_argument("--tiny", action="store_true",
                        help="Tiny sizes on the CPU, for a dry run of the scenario script.")
    parser.add_argument("--max-seconds", type=float, default=600.0,
                        help="Exit after this long whatever happens (default 600).")
    parser.add_argument("--port", type=int, default=0, help="JAX: the profiler server's port.")
    return parser.parse_args()


def info(key: str, value: object) -> None:
    print(f"info {key} {value}", flush=True)


def exit_with_parent(max_seconds: float) -> None:
    """Exit when stdin closes (the scenario script is gone) or after ``max_seconds``: a background
    thread each, ending the process with os._exit so that no framework thread can hold it up."""

    def on_stdin_closed() -> None:
        sys.stdin.read()
        os._exit(0)

    def on_time_up() -> None:
        time.sleep(max_seconds)
        print(f"info exit max-seconds ({max_seconds:g} s) reached", flush=True)
        os._exit(3)

    threading.Thread(target=on_stdin_closed, daemon=True).start()
    threading.Thread(target=on_time_up, daemon=True).start()


class WallClock:
    """Step time from the host's clock, a window of steps at a time."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._steps = 0

    def tick(self) -> bool:
        """Count a step; True when a window ended and its step time was printed."""
        self._steps += 1
        now = time.perf_counter()
        if now - self._start < WINDOW_S:
            return False
        print(f"step_ms {(now - self._start) / self._steps * 1e3:.3f}", flush=True)
        self._start, self._steps = now, 0
        return True


class CudaEventClock:
    """Step time from CUDA events on the current stream: the device's time between two windows' ends,
    which includes the time it waited for the host. Read without blocking: a window's figure is
    printed once the device has passed its end event."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._event = self._record()
        self._wall = time.perf_counter()
        self._steps = 0
        self._pending: deque[tuple[Any, Any, int]] = deque()

    def _record(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def tick(self) -> bool:
        self._steps += 1
        now = time.perf_counter()
        if now - self._wall >= WINDOW_S:
            end = self._record()
            self._pending.append((self._event, end, self._steps))
            self._event, self._wall, self._steps = end, now, 0
        printed = False
        while self._pending and self._pending[0][1].query():
            start, end, steps = self._pending.popleft()
            print(f"step_ms {start.elapsed_time(end) / steps:.3f}", flush=True)
            printed = True
        return printed


def run_forever(step: Callable[[], None], clock_factory: Callable[[], WallClock | CudaEventClock]) -> None:
    """Warm up, then run ``step`` until the process is ended, printing "ready" after the first window."""
    for _ in range(WARMUP_STEPS):
        step()
    clock = clock_factory()
    ready = False
    while True:
        step()
        if clock.tick() and not ready:
            print("ready", flush=True)
            ready = True
