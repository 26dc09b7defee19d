"""Prometheus exposition of the agent's captures, as a custom ``prometheus_client`` collector.

Each scrape reads what the CaptureStats source reports now. The catalogue entries are in
docs/metrics.md ("Captures").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, get_args

from gpuscope.capture.model import Outcome, TriggerKind
from gpuscope.exporters.families import Collector, CounterMetricFamily, GaugeMetricFamily, Metric

CAPTURE_LABELS = ("trigger", "outcome")
_ALL_PAIRS: tuple[tuple[TriggerKind, Outcome], ...] = tuple(
    (trigger, outcome) for trigger in get_args(TriggerKind) for outcome in get_args(Outcome))


class CaptureStats(Protocol):
    """The capture machinery as the metrics see it; every method is safe from any thread."""

    def capture_counts(self) -> Mapping[tuple[TriggerKind, Outcome], int]:
        """(trigger kind, outcome) -> captures that ended so, since the agent started (policy refusals
        included, with outcome ``refused``)."""
        ...

    def store_bytes(self) -> int | None:
        """Bytes the capture store holds now; None when there is no store (captures disabled)."""
        ...

    def last_capture_timestamp(self) -> float | None:
        """Unix time at which the newest stored capture with a trace started; None if there is none."""
        ...

    def budget_remaining(self) -> int | None:
        """Captures the hourly budget still allows now; None when there is no store."""
        ...


class FindingStats(Protocol):
    def finding_counts(self) -> Mapping[str, int]:
        """Finding kind (``healthy``: none) -> analysed captures that showed it, since the agent started."""
        ...


class CaptureCollector(Collector):
    """Collects ``gpuscope_captures_total``, ``gpuscope_capture_store_bytes``,
    ``gpuscope_capture_budget_remaining`` and ``gpuscope_capture_last_timestamp_seconds`` from
    ``source``, and ``gpuscope_capture_findings_total`` from ``findings`` (the analysis worker)."""

    def __init__(self, source: CaptureStats, findings: FindingStats | None = None) -> None:
        self._source = source
        self._findings = findings

    def describe(self) -> Iterable[Metric]:
        return []  # registration must not read the store

    def collect(self) -> Iterable[Metric]:
        families: list[Metric] = []
        stored = self._source.store_bytes()
        observed = self._source.capture_counts()
        if stored is not None:
            # Every (trigger, outcome) pair from 0 while captures are enabled: a series that first
            # appears at 1 hides that capture from increase() and rate(), so dashboards and alerts
            # would miss the first capture of each kind after every agent restart.
            observed = {**dict.fromkeys(_ALL_PAIRS, 0), **observed}
        counts = sorted(observed.items())
        if counts:
            counter = CounterMetricFamily(
                "gpuscope_captures",
                "Profiler captures since the agent started, by what triggered them and how they ended, "
                "in captures.",
                labels=CAPTURE_LABELS)
            for (trigger, outcome), count in counts:
                counter.add_metric((trigger, outcome), float(count))
            families.append(counter)
        if stored is not None:
            families.append(GaugeMetricFamily(
                "gpuscope_capture_store_bytes",
                "Disk space used by the stored captures (traces and records), in bytes.",
                value=float(stored), unit="bytes"))
        budget = self._source.budget_remaining()
        if budget is not None:
            families.append(GaugeMetricFamily(
                "gpuscope_capture_budget_remaining",
                "Alert and webhook captures the hourly budget (capture.hourly_budget) still allows in "
                "the rolling hour, restored across restarts.", value=float(budget)))
        if self._findings is not None:
            findings = CounterMetricFamily(
                "gpuscope_capture_findings",
                "Analysed captures since the agent started by the findings their traces showed (each "
                "finding's kind, such as input_bound or tensor_cores_idle; healthy: none that holds a "
                "step back), in captures.", labels=("finding",))
            for finding, count in sorted(self._findings.finding_counts().items()):
                findings.add_metric((finding,), float(count))
            families.append(findings)
        last = self._source.last_capture_timestamp()
        if last is not None:
            families.append(GaugeMetricFamily(
                "gpuscope_capture_last_timestamp_seconds",
                "Unix time at which the newest stored capture with a trace started, in seconds.",
                value=last, unit="seconds"))
        return families
