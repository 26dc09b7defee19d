"""Which GPU the sampler is reading, and which GPUs a stuck NVML call holds.

An NVML call can block for good (a driver in trouble, as around Xid 79), and a blocking C call
cannot be interrupted. So the sampler thread marks each GPU read here; when a read has not returned
within ``stuck_after`` the watchdog gives that thread up: the GPU it is stuck in is *held* (reported
down, skipped) and a new sampler thread, of the next *generation*, carries on with the other GPUs.
When the stuck call returns at last, its thread sees that it was given up on, releases the GPU (read
again from the next tick) and ends without publishing anything. So there is one extra thread per GPU
stuck at a time, and none otherwise. The Xid check that the sampler makes each tick when NVML's event
wait polls (see nvml.xid) is guarded the same way, under an index that no GPU has.
"""

from __future__ import annotations

import threading


class ReadGuard:
    """Thread-safe record of the read in progress (generation, GPU, start) and of the held GPUs."""

    def __init__(self, stuck_after_seconds: float) -> None:
        self.stuck_after_seconds = stuck_after_seconds
        self._lock = threading.Lock()
        self.generation = 0
        self._current: tuple[int, int, float] | None = None  # (generation, gpu index, monotonic start)
        self._held: dict[int, int] = {}  # gpu index -> the generation stuck in one of its calls
        self.stuck_calls_total = 0

    def next_generation(self) -> int:
        """A new sampler thread's generation; the previous ones are given up on."""
        with self._lock:
            self.generation += 1
            self._current = None
            return self.generation

    def held(self, gpu: int) -> bool:
        """A call on this GPU has not returned: the GPU is not read until it does."""
        return gpu in self._held

    def begin(self, generation: int, gpu: int, now: float) -> None:
        with self._lock:
            if generation == self.generation:
                self._current = (generation, gpu, now)

    def end(self, generation: int, gpu: int) -> bool:
        """The read returned. False when its thread was given up on meanwhile: the GPU is released and
        the thread must stop at once (its tick belongs to no one any more)."""
        with self._lock:
            if generation == self.generation:
                self._current = None
                return True
            if self._held.get(gpu) == generation:
                del self._held[gpu]
            return False

    def stuck_at(self) -> float | None:
        """When the read in progress will have run ``stuck_after`` (monotonic), or None when no read is
        in progress: the watchdog sleeps until then rather than waking on a short period."""
        with self._lock:
            current = self._current
        return None if current is None else current[2] + self.stuck_after_seconds

    def stuck(self, now: float) -> tuple[int, int] | None:
        """(the GPU whose read has run longer than ``stuck_after``, now held; the next generation), or
        None. The stuck thread is given up on in the same step, so its read cannot end unnoticed; the
        caller starts the next generation's thread."""
        with self._lock:
            current = self._current
            if current is None or now - current[2] < self.stuck_after_seconds:
                return None
            generation, gpu, _ = current
            self._held[gpu] = generation
            self.stuck_calls_total += 1
            self.generation += 1
            self._current = None
            return gpu, self.generation
