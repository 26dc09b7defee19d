"""Builders of realistic Snapshot objects for tests (an 8-GPU H100 80GB HBM3 node by default).

Every builder takes keyword overrides for any field, so a test states only what it is about::

    snap = make_snapshot(gpus=[make_gpu(0, power_watts=None), make_gpu(1, up=False)])

Values are deterministic (derived from the index or pid), so golden files stay stable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuscope.nvml.health import NVLINK_ERRORS, PCIE_ERROR_FIELDS
from gpuscope.snapshot import (
    GpuReading,
    MigReading,
    PodContainer,
    ProcessReading,
    SlurmJob,
    Snapshot,
    UtilizationSample,
)

GIB = 1024**3
MIB = 1024**2

H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MEMORY_TOTAL_BYTES = 81_559 * MIB  # what nvmlDeviceGetMemoryInfo_v2 reports on an H100 SXM5
H100_MEMORY_RESERVED_BYTES = 553 * MIB
H100_POWER_LIMIT_WATTS = 700.0
DRIVER_VERSION = "550.54.15"
HOSTNAME = "gpu-node-07"
# PCI bus ids of the eight GPUs of a DGX H100, in NVML index order.
PCI_BUS_IDS = (
    "00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
    "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0",
)
SNAPSHOT_TIMESTAMP = 1_717_171_717.25  # fixed wall clock so golden files do not change
CONTAINER_ID = "3f4e1c2b9a8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f"


def gpu_uuid(index: int) -> str:
    """A well-formed, deterministic GPU UUID."""
    return f"GPU-{index:08x}-5a1c-7d3e-9b2f-{0x4e6a8c0d1b3f + index:012x}"


def make_process(pid: int = 4242, **overrides: Any) -> ProcessReading:
    """A PyTorch training process holding 18 GiB on a GPU, visible on the host, inside a container."""
    fields: dict[str, Any] = {
        "pid": pid,
        "kind": "compute",
        "memory_used_bytes": 18 * GIB + (pid % 7) * 256 * MIB,
        "sm_utilization_ratio": round(0.55 + (pid % 5) * 0.08, 2),
        "host_visible": True,
        "name": "python3",
        "user": "alice",
        "container_id": CONTAINER_ID,
        "cmdline": ("python3", "-m", "torch.distributed.run", "--nproc-per-node=8", "train.py",
                    "--config", "configs/llama-7b.yaml"),
        "busy_seconds_total": 2_500.25 + pid % 97,
        "energy_joules_total": 812_345.5 + pid % 89,
    }
    fields.update(overrides)
    return ProcessReading(**fields)


def make_processes(gpu_index: int, count: int = 4, **overrides: Any) -> tuple[ProcessReading, ...]:
    """``count`` compute processes with distinct pids for GPU ``gpu_index``."""
    return tuple(make_process(10_000 + gpu_index * 100 + i, **overrides) for i in range(count))


def utilization_samples(mean: float, count: int = 6, start_us: int = 1_717_171_716_000_000) -> tuple[
        UtilizationSample, ...]:
    """``count`` driver samples ~166 ms apart whose values average exactly ``mean``."""
    return tuple(UtilizationSample(start_us + i * 166_667, mean) for i in range(count))


PCIE_ERROR_TYPES = tuple(PCIE_ERROR_FIELDS)
NVLINK_ERROR_TYPES = tuple(NVLINK_ERRORS)


def make_gpu(index: int = 0, **overrides: Any) -> GpuReading:
    """A busy, healthy H100 with every reading present and two compute processes.

    Clock events, Xid errors and processes default to "none active" / empty; pass them to test those.
    """
    utilization = round(0.9 - index * 0.01, 2)
    fields: dict[str, Any] = {
        "index": index,
        "uuid": gpu_uuid(index),
        "name": H100_NAME,
        "pci_bus_id": PCI_BUS_IDS[index % len(PCI_BUS_IDS)],
        "up": True,
        "mig_enabled": False,
        "utilization_ratio": utilization,
        "utilization_samples": utilization_samples(utilization),
        "busy_seconds_total": 5_321.5 + index,
        "memory_utilization_ratio": round(0.42 + index * 0.01, 2),
        "memory_used_bytes": 38 * GIB + index * 512 * MIB,
        "memory_reserved_bytes": H100_MEMORY_RESERVED_BYTES,
        "memory_total_bytes": H100_MEMORY_TOTAL_BYTES,
        "power_watts": 512.25 + index,
        "power_limit_watts": H100_POWER_LIMIT_WATTS,
        "energy_joules_total": 123_456_789.5 + index * 1000,
        "idle_energy_joules_total": 1_234_567.25 + index * 10,
        "temperature_celsius": 54.0 + index,
        "sm_clock_hertz": 1_980_000_000.0,
        "memory_clock_hertz": 2_619_000_000.0,
        "clock_event_reasons": frozenset(),
        "pcie_tx_bytes_total": 9.5e12 + index,
        "pcie_rx_bytes_total": 2.25e13 + index,
        "xid_errors": {},
        "ecc_uncorrected_errors_total": 0,
        "sm_active_ratio": 0.81,
        "sm_occupancy_ratio": 0.37,
        "tensor_active_ratio": 0.44,
        "dram_active_ratio": 0.29,
        "sm_active_seconds_total": 4_310.75 + index,
        "tensor_active_seconds_total": 2_341.125 + index,
        "idle_dips_total": 3 + index,
        "fp16_active_ratio": 0.02,
        "fp32_active_ratio": 0.11,
        "fp64_active_ratio": 0.0,
        "encoder_utilization_ratio": 0.0,
        "decoder_utilization_ratio": 0.0,
        "clock_throttle_seconds_total": {"power": 12.5 + index, "thermal": 0.0, "sync_boost": 0.0,
                                         "board_limit": 0.0, "low_utilization": 310.25, "reliability": 0.0},
        "remapped_rows_correctable_total": 0,
        "remapped_rows_uncorrectable_total": 0,
        "row_remap_pending": False,
        "row_remap_failed": False,
        "ecc_corrected_errors_total": 0,
        "pcie_replays_total": 0,
        "pcie_errors_total": dict.fromkeys(PCIE_ERROR_TYPES, 0),
        "memory_temperature_celsius": 47.0 + index,
        "nvlink_active_links": 18,
        "nvlink_transmit_bytes_total": 4.5e13 + index,
        "nvlink_receive_bytes_total": 4.25e13 + index,
        "nvlink_errors_total": dict.fromkeys(NVLINK_ERROR_TYPES, 0),
        "processes": make_processes(index, 2),
    }
    fields.update(overrides)
    return GpuReading(**fields)


def make_gpus(count: int = 8, processes_per_gpu: int = 2, **overrides: Any) -> tuple[GpuReading, ...]:
    """``count`` GPUs numbered from 0, each with ``processes_per_gpu`` compute processes."""
    return tuple(
        make_gpu(i, processes=make_processes(i, processes_per_gpu), **overrides) for i in range(count)
    )


def make_snapshot(gpus: Iterable[GpuReading] | None = None, **overrides: Any) -> Snapshot:
    """A snapshot of a healthy node; ``gpus`` defaults to ``make_gpus()`` (8 H100s)."""
    fields: dict[str, Any] = {
        "timestamp": SNAPSHOT_TIMESTAMP,
        "hostname": HOSTNAME,
        "nvml_up": True,
        "driver_version": DRIVER_VERSION,
        "gpus": tuple(make_gpus() if gpus is None else gpus),
        "sample_duration_seconds": 0.0125,
        "sample_errors": {},
        "interval_seconds": 1.0,
        "monotonic": 1000.0,
    }
    fields.update(overrides)
    return Snapshot(**fields)


def make_full_snapshot() -> Snapshot:
    """Every reading present and every label used: throttling, Xid errors, graphics and
    host-invisible processes, a Slurm job, sample errors, a pod. Renders every family in the catalogue."""
    gpu0 = make_gpu(
        0,
        clock_event_reasons=frozenset({"sw_power_cap", "hw_slowdown"}),
        xid_errors={79: 1, 13: 2},
        ecc_uncorrected_errors_total=2,
        processes=(
            make_process(4242),
            make_process(4243, kind="graphics", memory_used_bytes=64 * MIB, sm_utilization_ratio=0.0,
                         name="Xorg", user="root", container_id=None, cmdline=("/usr/lib/xorg/Xorg", ":0"),
                         busy_seconds_total=0.0, energy_joules_total=0.0),
            make_process(5150, host_visible=False, name=None, user=None, container_id=None, cmdline=None),
            make_process(6060, name="python3", user="alice", container_id=None,
                         cmdline=("python3", "train.py"), slurm_job=SlurmJob("4242", "0", 1000)),
        ),
        pods=(PodContainer(namespace="research", pod="llm-pretrain-0", container="trainer"),),
    )
    gpu1 = make_gpu(1, clock_event_reasons=frozenset({"gpu_idle"}), utilization_ratio=0.0,
                    utilization_samples=utilization_samples(0.0), processes=(), row_remap_pending=True,
                    remapped_rows_uncorrectable_total=1,
                    nvlink_link_bytes={0: {"transmit_bytes": 2.5e12, "receive_bytes": 2.25e12},
                                       1: {"transmit_bytes": 2.5e12, "receive_bytes": 2.0e12}},
                    nvlink_link_errors_total={0: dict.fromkeys(NVLINK_ERROR_TYPES, 0),
                                              1: {**dict.fromkeys(NVLINK_ERROR_TYPES, 0), "replay": 7}})
    return make_snapshot(gpus=(gpu0, gpu1, make_mig_gpu(2)),
                         sample_errors={"gpm": 3, "process_utilization": 1})


def make_mig_gpu(index: int, **overrides: Any) -> GpuReading:
    """A GPU in MIG mode with two 3g.40gb instances, a process and a pod on the first: what NVML gives
    per instance, and nothing of what it does not (utilization samples, process utilization)."""
    fields: dict[str, Any] = dict(
        mig_enabled=True, utilization_ratio=None, utilization_samples=(), busy_seconds_total=None,
        memory_utilization_ratio=None, sm_active_ratio=None, sm_occupancy_ratio=None,
        tensor_active_ratio=None, dram_active_ratio=None, sm_active_seconds_total=None,
        tensor_active_seconds_total=None,
        fp16_active_ratio=None, fp32_active_ratio=None, fp64_active_ratio=None, idle_dips_total=None,
        mig_devices=(
            MigReading(index=0, gpu_instance=1, compute_instance=0, uuid=mig_uuid(index, 0),
                       profile="3g.40gb", memory_used_bytes=21 * GIB, memory_total_bytes=40 * GIB - 512 * MIB,
                       sm_active_ratio=0.62, tensor_active_ratio=0.31, dram_active_ratio=0.27,
                       busy_seconds_total=812.5,
                       pods=(PodContainer(namespace="research", pod="finetune-7", container="trainer"),)),
            MigReading(index=1, gpu_instance=2, compute_instance=0, uuid=mig_uuid(index, 1),
                       profile="3g.40gb", memory_used_bytes=0, memory_total_bytes=40 * GIB - 512 * MIB,
                       sm_active_ratio=0.0,
                       tensor_active_ratio=0.0, dram_active_ratio=0.0, busy_seconds_total=0.0),
        ),
        processes=(make_process(9100 + index, sm_utilization_ratio=None, busy_seconds_total=None,
                                energy_joules_total=None, gpu_instance=1, compute_instance=0),),
    )
    fields.update(overrides)
    return make_gpu(index, **fields)


def mig_uuid(index: int, instance: int) -> str:
    return f"MIG-{index:08x}-{instance:04x}-4e6f-8d2a-5c3b1a9e0f7{instance}"


def with_gpus(snapshot: Snapshot, gpus: Sequence[GpuReading]) -> Snapshot:
    """``snapshot`` with its GPUs replaced."""
    return replace(snapshot, gpus=tuple(gpus))


@dataclass
class FakeSource:
    """A SnapshotSource whose answers the test sets: a snapshot, or a function read at every call."""

    snapshot: Snapshot | Callable[[], Snapshot | None] | None = None
    alive: bool = True
    interval: float = 1.0
    stale: bool = False

    @property
    def interval_seconds(self) -> float:
        return self.interval

    def latest(self) -> Snapshot | None:
        return self.snapshot() if callable(self.snapshot) else self.snapshot

    def is_alive(self) -> bool:
        return self.alive

    def snapshot_is_stale(self) -> bool:
        return self.stale
