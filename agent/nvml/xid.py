"""The Xid watcher: one thread blocked in NVML's event wait, counting Xid errors per GPU (or, with a
library whose wait polls, asking without waiting once a second)."""

from __future__ import annotations

import logging
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
# more often than this per second polls inside (NVIDIA's mock library does, 14 times a second, and its
# runtime's other threads with it, at some 3 ms of CPU a second): it is then asked without waiting,
# once every POLL_SECONDS, which costs next to nothing and delays a count by at most that long.
_POLLING_WAKEUPS_PER_S = 2.0
POLL_SECONDS = 1.0


class XidWatcher:
    def __init__(self, nvml: Nvml, devices: list[NvmlDevice], *, health: SourceHealth | None = None) -> None:
        self._health = health
        self._nvml = nvml
        self._devices = devices
        self._lock = threading.Lock()
        self._counts: dict[int, dict[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None

    def start(self) -> bool:
        """Start watching; False when no GPU supports Xid events (nothing to watch)."""
        self._event_set = self._nvml.xid_event_set(self._devices)
        if self._event_set is None:
            return False
        self._thread = start_thread("gpuscope-xid", self._run, health=self._health, source="nvml")
        return True

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the thread to end and wait up to ``timeout`` for it; one blocked in NVML's event wait
        ends when NVML shuts down, or is left to its daemon thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive() and self._event_set is not None:
                self._nvml.free_event_set(self._event_set)
                self._event_set = None

    def counts(self, gpu_index: int) -> dict[int, int]:
        """A copy of Xid code -> events seen on this GPU since start."""
        with self._lock:
            return dict(self._counts.get(gpu_index, {}))

    def _run(self) -> None:
        polling = drained = False
        while not self._stop.is_set():
            if polling and drained and self._stop.wait(POLL_SECONDS):  # events come back to back
                return
            switches, wall = (0 if polling else _context_switches()), time.monotonic()
            try:
                event = self._nvml.wait_xid(self._event_set, self._devices, 0 if polling else _WAIT_MS)
            except NvmlUnavailable:
                log.debug("NVML shut down: the Xid watcher stops")
                return
            except Exception:  # an NVML failure here must not kill the thread silently or spin
                log.exception("Xid event wait failed; retrying in 5 s")
                self._stop.wait(5.0)
                continue
            waited = time.monotonic() - wall
            woken = 0 if polling else _context_switches() - switches
            if not polling and waited > 1.0 and woken > _POLLING_WAKEUPS_PER_S * waited:
                polling = True
                log.info("NVML's event wait polls (its thread woke %d times in %.1f s): checking for Xid "
                         "events every %g s without waiting instead", woken, waited, POLL_SECONDS)
            drained = event is None
            if event is None:
                continue
            gpu, xid = event
            log.warning("GPU %d: Xid %d", gpu, xid)
            with self._lock:
                per_gpu = self._counts.setdefault(gpu, {})
                per_gpu[xid] = per_gpu.get(xid, 0) + 1


def _context_switches() -> int:
    """Times the calling thread gave up or lost the CPU so far (Linux); 0 where this cannot be read."""
    try:
        with open("/proc/thread-self/status", encoding="ascii") as status:
            return sum(int(line.split()[1]) for line in status
                       if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
    except (OSError, ValueError, IndexError):
        return 0
