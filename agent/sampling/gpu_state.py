"""What the sampler carries from one tick to the next for one GPU: its counters across driver resets,
its idle-dip counter, its busy time and energy by process, its MIG devices as last read, and when its
readings that are not read every tick are next due.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuscope.common.cadence import Cadence
from gpuscope.sampling.busy_time import GpmActiveTime, GpuBusyTime, ProcessBusyTime
from gpuscope.sampling.counters import RateIntegrator, ResetSafeCounter
from gpuscope.sampling.energy_split import EnergySplit
from gpuscope.sampling.idle_dips import IdleDipCounter
from gpuscope.snapshot import MigReading


@dataclass(frozen=True, slots=True)
class ReadCadences:
    """One GPU's readings that are read every so often rather than every tick (``nvml.*_interval``)."""

    energy: Cadence  # the energy counter
    samples: Cadence  # the utilization samples
    health: Cadence  # the health readings
    throttle: Cadence  # the throttle (violation) counters
    gpm: Cadence  # a GPM sample

    def due(self, now: float) -> tuple[bool, bool, bool, bool, bool]:
        """Which are to be read at the tick at ``now``: energy, samples, health, throttle, GPM."""
        return (self.energy.due(now), self.samples.due(now), self.health.due(now), self.throttle.due(now),
                self.gpm.due(now))

    def done(self, now: float, read: tuple[bool, bool, bool, bool, bool]) -> None:
        """Those ``read`` (as ``due`` ordered them) were read at the tick at ``now``."""
        cadences = (self.energy, self.samples, self.health, self.throttle, self.gpm)
        for cadence, was_read in zip(cadences, read, strict=True):
            if was_read:
                cadence.done(now)


@dataclass(slots=True)
class GpuState:
    """What the sampler carries from one tick to the next for one GPU."""

    dips: IdleDipCounter
    reads: ReadCadences  # when the readings not read every tick are next asked for
    energy: ResetSafeCounter = field(default_factory=ResetSafeCounter)
    pcie_tx: RateIntegrator = field(default_factory=RateIntegrator)
    pcie_rx: RateIntegrator = field(default_factory=RateIntegrator)
    busy: GpuBusyTime = field(default_factory=GpuBusyTime)
    gpm_active: GpmActiveTime = field(default_factory=GpmActiveTime)
    process_busy: ProcessBusyTime = field(default_factory=ProcessBusyTime)
    process_samples_seen: bool = False  # the GPU has reported per-process samples at least once
    energy_split: EnergySplit = field(default_factory=EnergySplit)
    # MIG: seconds each GPU instance was active (GPM's graphics activity times its interval), and the
    # MIG devices last read (reported, with their pods, while the GPU cannot be read).
    instance_busy: dict[tuple[int, frozenset[str]], float] = field(default_factory=dict)
    mig_devices: tuple[MigReading, ...] = ()
    lost: bool = False
