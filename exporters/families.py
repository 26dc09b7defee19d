"""Metric families as the collectors build them and the encoders read them, and the registry that
holds the collectors.

These are prometheus_client's shapes (``metrics_core.Metric``, ``GaugeMetricFamily``,
``CounterMetricFamily``, ``samples.Sample``, a registry's ``collect()``), written here so that the
agent does not import prometheus_client to serve ``/metrics``: its package imports its HTTP server
and client, and with them ``http.server``, ``urllib.request``, ``email`` and ``ssl`` (some 9 MiB of
a process's memory, for code the agent never runs). Names, units, types and samples follow
prometheus_client's rules exactly, so its own encoders (``exposition``'s slow path, imported when a
family needs it) render these families as they would render its own, and tests/test_exposition.py
checks both against each other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

__all__ = ["Collector", "CounterMetricFamily", "GaugeMetricFamily", "Metric", "Registry", "Sample"]

# prometheus_client's legacy metric name set (its validation accepts these names in every scheme).
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_TYPES = frozenset({"counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown", "info",
                    "stateset"})


class Sample(NamedTuple):
    """One sample of a family, field for field prometheus_client's ``Sample``."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: Any = None
    exemplar: Any = None
    native_histogram: Any = None


class Metric:
    """A metric family: its name (with the unit appended when it does not end with it already),
    help text, type, unit and samples."""

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        if not _METRIC_NAME.fullmatch(name):
            raise ValueError("Invalid metric name: " + name)
        if typ == "untyped":
            typ = "unknown"
        if typ not in _TYPES:
            raise ValueError("Invalid metric type: " + typ)
        self.name = name
        self.documentation = documentation
        self.unit = unit
        self.type = typ
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: dict[str, str], value: float,  # noqa: PLR0917 - as prometheus_client's
                   timestamp: Any = None, exemplar: Any = None, native_histogram: Any = None) -> None:
        self.samples.append(Sample(name, labels, value, timestamp, exemplar, native_histogram))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Metric) and self.name == other.name
                and self.documentation == other.documentation and self.type == other.type
                and self.unit == other.unit and self.samples == other.samples)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return (f"Metric({self.name!r}, {self.documentation!r}, {self.type!r}, {self.unit!r}, "
                f"{self.samples!r})")


class GaugeMetricFamily(Metric):
    """A gauge: one sample per label set, named as the family."""

    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None, unit: str = "") -> None:
        super().__init__(name, documentation, "gauge", unit)
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")
        self._labelnames = tuple(labels or ())
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float, timestamp: Any = None) -> None:
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels, strict=False)), value,
                                   timestamp))


class CounterMetricFamily(Metric):
    """A counter: the family is named without ``_total``, its samples with it."""

    def __init__(self, name: str, documentation: str,  # noqa: PLR0917 - as prometheus_client's
                 value: float | None = None, labels: Sequence[str] | None = None,
                 created: float | None = None, unit: str = "") -> None:
        if name.endswith("_total"):
            name = name[:-6]
        super().__init__(name, documentation, "counter", unit)
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")
        self._labelnames = tuple(labels or ())
        if value is not None:
            self.add_metric([], value, created)

    def add_metric(self, labels: Sequence[str], value: float, created: float | None = None,
                   timestamp: Any = None) -> None:
        label_dict = dict(zip(self._labelnames, labels, strict=False))
        self.samples.append(Sample(self.name + "_total", label_dict, value, timestamp))
        if created is not None:
            self.samples.append(Sample(self.name + "_created", dict(label_dict), created, timestamp))


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class Registry:
    """The collectors whose families ``/metrics`` serves, in the order they were registered."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        if any(c is collector for c in self._collectors):
            raise ValueError(f"collector already registered: {collector!r}")
        self._collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        self._collectors = [c for c in self._collectors if c is not collector]

    def collect(self) -> Iterator[Metric]:
        for collector in list(self._collectors):
            yield from collector.collect()


def new_family(counter: bool, name: str, help_text: str, labels: Sequence[str],
           unit: str = "") -> GaugeMetricFamily | CounterMetricFamily:
    """An empty counter or gauge family, chosen by ``counter`` (catalogue rows say which)."""
    return (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_text, labels=labels, unit=unit)
