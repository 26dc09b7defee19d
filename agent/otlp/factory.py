"""Builds the OTLP export from the settings: resolves the target, loads the protobuf classes (a
ConfigError naming ``pip install gpuscope[otlp]`` without them), and wires the families of each
snapshot (the Prometheus side's, with the same process settings) to the encoder and the push thread.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuscope.common.config_types import ConfigError
from gpuscope.common.process_labels import DEFAULT_MAX_PER_GPU, PROCESS_LABEL_CHOICES
from gpuscope.exporters.families import Collector, Metric
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.health import SourceHealth
from gpuscope.otlp.config import OtlpConfig
from gpuscope.otlp.delivery import OtlpExporter
from gpuscope.otlp.encode import RequestEncoder
from gpuscope.otlp.proto import load_protos
from gpuscope.otlp.self_metrics import OtlpCollector
from gpuscope.otlp.target import CONFIGURATION, ExportTarget, resolve_target
from gpuscope.otlp.transport import Transport, build_transport, payload
from gpuscope.snapshot import Snapshot, SnapshotSource


@dataclass(frozen=True)
class ProcessExport:
    """The ``processes`` settings that shape the per-process series, as the Prometheus side takes them."""

    export: bool = True
    cmdline: bool = False
    labels: Sequence[str] = PROCESS_LABEL_CHOICES
    max_per_gpu: int = DEFAULT_MAX_PER_GPU


class PinnedSource:
    """A SnapshotSource that answers one given snapshot: the Prometheus collector, asked by the push
    thread, renders the snapshot being pushed (never a newer one that came in meanwhile)."""

    def __init__(self, interval_seconds: float) -> None:
        self.interval_seconds = interval_seconds
        self.snapshot: Snapshot | None = None

    def latest(self) -> Snapshot | None:
        return self.snapshot

    def is_alive(self) -> bool:
        return True

    def snapshot_is_stale(self) -> bool:
        return False  # the push thread pushes no stale snapshot


class SnapshotFamilies:
    """The families of one snapshot, as /metrics renders them, plus ``extra`` collectors' (alerts,
    sources). One instance per push thread: the per-process series keep counter sums between calls."""

    def __init__(self, processes: ProcessExport, *, interval_seconds: float,
                 extra: Sequence[Collector] = ()) -> None:
        self._pinned = PinnedSource(interval_seconds)
        self._collector = SnapshotCollector(self._pinned, include_cmdline=processes.cmdline,
                                            include_processes=processes.export,
                                            process_labels=processes.labels,
                                            max_per_gpu=processes.max_per_gpu)
        self._extra = tuple(extra)

    def families(self, snapshot: Snapshot) -> list[Metric]:
        self._pinned.snapshot = snapshot
        families = list(self._collector.collect())
        for collector in self._extra:
            families.extend(collector.collect())
        return families


@dataclass
class OtlpExport:
    exporter: OtlpExporter
    collector: OtlpCollector
    target: ExportTarget


def build_otlp(config: OtlpConfig, source: SnapshotSource, *, processes: ProcessExport, start_time: float,
               extra: Sequence[Collector] = (), k8s_node_name: Callable[[], str | None] = lambda: None,
               health: SourceHealth | None = None,
               transport: Callable[[ExportTarget], Transport] = build_transport) -> OtlpExport:
    """The export of ``config`` (enabled); ConfigError for what cannot be used, naming its key."""
    protos = load_protos()
    target = resolve_target(config)
    try:
        sender = transport(target)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(CONFIGURATION, [f"otlp.tls: cannot load the certificates: {err}"]) from None
    families = SnapshotFamilies(processes, interval_seconds=source.interval_seconds, extra=extra)
    encoder = RequestEncoder(protos, start_time=start_time, k8s_node_name=k8s_node_name)

    def encode(snapshot: Snapshot) -> bytes:
        request = encoder.encode(snapshot, families.families(snapshot))
        return payload(target, request.SerializeToString())

    exporter = OtlpExporter(source, encode, sender, endpoint=target.url, interval_seconds=config.interval,
                            timeout_seconds=target.timeout_seconds, max_queue=config.max_queue, health=health)
    return OtlpExport(exporter=exporter, collector=OtlpCollector(exporter, config.max_queue), target=target)
