"""Building the capture service from configuration, or deciding the node runs without one."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gpuscope.capture.analysis_worker import AnalysisLimits, AnalysisWorker
from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.kineto.backend import KinetoBackend
from gpuscope.capture.kineto.daemon import KinetoDaemon
from gpuscope.capture.kineto.errors import KinetoDaemonError
from gpuscope.capture.ledger import LEDGER_FILE, AdmissionLedger, Admissions
from gpuscope.capture.model import CaptureBackend
from gpuscope.capture.policy import CapturePolicy
from gpuscope.capture.service import CaptureService
from gpuscope.capture.store import CaptureStore, CaptureStoreError, CaptureStoreInUseError
from gpuscope.capture.targets import TargetResolver
from gpuscope.capture.tsl import TslProfilerBackend
from gpuscope.health import SourceHealth
from gpuscope.listeners import SocketListeners
from gpuscope.snapshot import SnapshotSource

log = logging.getLogger(__name__)


@dataclass
class Captures:
    service: CaptureService
    store: CaptureStore
    kineto: KinetoDaemon
    analysis: AnalysisWorker | None = None

    def start(self) -> None:
        if self.analysis is not None:
            self.analysis.start()
        try:
            self.kineto.start()
        except KinetoDaemonError as err:  # e.g. a dynolog daemon already owns @dynolog
            setting = f" (setting capture.kineto.{err.setting})" if err.setting else ""
            log.warning("PyTorch (Kineto) captures disabled: %s%s", err, setting)
        self.service.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Within ``timeout``: a capture in progress is abandoned (its staging directory is removed at
        the next start), the Kineto daemon stops, the store is released."""
        deadline = time.monotonic() + timeout
        self.service.stop(timeout=max(0.0, deadline - time.monotonic()))
        if self.analysis is not None:
            self.analysis.stop(timeout=max(0.0, deadline - time.monotonic()))
        if self.kineto.running:
            self.kineto.stop(timeout=max(0.0, deadline - time.monotonic()))
        self.store.close()


def build_captures(config: CaptureConfig, *, snapshots: SnapshotSource, hostname: str,
                   health: SourceHealth | None = None,
                   listeners: SocketListeners | None = None) -> Captures | None:
    """The capture service, or None (logged once) when captures are off or the store is unusable:
    a node that cannot store traces still samples, exports and alerts. ``listeners``: the thread that
    waits on the Kineto daemon's socket (by default one of its own)."""
    if not config.enabled:
        return None
    try:
        store = CaptureStore(config.store.root, quota_bytes=config.store.quota_bytes,
                             min_free_bytes=config.store.min_free_bytes)
    except CaptureStoreInUseError as err:  # never shared: the other agent's captures stay its own
        log.warning("captures disabled: %s", err)
        return None
    except (OSError, CaptureStoreError) as err:
        log.warning("captures disabled: cannot use the capture store %s (%s); set capture.store.root "
                    "to a writable directory", config.store.root, err)
        return None
    # The node's Kineto on-demand daemon: PyTorch jobs started with KINETO_USE_DAEMON=1 register here.
    kineto = KinetoDaemon(trace_dir=config.kineto.trace_dir, socket_dir=config.kineto.socket_dir,
                          health=health, listeners=listeners)
    backends: dict[str, CaptureBackend] = {
        "tsl": TslProfilerBackend(max_trace_bytes=config.max_trace_bytes),
        # A Kineto trace is a file streamed into the store: its own cap (on disk) and wait.
        "kineto": KinetoBackend(kineto, hostname=hostname, max_trace_bytes=config.kineto.max_trace_bytes,
                                write_timeout_s=config.kineto.write_timeout)}
    resolver = TargetResolver(profiler_ports=config.profiler_ports, static_targets=config.targets,
                              kineto_registered=kineto.registered)
    ledger = AdmissionLedger(store.root / LEDGER_FILE)
    policy = CapturePolicy(config, ledger=ledger, restored=restored_admissions(ledger, store))
    service = CaptureService(store=store, policy=policy, resolver=resolver,
                             backends=backends, snapshots=snapshots, hostname=hostname, health=health,
                             deadline_margin_s=config.deadline_margin)
    analysis = None
    if config.analysis.enabled:
        analysis = AnalysisWorker(store, AnalysisLimits(
            max_trace_bytes=config.analysis.max_trace_bytes, cpu_seconds=config.analysis.cpu_seconds,
            memory_bytes=config.analysis.memory_bytes))
        service.add_stored_listener(analysis.submit)
    return Captures(service, store, kineto, analysis)


def restored_admissions(ledger: AdmissionLedger, store: CaptureStore) -> Admissions:
    """The ledger's admissions; without a ledger (a store from an older agent), the stored alert and
    webhook captures' start times stand in: each one was admitted, charged the automatic captures'
    budget and started its GPU's alert cooldown (a person's request does neither: its budget is its
    requester's, in memory)."""
    if ledger.exists():
        return ledger.load()
    admissions = Admissions()
    for record in sorted(store.list(), key=lambda r: r.start):
        if record.trigger.kind in ("alert", "webhook"):
            admissions.started.append(record.start)
            admissions.last_on_gpu[record.gpu] = record.start
    return admissions
