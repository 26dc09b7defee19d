"""Who holds a GPU now and since when, as far as the agent has seen, for the rules that judge the
present (a GPU held or allocated while idle, shared by processes): its latest reading, since when each
of its compute processes has held it, since when each pod container has been allocated it, and when a
process last held a context on it (``Occupancy``); on a GPU in MIG mode the same per MIG device
(``InstanceOccupancy``). ``NodeHistory`` keeps one per GPU and updates it each tick.
"""

from __future__ import annotations

from gpuscope.snapshot import GpuReading, MigReading, PodContainer, ProcessReading


def mig_listed(reading: GpuReading, mig_known: bool) -> bool:
    """The reading's MIG devices are the GPU's now: it was read this tick and its devices were listed
    (or known to be none: MIG mode off, or no listing failed). ``mig_known`` False: a MIG device
    listing failed this tick (Snapshot.sample_errors)."""
    return reading.up and (mig_known or bool(reading.mig_devices) or not reading.mig_enabled)


class InstanceOccupancy:
    """Who holds one MIG device now and since when (``Occupancy`` of a device): updated in place each
    tick the device is listed; a tick at which the GPU's MIG devices are not known keeps it."""

    __slots__ = ("first_busy", "first_seen", "last_context", "pods_since", "processes", "reading")

    def __init__(self, t: float, reading: MigReading) -> None:
        self.first_seen = t
        self.reading = reading  # the latest reading
        self.processes: tuple[ProcessReading, ...] = ()  # the latest known processes on the device
        self.pods_since: dict[PodContainer, float] = {}  # allocated pod container -> first tick seen
        self.last_context: float | None = None  # last tick with a process on it, or an unknown list
        self.first_busy: tuple[float, float] | None = None  # (tick, counter) of its first busy-seconds

    def update(self, t: float, reading: MigReading, processes: tuple[ProcessReading, ...] | None) -> None:
        """``processes``: the GPU's processes this tick, None where the list is not known."""
        self.reading = reading
        if reading.pods or self.pods_since:
            pods = self.pods_since
            self.pods_since = {pod: pods.get(pod, t) for pod in reading.pods}
        if self.first_busy is None and reading.busy_seconds_total is not None:
            self.first_busy = (t, reading.busy_seconds_total)
        if processes is None:
            self.last_context = t
            return
        on_it = self.processes = tuple([p for p in processes if reading.runs(p)]) if processes else ()
        if on_it:
            self.last_context = t


class Occupancy:
    """Who holds one GPU now and since when, as far as the agent has seen: updated in place each tick.

    Times are the snapshots' monotonic clock. A tick at which the process lists are not known (the
    GPU is down, or NVML's process listing failed) changes neither ``processes`` nor ``held_since``,
    and counts as a tick at which a process may have held a context (``last_context``): an unknown
    is never taken for "no process".
    """

    __slots__ = ("first_seen", "held_since", "instances", "last_context", "pods_since", "processes",
                 "reading")

    def __init__(self, t: float, reading: GpuReading) -> None:
        self.first_seen = t  # the first tick of this GPU (this UUID at this index)
        self.reading = reading  # the latest reading
        self.processes: tuple[ProcessReading, ...] = ()  # the latest known process list
        self.held_since: dict[int, float] = {}  # compute process pid -> first tick it was seen on the GPU
        self.pods_since: dict[PodContainer, float] = {}  # allocated pod container -> first tick seen
        self.last_context: float | None = None  # last tick with a process on the GPU, or an unknown list
        # MIG mode: its MIG devices by UUID, as last listed.
        self.instances: dict[str, InstanceOccupancy] = {}

    def update(self, t: float, reading: GpuReading, processes_known: bool, mig_known: bool = True) -> None:
        self.reading = reading
        if reading.pods or self.pods_since:
            pods = self.pods_since
            self.pods_since = {pod: pods.get(pod, t) for pod in reading.pods}
        if reading.mig_devices or self.instances:
            self._update_instances(t, reading, processes_known, mig_known)
        if not (reading.up and processes_known):
            self.last_context = t
            return
        processes = self.processes = reading.processes
        if processes:
            self.last_context = t
        held = self.held_since
        if processes or held:
            self.held_since = {p.pid: held.get(p.pid, t) for p in processes if p.kind == "compute"}

    def _update_instances(self, t: float, reading: GpuReading, processes_known: bool,
                          mig_known: bool) -> None:
        """The MIG devices listed now replace those listed before; a GPU that is down, or whose
        devices could not be listed this tick (``mig_listed``), keeps the ones it had (with an unknown
        process list when the GPU is down)."""
        known = reading.processes if reading.up and processes_known else None
        instances = self.instances
        if not mig_listed(reading, mig_known):
            for device in instances.values():
                device.update(t, device.reading, known)
            return
        current = {}
        for mig in reading.mig_devices:
            device = instances.get(mig.uuid) or InstanceOccupancy(t, mig)
            device.update(t, mig, known)
            current[mig.uuid] = device
        self.instances = current
