"""The per-process series under processes.labels (an allow-list) and processes.max_per_gpu (a cap)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from agent_process import run_agent
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from snapshots import FakeSource, make_gpu, make_process, make_snapshot

from gpuscope.config import ConfigError, load_settings
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.snapshot import GpuReading, PodContainer, ProcessReading

GIB = 1 << 30
POD = (PodContainer("research", "trainer-0", "main"),)
Samples = dict[tuple[tuple[str, str], ...], float]


class Node:
    """A snapshot source whose GPU 0 processes a test changes between scrapes."""

    def __init__(self, *processes: ProcessReading, pods: tuple[PodContainer, ...] = POD) -> None:
        self.processes = processes
        self.pods = pods

    def gpu(self) -> GpuReading:
        return make_gpu(0, processes=self.processes, pods=self.pods)

    def source(self) -> FakeSource:
        return FakeSource(lambda: make_snapshot(gpus=(self.gpu(),)))


def scrape(collector: SnapshotCollector) -> dict[str, Samples]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    out: dict[str, Samples] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def proc(pid: int, *, memory_gib: float = 1, busy: float = 0.0, **overrides: object) -> ProcessReading:
    return make_process(pid, memory_used_bytes=int(memory_gib * GIB), busy_seconds_total=busy,
                        energy_joules_total=busy * 100, **overrides)


def only(samples: Samples) -> float:
    (value,) = samples.values()
    return value


def test_default_labels_are_every_label_and_one_series_per_process() -> None:
    node = Node(proc(101), proc(102))
    series = scrape(SnapshotCollector(node.source()))
    memory = series["gpu_process_memory_used_bytes"]
    assert len(memory) == 2
    assert {dict(labels)["pid"] for labels in memory} == {"101", "102"}
    assert set(dict(next(iter(memory)))) == {"gpu", "uuid", "gpu_instance", "pid", "process", "user",
                                             "container_id", "pod", "namespace", "container"}


def test_labels_leave_the_unlisted_ones_out_and_sum_the_processes_that_share_the_rest() -> None:
    node = Node(proc(101, memory_gib=2, busy=10), proc(102, memory_gib=3, busy=20),
                proc(103, memory_gib=4, busy=30))
    series = scrape(SnapshotCollector(node.source(), process_labels=["pod", "namespace", "container"]))
    memory = series["gpu_process_memory_used_bytes"]
    (labels,) = memory
    assert dict(labels) == {"gpu": "0", "uuid": make_gpu(0).uuid, "gpu_instance": "", "pod": "trainer-0",
                            "namespace": "research", "container": "main"}
    assert memory[labels] == 9 * GIB
    assert only(series["gpu_process_busy_seconds_total"]) == 60
    assert only(series["gpu_process_energy_joules_total"]) == 6000
    assert only(series["gpu_process_info"]) == 3  # the number of processes behind the series


def test_processes_that_differ_in_a_listed_label_keep_their_own_series() -> None:
    node = Node(proc(101, user="alice", memory_gib=2), proc(102, user="bob", memory_gib=3),
                proc(103, user="bob", memory_gib=4))
    series = scrape(SnapshotCollector(node.source(), process_labels=["user"]))
    memory = series["gpu_process_memory_used_bytes"]
    by_user = {dict(labels)["user"]: value for labels, value in memory.items()}
    assert by_user == {"alice": 2 * GIB, "bob": 7 * GIB}


def test_a_summed_counter_never_falls_when_a_process_exits_and_vanishes_with_its_last_process() -> None:
    node = Node(proc(101, busy=10), proc(102, busy=20))
    collector = SnapshotCollector(node.source(), process_labels=["pod"])
    assert only(scrape(collector)["gpu_process_busy_seconds_total"]) == 30
    node.processes = (proc(101, busy=15),)  # 102 exited with 20 s counted
    assert only(scrape(collector)["gpu_process_busy_seconds_total"]) == 35
    assert only(scrape(collector)["gpu_process_busy_seconds_total"]) == 35  # kept once, not per scrape
    node.processes = (proc(101, busy=16), proc(103, busy=1))
    assert only(scrape(collector)["gpu_process_busy_seconds_total"]) == 37
    node.processes = ()
    assert "gpu_process_busy_seconds_total" not in scrape(collector)
    node.processes = (proc(104, busy=2),)  # the series starts again from this process alone
    assert only(scrape(collector)["gpu_process_busy_seconds_total"]) == 2


def test_a_gauge_sum_is_of_the_processes_present() -> None:
    node = Node(proc(101, memory_gib=2), proc(102, memory_gib=3))
    collector = SnapshotCollector(node.source(), process_labels=["pod"])
    scrape(collector)
    node.processes = (proc(101, memory_gib=2),)
    assert only(scrape(collector)["gpu_process_memory_used_bytes"]) == 2 * GIB


def test_an_exited_process_series_is_gone_at_the_next_scrape() -> None:
    node = Node(proc(101), proc(102))
    collector = SnapshotCollector(node.source())
    assert len(scrape(collector)["gpu_process_busy_seconds_total"]) == 2
    node.processes = (proc(101),)
    for family in ("gpu_process_busy_seconds_total", "gpu_process_memory_used_bytes", "gpu_process_info"):
        assert [dict(labels)["pid"] for labels in scrape(collector)[family]] == ["101"]


def test_a_process_with_compute_and_graphics_contexts_counts_once() -> None:
    node = Node(proc(101, busy=5), proc(101, busy=5, kind="graphics"))
    series = scrape(SnapshotCollector(node.source(), process_labels=["pod"]))
    assert only(series["gpu_process_busy_seconds_total"]) == 5
    assert sorted(dict(labels)["type"] for labels in series["gpu_process_info"]) == ["compute", "graphics"]


def test_the_cap_keeps_the_largest_memory_holders_and_counts_each_left_out_process_once() -> None:
    node = Node(*(proc(100 + i, memory_gib=i + 1) for i in range(5)))
    collector = SnapshotCollector(node.source(), max_per_gpu=2)
    series = scrape(collector)
    assert sorted(dict(labels)["pid"] for labels in series["gpu_process_memory_used_bytes"]) == ["103", "104"]
    assert only(series["gpuscope_processes_dropped_total"]) == 3
    assert only(series["gpu_processes"]) == 5  # the per-GPU count still sees every process
    assert only(scrape(collector)["gpuscope_processes_dropped_total"]) == 3  # not again per scrape
    node.processes = (*node.processes, proc(200, memory_gib=0.5))
    assert only(scrape(collector)["gpuscope_processes_dropped_total"]) == 4


def test_no_process_is_dropped_under_the_cap() -> None:
    node = Node(*(proc(100 + i) for i in range(4)))
    series = scrape(SnapshotCollector(node.source(), max_per_gpu=4))
    assert len(series["gpu_process_memory_used_bytes"]) == 4
    assert only(series["gpuscope_processes_dropped_total"]) == 0


def test_an_unknown_label_is_refused_by_the_collector() -> None:
    with pytest.raises(ValueError, match="'cgroup'"):
        SnapshotCollector(Node().source(), process_labels=["pod", "cgroup"])


def test_configuration_refuses_an_unknown_or_repeated_label_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "gpuscope.yml"
    config.write_text("processes:\n  labels: [pod, hostname]\n")
    with pytest.raises(ConfigError, match=r"processes\.labels.*hostname|hostname.*processes\.labels"):
        load_settings(config)
    config.write_text("processes:\n  labels: [pod, pid, pod]\n")
    with pytest.raises(ConfigError, match="listed more than once: pod"):
        load_settings(config)
    config.write_text("processes:\n  max_per_gpu: 0\n")
    with pytest.raises(ConfigError, match=r"processes\.max_per_gpu"):
        load_settings(config)


def test_configuration_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings()
    assert settings.processes.labels == ["pid", "process", "user", "container_id", "pod", "namespace",
                                         "container"]
    assert settings.processes.max_per_gpu == 64
    monkeypatch.setenv("GPUSCOPE_PROCESSES__LABELS", '["pod", "namespace"]')
    monkeypatch.setenv("GPUSCOPE_PROCESSES__MAX_PER_GPU", "8")
    settings = load_settings()
    assert settings.processes.labels == ["pod", "namespace"]
    assert settings.processes.max_per_gpu == 8


def test_the_running_agent_exports_only_the_listed_labels(tmp_path: Path) -> None:
    config = tmp_path / "gpuscope.yml"
    config.write_text("processes:\n  labels: [process, container_id]\n  max_per_gpu: 1\n")
    with run_agent(tmp_path, "--simulate", "demo", "--config", str(config)) as agent:
        deadline = time.monotonic() + 30
        while True:  # the simulated processes start with the agent: wait for their first tick
            status, body = agent.get("/metrics")
            assert status == 200
            families = {family.name: family for family in text_string_to_metric_families(body)}
            if "gpu_process_memory_used_bytes" in families or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    memory = families["gpu_process_memory_used_bytes"].samples
    assert memory, "the demo node has GPU processes"
    for sample in memory:
        assert set(sample.labels) == {"gpu", "uuid", "gpu_instance", "process", "container_id"}
    kept: dict[str, float] = {}
    for sample in families["gpu_process_info"].samples:
        kept[sample.labels["gpu"]] = kept.get(sample.labels["gpu"], 0) + sample.value
    assert set(kept.values()) == {1}  # one process per GPU at most, and it is counted
    held = {sample.labels["gpu"]: sample.value for sample in families["gpu_processes"].samples}
    (dropped,) = families["gpuscope_processes_dropped"].samples
    assert dropped.value == sum(count - 1 for count in held.values() if count > 1) > 0
