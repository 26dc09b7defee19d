"""The agent's metric families and process collector against prometheus_client's, whose shapes they
take: the same constructor arguments build equal families, and the same process is described by the
same series."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, metrics_core
from prometheus_client.process_collector import ProcessCollector as ClientProcessCollector

from gpuscope.exporters import families
from gpuscope.exporters.process_metrics import ProcessCollector


def as_tuple(family: Any) -> tuple[Any, ...]:
    return (family.name, family.documentation, family.type, family.unit,
            [tuple(sample) for sample in family.samples])


@pytest.mark.parametrize(("kind", "args", "kwargs", "rows"), [
    ("Gauge", ("gpu_power", "Power."), {"unit": "watts", "labels": ["gpu"]}, [(["0"], 1.5), (["1"], 2)]),
    ("Gauge", ("gpu_power_watts", "Power."), {"unit": "watts"}, []),
    ("Gauge", ("up", "Up."), {"value": 1}, []),
    ("Counter", ("gpu_energy_joules_total", "Energy."), {"unit": "joules", "labels": ["gpu", "uuid"]},
     [(["0", "GPU-a"], 10.0), (["1", "GPU-b"], 0)]),
    ("Counter", ("xids", "Xids."), {"labels": ["gpu"]}, [(["0"], 3, 1_700_000_000.0)]),
    ("Counter", ("scrapes_total", "Scrapes."), {"value": 7, "created": 123.0}, []),
    ("Gauge", ("job:recorded", "A colon."), {"labels": ["a"]}, [(["x"], 1)]),
])
def test_the_same_arguments_build_the_same_family(kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                                                  rows: list[tuple[Any, ...]]) -> None:
    ours = getattr(families, f"{kind}MetricFamily")(*args, **kwargs)
    theirs = getattr(metrics_core, f"{kind}MetricFamily")(*args, **kwargs)
    for row in rows:
        ours.add_metric(*row)
        theirs.add_metric(*row)
    assert as_tuple(ours) == as_tuple(theirs)
    assert families.Sample._fields == metrics_core.Sample._fields
    twin = copy.copy(ours)
    twin.samples = twin.samples[:1]
    assert ours.samples == [families.Sample(*s) for s in theirs.samples]  # the copy left it whole


@pytest.mark.parametrize(("name", "typ", "error"), [
    ("1gpu", "gauge", "Invalid metric name"), ("gpu power", "gauge", "Invalid metric name"),
    ("gpu", "heatmap", "Invalid metric type"),
])
def test_an_invalid_name_or_type_is_refused(name: str, typ: str, error: str) -> None:
    # Names outside the legacy character set, which prometheus_client takes since UTF-8 names, are
    # refused too: the agent's names are all legacy ones, and a typo is caught where it is made.
    with pytest.raises(ValueError, match=error):
        families.Metric(name, "Help.", typ)


def test_value_and_labels_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="at most one"):
        families.GaugeMetricFamily("g", "G.", value=1, labels=["a"])
    with pytest.raises(ValueError, match="at most one"):
        families.CounterMetricFamily("c", "C.", value=1, labels=["a"])


def test_the_registry_collects_in_order_and_refuses_a_collector_twice() -> None:
    class Fixed:
        def __init__(self, *names: str) -> None:
            self.names = names

        def collect(self) -> list[families.Metric]:
            return [families.GaugeMetricFamily(name, "H.", value=1) for name in self.names]

    registry = families.Registry()
    first, second = Fixed("a", "b"), Fixed("c")
    registry.register(first)
    registry.register(second)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(first)
    assert [f.name for f in registry.collect()] == ["a", "b", "c"]
    registry.unregister(first)
    assert [f.name for f in registry.collect()] == ["c"]


def test_the_process_collector_describes_this_process_as_prometheus_clients_does() -> None:
    theirs = {f.name: f for f in ClientProcessCollector(registry=CollectorRegistry()).collect()}
    ours = {f.name: f for f in ProcessCollector().collect()}
    assert sorted(ours) == sorted(theirs) == sorted([
        "process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
        "process_cpu_seconds", "process_open_fds", "process_max_fds"])
    for name, family in ours.items():
        other = theirs[name]
        assert (family.documentation, family.type) == (other.documentation, other.type)
        assert family.unit == other.unit
        assert [s.name for s in family.samples] == [s.name for s in other.samples]
        value, expected = family.samples[0].value, other.samples[0].value
        if name in ("process_start_time_seconds", "process_max_fds"):
            assert value == expected
        else:  # read a moment apart
            assert value == pytest.approx(expected, rel=0.2, abs=64 << 20)


def test_without_proc_there_are_no_process_series(tmp_path: Any) -> None:
    assert ProcessCollector(proc=str(tmp_path)).collect() == []
