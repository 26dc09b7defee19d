"""Prometheus exposition of the agent's per-source health (the catalogue: docs/metrics.md, "Sources"):
``gpuscope_collector_success{collector}`` and ``gpuscope_collector_duration_seconds{collector}``,
the way node_exporter reports ``node_scrape_collector_*``."""

from __future__ import annotations

from collections.abc import Iterable

from gpuscope.exporters.families import Collector, GaugeMetricFamily, Metric
from gpuscope.health import SourceHealth


class SourceHealthCollector(Collector):
    """Collects the latest run of each source from ``health``; a source that never ran is absent."""

    def __init__(self, health: SourceHealth) -> None:
        self._health = health

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        runs = self._health.runs()
        if not runs:
            return []
        success = GaugeMetricFamily(
            "gpuscope_collector_success",
            "Whether the last run of the agent's source succeeded (1) or not (0), by source.",
            labels=("collector",))
        duration = GaugeMetricFamily(
            "gpuscope_collector_duration_seconds",
            "Time the last run of the agent's source took, by source, in seconds.",
            labels=("collector",), unit="seconds")
        for source, run in runs.items():
            success.add_metric((source,), 1.0 if run.success else 0.0)
            if run.duration_seconds is not None:
                duration.add_metric((source,), run.duration_seconds)
        return [family for family in (success, duration) if family.samples]
