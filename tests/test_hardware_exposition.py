"""The exposition of the hardware families (health, NVLink, throttle time) and of MIG devices: values,
labels, and absence where a GPU does not give a reading."""

from __future__ import annotations

from snapshots import (
    NVLINK_ERROR_TYPES,
    gpu_uuid,
    make_gpu,
    make_mig_gpu,
    make_process,
    make_snapshot,
    mig_uuid,
)
from test_exporter import collect, samples

from gpuscope.snapshot import PodContainer


def _by(series: dict, label: str) -> dict[str, float]:
    return {dict(labels)[label]: value for labels, value in series.items()}


def test_health_state_is_one_series_per_state_with_the_gpus_at_one() -> None:
    gpus = [make_gpu(0), make_gpu(1, row_remap_pending=True), make_gpu(2, row_remap_failed=True,
                                                                       row_remap_pending=True),
            make_gpu(3, up=False)]
    series = samples(make_snapshot(gpus=gpus), "gpu_health")
    current = {dict(labels)["gpu"]: dict(labels)["state"] for labels, value in series.items() if value == 1}
    assert current == {"0": "ok", "1": "reset_required", "2": "replace", "3": "lost"}
    assert len(series) == 4 * 4  # every state of every GPU, so that a query can select the others' 0


def test_throttle_time_remapped_rows_and_error_counters_by_label() -> None:
    gpu = make_gpu(0, clock_throttle_seconds_total={"power": 12.5, "thermal": 3.0},
                   remapped_rows_correctable_total=2, remapped_rows_uncorrectable_total=None,
                   pcie_errors_total={"fatal": 1, "correctable": 40})
    snapshot = make_snapshot(gpus=[gpu])
    throttle = samples(snapshot, "gpu_clock_throttle_seconds_total")
    assert _by(throttle, "reason") == {"power": 12.5, "thermal": 3.0}
    assert _by(samples(snapshot, "gpu_remapped_rows_total"), "cause") == {"correctable": 2.0}
    assert _by(samples(snapshot, "gpu_pcie_errors_total"), "type") == {"fatal": 1.0, "correctable": 40.0}
    assert samples(snapshot, "gpu_row_remap_pending") == {(("gpu", "0"), ("uuid", gpu_uuid(0))): 0.0}


def test_nvlink_families_absent_without_nvlink_and_per_link_only_when_read() -> None:
    pcie_card = make_gpu(0, nvlink_active_links=None, nvlink_transmit_bytes_total=None,
                         nvlink_receive_bytes_total=None, nvlink_errors_total=None)
    families = collect(make_snapshot(gpus=[pcie_card]))
    assert not [name for name in families if name.startswith("gpu_nvlink_")]
    sums_only = collect(make_snapshot(gpus=[make_gpu(0)]))
    assert {name for name in sums_only if name.startswith("gpu_nvlink_")} == {
        "gpu_nvlink_active_links", "gpu_nvlink_transmit_bytes_total", "gpu_nvlink_receive_bytes_total",
        "gpu_nvlink_errors_total"}
    per_link = make_gpu(0, nvlink_link_bytes={3: {"transmit_bytes": 10.0, "receive_bytes": 20.0}},
                        nvlink_link_errors_total={3: {**dict.fromkeys(NVLINK_ERROR_TYPES, 0), "replay": 2}})
    snapshot = make_snapshot(gpus=[per_link])
    assert _by(samples(snapshot, "gpu_nvlink_link_receive_bytes_total"), "link") == {"3": 20.0}
    errors = samples(snapshot, "gpu_nvlink_link_errors_total")
    assert {(dict(k)["link"], dict(k)["type"]): v for k, v in errors.items() if v} == {("3", "replay"): 2.0}


def test_a_down_gpu_keeps_only_its_health_and_mig_identity() -> None:
    down = make_mig_gpu(0, up=False)
    families = collect(make_snapshot(gpus=[down]))
    assert "gpu_clock_throttle_seconds_total" not in families
    assert "gpu_mig_memory_used_bytes" not in families and "gpu_health" in families
    assert len(families["gpu_mig_info"].samples) == 2
    assert "gpu_mig_pod_info" in families  # allocations hold while the GPU cannot be read


def test_mig_devices_series_labels_values_and_pods() -> None:
    snapshot = make_snapshot(gpus=[make_mig_gpu(2)])
    info = samples(snapshot, "gpu_mig_info")
    assert {dict(labels)["mig_uuid"]: (dict(labels)["gpu_instance"], dict(labels)["compute_instance"],
                                       dict(labels)["mig_profile"]) for labels in info} == {
        mig_uuid(2, 0): ("1", "0", "3g.40gb"), mig_uuid(2, 1): ("2", "0", "3g.40gb")}
    busy = samples(snapshot, "gpu_mig_busy_seconds_total")
    assert _by(busy, "gpu_instance") == {"1": 812.5, "2": 0.0}
    used = samples(snapshot, "gpu_mig_memory_used_bytes")
    assert _by(used, "gpu_instance") == {"1": 21 * 1024**3, "2": 0.0}
    (pod,) = samples(snapshot, "gpu_mig_pod_info")
    labels = dict(pod)
    assert (labels["gpu_instance"], labels["pod"], labels["namespace"]) == ("1", "finetune-7", "research")
    # The parent GPU has no utilization of its own in MIG mode: absent, not 0.
    families = collect(snapshot)
    assert "gpu_utilization_ratio" not in families and "gpu_busy_seconds_total" not in families
    assert "gpu_power_watts" in families


def test_a_process_on_a_mig_device_carries_its_instance_and_its_instances_pod() -> None:
    gpu = make_mig_gpu(0, processes=(make_process(11, gpu_instance=1, compute_instance=0),
                                     make_process(12, gpu_instance=2, compute_instance=0)),
                       pods=(PodContainer("other", "whole-gpu", "c"),))
    series = samples(make_snapshot(gpus=[gpu]), "gpu_process_memory_used_bytes")
    by_pid = {dict(labels)["pid"]: (dict(labels)["gpu_instance"], dict(labels)["pod"]) for labels in series}
    assert by_pid == {"11": ("1", "finetune-7"), "12": ("2", "")}  # the second instance has no pod
    plain = samples(make_snapshot(gpus=[make_gpu(0, processes=(make_process(13),))]),
                    "gpu_process_memory_used_bytes")
    assert [dict(labels)["gpu_instance"] for labels in plain] == [""]
