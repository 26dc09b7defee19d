"""Pod attribution against a stand-in kubelet: the pod-resources API served over real gRPC on a Unix
socket (gpuscope.simulate.kubelet.FakeKubelet), including kubelet restarts and pods that end."""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_process import run_agent
from prometheus_client import CollectorRegistry, generate_latest
from test_exporter import CATALOGUE, CatalogueRow, _exposed_name, catalogue_section, parse_catalogue

from gpuscope.common.config_types import ConfigError
from gpuscope.config import load_settings
from gpuscope.exporters.pods import PodResourcesCollector
from gpuscope.generated.kubelet.v1 import podresources_pb2 as pb
from gpuscope.host.kubelet import KubeletError, PodResourcesClient, gpu_allocations
from gpuscope.host.pods import PodAttribution
from gpuscope.simulate.kubelet import DeviceAllocation, FakeKubelet
from gpuscope.snapshot import PodContainer

UUID0 = "GPU-57f177e6-6a73-5975-bfcd-f0d726512505"
UUID1 = "GPU-3863ff79-531c-571c-8951-8417fe6776d6"
TRAINER = PodContainer("research", "llm-pretrain-0", "trainer")
EVAL = PodContainer("research", "eval-nightly", "eval")


def response(*pods: tuple[str, str, list[tuple[str, list[tuple[str, list[str]]]]]]
             ) -> pb.ListPodResourcesResponse:
    """(namespace, pod, [(container, [(resource, device ids)])]) -> a List answer."""
    return pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(namespace=ns, name=name, containers=[
            pb.ContainerResources(name=container, devices=[
                pb.ContainerDevices(resource_name=resource, device_ids=ids) for resource, ids in devices])
            for container, devices in containers])
        for ns, name, containers in pods])


# -- reading the kubelet's answer ----------------------------------------------------------------------


def test_gpus_are_keyed_by_uuid_with_time_slicing_replicas_folded() -> None:
    allocations = gpu_allocations(response(
        ("research", "llm-pretrain-0", [("trainer", [("nvidia.com/gpu", [UUID0])])]),
        # Time-slicing: two replicas of GPU 1 to one pod, another replica to a second pod.
        ("research", "eval-nightly", [("eval", [("nvidia.com/gpu.shared", [f"{UUID1}::0", f"{UUID1}::3"])])]),
        ("research", "llm-pretrain-0", [("sidecar", [("example.com/nic", ["eth1"])])]),
    ))
    assert allocations.pods_for(UUID0, 0) == (TRAINER,)
    assert allocations.pods_for(UUID1, 1) == (EVAL,)
    assert allocations.pods_for("GPU-other", 7) == ()
    assert allocations.pod_count == 2


def test_several_pods_on_one_gpu_are_all_kept_sorted() -> None:
    allocations = gpu_allocations(response(
        ("research", "llm-pretrain-0", [("trainer", [("nvidia.com/gpu", [f"{UUID0}::1"])])]),
        ("research", "eval-nightly", [("eval", [("nvidia.com/gpu", [f"{UUID0}::0"])])]),
    ))
    assert allocations.pods_for(UUID0, 0) == (EVAL, TRAINER)


def test_index_device_ids_only_for_nvidia_gpu_resources_and_mig_is_not_attributed() -> None:
    allocations = gpu_allocations(response(
        # DEVICE_ID_STRATEGY=index
        ("research", "llm-pretrain-0", [("trainer", [("nvidia.com/gpu", ["1"])])]),
        ("research", "eval-nightly", [("eval", [("example.com/fpga", ["0"]),
                                                ("nvidia.com/mig-1g.10gb", ["MIG-5c7b2b2e-0000"])])]),
    ))
    assert allocations.pods_for("GPU-any", 1) == (TRAINER,)
    assert allocations.pods_for("GPU-any", 0) == ()  # an FPGA's "0" is not GPU 0
    assert allocations.pods_for(UUID0, 1) == (TRAINER,)  # by index when the UUID is unknown


# -- the client, over real gRPC ------------------------------------------------------------------------


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(tmp_path / "pod-resources" / "kubelet.sock", [
        DeviceAllocation("research", "llm-pretrain-0", "trainer", (UUID0,)),
        DeviceAllocation("research", "eval-nightly", "eval", (f"{UUID1}::0",)),
    ])
    fake.socket_path.parent.mkdir()
    fake.start()
    yield fake
    fake.stop()


def test_client_lists_the_fake_kubelets_allocations(kubelet: FakeKubelet) -> None:
    client = PodResourcesClient(kubelet.socket_path, timeout_seconds=5)
    try:
        allocations = client.list_gpu_allocations()
    finally:
        client.close()
    assert allocations.pods_for(UUID0, 0) == (TRAINER,)
    assert allocations.pods_for(UUID1, 1) == (EVAL,)
    assert kubelet.calls == 1


def test_client_errors_name_the_socket_and_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "kubelet.sock"
    client = PodResourcesClient(missing, timeout_seconds=2)
    with pytest.raises(KubeletError, match=f"no kubelet pod-resources socket at {re.escape(str(missing))}"):
        client.list_gpu_allocations()
    # A socket file left by a kubelet that died: nobody accepts connections on it.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(missing))
    started = time.monotonic()
    with pytest.raises(KubeletError, match="UNAVAILABLE"):
        client.list_gpu_allocations()
    assert time.monotonic() - started < 2.0  # refused at once, not at the deadline
    client.close()


# -- the cache: restarts, stale pods, hosts without a kubelet ------------------------------------------


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def attribution(socket_path: Path, clock: ManualClock, keep_for: float = 300.0) -> PodAttribution:
    return PodAttribution(socket_path, refresh_interval=10, timeout=5, keep_for=keep_for, clock=clock)


def test_a_kubelet_restart_keeps_the_pods_and_recovers(kubelet: FakeKubelet) -> None:
    clock = ManualClock()
    pods = attribution(kubelet.socket_path, clock)
    pods.refresh()
    assert pods.pods_for(UUID0, 0) == (TRAINER,)
    assert pods.status().up and pods.status().pods == 2

    kubelet.stop()  # the socket disappears
    assert not kubelet.socket_path.exists()
    clock.now += 10
    pods.refresh()
    status = pods.status()
    assert (status.seen, status.up, status.failures_total) == (True, False, 1)
    assert pods.pods_for(UUID0, 0) == (TRAINER,)  # the pods keep running while the kubelet restarts

    kubelet.set_allocations([DeviceAllocation("research", "llm-pretrain-0", "trainer", (UUID0,))])
    kubelet.start()  # ... and comes back with a new socket
    clock.now += 10
    pods.refresh()
    assert pods.status().up and pods.status().failures_total == 1
    assert pods.pods_for(UUID1, 1) == ()  # eval-nightly ended meanwhile
    pods.stop()


def test_a_pod_that_ends_disappears_with_the_next_answer(kubelet: FakeKubelet) -> None:
    pods = attribution(kubelet.socket_path, ManualClock())
    pods.refresh()
    assert pods.pods_for(UUID1, 1) == (EVAL,)
    kubelet.set_allocations([DeviceAllocation("research", "llm-pretrain-0", "trainer", (UUID0,))])
    pods.refresh()
    assert pods.pods_for(UUID1, 1) == ()
    assert pods.pods_for(UUID0, 0) == (TRAINER,)
    assert pods.status().pods == 1
    pods.stop()


def test_a_long_outage_drops_the_last_answer(kubelet: FakeKubelet) -> None:
    clock = ManualClock()
    pods = attribution(kubelet.socket_path, clock, keep_for=60)
    pods.refresh()
    kubelet.stop()
    clock.now += 59
    pods.refresh()
    assert pods.pods_for(UUID0, 0) == (TRAINER,)
    clock.now += 2
    pods.refresh()
    assert pods.pods_for(UUID0, 0) == ()  # over keep_for: these pods may be gone too
    assert pods.status().failures_total == 2
    pods.stop()


def test_no_kubelet_socket_is_harmless_and_quiet(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuscope.host.pods")
    pods = attribution(tmp_path / "kubelet.sock", ManualClock())
    pods.start()
    pods.refresh()
    pods.stop()
    assert pods.pods_for(UUID0, 0) == ()
    assert pods.status().seen is False and pods.status().failures_total == 0
    assert list(PodResourcesCollector(pods.status).collect()) == []  # no permanent "down" series
    assert [r.levelname for r in caplog.records if r.name == "gpuscope.host.pods"] == ["INFO"]


def test_start_asks_at_once_then_refreshes_on_its_thread(kubelet: FakeKubelet) -> None:
    pods = PodAttribution(kubelet.socket_path, refresh_interval=0.1, timeout=5, keep_for=300)
    pods.start()
    try:
        assert pods.pods_for(UUID0, 0) == (TRAINER,)  # the first snapshot can already name the pod
        kubelet.set_allocations([])
        deadline = time.monotonic() + 10
        while pods.pods_for(UUID0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pods.pods_for(UUID0, 0) == ()
    finally:
        pods.stop()


# -- metrics -------------------------------------------------------------------------------------------


def test_pod_resources_collector_renders_exactly_its_catalogue_rows(kubelet: FakeKubelet) -> None:
    pods = attribution(kubelet.socket_path, ManualClock())
    pods.refresh()
    documented = {row for row in parse_catalogue(catalogue_section(CATALOGUE.read_text(), "Pods"))
                  if row.name.startswith("gpuscope_pod_resources_")}
    emitted = {CatalogueRow(_exposed_name(f), f.type, f.unit, frozenset(f.samples[0].labels), f.documentation)
               for f in PodResourcesCollector(pods.status).collect()}
    assert emitted == documented
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PodResourcesCollector(pods.status))
    text = generate_latest(registry).decode()
    assert "gpuscope_pod_resources_up 1.0" in text and "gpuscope_pod_resources_pods 2.0" in text
    pods.stop()


# -- configuration -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"socket": "pod-resources/kubelet.sock"}, "pods.socket: must be an absolute path"),
    ({"socket": "/run/a\x00b"}, "pods.socket: a path must not contain a NUL character"),
    ({"socket": "/" + "k" * 107}, "pods.socket: must be at most 107 bytes long"),
    ({"refresh_interval": "100ms"}, "pods.refresh_interval: Input should be greater than or equal to 1"),
    ({"timeout": "0s"}, "pods.timeout: Input should be greater than 0"),
    ({"keep_for": "soon"}, "pods.keep_for:"),
    ({"sockets": "/x"}, "pods.sockets: unknown key"),
])
def test_bad_pods_settings_are_refused_with_their_key(overrides: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(overrides={"pods": overrides})
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def test_pods_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_PODS__SOCKET", "/run/k/kubelet.sock")
    monkeypatch.setenv("GPUSCOPE_PODS__REFRESH_INTERVAL", "30s")
    settings = load_settings()
    assert (settings.pods.socket, settings.pods.refresh_interval) == (Path("/run/k/kubelet.sock"), 30.0)


def test_the_simulated_kubelet_serves_the_scenarios_pods_and_leaves_nothing_behind() -> None:
    from gpuscope.simulate import Simulation, load_scenario

    simulation = Simulation(load_scenario("demo"), spawn_processes=False)
    socket_path = simulation.kubelet_socket
    assert socket_path is not None and socket_path.parent.is_dir()
    simulation.uninstall()  # never installed (an agent that failed to start): the directory goes too
    assert not socket_path.parent.exists()

    simulation = Simulation(load_scenario("demo"), spawn_processes=False)
    with simulation:
        socket_path = simulation.kubelet_socket
        assert socket_path is not None
        client = PodResourcesClient(socket_path, timeout_seconds=5)
        allocations = client.list_gpu_allocations()
        client.close()
        uuids = [model.uuid for model in simulation._models()]
        assert allocations.pods_for(uuids[0], 0) == (PodContainer("research", "llm-pretrain-0", "trainer"),)
        assert [p.pod for p in allocations.pods_for(uuids[2], 2)] == ["eval-nightly", "llm-pretrain-2"]
    assert not socket_path.parent.exists()
    assert Simulation(load_scenario("healthy")).kubelet_socket is None  # no pods, no kubelet


# -- the whole agent -----------------------------------------------------------------------------------

SCENARIO = """
name: pods-e2e
duration: 20m
gpus:
  - utilization: 0.95
    processes: [{name: train-rank0, spawn: true, memory: 60GiB}]
  - utilization: 0.55
    processes: [{name: eval-a, spawn: true, memory: 20GiB}, {name: eval-b, spawn: true, memory: 20GiB}]
"""


def metrics_lines(body: str, name: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def test_gpuscope_run_attributes_gpus_to_the_kubelets_pods(tmp_path: Path) -> None:
    from gpuscope.simulate import Simulation
    from gpuscope.simulate.loader import parse_scenario

    scenario = tmp_path / "node.yaml"
    scenario.write_text(SCENARIO)
    sim = Simulation(parse_scenario(SCENARIO, source="pods-e2e"), spawn_processes=False)
    uuid0, uuid1 = (model.uuid for model in sim._models())  # the UUIDs the agent's simulation will use
    fake = FakeKubelet(tmp_path / "kubelet.sock", [
        DeviceAllocation("research", "llm-pretrain-0", "trainer", (uuid0,)),
        DeviceAllocation("research", "eval-a", "eval", (f"{uuid1}::0",)),
        DeviceAllocation("research", "eval-b", "eval", (f"{uuid1}::1",)),
    ])
    fake.start()
    try:
        with run_agent(tmp_path, "--simulate", str(scenario), env={
                "GPUSCOPE_PODS__SOCKET": str(fake.socket_path), "GPUSCOPE_PODS__REFRESH_INTERVAL": "1s"}
                       ) as agent:
            body = agent.wait_for("/metrics", 'process="train-rank0"')
            info = metrics_lines(body, "gpu_pod_info")
            assert len(info) == 3, info
            (rank0,) = [line for line in metrics_lines(body, "gpu_process_info") if "train-rank0" in line]
            for label in ('namespace="research"', 'pod="llm-pretrain-0"', 'container="trainer"'):
                assert label in rank0, rank0
            # GPU 1 is time-sliced between two pods: its processes name none.
            for line in metrics_lines(body, "gpu_process_info"):
                if 'gpu="1"' in line:
                    assert 'pod=""' in line, line
            assert "gpuscope_pod_resources_up 1.0" in body

            fake.set_allocations([DeviceAllocation("research", "llm-pretrain-0", "trainer", (uuid0,))])
            agent.wait_for("/metrics", "gpuscope_pod_resources_pods 1.0", timeout=15)
            # gpu_pod_info follows with the next snapshot (the sampler's tick after the refresh).
            deadline = time.monotonic() + 10
            while len(info := metrics_lines(agent.get("/metrics")[1], "gpu_pod_info")) != 1:
                assert time.monotonic() < deadline, info
                time.sleep(0.1)

            fake.stop()  # the kubelet restarts: attribution holds, the agent's own series says so
            body = agent.wait_for("/metrics", "gpuscope_pod_resources_up 0.0", timeout=15)
            assert len(metrics_lines(body, "gpu_pod_info")) == 1
            fake.start()
            agent.wait_for("/metrics", "gpuscope_pod_resources_up 1.0", timeout=15)
            status, snapshot = agent.get("/api/v1/snapshot")
            assert status == 200 and '"pod": "llm-pretrain-0"' in snapshot
            assert "Traceback" not in agent.stderr()
    finally:
        fake.stop()
