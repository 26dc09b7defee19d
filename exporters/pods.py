"""Prometheus exposition of the pod attribution's own health (the catalogue: docs/metrics.md, "Pods").

Nothing is exported on a node that never had a kubelet pod-resources socket, so bare-metal hosts do
not carry a permanently "down" series. The attribution itself (``gpu_pod_info`` and the ``pod``
labels) comes with the Snapshot, in ``prometheus.SnapshotCollector``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpuscope.exporters.families import Collector, CounterMetricFamily, GaugeMetricFamily, Metric
from gpuscope.host.pods import PodResourcesStatus


class PodResourcesCollector(Collector):
    """Collects ``gpuscope_pod_resources_up``, ``gpuscope_pod_resources_pods`` and
    ``gpuscope_pod_resources_failures_total`` from ``source``."""

    def __init__(self, source: Callable[[], PodResourcesStatus]) -> None:
        self._source = source

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        status = self._source()
        if not status.seen:
            return []
        up = GaugeMetricFamily(
            "gpuscope_pod_resources_up",
            "Whether the last query of the kubelet's pod-resources API succeeded (1) or not (0).",
            value=1 if status.up else 0)
        pods = GaugeMetricFamily(
            "gpuscope_pod_resources_pods",
            "Pods holding at least one of this node's GPUs, as last known from the kubelet, in pods.",
            value=status.pods)
        failures = CounterMetricFamily(
            "gpuscope_pod_resources_failures",
            "Failed queries of the kubelet's pod-resources API since the agent started, in failures.",
            value=status.failures_total)
        return [up, pods, failures]
