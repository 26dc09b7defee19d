"""The Xid watcher: one thread blocked in NVML's event wait, counting Xid errors per GPU."""

from __future__ import annotations

import logging
import threading
from typing import Any

from gpuscope.health import SourceHealth
from gpuscope.nvml.boundary import Nvml, NvmlDevice, NvmlUnavailable
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

# How long one wait blocks. The thread wakes this often with nothing to do; a stop does not wait for
# it: shutting NVML down ends the wait (stop() is followed by Nvml.shutdown()).
_WAIT_MS = 10_000


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
        while not self._stop.is_set():
            try:
                event = self._nvml.wait_xid(self._event_set, self._devices, _WAIT_MS)
            except NvmlUnavailable:
                log.debug("NVML shut down: the Xid watcher stops")
                return
            except Exception:  # an NVML failure here must not kill the thread silently or spin
                log.exception("Xid event wait failed; retrying in 5 s")
                self._stop.wait(5.0)
                continue
            if event is None:
                continue
            gpu, xid = event
            log.warning("GPU %d: Xid %d", gpu, xid)
            with self._lock:
                per_gpu = self._counts.setdefault(gpu, {})
                per_gpu[xid] = per_gpu.get(xid, 0) + 1
