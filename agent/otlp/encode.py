"""One snapshot's families as an OTLP ``ExportMetricsServiceRequest`` (catalogue.py names each).

The families are the ones the Prometheus side renders from the same snapshot (built by the caller
with the same settings), so what is pushed is what is scraped: the same series, the same values,
the same per-process bounds. What OTLP adds:

* the resource: ``service.name`` (gpuscope), ``service.version``, ``host.name`` (the node's name) and
  ``k8s.node.name`` where the kubelet answers;
* on every point of a GPU the hardware conventions' descriptors: ``hw.id`` (its UUID), ``hw.type``
  (gpu), ``hw.name`` (``GPU <index>``), ``hw.model``, ``hw.vendor``, ``hw.driver_version``;
* counters and up-down counters as cumulative Sums with a start time: the agent's start for a series
  in the first push, else the previous push's time for a series first seen (or seen to fall) since;
* ``hw.gpu.memory.utilization``, memory used over memory total.

An empty label value (no pod, no MIG instance) is an absent attribute, never an empty one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpuscope.exporters.families import Metric
from gpuscope.otlp.catalogue import HW_ID, HW_PARENT, INT_ATTRIBUTES, RULES, OtlpRule
from gpuscope.otlp.proto import OtlpProtos
from gpuscope.snapshot import Snapshot
from gpuscope.version import __version__

SERVICE_NAME = "gpuscope"
GPU_VENDOR = "NVIDIA"  # NVML speaks for NVIDIA's GPUs only
_CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
_NS = 1_000_000_000
# The conventions' own descriptions of the hw.* metrics (several families share each).
HW_DESCRIPTIONS = {
    "hw.gpu.utilization": "Fraction of time spent in a specific task.",
    "hw.gpu.memory.usage": "GPU memory used.",
    "hw.gpu.memory.limit": "Size of the GPU memory.",
    "hw.gpu.memory.utilization": "Fraction of GPU memory used.",
    "hw.gpu.io": "Received and transmitted bytes by the GPU.",
    "hw.power": "Instantaneous power consumed by the component.",
    "hw.energy": "Energy consumed by the component.",
    "hw.errors": "Number of errors encountered by the component.",
    "hw.status": "Operational status: 1 (true) or 0 (false) for each of the possible states.",
}

_Attributes = tuple[tuple[str, str | int], ...]
_SeriesKey = tuple[str, _Attributes]


class RequestEncoder:
    """Encodes one push at a time, keeping each cumulative series' start time between pushes (only of
    the series in the last push: the memory is that of one push)."""

    def __init__(self, protos: OtlpProtos, *, start_time: float,
                 k8s_node_name: Callable[[], str | None] = lambda: None) -> None:
        self._pb = protos
        self._start_ns = unix_nanos(start_time)
        self._k8s_node_name = k8s_node_name
        self._previous_ns: int | None = None  # the last push's time
        self._series: dict[_SeriesKey, tuple[int, float]] = {}  # -> (start time, last value)

    def encode(self, snapshot: Snapshot, families: Iterable[Metric]) -> Any:
        """The ExportMetricsServiceRequest of ``snapshot``'s ``families``; families without a rule
        (catalogue.NOT_PUSHED) are left out."""
        time_ns = unix_nanos(snapshot.timestamp)
        first_sight_ns = self._start_ns if self._previous_ns is None else self._previous_ns
        descriptors = gpu_descriptors(snapshot)
        metrics: dict[str, Any] = {}  # OTLP name -> Metric message, in first-seen order
        seen: dict[_SeriesKey, tuple[int, float]] = {}
        for family in families:
            rule = RULES.get(_exposed_name(family))
            if rule is None:
                continue
            metric = metrics.get(rule.name)
            if metric is None:
                metric = metrics[rule.name] = self._new_metric(rule, family.documentation)
            points = metric.sum.data_points if rule.cumulative else metric.gauge.data_points
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                attributes = _attributes(rule, sample.labels, descriptors)
                value = float(sample.value)
                point = points.add(time_unix_nano=time_ns)
                _set_value(point, rule, value)
                _set_attributes(self._pb, point.attributes, attributes)
                if rule.cumulative:
                    key = (rule.name, attributes)
                    start, last = self._series.get(key, (first_sight_ns, value))
                    if value < last and rule.instrument == "counter":  # a reset: counting anew
                        start = first_sight_ns
                    seen[key] = (start, value)
                    point.start_time_unix_nano = min(start, time_ns)
        self._add_memory_utilization(snapshot, metrics, descriptors, time_ns)
        self._series = seen
        self._previous_ns = time_ns
        pb = self._pb
        resource = pb.resource.Resource()
        _set_attributes(pb, resource.attributes, self._resource_attributes(snapshot))
        scope = pb.common.InstrumentationScope(name=SERVICE_NAME, version=__version__)
        scope_metrics = pb.metrics.ScopeMetrics(scope=scope, metrics=list(metrics.values()))
        resource_metrics = pb.metrics.ResourceMetrics(resource=resource, scope_metrics=[scope_metrics])
        return pb.service.ExportMetricsServiceRequest(resource_metrics=[resource_metrics])

    def _new_metric(self, rule: OtlpRule, help_text: str) -> Any:
        metric = self._pb.metrics.Metric(name=rule.name, unit=rule.unit,
                                         description=HW_DESCRIPTIONS.get(rule.name, help_text))
        if rule.cumulative:
            metric.sum.aggregation_temporality = _CUMULATIVE
            metric.sum.is_monotonic = rule.instrument == "counter"
        else:
            metric.gauge.SetInParent()
        return metric

    def _add_memory_utilization(self, snapshot: Snapshot, metrics: dict[str, Any],
                                descriptors: Mapping[str, _Attributes], time_ns: int) -> None:
        gpus = [g for g in snapshot.gpus if g.up and g.memory_used_bytes is not None and g.memory_total_bytes]
        if not gpus:
            return
        metric = metrics["hw.gpu.memory.utilization"] = self._pb.metrics.Metric(
            name="hw.gpu.memory.utilization", unit="1",
            description=HW_DESCRIPTIONS["hw.gpu.memory.utilization"])
        for gpu in gpus:
            point = metric.gauge.data_points.add(time_unix_nano=time_ns)
            point.as_double = (gpu.memory_used_bytes or 0) / (gpu.memory_total_bytes or 1)
            _set_attributes(self._pb, point.attributes, ((HW_ID, gpu.uuid), *descriptors.get(gpu.uuid, ())))

    def _resource_attributes(self, snapshot: Snapshot) -> _Attributes:
        attributes: list[tuple[str, str | int]] = [
            ("service.name", SERVICE_NAME), ("service.version", __version__),
            ("host.name", snapshot.hostname)]
        node = self._k8s_node_name()
        if node:
            attributes.append(("k8s.node.name", node))
        return tuple(attributes)


def unix_nanos(seconds: float) -> int:
    """Unix seconds as nanoseconds, the whole seconds exact (a float of 1.7e18 ns is not)."""
    whole = int(seconds)
    return whole * _NS + round((seconds - whole) * _NS)


def gpu_descriptors(snapshot: Snapshot) -> dict[str, _Attributes]:
    """Per GPU UUID, the attributes the conventions recommend for a GPU besides hw.id."""
    driver = (("hw.driver_version", snapshot.driver_version),) if snapshot.driver_version else ()
    return {gpu.uuid: (("hw.type", "gpu"), ("hw.name", f"GPU {gpu.index}"), ("hw.model", gpu.name),
                       ("hw.vendor", GPU_VENDOR), *driver)
            for gpu in snapshot.gpus}


def _attributes(rule: OtlpRule, labels: Mapping[str, str], descriptors: Mapping[str, _Attributes]
                ) -> _Attributes:
    out: list[tuple[str, str | int]] = []
    for label, written in labels.items():
        attribute = rule.labels.get(label)
        if not attribute or written == "":
            continue  # DROP, or an empty label: no attribute
        value = rule.values.get(label, {}).get(written, written)
        out.append((attribute, int(value) if attribute in INT_ATTRIBUTES and value.isdigit() else value))
    out.extend(rule.fixed)
    if rule.per_gpu:
        out.extend(descriptors.get(labels.get("uuid", ""), (("hw.type", "gpu"),)))
    elif rule.labels.get("uuid") == HW_PARENT:
        out.append(("hw.type", "gpu"))
    return tuple(out)


def _set_value(point: Any, rule: OtlpRule, value: float) -> None:
    if rule.unit.startswith("{") and value.is_integer():
        point.as_int = int(value)
    else:
        point.as_double = value


def _set_attributes(pb: OtlpProtos, target: Any, attributes: Iterable[tuple[str, str | int]]) -> None:
    for key, value in attributes:
        if isinstance(value, int):
            target.append(pb.common.KeyValue(key=key, value=pb.common.AnyValue(int_value=value)))
        else:
            target.append(pb.common.KeyValue(key=key, value=pb.common.AnyValue(string_value=value)))


def _exposed_name(family: Metric) -> str:
    return family.name + "_total" if family.type == "counter" else family.name
