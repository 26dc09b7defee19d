"""The OTLP mapping (gpuscope.otlp.catalogue, encode): every family the Prometheus side renders has its
OTLP metric, the hw.* metrics carry the conventions' names, units and required attributes, values are
the snapshot's own, the per-process series keep the Prometheus side's bounds and privacy defaults,
and counters are cumulative with a start time."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from snapshots import make_full_snapshot, make_gpu, make_process, make_snapshot

from gpuscope.alerts.model import Alert
from gpuscope.exporters.alerts import AlertCollector
from gpuscope.exporters.families import Metric
from gpuscope.exporters.health import SourceHealthCollector
from gpuscope.health import SourceHealth
from gpuscope.otlp.catalogue import DERIVED, DROP, NOT_PUSHED, RULES
from gpuscope.otlp.encode import RequestEncoder, unix_nanos
from gpuscope.otlp.factory import ProcessExport, SnapshotFamilies
from gpuscope.otlp.proto import load_protos
from gpuscope.snapshot import Snapshot
from gpuscope.version import __version__

ROOT = Path(__file__).resolve().parent.parent
START = 1.7e9
PROTOS = load_protos()


class _Alerts:
    """An AlertSource with one firing alert and a transition count."""

    def alerts(self) -> list[Alert]:
        return [Alert(name="GpuLowUtilization", gpu=0, uuid=make_gpu(0).uuid, severity="warning",
                      state="firing", hostname="node-7", active_since=START, firing_since=START, values={},
                      summary="low")]

    def transition_counts(self) -> dict[tuple[str, str], int]:
        return {("GpuLowUtilization", "firing"): 1}


def _extra() -> list[Any]:
    health = SourceHealth()
    health.record("nvml", success=True, duration_seconds=0.01)
    return [SourceHealthCollector(health), AlertCollector(_Alerts())]  # type: ignore[arg-type]


def encode(snapshot: Snapshot, *, processes: ProcessExport | None = None,
           encoder: RequestEncoder | None = None, families: SnapshotFamilies | None = None) -> Any:
    families = families or SnapshotFamilies(processes or ProcessExport(), interval_seconds=1.0,
                                            extra=_extra())
    encoder = encoder or RequestEncoder(PROTOS, start_time=START, k8s_node_name=lambda: "node-7")
    return encoder.encode(snapshot, families.families(snapshot))


def metrics_of(request: Any) -> dict[str, Any]:
    (resource_metrics,) = request.resource_metrics
    (scope_metrics,) = resource_metrics.scope_metrics
    return {m.name: m for m in scope_metrics.metrics}


def points(metric: Any) -> list[Any]:
    return list(metric.sum.data_points if metric.WhichOneof("data") == "sum" else metric.gauge.data_points)


def attrs(point: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in point.attributes}


def value(point: Any) -> float:
    return float(getattr(point, point.WhichOneof("value")))


def find(metric: Any, **wanted: Any) -> Any:
    """The one point of ``metric`` whose attributes include ``wanted`` (dots written as __)."""
    wanted = {key.replace("__", "."): v for key, v in wanted.items()}
    found = [p for p in points(metric) if wanted.items() <= attrs(p).items()]
    assert len(found) == 1, (metric.name, wanted, [attrs(p) for p in points(metric)])
    return found[0]


def _families(snapshot: Snapshot, **options: Any) -> list[Metric]:
    return SnapshotFamilies(ProcessExport(**options), interval_seconds=1.0, extra=_extra()).families(snapshot)


def _exposed(family: Metric) -> str:
    return family.name + "_total" if family.type == "counter" else family.name


# -- the catalogue -------------------------------------------------------------------------------------


def test_every_family_of_a_full_snapshot_is_mapped_or_listed_as_not_pushed() -> None:
    names = {_exposed(f) for f in _families(make_full_snapshot(), cmdline=True)}
    assert names - RULES.keys() - NOT_PUSHED.keys() == set(), "a family without an OTLP rule"
    assert RULES.keys() - names == set(), "a rule no family uses"


def test_every_label_has_an_attribute_or_is_dropped_on_purpose() -> None:
    for family in _families(make_full_snapshot(), cmdline=True):
        rule = RULES.get(_exposed(family))
        if rule is None:
            continue
        for sample in family.samples:
            unmapped = set(sample.labels) - set(rule.labels)
            assert not unmapped, (family.name, unmapped)


def test_one_name_one_instrument_and_unit() -> None:
    seen: dict[str, tuple[str, str]] = {}
    for rule in RULES.values():
        kind = (rule.instrument, rule.unit)
        assert seen.setdefault(rule.name, kind) == kind, rule.name
        assert re.fullmatch(r"(hw|gpuscope)\.[a-z0-9_.]+", rule.name), rule.name


def test_the_hw_names_are_the_conventions_own() -> None:
    conventions = {  # docs/hardware/gpu.md and common.md of the semantic conventions
        "hw.gpu.utilization": ("gauge", "1"), "hw.gpu.memory.usage": ("updowncounter", "By"),
        "hw.gpu.memory.limit": ("updowncounter", "By"), "hw.gpu.io": ("counter", "By"),
        "hw.power": ("gauge", "W"), "hw.energy": ("counter", "J"), "hw.errors": ("counter", "{error}"),
        "hw.status": ("updowncounter", "1"),
    }
    used = {rule.name: (rule.instrument, rule.unit) for rule in RULES.values() if rule.name.startswith("hw.")}
    assert used == conventions
    assert {name for name, *_ in DERIVED} == {"hw.gpu.memory.utilization"}


# -- values and attributes -----------------------------------------------------------------------------------


def test_the_hw_metrics_carry_the_snapshots_values_and_required_attributes() -> None:
    snapshot = make_full_snapshot()
    request = encode(snapshot)
    metrics = metrics_of(request)
    for gpu in snapshot.gpus:
        hw = {"hw__id": gpu.uuid}
        if gpu.utilization_ratio is not None:
            general = find(metrics["hw.gpu.utilization"], hw__gpu__task="general", **hw)
            assert value(general) == gpu.utilization_ratio
        assert value(find(metrics["hw.gpu.memory.usage"], **hw)) == gpu.memory_used_bytes
        assert value(find(metrics["hw.gpu.memory.limit"], **hw)) == gpu.memory_total_bytes
        assert value(find(metrics["hw.gpu.memory.utilization"], **hw)) == pytest.approx(
            (gpu.memory_used_bytes or 0) / (gpu.memory_total_bytes or 1))
        io = metrics["hw.gpu.io"]
        assert value(find(io, network__io__direction="transmit", **hw)) == gpu.pcie_tx_bytes_total
        assert value(find(io, network__io__direction="receive", **hw)) == gpu.pcie_rx_bytes_total
        assert value(find(metrics["hw.power"], **hw)) == gpu.power_watts
        assert value(find(metrics["hw.energy"], **hw)) == gpu.energy_joules_total
        errors = metrics["hw.errors"]
        assert value(find(errors, error__type="uncorrected", **hw)) == gpu.ecc_uncorrected_errors_total
        assert value(find(errors, error__type="corrected", **hw)) == gpu.ecc_corrected_errors_total
        assert value(find(metrics["hw.gpu.utilization"], hw__gpu__task="encoder", **hw)) == (
            gpu.encoder_utilization_ratio)
        states = {attrs(p)["hw.state"]: value(p) for p in points(metrics["hw.status"])
                  if attrs(p)["hw.id"] == gpu.uuid}
        state = "degraded" if gpu.index == 1 else "ok"  # GPU 1 has a remapped row waiting for a reset
        assert states == {s: float(s == state) for s in ("ok", "degraded", "predicted_failure", "failed")}
    for name, metric in metrics.items():
        if not name.startswith("hw."):
            continue
        for point in points(metric):
            found = attrs(point)
            assert found["hw.type"] == "gpu" and found["hw.id"].startswith("GPU-"), (name, found)
            gpu = next(g for g in snapshot.gpus if g.uuid == found["hw.id"])
            assert found["hw.model"] == gpu.name and found["hw.vendor"] == "NVIDIA"
            assert found["hw.name"] == f"GPU {gpu.index}"
            assert found["hw.driver_version"] == snapshot.driver_version
            assert point.time_unix_nano == unix_nanos(snapshot.timestamp)


def test_the_resource_names_the_service_the_host_and_the_node() -> None:
    request = encode(make_full_snapshot())
    resource = {kv.key: kv.value.string_value for kv in request.resource_metrics[0].resource.attributes}
    assert resource == {"service.name": "gpuscope", "service.version": __version__,
                        "host.name": make_full_snapshot().hostname, "k8s.node.name": "node-7"}
    scope = request.resource_metrics[0].scope_metrics[0].scope
    assert (scope.name, scope.version) == ("gpuscope", __version__)


def test_empty_labels_are_absent_attributes_and_pids_are_integers() -> None:
    metrics = metrics_of(encode(make_full_snapshot()))
    for point in points(metrics["gpuscope.process.memory.usage"]):
        found = attrs(point)
        assert "" not in found.values()
        assert isinstance(found["process.pid"], int)
    pod = find(metrics["gpuscope.process.memory.usage"], process__pid=4242)
    assert attrs(pod)["k8s.pod.name"] == "llm-pretrain-0" and attrs(pod)["k8s.namespace.name"] == "research"


def test_command_lines_only_when_opted_in() -> None:
    quiet = metrics_of(encode(make_full_snapshot()))
    assert not [p for p in points(quiet["gpuscope.process.info"]) if "process.command_line" in attrs(p)]
    loud = metrics_of(encode(make_full_snapshot(), processes=ProcessExport(cmdline=True)))
    shown = {attrs(p).get("process.command_line") for p in points(loud["gpuscope.process.info"])}
    assert "python3 train.py" in shown


def test_process_series_keep_the_label_allow_list_and_the_cap() -> None:
    processes = tuple(make_process(1000 + i, memory_used_bytes=(i + 1) << 20) for i in range(5))
    snapshot = make_snapshot(gpus=(make_gpu(0, processes=processes),))
    bounded = ProcessExport(labels=("pod", "namespace"), max_per_gpu=2)
    metrics = metrics_of(encode(snapshot, processes=bounded))
    (point,) = points(metrics["gpuscope.process.memory.usage"])  # no pid: the two kept processes summed
    assert "process.pid" not in attrs(point) and value(point) == (5 << 20) + (4 << 20)
    assert value(points(metrics["gpuscope.processes.dropped"])[0]) == 3
    none = metrics_of(encode(snapshot, processes=ProcessExport(export=False)))
    assert not [name for name in none if name.startswith("gpuscope.process")]


def test_mig_devices_are_components_of_their_gpu() -> None:
    snapshot = make_full_snapshot()
    metrics = metrics_of(encode(snapshot))
    mig_gpu = snapshot.gpus[2]
    device = mig_gpu.mig_devices[0]
    point = find(metrics["gpuscope.mig.memory.usage"], hw__id=device.uuid)
    assert attrs(point)["hw.parent"] == mig_gpu.uuid and attrs(point)["gpuscope.mig.profile"] == "3g.40gb"
    assert value(point) == device.memory_used_bytes


def test_alerts_and_sources_are_pushed() -> None:
    metrics = metrics_of(encode(make_full_snapshot()))
    firing = find(metrics["gpuscope.alert.firing"], gpuscope__alert__name="GpuLowUtilization")
    assert attrs(firing)["hw.id"] == make_gpu(0).uuid and value(firing) == 1.0
    assert value(find(metrics["gpuscope.source.success"], gpuscope__source="nvml")) == 1.0


# -- cumulative sums -----------------------------------------------------------------------------------------


def test_counters_are_cumulative_sums_from_the_agents_start_or_their_first_sight() -> None:
    families = SnapshotFamilies(ProcessExport(), interval_seconds=1.0)
    encoder = RequestEncoder(PROTOS, start_time=START)
    first = make_snapshot(gpus=(make_gpu(0, processes=()),))
    metrics = metrics_of(encode(first, encoder=encoder, families=families))
    energy = metrics["hw.energy"]
    assert energy.sum.is_monotonic and energy.sum.aggregation_temporality == 2  # CUMULATIVE
    assert points(energy)[0].start_time_unix_nano == unix_nanos(START)
    usage = metrics["hw.gpu.memory.usage"]
    assert not usage.sum.is_monotonic and usage.sum.aggregation_temporality == 2
    assert metrics["hw.power"].WhichOneof("data") == "gauge"
    assert points(metrics["hw.power"])[0].start_time_unix_nano == 0

    later = replace(first, timestamp=first.timestamp + 10,
                    gpus=(make_gpu(0, processes=(make_process(77),)),))
    metrics = metrics_of(encode(later, encoder=encoder, families=families))
    assert points(metrics["hw.energy"])[0].start_time_unix_nano == unix_nanos(START)  # the same series
    (busy,) = points(metrics["gpuscope.process.busy_time"])  # first seen now: since the previous push
    assert busy.start_time_unix_nano == unix_nanos(first.timestamp)

    reset = replace(later, timestamp=later.timestamp + 10,
                    gpus=(make_gpu(0, processes=(), energy_joules_total=1.0),))
    metrics = metrics_of(encode(reset, encoder=encoder, families=families))
    assert points(metrics["hw.energy"])[0].start_time_unix_nano == unix_nanos(later.timestamp)


# -- a simulated node ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simulated_snapshot() -> Iterator[Snapshot]:
    """A few ticks of the simulated ``demo`` node through the real sampler."""
    from gpuscope.host.processes import ProcessInspector
    from gpuscope.nvml.boundary import Nvml
    from gpuscope.sampling.sampler import Sampler
    from gpuscope.simulate import Simulation, load_scenario

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    simulation = Simulation(load_scenario("demo"), clock=clock)
    simulation.install()
    sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                      wall_clock=lambda: START + clock.now, hostname="sim-node")
    try:
        for _ in range(12):
            sampler.tick()
            clock.now += 1.0
        snapshot = sampler.latest()
        assert snapshot is not None
        yield snapshot
    finally:
        sampler.stop()
        simulation.uninstall()


def test_a_simulated_nodes_snapshot_maps_exactly(simulated_snapshot: Snapshot) -> None:
    snapshot = simulated_snapshot
    families = _families(snapshot)
    metrics = metrics_of(encode(snapshot))
    # Every Prometheus sample of a mapped family is one OTLP point of its metric, with the same value.
    expected: dict[str, int] = {}
    for family in families:
        rule = RULES.get(_exposed(family))
        if rule is not None:
            expected[rule.name] = expected.get(rule.name, 0) + len(family.samples)
    derived = {name for name, *_ in DERIVED}
    got = {name: len(points(metric)) for name, metric in metrics.items() if name not in derived}
    assert got == expected
    for family in families:
        rule = RULES.get(_exposed(family))
        if rule is None or not rule.per_gpu:
            continue
        for sample in family.samples:
            wanted = {**dict(rule.fixed), "hw.id": sample.labels["uuid"]}
            for label, attribute in rule.labels.items():
                written = sample.labels.get(label, "")
                if attribute not in (DROP, "hw.id", "process.pid") and written:
                    wanted[attribute] = rule.values.get(label, {}).get(written, written)
            if "pid" in sample.labels:
                wanted["process.pid"] = int(sample.labels["pid"])
            matches = [p for p in points(metrics[rule.name]) if wanted.items() <= attrs(p).items()]
            assert len(matches) == 1, (rule.name, wanted)
            assert value(matches[0]) == pytest.approx(sample.value), (rule.name, wanted)


# -- the documentation --------------------------------------------------------------------------------------


def test_docs_metrics_md_lists_every_rule() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    match = re.search(r"^## OpenTelemetry \(OTLP\)\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, "no '## OpenTelemetry (OTLP)' section in docs/metrics.md"
    documented = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| gpu") and len(cells) == 5:
            documented[cells[0]] = (cells[1].strip("`"), cells[2], cells[3].strip("`"))
    expected = {family: (rule.name, rule.instrument, rule.unit) for family, rule in RULES.items()}
    expected.update({family: ("not pushed", "", "") for family in NOT_PUSHED})
    for family, (name, *_rest) in documented.items():
        if name.startswith("not pushed"):
            documented[family] = ("not pushed", "", "")
    assert documented == expected
