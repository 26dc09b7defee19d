"""Pod attribution: which pod container each GPU is allocated to, kept fresh off the hot paths.

A background thread asks the kubelet (``kubelet.PodResourcesClient``) every ``refresh_interval`` and
replaces one reference to the answer; the sampler's per-tick lookup is a dictionary read with no
lock and no I/O, and a scrape never waits on the kubelet.

* No socket (bare metal, or the kubelet's directory not mounted): nothing is attributed, nothing is
  logged past one line at start, and no pod metric is exported.
* The kubelet restarts (its socket disappears and comes back, or refuses connections for a moment):
  the last answer stays in use for ``keep_for``, since the pods themselves keep running; then it is
  dropped, so a long outage never attributes GPUs to pods that may be gone.
* A pod that ends disappears with the next answer that leaves it out: each answer replaces the
  previous one whole. (The kubelet may go on listing a finished pod until it is garbage-collected.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuscope.health import SourceHealth
from gpuscope.host.kubelet import GpuAllocations, KubeletError, PodResourcesClient
from gpuscope.snapshot import PodContainer
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

_EMPTY = GpuAllocations()


class AllocationSource(Protocol):
    def list_gpu_allocations(self) -> GpuAllocations: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PodResourcesStatus:
    """For the agent's own metrics. ``seen`` stays False on a node that never had a kubelet socket."""

    seen: bool
    up: bool
    failures_total: int
    pods: int


class PodAttribution:
    """Caches the kubelet's GPU allocations. ``start``/``stop`` run the refresh thread;
    ``refresh`` is one round (tests call it directly). ``pods_for`` is safe from any thread."""

    def __init__(self, socket_path: Path, *, refresh_interval: float, timeout: float, keep_for: float,
                 client: AllocationSource | None = None,
                 clock: Callable[[], float] = time.monotonic, health: SourceHealth | None = None) -> None:
        self.socket_path = socket_path
        self._interval = refresh_interval
        self._keep_for = keep_for
        self._client: AllocationSource = client or PodResourcesClient(socket_path, timeout_seconds=timeout)
        self._clock = clock
        self._health = health
        self._allocations = _EMPTY
        self._last_success: float | None = None
        self._seen = False
        self._up = False
        self._failures = 0
        self._failing_since_logged = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pods_for(self, uuid: str, index: int) -> tuple[PodContainer, ...]:
        return self._allocations.pods_for(uuid, index)

    def status(self) -> PodResourcesStatus:
        return PodResourcesStatus(seen=self._seen, up=self._up, failures_total=self._failures,
                                  pods=self._allocations.pod_count)

    def start(self) -> None:
        """Asks once (so the first snapshots already name pods; at most ``timeout``), then every
        ``refresh_interval`` on a thread."""
        if not self.socket_path.exists():
            log.info("no kubelet pod-resources socket at %s: GPUs are not attributed to pods "
                     "(looking again every %gs)", self.socket_path, self._interval)
        self.refresh()
        self._thread = start_thread("gpuscope-pods", self._run, health=self._health, source="pods")

    def stop(self, timeout: float = 0.5) -> None:
        """Quick: a refresh still waiting on the kubelet (at most ``timeout`` of its own) is left to
        its daemon thread, which never starts another, rather than closed under it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        self._client.close()

    def refresh(self) -> None:
        """Ask the kubelet once; on failure keep the last answer until it is ``keep_for`` old."""
        if self._stop.is_set():
            return
        present = self.socket_path.exists()
        if not present and not self._seen:
            return  # not a Kubernetes node (yet): stay quiet
        started = time.perf_counter()
        try:
            allocations = self._client.list_gpu_allocations()
        except KubeletError as err:
            self._failed(str(err), time.perf_counter() - started)
            return
        except Exception as err:  # a bug here must not end attribution for good
            log.exception("pod attribution refresh failed")
            self._failed(repr(err), time.perf_counter() - started)
            return
        if self._health is not None:
            self._health.record("pods", success=True, duration_seconds=time.perf_counter() - started)
        if not self._up:
            log.info("kubelet pod-resources at %s answers: %d pods hold GPUs",
                     self.socket_path, allocations.pod_count)
        self._allocations = allocations
        self._last_success = self._clock()
        self._seen = True
        self._up = True
        self._failing_since_logged = False

    def _failed(self, reason: str, duration: float) -> None:
        if self._health is not None:
            self._health.record("pods", success=False, duration_seconds=duration)
        self._seen = True
        self._up = False
        self._failures += 1
        if not self._failing_since_logged:
            log.warning("cannot list pods: %s; keeping the last answer for up to %gs",
                        reason, self._keep_for)
            self._failing_since_logged = True
        if self._last_success is None or self._clock() - self._last_success > self._keep_for:
            if self._allocations is not _EMPTY:
                log.warning("dropping pod attribution: the kubelet has not answered for over %gs",
                            self._keep_for)
            self._allocations = _EMPTY

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.refresh()
