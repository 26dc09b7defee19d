"""The sampler: one background thread, one immutable Snapshot per interval.

It owns NVML's lifecycle (lazy init with back-off while there is no driver), the per-GPU counter
state (energy resets, PCIe integration, idle dips, busy time, energy by process) and the process
mapping, and publishes each new Snapshot by replacing one reference, so readers never block it and it
never blocks on them. When NVML's event wait polls, each tick also checks for Xid events (see nvml.xid).
A watchdog (its own thread, or the agent's main thread) gives up on an NVML call that does not return
(see read_guard).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import socket
import threading
import time
from collections.abc import Callable

from gpuscope.common.cadence import Cadence
from gpuscope.health import SourceHealth
from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import GpuLostError, Nvml, NvmlDevice, NvmlUnavailable
from gpuscope.nvml.clock_events import decode_clock_event_reasons
from gpuscope.nvml.readings import DeviceReadings, MigDeviceReadings
from gpuscope.nvml.xid import XidWatcher
from gpuscope.sampling.gpu_state import GpuState, ReadCadences
from gpuscope.sampling.idle_dips import IdleDipCounter
from gpuscope.sampling.read_guard import ReadGuard
from gpuscope.snapshot import (
    STALE_AFTER_INTERVALS,
    GpuReading,
    MigReading,
    PodContainer,
    ProcessReading,
    Snapshot,
    UtilizationSample,
)
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

SnapshotListener = Callable[[Snapshot], None]
# (GPU UUID, GPU index) -> the pod containers the GPU is allocated to; a dictionary lookup, no I/O.
PodLookup = Callable[[str, int], tuple[PodContainer, ...]]


class _GivenUp(Exception):
    """This sampler thread was given up on while stuck in an NVML call (see read_guard)."""


# The read guard's index for the Xid check made each tick when NVML's event wait polls: no GPU has it, so
# a check that hangs is given up on as a GPU read is, and only Xid counting waits for it.
XID_CHECK_INDEX = -1


# The readings the boundary hands over unchanged: DeviceReadings' fields that GpuReading has too.
_SNAPSHOT_FIELDS = frozenset(f.name for f in dataclasses.fields(GpuReading))
PLAIN_READINGS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(DeviceReadings) if f.name in _SNAPSHOT_FIELDS)
_plain_values = operator.attrgetter(*PLAIN_READINGS)


def _no_pods(_uuid: str, _index: int) -> tuple[PodContainer, ...]:
    return ()  # not a Kubernetes node, or pod attribution disabled


class Sampler:
    def __init__(
        self,
        nvml: Nvml,
        inspector: ProcessInspector,
        *,
        interval_seconds: float = 1.0,
        idle_dip_threshold: float = 0.25,
        idle_dip_max_seconds: float = 5.0,
        hostname: str | None = None,
        retry_initial_seconds: float = 1.0,
        retry_max_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        pods: PodLookup | None = None,
        health: SourceHealth | None = None,
        expected_gpus: int | None = None,
        energy_interval_seconds: float = 0.0,
        samples_interval_seconds: float = 0.0,
        health_interval_seconds: float = 0.0,
        throttle_interval_seconds: float = 0.0,
        gpm_interval_seconds: float = 0.0,
        nvlink_per_link: bool = False,
        stuck_after_seconds: float = 3.0,
        unhealthy_after_seconds: float = 30.0,
    ) -> None:
        self._nvml = nvml
        self._inspector = inspector
        self._interval = interval_seconds
        self._dip_threshold = idle_dip_threshold
        self._dip_max_us = int(idle_dip_max_seconds * 1e6)
        self._hostname = hostname or socket.gethostname()
        self._retry_initial = retry_initial_seconds
        self._retry_max = retry_max_seconds
        self._clock = clock
        self._wall_clock = wall_clock
        self._pods = pods or _no_pods
        self._health = health
        self._expected_gpus = expected_gpus
        # A tick reads a GPU's energy counter (and the other readings with an interval of their own)
        # once that interval has passed since it last did (common/cadence.py).
        self._read_periods = (energy_interval_seconds, samples_interval_seconds, health_interval_seconds,
                              throttle_interval_seconds, gpm_interval_seconds)
        self._nvlink_per_link = nvlink_per_link
        self._process_seconds = 0.0  # this tick's time in process mapping (part of every GPU's read)

        self._devices: list[NvmlDevice] = []
        self._driver_version: str | None = None
        self._states: dict[int, GpuState] = {}
        self._xid: XidWatcher | None = None
        self._next_init_at = 0.0
        self._backoff = retry_initial_seconds
        self._init_failures = 0

        self._reasons: dict[int, frozenset[str]] = {}  # clock event mask -> names (a handful of masks)

        self._latest: Snapshot | None = None
        self._listeners: list[SnapshotListener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._guard = ReadGuard(stuck_after_seconds)
        self._unhealthy_after = unhealthy_after_seconds
        self._progress_at = 0.0  # monotonic: when the sampler started, then when a tick last completed

    # ------------------------------------------------------------ SnapshotSource

    @property
    def interval_seconds(self) -> float:
        return self._interval

    def latest(self) -> Snapshot | None:
        return self._latest

    def is_alive(self) -> bool:
        """Sampling makes progress: a tick completed within ``unhealthy_after`` (or the sampler started
        that recently). A sampler stuck as a whole (NVML's init, a listener) is not alive."""
        return self._thread is not None and time.monotonic() - self._progress_at < self._unhealthy_after

    def snapshot_is_stale(self) -> bool:
        latest = self._latest
        limit = STALE_AFTER_INTERVALS * self._interval
        return latest is not None and self._clock() - latest.monotonic >= limit

    @property
    def stuck_calls_total(self) -> int:
        """NVML calls given up on since start: GPU reads, or Xid checks, that did not return within
        stuck_after."""
        return self._guard.stuck_calls_total

    # ------------------------------------------------------------ lifecycle

    def add_listener(self, listener: SnapshotListener) -> None:
        """Called in the sampler thread with every new Snapshot; must be quick and must not raise."""
        self._listeners.append(listener)

    def start(self, *, watchdog_thread: bool = True) -> None:
        """Start sampling. ``watchdog_thread=False``: no watchdog thread; the caller runs the watchdog
        instead, calling ``watch_once`` when it says (the agent's main thread, idle otherwise)."""
        self._progress_at = time.monotonic()
        self._start_thread(self._guard.next_generation())
        if watchdog_thread:
            self._watchdog = start_thread("gpuscope-watchdog", self._watch, health=self._health,
                                          source="nvml")

    def _start_thread(self, generation: int) -> None:
        self._thread = start_thread("gpuscope-sampler", lambda: self._run(generation), health=self._health,
                                    source="nvml")

    def stop(self, timeout: float = 1.0) -> None:
        """Stop ticking within ``timeout``; a tick stuck in NVML is abandoned (a daemon thread)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in (self._thread, self._watchdog):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._xid is not None:
            # Asked now: a watcher that polls frees its event set here, before NVML shuts down; a thread
            # blocked in the event wait ends when NVML shuts down.
            self._xid.stop(timeout=0.0)
        if self._thread is None or not self._thread.is_alive():
            self._nvml.shutdown()
        if self._xid is not None:
            self._xid.stop(timeout=max(0.0, deadline - time.monotonic()))

    def wait_first(self, timeout: float) -> Snapshot | None:
        """Block until the first snapshot exists (for `gpuscope snapshot` and tests)."""
        deadline = time.monotonic() + timeout
        while self._latest is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.01)
        return self._latest

    def _watch(self) -> None:
        """The watchdog thread: ``watch_once`` when it says, until the sampler stops."""
        delay = self._guard.stuck_after_seconds
        while not self._stop.wait(delay):
            delay = self.watch_once()

    def watch_once(self) -> float:
        """One round of the watchdog: gives up on an NVML call (a GPU read, the Xid check) that has not
        returned within ``stuck_after`` (see read_guard); returns the seconds until the next round.

        With no call in progress that is ``stuck_after``; with one, until that call will have run
        ``stuck_after``. A call that starts in between has run less than that at the next round, so
        every stuck call is given up on once it has run ``stuck_after`` (not up to a period later),
        and on a quiet node the watchdog runs once per ``stuck_after``."""
        stuck_after = self._guard.stuck_after_seconds
        now = time.monotonic()
        found = self._guard.stuck(now)
        if found is not None:
            gpu, generation = found
            if gpu == XID_CHECK_INDEX:
                log.warning("NVML's Xid event check has not returned for %gs: Xid events are not counted "
                            "until it returns; the GPUs keep reporting", stuck_after)
            else:
                log.warning("GPU %d: an NVML call has not returned for %gs: GPU %d is reported down and "
                            "skipped until it returns; the other GPUs keep reporting", gpu, stuck_after, gpu)
            self._start_thread(generation)
        stuck_at = self._guard.stuck_at()
        # (At least a millisecond: a read that became stuck just now is found by the next round.)
        return stuck_after if stuck_at is None else max(stuck_at - now, 0.001)

    def _run(self, generation: int) -> None:
        next_at = self._clock()
        while not self._stop.is_set() and generation == self._guard.generation:
            try:
                self.tick(generation)
            except _GivenUp:
                return  # a newer sampler thread carries on
            except Exception:  # a bug in one tick must not end sampling for good
                log.exception("sampling tick failed")
            next_at += self._interval
            delay = next_at - self._clock()
            if delay < 0:  # fell behind (slow NVML): skip the missed ticks rather than burst
                next_at = self._clock()
                delay = 0.0
            self._stop.wait(delay)

    # ------------------------------------------------------------ one tick

    def tick(self, generation: int | None = None) -> Snapshot:
        """Read everything once and publish a new Snapshot. ``generation``: the sampler thread's (see
        read_guard); a tick called directly (tests, `gpuscope snapshot`) reads as the current one."""
        if generation is None:
            generation = self._guard.generation
        started = time.perf_counter()
        now = self._clock()
        self._process_seconds = 0.0
        errors_before = sum(self._nvml.error_counts.values())
        self._ensure_nvml(now)
        self._check_xid(generation)
        gpus: list[GpuReading] = []
        pids: set[int] = set()
        for device in self._devices:
            reading = self._read_gpu(device, now, generation)
            gpus.append(reading)
            pids.update(p.pid for p in reading.processes)
        mapped = time.perf_counter()
        self._inspector.retain(pids)
        self._process_seconds += time.perf_counter() - mapped
        if self._health is not None:
            self._record_health(gpus, errors_before, time.perf_counter() - started)
        snapshot = Snapshot(
            timestamp=self._wall_clock(),
            hostname=self._hostname,
            nvml_up=self._nvml.initialized,
            driver_version=self._driver_version,
            gpus=tuple(gpus),
            sample_duration_seconds=time.perf_counter() - started,
            sample_errors=dict(self._nvml.error_counts),
            interval_seconds=self._interval,
            monotonic=now,
            nvml_stuck_calls_total=self._guard.stuck_calls_total,
        )
        self._latest = snapshot
        self._progress_at = time.monotonic()
        for listener in self._listeners:
            try:
                listener(snapshot)
            except Exception:
                log.exception("snapshot listener %r failed", listener)
        return snapshot

    def _record_health(self, gpus: list[GpuReading], errors_before: int, elapsed: float) -> None:
        """nvml: up, every GPU read and no reading failed this tick; processes: pids can be mapped."""
        assert self._health is not None
        nvml_ok = (self._nvml.initialized and all(g.up for g in gpus)
                   and sum(self._nvml.error_counts.values()) == errors_before)
        self._health.record("nvml", success=nvml_ok, duration_seconds=elapsed - self._process_seconds)
        self._health.record("processes", success=self._inspector.host_pid_namespace,
                            duration_seconds=self._process_seconds)

    def _ensure_nvml(self, now: float) -> None:
        if self._nvml.initialized or now < self._next_init_at:
            return
        try:
            self._nvml.init()
            try:
                devices = self._nvml.devices()
            except NvmlUnavailable:
                self._nvml.shutdown()  # not "up with no GPUs": down, and tried again like a failed init
                raise
        except NvmlUnavailable as err:
            self._init_failures += 1
            if self._init_failures == 1:
                log.warning("%s", err.hint)
            else:
                log.debug("NVML still unavailable (%s); next try in %.0f s", err.reason, self._backoff)
            self._next_init_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self._retry_max)
            return
        if self._init_failures:
            log.info("NVML is available after %d failed attempt(s)", self._init_failures)
        self._init_failures = 0
        self._backoff = self._retry_initial
        self._driver_version = self._nvml.driver_version()
        self._devices = devices
        if self._expected_gpus is not None and len(devices) < self._expected_gpus:
            log.warning("NVML lists %d GPU(s), %d expected (nvml.expected_gpus): /-/ready fails until "
                        "they are all readable", len(devices), self._expected_gpus)
        self._states = {
            d.identity.index: GpuState(IdleDipCounter(self._dip_threshold, self._dip_max_us),
                                        ReadCadences(*(Cadence(period, self._interval)
                                                        for period in self._read_periods)))
            for d in self._devices
        }
        log.info("NVML up: driver %s, %d GPU(s)", self._driver_version, len(self._devices))
        for d in self._devices:
            if d.identity.mig_enabled:
                log.info("GPU %d has MIG enabled: no utilization samples, process utilization or GPM "
                         "for it (NVML does not provide them per MIG instance)", d.identity.index)
        self._xid = XidWatcher(self._nvml, self._devices, health=self._health)
        self._xid.start()

    def _check_xid(self, generation: int) -> None:
        """Count the Xid events that came since the last tick, when the watcher has no thread waiting
        for them (its library's wait polls). Guarded like a GPU read: skipped while a check is stuck."""
        xid = self._xid
        if xid is None or not xid.polling or self._guard.held(XID_CHECK_INDEX):
            return
        self._guard.begin(generation, XID_CHECK_INDEX, time.monotonic())
        try:
            xid.poll()
        finally:
            current = self._guard.end(generation, XID_CHECK_INDEX)
        if not current:  # given up on while stuck in it (see _read_gpu)
            log.info("NVML's Xid event check that was stuck returned")
            raise _GivenUp

    def _read_gpu(self, device: NvmlDevice, now: float, generation: int) -> GpuReading:
        ident = device.identity
        state = self._states[ident.index]
        xids = self._xid.counts(ident.index) if self._xid is not None else {}
        if self._guard.held(ident.index):  # a call on it is still stuck: down, not asked again
            state.busy.interrupted()
            return self._down(device, xids, state)
        self._guard.begin(generation, ident.index, time.monotonic())
        reads = state.reads
        due = reads.due(now)
        read_energy, read_samples, read_health, read_throttle, read_gpm = due
        try:
            raw: DeviceReadings | None = self._nvml.read(
                device, energy=read_energy, samples=read_samples, health=read_health, throttle=read_throttle,
                gpm=read_gpm, nvlink_per_link=self._nvlink_per_link)
        except GpuLostError as err:
            raw = None
            # What the boundary dropped at the loss is read again as soon as the GPU is back.
            for cadence in (reads.health, reads.throttle, reads.gpm):
                cadence.reset()
            if not state.lost:
                log.warning("GPU %d (%s) is lost: %s; the other GPUs keep reporting",
                            ident.index, ident.uuid, err)
                state.lost = True
        finally:
            current = self._guard.end(generation, ident.index)
        if not current:
            # Given up on while stuck in that call: the GPU is released (read again from the next
            # tick, by the thread that carried on) and this thread touches nothing more.
            log.info("GPU %d: the NVML call that was stuck returned", ident.index)
            raise _GivenUp
        if raw is None:
            state.busy.interrupted()
            return self._down(device, xids, state)
        if state.lost:
            log.info("GPU %d (%s) is readable again", ident.index, ident.uuid)
            state.lost = False
        reads.done(now, due)
        return self._to_reading(device, raw, state, xids, now)

    def _down(self, device: NvmlDevice, xids: dict[int, int], state: GpuState) -> GpuReading:
        """A GPU that could not be read this tick (lost, or held by a stuck call): identity, Xid counts
        and pods only, and its MIG devices as last read (their allocations hold; their readings are
        not exported while the GPU is down)."""
        ident = device.identity
        mig = tuple(dataclasses.replace(m, pods=self._pods(m.uuid, -1)) for m in state.mig_devices)
        return GpuReading(index=ident.index, uuid=ident.uuid, name=ident.name, pci_bus_id=ident.pci_bus_id,
                          up=False, mig_enabled=ident.mig_enabled, xid_errors=xids,
                          pods=self._pods(ident.uuid, ident.index), mig_devices=mig)

    def _to_reading(self, device: NvmlDevice, raw: DeviceReadings, state: GpuState,
                    xids: dict[int, int], now: float) -> GpuReading:
        ident = device.identity
        new_samples = raw.new_utilization_samples
        samples = tuple(itertools.starmap(UtilizationSample, new_samples)) if new_samples else ()
        if samples:
            utilization: float | None = sum([v for _, v in new_samples or ()]) / len(samples)
        else:
            utilization = raw.rate_utilization_ratio  # no new samples (idle or unsupported): the rate API
        dips = None if new_samples is None else state.dips.update(new_samples)
        busy: float | None = None
        if new_samples is not None:
            state.busy.add_samples(new_samples, from_history=raw.utilization_samples_from_history)
            busy = state.busy.total
        elif raw.rate_utilization_ratio is not None:  # a GPU that keeps no samples
            state.busy.add_rate(raw.rate_utilization_ratio, now)
            busy = state.busy.total
        gpm = state.gpm_active
        gpm.add(raw.sm_active_ratio, raw.tensor_active_ratio, raw.gpm_interval_seconds)
        tx = rx = None
        if raw.pcie is not None:
            if raw.pcie.cumulative:
                tx, rx = raw.pcie.tx, raw.pcie.rx
            else:
                tx, rx = state.pcie_tx.update(raw.pcie.tx, now), state.pcie_rx.update(raw.pcie.rx, now)
        # Between two reads of the energy counter (nvml.energy_interval) the GPU keeps its last total, as
        # does one whose read failed this tick; the split among processes waits for the next read.
        energy = raw.energy_counter_joules
        fresh_energy = None if energy is None else state.energy.update(energy)
        energy_total = state.energy.total if state.energy.has_reading else None
        busy_by_pid, energy_by_pid = self._process_counters(raw, state, fresh_energy, energy_total, now)
        processes = self._processes(raw, busy_by_pid, energy_by_pid)
        mask = raw.clock_event_mask
        return GpuReading(
            index=ident.index,
            uuid=ident.uuid,
            name=ident.name,
            pci_bus_id=ident.pci_bus_id,
            up=True,
            mig_enabled=ident.mig_enabled,
            utilization_ratio=utilization,
            utilization_samples=samples,
            busy_seconds_total=busy,
            energy_joules_total=energy_total,
            idle_energy_joules_total=None if energy_total is None else state.energy_split.idle_total,
            sm_active_seconds_total=gpm.sm_seconds,
            tensor_active_seconds_total=gpm.tensor_seconds,
            clock_event_reasons=None if mask is None else self._clock_reasons(mask),
            pcie_tx_bytes_total=tx,
            pcie_rx_bytes_total=rx,
            xid_errors=xids,
            idle_dips_total=dips,
            processes=processes,
            pods=self._pods(ident.uuid, ident.index),
            mig_devices=self._mig_devices(raw.mig_readings, state),
            **dict(zip(PLAIN_READINGS, _plain_values(raw), strict=True)),
        )

    def _mig_devices(self, readings: tuple[MigDeviceReadings, ...],
                     state: GpuState) -> tuple[MigReading, ...]:
        if not readings:
            state.mig_devices = ()
            return ()
        busy = state.instance_busy
        # A GPU instance is known by its id and its MIG devices' UUIDs: one destroyed and made anew
        # under the same id starts its busy time at 0.
        members: dict[int, set[str]] = {}
        for m in readings:
            members.setdefault(m.identity.gpu_instance, set()).add(m.identity.uuid)
        keys = {instance: (instance, frozenset(uuids)) for instance, uuids in members.items()}
        for gone in set(busy) - set(keys.values()):
            del busy[gone]
        counted: set[int] = set()
        out = []
        for m in readings:
            ident = m.identity
            instance = ident.gpu_instance
            key = keys[instance]
            # Compute instances of one GPU instance share its GPM figures: counted once per instance.
            if instance not in counted and m.graphics_active_ratio is not None and m.gpm_interval_seconds:
                busy[key] = busy.get(key, 0.0) + m.graphics_active_ratio * m.gpm_interval_seconds
                counted.add(instance)
            out.append(MigReading(
                index=ident.index, gpu_instance=instance, compute_instance=ident.compute_instance,
                uuid=ident.uuid, profile=ident.profile, memory_used_bytes=m.memory_used_bytes,
                memory_total_bytes=m.memory_total_bytes, sm_active_ratio=m.sm_active_ratio,
                tensor_active_ratio=m.tensor_active_ratio, dram_active_ratio=m.dram_active_ratio,
                busy_seconds_total=busy.get(key), pods=self._pods(ident.uuid, -1),
            ))
        state.mig_devices = tuple(out)
        return state.mig_devices

    def _clock_reasons(self, mask: int) -> frozenset[str]:
        reasons = self._reasons.get(mask)
        if reasons is None:
            if len(self._reasons) > 1024:  # a few masks occur in practice; never grow without bound
                self._reasons.clear()
            reasons = self._reasons[mask] = decode_clock_event_reasons(mask)
        return reasons

    @staticmethod
    def _process_counters(raw: DeviceReadings, state: GpuState, fresh_energy: float | None,
                          energy_total: float | None,
                          now: float) -> tuple[dict[int, float] | None, dict[int, float] | None]:
        """Each listed process's busy seconds and energy so far: None where the GPU reports no
        per-process samples (energy: or no energy either), all of its energy then being idle energy.
        ``fresh_energy``: the energy total if read this tick; ``energy_total``: the last one read."""
        per_pid = raw.new_process_samples
        busy_by_pid: dict[int, float] | None = None
        if per_pid is not None:
            state.process_samples_seen = True
        if state.process_samples_seen:
            # A tick whose call failed (None) counts nothing: the next one reads on from the cursor.
            busy_by_pid = state.process_busy.update(
                per_pid or {}, {proc.pid for proc in raw.nvml_processes},
                from_history=raw.process_samples_from_history)
        state.energy_split.update(fresh_energy, now, busy_by_pid or {})
        if energy_total is None or busy_by_pid is None:
            return busy_by_pid, None
        return busy_by_pid, state.energy_split.by_pid

    def _processes(self, raw: DeviceReadings, busy_by_pid: dict[int, float] | None,
                   energy_by_pid: dict[int, float] | None) -> tuple[ProcessReading, ...]:
        started = time.perf_counter()
        out = []
        describe = self._inspector.describe
        per_pid = raw.new_process_samples
        for proc in raw.nvml_processes:
            host = describe(proc.pid)
            sm: float | None = None
            if per_pid is not None and proc.kind == "compute":
                # No sample for a pid since the last tick means it ran no kernels in that time.
                rows = per_pid.get(proc.pid)
                sm = sum([value for _, value in rows]) / len(rows) if rows else 0.0
            out.append(ProcessReading(
                pid=proc.pid,
                kind=proc.kind,
                memory_used_bytes=proc.memory_used_bytes,
                sm_utilization_ratio=sm,
                host_visible=host.visible,
                name=host.name,
                user=host.user,
                container_id=host.container_id,
                cmdline=host.cmdline,
                slurm_job=host.slurm_job,
                busy_seconds_total=None if busy_by_pid is None else busy_by_pid.get(proc.pid),
                energy_joules_total=None if energy_by_pid is None else energy_by_pid.get(proc.pid),
                gpu_instance=proc.gpu_instance,
                compute_instance=proc.compute_instance,
            ))
        self._process_seconds += time.perf_counter() - started
        return tuple(out)
