"""Prometheus exposition of the HTTP port's own state: the requests it refused before they reached
an endpoint, by reason, and whether the last change of the web configuration file could be used
(as Prometheus's ``prometheus_config_last_reload_successful``).

It lives with the HTTP side it reports on, not in ``exporters/``: the web package imports the
exporters (the families, the encoders), so the exporters must not import it back. Its families
change between sampling ticks (a refusal can come at any time), so ``/metrics`` renders them on
every request (``tick_exposition``).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuscope.exporters.families import Collector, CounterMetricFamily, GaugeMetricFamily, Metric
from gpuscope.web.rejections import Rejections
from gpuscope.web.web_config import WebConfigWatcher


class WebCollector(Collector):
    def __init__(self, rejections: Rejections, web_config: WebConfigWatcher) -> None:
        self._rejections = rejections
        self._web_config = web_config

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        rejected = CounterMetricFamily(
            "gpuscope_http_rejected_requests",
            "HTTP requests refused before reaching an endpoint, by reason: busy (web.max_requests), "
            "unauthorized, rate_limited, tls_handshake.", labels=("reason",))
        for reason, count in self._rejections.counts().items():
            rejected.add_metric((reason,), float(count))
        families: list[Metric] = [rejected]
        if self._web_config.path is not None:
            reload = GaugeMetricFamily(
                "gpuscope_web_config_last_reload_successful",
                "Whether the web configuration file's last change could be used (1) or the previous one "
                "stays in force (0).")
            reload.add_metric((), 1.0 if self._web_config.last_reload_successful else 0.0)
            families.append(reload)
        return families
