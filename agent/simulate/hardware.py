"""What a simulated GPU reports beyond its utilization: throttle (violation) time, the health counters,
NVLink, and its MIG devices' memory and activity. Used by the fake library's health, NVLink and MIG
functions; a GpuModel has one (``GpuModel.hardware``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gpuscope.nvml.clock_events import POWER_REASONS, THERMAL_REASONS
from gpuscope.simulate.patterns import noise_stream
from gpuscope.simulate.scenario import REASON_BITS, MigDeviceSpec
from gpuscope.simulate.timeline import TICKS_PER_SECOND, Integral

if TYPE_CHECKING:
    from gpuscope.simulate.model import GpuModel

# Violation policy (as nvmlDeviceGetViolationStatus numbers them) -> the clock event reasons it counts.
_POLICY_REASONS: dict[int, frozenset[str]] = {
    0: POWER_REASONS,  # NVML_PERF_POLICY_POWER
    1: THERMAL_REASONS,  # NVML_PERF_POLICY_THERMAL
    2: frozenset({"sync_boost"}),  # NVML_PERF_POLICY_SYNC_BOOST
    3: frozenset({"hw_slowdown"}),  # NVML_PERF_POLICY_BOARD_LIMIT
    4: frozenset({"gpu_idle"}),  # NVML_PERF_POLICY_LOW_UTILIZATION
    5: frozenset(),  # NVML_PERF_POLICY_RELIABILITY
}
_MAX_AVERAGE_TICKS = 600
GPU_INSTANCE_BASE = 1  # NVML numbers a GPU's instances from 1; a MIG device's is by default its index + 1


class HardwareModel:
    def __init__(self, gpu: GpuModel, seed: int) -> None:
        self._gpu = gpu
        spec = gpu.spec
        self._violations: dict[int, Integral] = {}
        nvlink = spec.nvlink
        self.up_links = [link for link in range(nvlink.links) if link not in nvlink.down]
        self._nvlink_tx = Integral(lambda tau: nvlink.tx_bytes_per_s * gpu.utilization(tau), gpu.period)
        self._nvlink_rx = Integral(lambda tau: nvlink.rx_bytes_per_s * gpu.utilization(tau), gpu.period)
        self.mig_devices: list[MigDeviceSpec] = list(spec.mig_devices)
        # Per MIG device: (GPU instance id, compute instance id), and the device that describes its GPU
        # instance (the first that names it).
        self.mig_ids = [(m.gpu_instance or i + GPU_INSTANCE_BASE, m.compute_instance)
                        for i, m in enumerate(self.mig_devices)]
        self._instance_device: dict[int, int] = {}
        for i, (gi, _) in enumerate(self.mig_ids):
            self._instance_device.setdefault(gi, i)
        self._mig_streams = [noise_stream(seed, gpu.index, 1000 + i) for i in range(len(self.mig_devices))]

    # ---------------------------------------------------------------- throttle time

    def violation_ns(self, policy: int, t: float) -> int | None:
        """Nanoseconds the policy's reasons held the clocks since the start; None for an unknown policy."""
        reasons = _POLICY_REASONS.get(policy)
        if reasons is None:
            return None
        integral = self._violations.get(policy)
        if integral is None:
            bits = sum(REASON_BITS[name] for name in reasons)
            gpu = self._gpu
            integral = Integral(lambda tau: 1.0 if gpu.clock_event_mask(tau) & bits else 0.0, gpu.period)
            self._violations[policy] = integral
        return round(integral.at(t) * 1e9)

    # ---------------------------------------------------------------- NVLink

    def nvlink_kib(self, t: float, link: int | None) -> tuple[int, int]:
        """(transmitted, received) KiB over all links (``link`` None) or one link."""
        if not self.up_links or (link is not None and link not in self.up_links):
            return 0, 0
        share = 1.0 if link is None else 1.0 / len(self.up_links)
        return (math.floor(self._nvlink_tx.at(t) * share / 1024),
                math.floor(self._nvlink_rx.at(t) * share / 1024))

    def nvlink_errors(self, link: int | None, t: float) -> dict[str, int]:
        nvlink = self._gpu.spec.nvlink
        if link is not None and link != nvlink.errors_link:
            return {}
        counts = dict(nvlink.errors)
        for burst in self._gpu.spec.errors:
            if burst.at <= t:
                for kind, n in burst.nvlink.items():
                    counts[kind] = counts.get(kind, 0) + n
        return counts

    def pcie_errors(self, kind: str, t: float) -> int:
        """The PCIe error counter of ``kind`` at ``t``: the health spec's, plus the errors since."""
        return self._gpu.spec.health.pcie_errors.get(kind, 0) + sum(
            burst.pcie.get(kind, 0) for burst in self._gpu.spec.errors if burst.at <= t)

    def pcie_replays(self, t: float) -> int:
        return self._gpu.spec.health.pcie_replays + sum(
            burst.pcie_replays for burst in self._gpu.spec.errors if burst.at <= t)

    def ecc_uncorrected(self, t: float) -> int:
        return self._gpu.spec.ecc.uncorrected_volatile + sum(
            burst.ecc_uncorrected for burst in self._gpu.spec.errors if burst.at <= t)

    # ---------------------------------------------------------------- MIG

    def instance_device(self, gpu_instance: int) -> int | None:
        """The index of the MIG device that describes a GPU instance; None for no such instance."""
        return self._instance_device.get(gpu_instance)

    def mig_memory_used(self, index: int, tau: float) -> int:
        """The memory in use in the MIG device's GPU instance (its compute instances share it). A
        process that names no MIG device runs on the first."""
        gi = self.mig_ids[index][0]
        return sum(p.spec.memory for p in self._gpu.active_processes(tau)
                   if self.mig_ids[p.spec.mig_device or 0][0] == gi)

    def mig_activity(self, index: int, t1: float, t2: float) -> float:
        """The MIG device's mean activity (0-1) over the ticks between two GPM samples."""
        pattern, stream = self.mig_devices[index].utilization, self._mig_streams[index]
        first = math.floor(t1 * TICKS_PER_SECOND - 0.5) + 1
        last = math.floor(t2 * TICKS_PER_SECOND - 0.5)
        if last < first:
            first = last = math.floor(t2 * TICKS_PER_SECOND)
        step = max(1, (last - first + 1) // _MAX_AVERAGE_TICKS)
        values = [pattern.value(self._gpu.loop_time((k + 0.5) / TICKS_PER_SECOND), stream, k)
                  for k in range(first, last + 1, step)]
        return sum(values) / len(values)
