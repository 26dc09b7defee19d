"""The Prometheus collector: catalogue, golden exposition, absence semantics, label values.

Regenerate the golden files after an intended change with::

    UPDATE_GOLDEN=1 pytest tests/test_exporter.py -k golden

and review the diff: every changed line is a change to what dashboards and alert rules see.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from snapshots import (
    DRIVER_VERSION,
    MIB,
    FakeSource,
    gpu_uuid,
    make_full_snapshot,
    make_gpu,
    make_gpus,
    make_process,
    make_snapshot,
)

from gpuscope.alerts.model import Alert, AlertState, Severity, TransitionState
from gpuscope.capture.model import Outcome, TriggerKind
from gpuscope.exporters.alerts import AlertCollector
from gpuscope.exporters.captures import CaptureCollector
from gpuscope.exporters.health import SourceHealthCollector
from gpuscope.exporters.process_series import CMDLINE_MAX_CHARS
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.health import SOURCES, SourceHealth
from gpuscope.nvml.clock_events import CLOCK_EVENT_REASONS
from gpuscope.snapshot import GpuReading, PodContainer, SlurmJob, Snapshot
from gpuscope.version import __version__
from gpuscope.web.rejections import Rejections
from gpuscope.web.self_metrics import WebCollector
from gpuscope.web.web_config import WebConfigWatcher

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "docs" / "metrics.md"
GOLDEN = Path(__file__).resolve().parent / "golden"
VERSION_PLACEHOLDER = "@VERSION@"


# -- helpers -----------------------------------------------------------------------------------------


def collect(snapshot: Snapshot | None, include_cmdline: bool = False) -> dict[str, Metric]:
    """The families one scrape yields, by exposed name (counters with ``_total``)."""
    collector = SnapshotCollector(FakeSource(snapshot), include_cmdline=include_cmdline)
    return {_exposed_name(m): m for m in collector.collect()}


def render(snapshot: Snapshot | None, include_cmdline: bool = False, openmetrics: bool = False) -> str:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(FakeSource(snapshot), include_cmdline=include_cmdline))
    encode = generate_openmetrics if openmetrics else generate_latest
    return encode(registry).decode()


LabelItems = tuple[tuple[str, str], ...]


def samples(snapshot: Snapshot | None, name: str, include_cmdline: bool = False) -> dict[LabelItems, float]:
    """Samples of the family ``name`` as {sorted label items: value}; {} when the family is absent."""
    family = collect(snapshot, include_cmdline).get(name)
    if family is None:
        return {}
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def gpu_values(snapshot: Snapshot, name: str) -> dict[str, float]:
    """{gpu index label: value} of a per-GPU family without extra labels."""
    family = collect(snapshot).get(name)
    return {} if family is None else {s.labels["gpu"]: s.value for s in family.samples}


def _exposed_name(metric: Metric) -> str:
    return metric.name + "_total" if metric.type == "counter" else metric.name


# -- catalogue ---------------------------------------------------------------------------------------


class CatalogueRow(NamedTuple):
    name: str
    type: str
    unit: str
    labels: frozenset[str]
    help: str


def parse_catalogue(text: str) -> list[CatalogueRow]:
    """The metric rows of docs/metrics.md: ``| `name` | type | `unit` | `l1`, `l2` | source | help |``."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 6, f"catalogue row needs 6 cells, got {len(cells)}: {line}"
        name, typ, unit, labels, _source, help_text = cells
        unit = unit.strip("`")
        rows.append(CatalogueRow(
            name=name.strip("`"),
            type=typ,
            unit="" if unit == "-" else unit,
            labels=frozenset(re.findall(r"`(\w+)`", labels)),
            help=help_text,
        ))
    return rows


def test_catalogue_is_well_formed() -> None:
    rows = parse_catalogue(CATALOGUE.read_text())
    names = [row.name for row in rows]
    assert len(names) == len(set(names)), "a metric is documented twice"
    assert len(rows) >= 30
    for row in rows:
        assert row.type in ("gauge", "counter"), row
        assert row.name.endswith("_total") == (row.type == "counter"), row
        assert re.fullmatch(r"(gpu|gpuscope)_[a-z][a-z0-9_]*", row.name), row
        assert row.help.endswith("."), f"HELP of {row.name} is not a sentence"
        if row.unit:
            assert f"_{row.unit}" in row.name, f"{row.name}: unit {row.unit} not in the name"
        if row.name.startswith("gpu_"):
            assert {"gpu", "uuid"} <= row.labels, f"{row.name} lacks the gpu/uuid labels"


def catalogue_section(text: str, title: str) -> str:
    """The text of the ``## title`` section of docs/metrics.md (up to the next ``## `` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no '## {title}' section in {CATALOGUE}"
    return match.group(1)


def test_full_snapshot_renders_exactly_the_catalogue() -> None:
    text = CATALOGUE.read_text()
    # The Alerts table is AlertCollector's, checked by test_alert_collector_renders_exactly_the_catalogue;
    # the Captures table is CaptureCollector's (test_capture_collector_renders_exactly_the_catalogue),
    # the Pods table's gpuscope_pod_resources_* rows PodResourcesCollector's (test_pods.py).
    documented = set(parse_catalogue(text)) - set(parse_catalogue(catalogue_section(text, "Alerts")))
    documented -= set(parse_catalogue(catalogue_section(text, "Captures")))
    documented -= set(parse_catalogue(catalogue_section(text, "Diagnosis")))  # test_diagnosis_metrics.py
    documented -= set(parse_catalogue(catalogue_section(text, "Sources")))  # SourceHealthCollector's
    documented -= set(parse_catalogue(catalogue_section(text, "The HTTP port")))  # WebCollector's
    documented = {row for row in documented if not row.name.startswith("gpuscope_pod_resources_")}
    emitted = set()
    for family in collect(make_full_snapshot(), include_cmdline=True).values():
        label_sets = {frozenset(s.labels) for s in family.samples}
        assert len(label_sets) == 1, f"{family.name}: samples with different label names"
        emitted.add(CatalogueRow(_exposed_name(family), family.type, family.unit, label_sets.pop(),
                                 family.documentation))
    assert emitted - documented == set(), "emitted but not documented (or documented differently)"
    assert documented - emitted == set(), "documented but not emitted by a fully populated snapshot"


def test_every_clock_event_reason_is_exported() -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, clock_event_reasons=frozenset({"sw_thermal_slowdown"}))])
    series = samples(snapshot, "gpu_clock_event_active")
    got = {dict(labels)["reason"]: value for labels, value in series.items()}
    assert list(got) == list(CLOCK_EVENT_REASONS.values())
    assert got == {reason: (1.0 if reason == "sw_thermal_slowdown" else 0.0) for reason in got}


# -- golden exposition -------------------------------------------------------------------------------


def _degraded_snapshot() -> Snapshot:
    """A healthy GPU, a GPU that cannot be read (with Xid history) and a MIG GPU missing readings."""
    healthy = make_gpu(0, processes=(make_process(4242),), idle_dips_total=0)
    lost = make_gpu(1, up=False, xid_errors={79: 1}, processes=(make_process(7777),))
    mig = make_gpu(
        2, mig_enabled=True, utilization_ratio=None, utilization_samples=(), busy_seconds_total=None,
        memory_utilization_ratio=None, sm_active_ratio=None, sm_occupancy_ratio=None,
        tensor_active_ratio=None, dram_active_ratio=None, sm_active_seconds_total=None,
        tensor_active_seconds_total=None,
        idle_dips_total=None, clock_event_reasons=None, pcie_tx_bytes_total=None, pcie_rx_bytes_total=None,
        ecc_uncorrected_errors_total=None,
        processes=(make_process(8888, sm_utilization_ratio=None, container_id=None, busy_seconds_total=None,
                                energy_joules_total=None),),
    )
    return make_snapshot(gpus=(healthy, lost, mig), sample_errors={"gpu_lost": 4})


GOLDEN_CASES: dict[str, Callable[[], str]] = {
    "full.prom": lambda: render(make_full_snapshot(), include_cmdline=True),
    "full_openmetrics.prom": lambda: render(make_full_snapshot(), include_cmdline=True, openmetrics=True),
    "default_8gpu.prom": lambda: render(make_snapshot(gpus=make_gpus(8, processes_per_gpu=4))),
    "degraded.prom": lambda: render(_degraded_snapshot()),
    "no_snapshot.prom": lambda: render(None),
}


@pytest.mark.parametrize("filename", sorted(GOLDEN_CASES))
def test_golden_exposition(filename: str) -> None:
    # The agent version is a placeholder in the files, so a release does not touch them.
    text = GOLDEN_CASES[filename]().replace(f'version="{__version__}"', f'version="{VERSION_PLACEHOLDER}"')
    path = GOLDEN / filename
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(text.encode())
    assert path.exists(), f"{path} missing; run with UPDATE_GOLDEN=1 to create it"
    assert text.encode() == path.read_bytes(), f"exposition differs from {path} (UPDATE_GOLDEN=1)"


# -- values and absence ------------------------------------------------------------------------------

# (GpuReading attribute, exposed family) for every plain per-GPU reading.
READINGS = [
    ("utilization_ratio", "gpu_utilization_ratio"),
    ("busy_seconds_total", "gpu_busy_seconds_total"),
    ("memory_utilization_ratio", "gpu_memory_utilization_ratio"),
    ("memory_used_bytes", "gpu_memory_used_bytes"),
    ("memory_reserved_bytes", "gpu_memory_reserved_bytes"),
    ("memory_total_bytes", "gpu_memory_total_bytes"),
    ("power_watts", "gpu_power_watts"),
    ("power_limit_watts", "gpu_power_limit_watts"),
    ("energy_joules_total", "gpu_energy_joules_total"),
    ("idle_energy_joules_total", "gpu_idle_energy_joules_total"),
    ("temperature_celsius", "gpu_temperature_celsius"),
    ("sm_clock_hertz", "gpu_sm_clock_hertz"),
    ("memory_clock_hertz", "gpu_memory_clock_hertz"),
    ("pcie_tx_bytes_total", "gpu_pcie_tx_bytes_total"),
    ("pcie_rx_bytes_total", "gpu_pcie_rx_bytes_total"),
    ("ecc_uncorrected_errors_total", "gpu_ecc_uncorrected_errors_total"),
    ("sm_active_ratio", "gpu_sm_active_ratio"),
    ("sm_active_seconds_total", "gpu_sm_active_seconds_total"),
    ("sm_occupancy_ratio", "gpu_sm_occupancy_ratio"),
    ("tensor_active_ratio", "gpu_tensor_active_ratio"),
    ("tensor_active_seconds_total", "gpu_tensor_active_seconds_total"),
    ("dram_active_ratio", "gpu_dram_active_ratio"),
    ("idle_dips_total", "gpu_idle_dips_total"),
    ("fp16_active_ratio", "gpu_fp16_active_ratio"),
    ("fp32_active_ratio", "gpu_fp32_active_ratio"),
    ("fp64_active_ratio", "gpu_fp64_active_ratio"),
    ("encoder_utilization_ratio", "gpu_encoder_utilization_ratio"),
    ("decoder_utilization_ratio", "gpu_decoder_utilization_ratio"),
    ("memory_temperature_celsius", "gpu_memory_temperature_celsius"),
    ("ecc_corrected_errors_total", "gpu_ecc_corrected_errors_total"),
    ("row_remap_pending", "gpu_row_remap_pending"),
    ("row_remap_failed", "gpu_row_remap_failed"),
    ("pcie_replays_total", "gpu_pcie_replays_total"),
    ("nvlink_active_links", "gpu_nvlink_active_links"),
    ("nvlink_transmit_bytes_total", "gpu_nvlink_transmit_bytes_total"),
    ("nvlink_receive_bytes_total", "gpu_nvlink_receive_bytes_total"),
]


@pytest.mark.parametrize(("attr", "name"), READINGS)
def test_reading_is_exported_with_its_value(attr: str, name: str) -> None:
    snapshot = make_snapshot(gpus=make_gpus(2))
    assert gpu_values(snapshot, name) == {str(g.index): getattr(g, attr) for g in snapshot.gpus}


@pytest.mark.parametrize(("attr", "name"), READINGS)
def test_none_reading_is_absent_not_zero(attr: str, name: str) -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, **{attr: None}), make_gpu(1)])
    assert list(gpu_values(snapshot, name)) == ["1"]
    only_missing = make_snapshot(gpus=[make_gpu(0, **{attr: None})])
    assert name not in collect(only_missing), "an empty family must not be exposed (HELP without samples)"


@pytest.mark.parametrize(("attr", "name"), READINGS)
def test_zero_reading_is_exported(attr: str, name: str) -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, **{attr: 0})])
    assert gpu_values(snapshot, name) == {"0": 0.0}


def test_down_gpu_exports_only_info_up_and_xid_counters() -> None:
    down = make_gpu(1, up=False, xid_errors={48: 2, 79: 1}, clock_event_reasons=frozenset({"hw_slowdown"}),
                    processes=(make_process(9999),))
    families = collect(make_snapshot(gpus=[make_gpu(0), down]), include_cmdline=True)
    per_family = {
        name: sorted(s.value for s in family.samples if s.labels.get("gpu") == "1")
        for name, family in families.items()
    }
    assert {name: values for name, values in per_family.items() if values} == {
        "gpu_info": [1.0],
        "gpu_up": [0.0],
        "gpu_xid_errors_total": [1.0, 2.0],
        "gpu_health": [0.0, 0.0, 0.0, 1.0],  # state="lost"
    }
    assert samples(make_snapshot(gpus=[down]), "gpu_xid_errors_total") == {
        (("gpu", "1"), ("uuid", gpu_uuid(1)), ("xid", "48")): 2.0,
        (("gpu", "1"), ("uuid", gpu_uuid(1)), ("xid", "79")): 1.0,
    }


def test_before_first_snapshot_only_build_info_and_nvml_down() -> None:
    families = collect(None)
    assert list(families) == ["gpuscope_build_info", "gpuscope_nvml_up"]
    assert samples(None, "gpuscope_build_info") == {(("version", __version__),): 1.0}
    assert samples(None, "gpuscope_nvml_up") == {(): 0.0}


def test_nvml_down_snapshot() -> None:
    snapshot = make_snapshot(gpus=(), nvml_up=False, driver_version=None, sample_errors={"init": 3})
    assert sorted(collect(snapshot)) == sorted([
        "gpuscope_build_info", "gpuscope_nvml_up", "gpuscope_gpus", "gpuscope_sample_duration_seconds",
        "gpuscope_last_sample_timestamp_seconds", "gpuscope_sample_errors_total",
        "gpuscope_nvml_stuck_calls_total", "gpuscope_processes_dropped_total",
    ])
    assert samples(snapshot, "gpuscope_nvml_up") == {(): 0.0}
    assert samples(snapshot, "gpuscope_gpus") == {(): 0.0}
    assert samples(snapshot, "gpuscope_sample_errors_total") == {(("reading", "init"),): 3.0}


def test_agent_metrics() -> None:
    snapshot = make_snapshot(sample_duration_seconds=0.031, timestamp=1_700_000_000.5)
    assert samples(snapshot, "gpuscope_gpus") == {(): 8.0}
    assert samples(snapshot, "gpuscope_sample_duration_seconds") == {(): 0.031}
    assert samples(snapshot, "gpuscope_last_sample_timestamp_seconds") == {(): 1_700_000_000.5}
    assert "gpuscope_sample_errors_total" not in collect(snapshot), "no errors yet: no series"


def test_gpu_info_labels() -> None:
    got = samples(make_snapshot(gpus=[make_gpu(3)]), "gpu_info")
    assert got == {(
        ("driver_version", DRIVER_VERSION), ("gpu", "3"), ("name", "NVIDIA H100 80GB HBM3"),
        ("pci_bus_id", "00000000:5D:00.0"), ("uuid", gpu_uuid(3)),
    ): 1.0}
    unknown_driver = samples(make_snapshot(gpus=[make_gpu(0)], driver_version=None), "gpu_info")
    assert [dict(labels)["driver_version"] for labels in unknown_driver] == [""]


def test_clock_events_absent_when_not_reported() -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, clock_event_reasons=None)])
    assert "gpu_clock_event_active" not in collect(snapshot)


def test_unknown_clock_event_reason_is_ignored() -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, clock_event_reasons=frozenset({"from_a_future_driver"}))])
    got = samples(snapshot, "gpu_clock_event_active")
    assert len(got) == len(CLOCK_EVENT_REASONS)
    assert set(got.values()) == {0.0}


def test_gpu_processes_counts_compute_processes_only() -> None:
    processes = (make_process(1), make_process(2), make_process(3, kind="graphics"))
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=processes), make_gpu(1, processes=())])
    assert gpu_values(snapshot, "gpu_processes") == {"0": 2.0, "1": 0.0}


# -- processes ---------------------------------------------------------------------------------------


def test_process_series_labels_and_values() -> None:
    process = make_process(4242, memory_used_bytes=20 * 1024 * MIB, sm_utilization_ratio=0.75,
                           busy_seconds_total=12.5, energy_joules_total=3456.25)
    snapshot = make_snapshot(gpus=[make_gpu(5, processes=(process,))])
    labels = (("container", ""), ("container_id", process.container_id), ("gpu", "5"), ("gpu_instance", ""),
              ("namespace", ""), ("pid", "4242"), ("pod", ""), ("process", "python3"), ("user", "alice"),
              ("uuid", gpu_uuid(5)))
    assert samples(snapshot, "gpu_process_memory_used_bytes") == {labels: 20 * 1024 * MIB}
    assert samples(snapshot, "gpu_process_sm_utilization_ratio") == {labels: 0.75}
    assert samples(snapshot, "gpu_process_busy_seconds_total") == {labels: 12.5}
    assert samples(snapshot, "gpu_process_energy_joules_total") == {labels: 3456.25}
    assert samples(snapshot, "gpu_process_info") == {tuple(sorted((*labels, ("type", "compute")))): 1.0}


def test_cmdline_label_only_when_opted_in() -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=(make_process(1),))])
    for family in collect(snapshot).values():
        assert all("cmdline" not in s.labels for s in family.samples), family.name
    opted_in = samples(snapshot, "gpu_process_memory_used_bytes", include_cmdline=True)
    assert [dict(labels)["cmdline"] for labels in opted_in] == [
        "python3 -m torch.distributed.run --nproc-per-node=8 train.py --config configs/llama-7b.yaml"
    ]


def test_per_process_series_left_out_when_not_exported() -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=(make_process(1),))])
    source = FakeSource(snapshot)
    names = {_exposed_name(f) for f in SnapshotCollector(source, include_processes=False).collect()}
    assert names and not any(name.startswith("gpu_process_") for name in names)
    assert "gpu_utilization_ratio" in names
    everything = {_exposed_name(f) for f in SnapshotCollector(source).collect()}
    assert any(name.startswith("gpu_process_") for name in everything)


def test_cmdline_is_truncated() -> None:
    process = make_process(1, cmdline=("python3", "-c", "x" * 1000))
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=(process,))])
    (labels,) = samples(snapshot, "gpu_process_info", include_cmdline=True)
    cmdline = dict(labels)["cmdline"]
    assert len(cmdline) == CMDLINE_MAX_CHARS
    assert cmdline.startswith("python3 -c xxx")


def test_process_without_host_details_has_empty_labels() -> None:
    process = make_process(5150, host_visible=False, name=None, user=None, container_id=None, cmdline=None)
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=(process,))])
    (labels,) = samples(snapshot, "gpu_process_info", include_cmdline=True)
    assert dict(labels) == {"gpu": "0", "uuid": gpu_uuid(0), "gpu_instance": "", "pid": "5150", "process": "",
                            "user": "", "container_id": "", "pod": "", "namespace": "", "container": "",
                            "cmdline": "",
                            "type": "compute"}


def test_host_details_ignored_when_not_host_visible() -> None:
    # A stale name from a recycled pid must not be attributed to the GPU process.
    process = make_process(5150, host_visible=False)
    (labels,) = samples(make_snapshot(gpus=[make_gpu(0, processes=(process,))]), "gpu_process_info")
    assert (dict(labels)["process"], dict(labels)["user"], dict(labels)["container_id"]) == ("", "", "")


TRAINER = PodContainer(namespace="research", pod="llm-pretrain-0", container="trainer")
EVAL = PodContainer(namespace="research", pod="eval-nightly", container="eval")


def test_process_of_a_gpu_allocated_to_one_pod_carries_the_pod() -> None:
    # Host-invisible processes too: the labels describe the GPU's allocation.
    processes = (make_process(1), make_process(2, host_visible=False))
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=processes, pods=(TRAINER,)),
                                   make_gpu(1, processes=(make_process(3),))])
    pods = {dict(labels)["pid"]: (dict(labels)["namespace"], dict(labels)["pod"], dict(labels)["container"])
            for labels in samples(snapshot, "gpu_process_info")}
    assert pods == {"1": ("research", "llm-pretrain-0", "trainer"),
                    "2": ("research", "llm-pretrain-0", "trainer"), "3": ("", "", "")}


def test_time_sliced_gpu_attributes_no_process_but_lists_every_pod() -> None:
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=(make_process(1), make_process(2)),
                                            pods=(EVAL, TRAINER))])
    assert {dict(labels)["pod"] for labels in samples(snapshot, "gpu_process_memory_used_bytes")} == {""}
    assert samples(snapshot, "gpu_pod_info") == {
        tuple(sorted({"gpu": "0", "uuid": gpu_uuid(0), "namespace": "research", "pod": pod.pod,
                      "container": pod.container}.items())): 1.0
        for pod in (EVAL, TRAINER)}


def test_a_gpu_shared_by_containers_of_one_pod_names_the_pod_without_a_container() -> None:
    sidecar = PodContainer(namespace="research", pod="llm-pretrain-0", container="profiler")
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=(make_process(1),), pods=(sidecar, TRAINER))])
    ((labels, _),) = samples(snapshot, "gpu_process_info").items()
    assert (dict(labels)["namespace"], dict(labels)["pod"], dict(labels)["container"]) == (
        "research", "llm-pretrain-0", "")


def test_pod_info_absent_without_pods_and_kept_while_a_gpu_is_down() -> None:
    assert "gpu_pod_info" not in collect(make_snapshot(gpus=make_gpus(2)))
    down = GpuReading(index=0, uuid=gpu_uuid(0), name="NVIDIA H100 80GB HBM3", pci_bus_id="0", up=False,
                      pods=(TRAINER,))
    assert [dict(labels)["pod"] for labels in samples(make_snapshot(gpus=[down]), "gpu_pod_info")] == [
        "llm-pretrain-0"]


def test_process_none_readings_are_absent() -> None:
    process = make_process(1, memory_used_bytes=None, sm_utilization_ratio=None, busy_seconds_total=None,
                           energy_joules_total=None)
    families = collect(make_snapshot(gpus=[make_gpu(0, processes=(process,))]))
    assert "gpu_process_memory_used_bytes" not in families
    assert "gpu_process_sm_utilization_ratio" not in families
    assert "gpu_process_busy_seconds_total" not in families
    assert "gpu_process_energy_joules_total" not in families
    assert len(families["gpu_process_info"].samples) == 1


def test_process_with_compute_and_graphics_contexts_is_not_duplicated() -> None:
    both = (make_process(77, kind="compute"), make_process(77, kind="graphics"))
    snapshot = make_snapshot(gpus=[make_gpu(0, processes=both)])
    assert len(samples(snapshot, "gpu_process_memory_used_bytes")) == 1
    assert len(samples(snapshot, "gpu_process_sm_utilization_ratio")) == 1
    assert len(samples(snapshot, "gpu_process_busy_seconds_total")) == 1
    assert len(samples(snapshot, "gpu_process_energy_joules_total")) == 1
    assert sorted(dict(labels)["type"] for labels in samples(snapshot, "gpu_process_info")) == [
        "compute", "graphics"
    ]
    # The text must parse back without duplicate series (Prometheus rejects a scrape that has them).
    lines = [line for line in render(snapshot).splitlines() if not line.startswith("#")]
    assert len(lines) == len(set(lines))


def test_vanished_processes_and_gpus_vanish_from_the_next_scrape() -> None:
    current: list[Snapshot] = [make_snapshot(gpus=make_gpus(2, processes_per_gpu=2))]
    collector = SnapshotCollector(FakeSource(lambda: current[0]))
    first = {m.name: len(m.samples) for m in collector.collect()}
    assert first["gpu_process_info"] == 4
    assert first["gpu_up"] == 2
    current[0] = make_snapshot(gpus=[make_gpu(0, processes=())])
    second = {m.name: m for m in collector.collect()}
    assert "gpu_process_info" not in second
    assert [s.labels["gpu"] for s in second["gpu_up"].samples] == ["0"]


def test_describe_does_not_collect() -> None:
    def source() -> Snapshot | None:
        raise AssertionError("the source must not be read at registration")

    registry = CollectorRegistry(auto_describe=True)
    collector = SnapshotCollector(FakeSource(source))
    registry.register(collector)
    assert list(collector.describe()) == []


def test_exposition_parses_back_to_the_snapshot_values() -> None:
    """Round trip through prometheus_client's parser: escaping of odd label values, exact large numbers."""
    odd = make_process(1, name='we"ird\\name', user="bob\nsmith", cmdline=("a b", "c\td"))
    gpu = make_gpu(0, processes=(odd,), energy_joules_total=987_654_321_012.5)
    snapshot = make_snapshot(gpus=[gpu])
    parsed = {f.name: f for f in text_string_to_metric_families(render(snapshot, include_cmdline=True))}
    (info,) = parsed["gpu_process_info"].samples
    assert (info.labels["process"], info.labels["user"], info.labels["cmdline"]) == (
        'we"ird\\name', "bob\nsmith", "a b c\td")
    assert parsed["gpu_energy_joules"].samples[0].value == 987_654_321_012.5
    assert parsed["gpu_memory_total_bytes"].samples[0].value == gpu.memory_total_bytes


def test_openmetrics_has_units_and_eof() -> None:
    text = render(make_snapshot(gpus=[make_gpu(0)]), openmetrics=True)
    assert "# UNIT gpu_memory_used_bytes bytes\n" in text
    assert "# UNIT gpu_energy_joules joules\n" in text
    assert "gpu_energy_joules_total{" in text
    assert text.endswith("# EOF\n")


def test_every_gpu_reading_field_is_covered() -> None:
    """A reading added to GpuReading must be exported (or listed here as deliberately not)."""
    not_plain_readings = {
        "index", "uuid", "name", "pci_bus_id", "up", "mig_enabled", "utilization_samples",
        "clock_event_reasons", "xid_errors", "processes", "pods", "mig_devices",
        # labelled families, tested in test_hardware_exposition.py
        "clock_throttle_seconds_total", "remapped_rows_correctable_total",
        "remapped_rows_uncorrectable_total", "pcie_errors_total", "nvlink_errors_total",
        "nvlink_link_bytes", "nvlink_link_errors_total",
    }
    assert {f.name for f in fields(GpuReading)} - not_plain_readings == {attr for attr, _ in READINGS}


# -- alerts (AlertCollector) -------------------------------------------------------------------------


class FakeAlertSource:
    """An AlertSource whose alerts and transition counts the test sets."""

    def __init__(self, alerts: list[Alert] | None = None,
                 counts: dict[tuple[str, TransitionState], int] | None = None) -> None:
        self.current = alerts or []
        self.counts = counts or {}

    def alerts(self) -> list[Alert]:
        return list(self.current)

    def transition_counts(self) -> Mapping[tuple[str, TransitionState], int]:
        return dict(self.counts)


def make_alert(name: str, gpu: int, state: AlertState = "firing", severity: Severity = "warning",
               **labels: str) -> Alert:
    return Alert(name=name, gpu=gpu, uuid=gpu_uuid(gpu), severity=severity, state=state, hostname="node-1",
                 active_since=1_700_000_000.0, firing_since=None if state == "pending" else 1_700_000_120.0,
                 values={"mean_utilization": 0.55}, summary=f"{name} on GPU {gpu}", labels=labels)


def _alert_source() -> FakeAlertSource:
    return FakeAlertSource(
        alerts=[
            make_alert("GpuLowUtilization", 1),
            make_alert("GpuXidError", 3, severity="critical"),
            make_alert("GpuSharedByProcesses", 2, state="pending"),
        ],
        counts={
            ("GpuLowUtilization", "pending"): 2, ("GpuLowUtilization", "firing"): 1,
            ("GpuLowUtilization", "inactive"): 1, ("GpuXidError", "pending"): 1, ("GpuXidError", "firing"): 1,
            ("GpuSharedByProcesses", "pending"): 1, ("GpuThrottled", "resolved"): 4,
        },
    )


def _render_alerts(source: FakeAlertSource) -> str:
    registry = CollectorRegistry()
    registry.register(AlertCollector(source))
    return generate_latest(registry).decode()


def test_alert_collector_renders_exactly_the_catalogue() -> None:
    documented = set(parse_catalogue(catalogue_section(CATALOGUE.read_text(), "Alerts")))
    assert {row.name for row in documented} == {"gpuscope_alert_firing", "gpuscope_alert_transitions_total"}
    emitted = set()
    for family in AlertCollector(_alert_source()).collect():
        label_sets = {frozenset(s.labels) for s in family.samples}
        assert len(label_sets) == 1, f"{family.name}: samples with different label names"
        emitted.add(CatalogueRow(_exposed_name(family), family.type, family.unit, label_sets.pop(),
                                 family.documentation))
    assert emitted == documented


def test_alert_collector_golden() -> None:
    text = _render_alerts(_alert_source())
    path = GOLDEN / "alerts.prom"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_bytes(text.encode())
    assert path.exists(), f"{path} missing; run with UPDATE_GOLDEN=1 to create it"
    assert text.encode() == path.read_bytes(), f"exposition differs from {path} (UPDATE_GOLDEN=1)"


def test_alert_collector_values_absence_and_freshness() -> None:
    source = _alert_source()
    collector = AlertCollector(source)
    families = {_exposed_name(m): m for m in collector.collect()}
    firing = [(dict(s.labels), s.value) for s in families["gpuscope_alert_firing"].samples]
    assert firing == [
        ({"alertname": "GpuLowUtilization", "gpu": "1", "uuid": gpu_uuid(1), "severity": "warning"}, 1.0),
        ({"alertname": "GpuXidError", "gpu": "3", "uuid": gpu_uuid(3), "severity": "critical"}, 1.0),
    ], "pending alerts are not exported"
    transitions = families["gpuscope_alert_transitions_total"].samples
    assert {(s.labels["alertname"], s.labels["state"]): s.value for s in transitions} == {
        key: float(count) for key, count in source.counts.items()}
    assert all(s.name == "gpuscope_alert_transitions_total" for s in transitions)

    # Two firing alerts of one rule on one GPU that differ only in their extra labels: one series.
    source.current = [make_alert("GpuUtilizationSkew", 0, laggard="true"),
                      make_alert("GpuUtilizationSkew", 0)]
    assert len(next(iter(collector.collect())).samples) == 1

    # Nothing firing, no transitions yet: no families at all (no HELP without samples).
    source.current, source.counts = [make_alert("GpuLowUtilization", 0, state="pending")], {}
    assert list(collector.collect()) == []
    assert _render_alerts(source) == ""


def test_alert_collector_describe_does_not_collect() -> None:
    class Exploding(FakeAlertSource):
        def alerts(self) -> list[Alert]:
            raise AssertionError("the source must not be read at registration")

    registry = CollectorRegistry(auto_describe=True)
    collector = AlertCollector(Exploding())
    registry.register(collector)
    assert list(collector.describe()) == []


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not on PATH (apt install prometheus)")
def test_alert_collector_output_passes_promtool_check_metrics() -> None:
    body = _render_alerts(_alert_source()).encode()
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30,
                            check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b""), result


# -- captures (CaptureCollector) ---------------------------------------------------------------------


class FakeCaptureStats:
    """A CaptureStats whose counts, store size and last capture time the test sets."""

    def __init__(self, counts: dict[tuple[TriggerKind, Outcome], int] | None = None,
                 stored: int | None = 0, last: float | None = None, budget: int | None = 6) -> None:
        self.counts = counts or {}
        self.stored = stored
        self.last = last
        self.budget = budget

    def capture_counts(self) -> Mapping[tuple[TriggerKind, Outcome], int]:
        return dict(self.counts)

    def store_bytes(self) -> int | None:
        return self.stored

    def last_capture_timestamp(self) -> float | None:
        return self.last

    def budget_remaining(self) -> int | None:
        return self.budget


class FakeFindings:
    def finding_counts(self) -> dict[str, int]:
        return {"input_bound": 2, "healthy": 1}


def _capture_stats() -> FakeCaptureStats:
    return FakeCaptureStats(
        counts={("alert", "captured"): 3, ("alert", "refused"): 5, ("user", "unreachable"): 1},
        stored=12_345_678, last=1_700_000_300.5)


def test_capture_collector_renders_exactly_the_catalogue() -> None:
    documented = set(parse_catalogue(catalogue_section(CATALOGUE.read_text(), "Captures")))
    assert {row.name for row in documented} == {
        "gpuscope_captures_total", "gpuscope_capture_store_bytes", "gpuscope_capture_last_timestamp_seconds",
        "gpuscope_capture_budget_remaining", "gpuscope_capture_findings_total"}
    emitted = set()
    for family in CaptureCollector(_capture_stats(), FakeFindings()).collect():
        label_sets = {frozenset(s.labels) for s in family.samples}
        assert len(label_sets) == 1, f"{family.name}: samples with different label names"
        emitted.add(CatalogueRow(_exposed_name(family), family.type, family.unit, label_sets.pop(),
                                 family.documentation))
    assert emitted == documented


def test_capture_collector_values_and_absence() -> None:
    stats = _capture_stats()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(CaptureCollector(stats))
    parsed = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    counted = {(s.labels["trigger"], s.labels["outcome"]): s.value
               for s in parsed["gpuscope_captures"].samples}
    assert {pair: value for pair, value in counted.items() if value} == {
        ("alert", "captured"): 3.0, ("alert", "refused"): 5.0, ("user", "unreachable"): 1.0}
    # Every other pair from 0, so that increase() sees each kind's first capture.
    assert len(counted) == 4 * 7 and counted[("webhook", "captured")] == 0.0
    assert [s.value for s in parsed["gpuscope_capture_store_bytes"].samples] == [12_345_678.0]
    assert [s.value for s in parsed["gpuscope_capture_last_timestamp_seconds"].samples] == [1_700_000_300.5]
    assert [s.value for s in parsed["gpuscope_capture_budget_remaining"].samples] == [6.0]

    # Before the first capture: every counter at 0, an empty store, no last timestamp.
    stats.counts, stats.stored, stats.last, stats.budget = {}, 0, None, None
    families = {_exposed_name(m): m for m in CaptureCollector(stats).collect()}
    assert set(families) == {"gpuscope_captures_total", "gpuscope_capture_store_bytes"}
    assert {s.value for s in families["gpuscope_captures_total"].samples} == {0.0}
    assert families["gpuscope_capture_store_bytes"].samples[0].value == 0.0
    # No store (captures disabled): nothing at all.
    stats.stored = None
    assert list(CaptureCollector(stats).collect()) == []


# -- per-source health ------------------------------------------------------------------------------


def test_source_health_collector_renders_exactly_the_catalogue() -> None:
    health = SourceHealth()
    for source in SOURCES:
        health.record(source, success=source != "pods", duration_seconds=0.25)
    documented = set(parse_catalogue(catalogue_section(CATALOGUE.read_text(), "Sources")))
    emitted = {CatalogueRow(_exposed_name(f), f.type, f.unit, frozenset({"collector"}), f.documentation)
               for f in SourceHealthCollector(health).collect()}
    assert emitted == documented
    families = {_exposed_name(f): f for f in SourceHealthCollector(health).collect()}
    success = {s.labels["collector"]: s.value for s in families["gpuscope_collector_success"].samples}
    assert success == {"nvml": 1.0, "processes": 1.0, "pods": 0.0, "alerts": 1.0, "captures": 1.0}


def test_web_collector_renders_exactly_the_catalogue(tmp_path: Path) -> None:
    rejections = Rejections()
    rejections.count("unauthorized")
    rejections.count("unauthorized")
    (tmp_path / "web.yml").write_text("")
    collector = WebCollector(rejections, WebConfigWatcher(tmp_path / "web.yml"))
    documented = set(parse_catalogue(catalogue_section(CATALOGUE.read_text(), "The HTTP port")))
    families = list(collector.collect())
    emitted = set()
    for family in families:
        labels = frozenset(key for sample in family.samples for key in sample.labels)
        emitted.add(CatalogueRow(_exposed_name(family), family.type, family.unit, labels,
                                 family.documentation))
    assert emitted == documented
    counts = {s.labels["reason"]: s.value for s in families[0].samples if s.name.endswith("_total")}
    assert counts == {"busy": 0.0, "unauthorized": 2.0, "rate_limited": 0.0, "tls_handshake": 0.0}
    # Without a web configuration file there is no reload to report.
    assert [_exposed_name(f) for f in WebCollector(rejections, WebConfigWatcher(None)).collect()] == [
        "gpuscope_http_rejected_requests_total"]


def test_a_source_that_never_ran_has_no_duration_and_one_that_is_off_no_series() -> None:
    health = SourceHealth()
    assert list(SourceHealthCollector(health).collect()) == []
    health.record("captures", success=True, duration_seconds=None)  # the worker is up, nothing captured
    families = {_exposed_name(f): f for f in SourceHealthCollector(health).collect()}
    assert [s.labels for s in families["gpuscope_collector_success"].samples] == [{"collector": "captures"}]
    assert "gpuscope_collector_duration_seconds" not in families
    with pytest.raises(ValueError, match="unknown source"):
        health.record("gpu", success=True, duration_seconds=0.0)


def test_a_stale_snapshot_exports_the_agents_own_families_only() -> None:
    """A stuck sampler: no frozen gpu_* values (Prometheus marks them stale), the gpuscope_* ones stay."""
    source = FakeSource(make_full_snapshot(), stale=True)
    names = {_exposed_name(f) for f in SnapshotCollector(source).collect()}
    assert names and all(name.startswith("gpuscope_") for name in names), names
    assert {"gpuscope_last_sample_timestamp_seconds", "gpuscope_nvml_stuck_calls_total"} <= names
    source.stale = False
    assert any(_exposed_name(f).startswith("gpu_") for f in SnapshotCollector(source).collect())


def _slurm_job_series(snapshot: Snapshot) -> list[dict[str, str]]:
    return [sample.labels for sample in collect(snapshot)["gpu_slurm_job_info"].samples]


def test_slurm_job_info_once_per_gpu_and_step() -> None:
    step0, batch = SlurmJob("77", "0", 1000), SlurmJob("77", "batch", 1000)
    gpu = make_gpu(0, processes=(
        make_process(100, slurm_job=step0), make_process(101, slurm_job=step0),  # two ranks, one step
        make_process(102, slurm_job=batch, user=None),  # no user name read: the cgroup's uid
        make_process(103, slurm_job=SlurmJob("78", "0"), host_visible=False),  # not mapped: no job
        make_process(104),  # outside Slurm
    ))
    series = _slurm_job_series(make_snapshot(gpus=(gpu,)))
    labels = [(s["job_id"], s["step"], s["user"]) for s in series]
    assert labels == [("77", "0", "alice"), ("77", "batch", "1000")]
    assert all((s["gpu"], s["uuid"]) == ("0", gpu.uuid) for s in series)


def test_slurm_job_info_absent_without_jobs_or_when_gpu_down() -> None:
    job_gpu = make_gpu(0, up=False, processes=(make_process(100, slurm_job=SlurmJob("77", "0")),))
    assert "gpu_slurm_job_info" not in collect(make_snapshot(gpus=(job_gpu, *make_gpus(2)[1:])))


def test_slurm_job_info_kept_when_processes_are_not_exported() -> None:
    gpu = make_gpu(0, processes=(make_process(100, slurm_job=SlurmJob("77", "0"), user=None),))
    collector = SnapshotCollector(FakeSource(make_snapshot(gpus=(gpu,))), include_processes=False)
    families = {family.name: family for family in collector.collect()}
    assert "gpu_process_info" not in families
    assert [s.labels["user"] for s in families["gpu_slurm_job_info"].samples] == [""]
