"""The OTLP export's own state on the Prometheus side (the catalogue: docs/metrics.md, "OTLP export"):
requests by outcome, the queue, the last accepted push. Rendered on every scrape: pushes happen
between sampling ticks."""

from __future__ import annotations

from collections.abc import Iterable

from gpuscope.exporters.families import Collector, CounterMetricFamily, GaugeMetricFamily, Metric
from gpuscope.otlp.delivery import OUTCOMES, OtlpExporter


class OtlpCollector(Collector):
    def __init__(self, exporter: OtlpExporter, max_queue: int) -> None:
        self._exporter = exporter
        self._max_queue = max_queue

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        counts = self._exporter.counts()
        exports = CounterMetricFamily(
            "gpuscope_otlp_exports",
            "OTLP export requests since the agent started, by outcome: sent (accepted by the receiver), "
            "failed (refused, not retried), dropped (the queue was full, or unsent at shutdown), in "
            "requests.",
            labels=("outcome",))
        for outcome in OUTCOMES:
            exports.add_metric((outcome,), float(counts[outcome]))
        families: list[Metric] = [
            exports,
            CounterMetricFamily("gpuscope_otlp_retries",
                                "OTLP push attempts that failed and were tried again (connection errors, "
                                "timeouts, 429, 502, 503, 504), in attempts.",
                                value=float(self._exporter.retries)),
            GaugeMetricFamily("gpuscope_otlp_queue_length",
                              "OTLP export requests waiting to be sent, in requests (at most "
                              "otlp.max_queue).",
                              value=float(self._exporter.queue_length())),
            GaugeMetricFamily("gpuscope_otlp_queue_capacity",
                              "OTLP export requests the queue holds at most (otlp.max_queue), in requests.",
                              value=float(self._max_queue)),
        ]
        last = self._exporter.last_success()
        if last is not None:
            families.append(GaugeMetricFamily(
                "gpuscope_otlp_last_success_timestamp_seconds",
                "Unix time of the last OTLP push the receiver accepted, in seconds; absent before one.",
                value=last, unit="seconds"))
        return families
