"""Prometheus exposition of the agent's own alerts, as a custom ``prometheus_client`` collector.

Every scrape builds fresh families from what the AlertSource reports now (unlike SnapshotCollector's,
rendered once per tick, these are rendered on every request): an alert that stops firing is gone
from the next scrape. Pending alerts are not exported (Prometheus'
own ``ALERTS`` series has them, with an ``alertstate`` label; the agent's are for dashboards that
show what the agent itself concluded), nor are alerts muted by a greater one on their GPU
(alerts/inhibition.py). The catalogue entries are in docs/metrics.md ("Alerts").
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuscope.alerts.model import AlertSource
from gpuscope.exporters.families import Collector, CounterMetricFamily, GaugeMetricFamily, Metric

FIRING_LABELS = ("alertname", "gpu", "uuid", "severity")
TRANSITION_LABELS = ("alertname", "state")


class AlertCollector(Collector):
    """Collects ``gpuscope_alert_firing`` and ``gpuscope_alert_transitions_total`` from ``source``."""

    def __init__(self, source: AlertSource) -> None:
        self._source = source

    def describe(self) -> Iterable[Metric]:
        # Nothing to describe up front: families depend on what fires (and registration must not collect).
        return []

    def collect(self) -> Iterable[Metric]:
        families: list[Metric] = []
        # Two firing alerts of one rule on one GPU may differ only in their extra labels (not exported):
        # one series for both, since a duplicate series makes Prometheus reject the whole scrape.
        firing = sorted({
            (alert.name, str(alert.gpu), alert.uuid, alert.severity)
            for alert in self._source.alerts() if alert.state == "firing" and not alert.inhibited_by
        })
        if firing:
            family = GaugeMetricFamily(
                "gpuscope_alert_firing",
                "Whether an alert of the agent's own rules is firing on the GPU (1); absent when it is not, "
                "or when a greater alert on the GPU inhibits it.",
                labels=FIRING_LABELS)
            for labels in firing:
                family.add_metric(labels, 1.0)
            families.append(family)
        counts = sorted(self._source.transition_counts().items())
        if counts:
            counter = CounterMetricFamily(
                "gpuscope_alert_transitions",
                "Alert state transitions since the agent started, by rule and the state entered, "
                "in transitions.",
                labels=TRANSITION_LABELS)
            for (name, state), count in counts:
                counter.add_metric((name, state), float(count))
            families.append(counter)
        return families
