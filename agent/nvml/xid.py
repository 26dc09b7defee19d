"""The Xid watcher: counts Xid errors per GPU.

With a driver, one thread blocks in NVML's event wait, which sleeps in the kernel until an event comes.
With a library whose wait polls inside (its thread wakes many times while it waits), that thread ends
and the sampler asks for events without waiting once a tick instead (``polling``, ``poll``): no thread
of its own and no wake-up beyond the tick's, for a count delayed by a sampling interval at most
(after a failed check, the next comes 5 s later; a storm of events is taken 64 a tick)."""

from __future__ import annotations

import logging
import resource
import threading
import time
from typing import Any

from gpuscope.health import SourceHealth
from gpuscope.nvml.boundary import Nvml, NvmlDevice, NvmlUnavailable
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

# How long one wait blocks. The thread wakes this often with nothing to do; a stop does not wait for
# it: shutting NVML down ends the wait (stop() is followed by Nvml.shutdown()).
_WAIT_MS = 10_000
# A driver's wait sleeps in the kernel: the waiting thread is woken once. A library whose wait wakes it
# more often than this per second polls inside (NVIDIA's mock library does, 14 to 16 times a second,
# and its runtime's other threads with it, at some 3 ms of CPU a second): the thread then ends and the
# sampler polls, which costs next to nothing.
_POLLING_WAKEUPS_PER_S = 5.0
# Fewer wake-ups than this in one wait never mean polling: the thread's count also holds the times it
# waited for the interpreter's lock on its way back from the wait, many where other threads keep that
# lock busy (up to 39 measured in a 1.2 s wait beside 4 threads spinning in Python on a loaded 2-core
# machine; a 10 s wait of the mock library gives some 100).
_POLLING_MIN_WAKEUPS = 64
# The most events one poll takes: a storm of Xids cannot hold a tick for long; the rest come next tick.
POLL_MAX_EVENTS = 64
# After a poll fails (other than by NVML shutting down), polls are skipped this long: retried, not
# logged once a tick.
_POLL_RETRY_SECONDS = 5.0


class XidWatcher:
    def __init__(self, nvml: Nvml, devices: list[NvmlDevice], *, health: SourceHealth | None = None) -> None:
        self._health = health
        self._nvml = nvml
        self._devices = devices
        self._lock = threading.Lock()  # the counts; and the event set's use against its freeing
        self._counts: dict[int, dict[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self._polling = False
        self._polls_in_flight = 0  # at most 1 (the sampler skips a poll while one is stuck)
        self._poll_again_at = 0.0  # monotonic: after a failed poll
        self._ended = False  # NVML shut down under a poll: nothing more to ask

    @property
    def polling(self) -> bool:
        """The library's event wait polls: the thread has ended, and ``poll`` is to be called each tick."""
        return self._polling

    def start(self) -> bool:
        """Start watching; False when no GPU supports Xid events (nothing to watch)."""
        self._event_set = self._nvml.xid_event_set(self._devices)
        if self._event_set is None:
            return False
        self._thread = start_thread("gpuscope-xid", self._run, health=self._health, source="nvml")
        return True

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the thread to end and wait up to ``timeout`` for it; one blocked in NVML's event wait
        ends when NVML shuts down, or is left to its daemon thread. The event set is freed once nothing
        uses it: no thread waiting in it and no poll in flight (a poll stuck in NVML keeps it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            if (self._thread is not None and self._thread.is_alive()) or self._polls_in_flight:
                return
            event_set, self._event_set = self._event_set, None
        if event_set is not None:
            self._nvml.free_event_set(event_set)

    def counts(self, gpu_index: int) -> dict[int, int]:
        """A copy of Xid code -> events seen on this GPU since start."""
        with self._lock:
            return dict(self._counts.get(gpu_index, {}))

    def poll(self) -> None:
        """Count the events that came since the last poll, asking without waiting (up to
        POLL_MAX_EVENTS of them). Called by the sampler thread, under its read guard: the call can
        hang like any NVML call."""
        with self._lock:
            if (not self._polling or self._ended or self._stop.is_set() or self._event_set is None
                    or time.monotonic() < self._poll_again_at):
                return
            self._polls_in_flight += 1
            event_set = self._event_set
        try:
            for _ in range(POLL_MAX_EVENTS):
                event = self._nvml.wait_xid(event_set, self._devices, 0)
                if event is None:
                    return
                self._count(*event)
        except NvmlUnavailable:
            log.debug("NVML shut down: no more Xid checks")
            self._ended = True
        except Exception:  # an NVML failure must not fail the tick, nor be logged once a tick
            log.exception("Xid event check failed; retrying in %g s", _POLL_RETRY_SECONDS)
            self._poll_again_at = time.monotonic() + _POLL_RETRY_SECONDS
        finally:
            with self._lock:
                self._polls_in_flight -= 1

    def _count(self, gpu: int, xid: int) -> None:
        log.warning("GPU %d: Xid %d", gpu, xid)
        with self._lock:
            per_gpu = self._counts.setdefault(gpu, {})
            per_gpu[xid] = per_gpu.get(xid, 0) + 1

    def _run(self) -> None:
        while not self._stop.is_set():
            switches, wall = _context_switches(), time.monotonic()
            try:
                event = self._nvml.wait_xid(self._event_set, self._devices, _WAIT_MS)
            except NvmlUnavailable:
                log.debug("NVML shut down: the Xid watcher stops")
                return
            except Exception:  # an NVML failure here must not kill the thread silently or spin
                log.exception("Xid event wait failed; retrying in 5 s")
                self._stop.wait(5.0)
                continue
            waited = time.monotonic() - wall
            woken = _context_switches() - switches
            if event is not None:
                self._count(*event)
            if waited > 1.0 and woken > max(_POLLING_WAKEUPS_PER_S * waited, _POLLING_MIN_WAKEUPS):
                log.info("NVML's event wait polls (its thread woke %d times in %.1f s): the Xid watcher "
                         "thread ends, and each sampling tick checks for Xid events without waiting",
                         woken, waited)
                self._polling = True  # the last thing this thread does: polls never overlap its wait
                return


def _context_switches() -> int:
    """Times the calling thread gave up the CPU to wait so far (Linux); 0 where this cannot be read.
    Only the voluntary switches: a wait that polls sleeps and wakes, where being preempted on a busy
    machine says nothing of the wait. getrusage holds the interpreter's lock throughout, where reading
    /proc would let it go and count each wait to take it back (many where other threads keep it busy)."""
    try:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError, ValueError):  # RUSAGE_THREAD is Linux's
        return 0
    return usage.ru_nvcsw
