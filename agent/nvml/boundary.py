"""The NVML boundary: what the rest of the agent calls NVML through (``pynvml`` is imported only here
and in the helpers of this package it delegates to: ``errors``, ``decoding``, ``mig``, ``gpm``, ``health``).

It turns NVML's C-shaped API into plain typed readings: one call per (device, reading), each isolated,
with "not supported" remembered per device (so the agent stops asking) and kept distinct from an
error, which is counted per reading and logged once until the reading works again. Units are
converted here to base units (bytes, watts, joules, hertz, ratios). Above this module nothing knows
NVML: the sampler works on ``DeviceReadings`` and the tests of everything else use plain values.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpuscope.nvml import gpm, mig
from gpuscope.nvml import health as health_readings
from gpuscope.nvml.ctypes_layout import fields, layout, unpack_array
from gpuscope.nvml.decoding import (
    PCIE_FIELD_LAYOUT,
    clock_event_reasons,
    new_process_samples,
    new_utilization_samples,
    running_processes,
)
from gpuscope.nvml.device import NvmlDevice
from gpuscope.nvml.errors import GpuLostError, NvmlEnumerationError, NvmlError, NvmlUnavailable, describe
from gpuscope.nvml.readings import DeviceIdentity, DeviceReadings, PcieReading, RawProcess

__all__ = ["GpuLostError", "Nvml", "NvmlDevice", "NvmlEnumerationError", "NvmlError", "NvmlUnavailable"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# NVML error classes that mean "there is no usable driver on this node" (retry later, serve up=0).
_UNAVAILABLE = (
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_INSUFFICIENT_POWER,
)
# The GPU has dropped off the bus or needs a reset: keep serving the others, retry this one later.
_LOST = (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED)

# As (fieldId, scopeId) pairs: pynvml sets both (scope 0, the device, as with a bare id), where a bare
# id costs it a caught TypeError per field.
_PCIE_FIELDS = ((pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0), (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0))
_MEMORY_LAYOUT = layout(pynvml.c_nvmlMemory_v2_t, "total", "reserved", "used")
_UTILIZATION_LAYOUT = layout(pynvml.c_nvmlUtilization_t, "gpu", "memory")


class Nvml:
    """NVML, reduced to what the sampler needs. Thread-safe as NVML itself is."""

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        import time

        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._initialized = False
        self.error_counts: dict[str, int] = {}  # reading -> failures since start
        self._failing: set[tuple[int, str]] = set()  # (gpu index, reading) currently failing and logged

    # ---------------------------------------------------------------- lifecycle

    @property
    def initialized(self) -> bool:
        return self._initialized

    def init(self) -> None:
        """Initialise NVML; raises NvmlUnavailable with the driver's reason when it cannot."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            if err.value in _UNAVAILABLE:
                raise NvmlUnavailable(describe(err)) from err
            raise NvmlUnavailable(f"nvmlInit failed: {describe(err)}") from err
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as err:  # shutting down anyway; nothing to recover
                log.debug("nvmlShutdown failed: %s", describe(err))

    def driver_version(self) -> str | None:
        try:
            return str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as err:
            self._record_failure(-1, "driver_version", err)
            return None

    def devices(self) -> list[NvmlDevice]:
        """Enumerate the GPUs. A GPU whose identity cannot be read yet is returned with placeholders.
        NvmlEnumerationError when NVML cannot count them."""
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as err:
            raise NvmlEnumerationError(f"nvmlDeviceGetCount failed: {describe(err)}") from err
        found = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as err:
                log.warning("GPU %d: cannot get a handle: %s", index, describe(err))
                found.append(NvmlDevice(None, DeviceIdentity(index, "", "", "", False)))
                continue
            found.append(NvmlDevice(handle, self._identity(index, handle)))
        return found

    def _identity(self, index: int, handle: Any) -> DeviceIdentity:
        def text(fn: Callable[[Any], Any]) -> str:
            try:
                return str(fn(handle))
            except pynvml.NVMLError:
                return ""

        try:
            current_mig, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            mig = current_mig == pynvml.NVML_DEVICE_MIG_ENABLE
        except pynvml.NVMLError:
            mig = False  # not supported on pre-Ampere GPUs: no MIG
        return DeviceIdentity(
            index=index,
            uuid=text(pynvml.nvmlDeviceGetUUID),
            name=text(pynvml.nvmlDeviceGetName),
            pci_bus_id=text(lambda h: pynvml.nvmlDeviceGetPciInfo_v3(h).busId),
            mig_enabled=mig,
        )

    def refresh_identity(self, device: NvmlDevice) -> None:
        """Retry the handle/identity of a GPU that was unreadable at enumeration."""
        handle = device.handle
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.identity.index)
            device.handle = handle
        if not device.identity.uuid:
            device.identity = self._identity(device.identity.index, handle)

    # ---------------------------------------------------------------- readings

    def read(self, device: NvmlDevice, *, energy: bool = True, samples: bool = True, health: bool = True,
             throttle: bool = True, nvlink_per_link: bool = False, settings: bool | None = None,
             gpm: bool = True) -> DeviceReadings:
        """All of one GPU's readings for this tick. The energy counter only with ``energy``, the
        utilization samples only with ``samples`` (the first read takes them regardless): on some
        drivers these two cost more than all the others. A GPM sample only with ``gpm``: its ratios
        cover the time since the previous sample and are repeated until the next. The health
        readings only with ``health``, the throttle counters only with ``throttle``, the slow
        settings (health.read_settings) and the idle video engines' utilization only with
        ``settings`` (by default: with ``health``); between reads the last values are repeated.
        ``nvlink_per_link`` adds the NVLink counters of each link. Raises GpuLostError if the GPU is
        gone."""
        try:
            if health:
                self._follow_mig_mode(device)
            r = self._read(device, energy, samples, gpm)
            cache = device.health
            if throttle:
                health_readings.read_throttle(self.query, device)
            if health:
                health_readings.read_health(self.query, device, per_link=nvlink_per_link)
            if health if settings is None else settings:
                health_readings.read_settings(self.query, device)
                health_readings.read_video(self.query, device)
            elif cache.video_in_use:
                health_readings.read_video(self.query, device)
            (r.nvlink_transmit_bytes_total, r.nvlink_receive_bytes_total,
             r.nvlink_link_bytes) = health_readings.read_nvlink_data(self.query, device, nvlink_per_link)
            for name, value in cache.values.items():
                setattr(r, name, value)
            if device.identity.mig_enabled:
                r.mig_readings = mig.read_devices(self.query, self._clock(), device, relist=health)
            return r
        except GpuLostError:
            # GPM counters across the time the GPU was lost mean nothing: the next GPM sample after it
            # comes back starts afresh instead of closing an interval that spans the loss. The health
            # readings are dropped too: a reset (what a pending row remap waits for) makes the GPU
            # lost for a moment, and what it had before says nothing of it after.
            device.forget_gpm()
            device.health.values.clear()
            raise

    def _follow_mig_mode(self, device: NvmlDevice) -> None:
        """MIG mode can be switched while the agent runs (on some GPUs without a reset): read again
        with the health readings. On a change, forget what the other mode's readings taught."""
        if device.handle is None or "mig_mode" in device.unsupported:
            return
        mode = self.query(device, "mig_mode", pynvml.nvmlDeviceGetMigMode, device.handle)
        if mode is None:
            return
        enabled = mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        if enabled != device.identity.mig_enabled:
            log.info("GPU %d: MIG mode is now %s", device.identity.index, "on" if enabled else "off")
            for state in device.mig_gpm.values():
                gpm.free(state)
            device.switch_mig_mode(enabled)

    def _read(self, device: NvmlDevice, read_energy: bool, read_samples: bool, read_gpm: bool,
              ) -> DeviceReadings:
        if device.handle is None or not device.identity.uuid:
            try:
                self.refresh_identity(device)
            except pynvml.NVMLError as err:
                raise GpuLostError(describe(err)) from err
        h = device.handle
        r = DeviceReadings()
        query = self.query
        # The first call doubles as the liveness probe: a lost GPU raises here and we stop.
        mem = query(device, "memory", pynvml.nvmlDeviceGetMemoryInfo, h, pynvml.nvmlMemory_v2)
        if mem is not None:
            total, reserved, used = (fields(_MEMORY_LAYOUT, pynvml.c_nvmlMemory_v2_t, mem)
                                     or (mem.total, mem.reserved, mem.used))
            r.memory_used_bytes, r.memory_reserved_bytes, r.memory_total_bytes = (
                int(used), int(reserved), int(total))
        rates = query(device, "utilization", pynvml.nvmlDeviceGetUtilizationRates, h)
        if rates is not None:
            gpu, memory = (fields(_UTILIZATION_LAYOUT, pynvml.c_nvmlUtilization_t, rates)
                           or (rates.gpu, rates.memory))
            r.rate_utilization_ratio = gpu / 100.0
            r.memory_utilization_ratio = memory / 100.0
        first_samples = not device.samples_read
        r.new_utilization_samples = self._utilization_samples(device, read_samples or first_samples)
        r.utilization_samples_from_history = first_samples and device.samples_read
        power = query(device, "power", pynvml.nvmlDeviceGetPowerUsage, h)
        r.power_watts = None if power is None else power / 1000.0
        if read_energy:
            energy = query(device, "energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
            r.energy_counter_joules = None if energy is None else energy / 1000.0
        temp = query(device, "temperature", pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        r.temperature_celsius = None if temp is None else float(temp)
        sm = query(device, "sm_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        r.sm_clock_hertz = None if sm is None else sm * 1e6
        r.clock_event_mask = query(device, "clock_events", clock_event_reasons, h)
        r.pcie = self._pcie(device)
        if read_gpm:  # else the ratios last read, with no interval: the time they cover is counted
            activity = gpm.device_metrics(query, self._clock(), device)
            device.gpm.ratios = activity[0] if activity is not None else {}
            if activity is not None and activity[0]:
                r.gpm_interval_seconds = activity[1]
        for name, value in device.gpm.ratios.items():
            setattr(r, name, value)
        r.nvml_processes = self._processes(device)
        first_process_samples = not device.process_samples_read
        r.new_process_samples = self._process_utilization(device)
        r.process_samples_from_history = first_process_samples and device.process_samples_read
        return r

    def query(self, device: NvmlDevice, reading: str, call: Callable[..., T], *args: Any) -> T | None:
        """One isolated reading, ``call(*args)``: None when unsupported (remembered) or failed (counted,
        logged once). The call and its arguments are passed rather than wrapped in a closure: this runs
        some twenty times per GPU per tick."""
        if reading in device.unsupported:
            return None
        try:
            value = call(*args)
        except pynvml.NVMLError as err:
            index = device.identity.index
            if err.value in _LOST:
                raise GpuLostError(describe(err)) from err
            if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                device.unsupported.add(reading)
                log.debug("GPU %d: %s not supported", index, reading)
                return None
            self._record_failure(index, reading, err)
            return None
        if self._failing and (device.identity.index, reading) in self._failing:
            index = device.identity.index
            self._failing.discard((index, reading))
            log.info("GPU %d: reading %s works again", index, reading)
        return value

    def _record_failure(self, index: int, reading: str, err: pynvml.NVMLError) -> None:
        with self._lock:
            self.error_counts[reading] = self.error_counts.get(reading, 0) + 1
            first = (index, reading) not in self._failing
            self._failing.add((index, reading))
        if first:  # once per failing streak, not every tick
            log.warning("GPU %d: reading %s failed: %s (logged once until it recovers)",
                        index, reading, describe(err))

    def _utilization_samples(self, device: NvmlDevice, read: bool) -> tuple[tuple[int, float], ...] | None:
        """The new samples; None when this GPU keeps none (unsupported, or MIG), () when the call
        failed this tick (the failure is counted) or was not made (``read`` false: the driver keeps
        them for the next read)."""
        if device.identity.mig_enabled:
            return None  # not per MIG instance
        if not read:
            return None if "utilization_samples" in device.unsupported else ()
        samples = self.query(device, "utilization_samples", new_utilization_samples, device)
        if samples is None:
            return None if "utilization_samples" in device.unsupported else ()
        device.samples_read = True
        return samples

    def _pcie(self, device: NvmlDevice) -> PcieReading | None:
        h = device.handle
        if device.pcie_counters is not False:
            array = self.query(device, "pcie_counters", pynvml.nvmlDeviceGetFieldValues, h, _PCIE_FIELDS)
            # (nvmlReturn, value.ullVal) of the TX then the RX field
            values = None if array is None else (
                unpack_array(PCIE_FIELD_LAYOUT, pynvml.c_nvmlFieldValue_t, array)
                or [(v.nvmlReturn, v.value.ullVal) for v in array])
            if values is not None and all(ret == pynvml.NVML_SUCCESS for ret, _ in values):
                device.pcie_counters = True
                return PcieReading(True, float(values[0][1]), float(values[1][1]))
            unsupported = "pcie_counters" in device.unsupported or (
                values is not None and any(ret == pynvml.NVML_ERROR_NOT_SUPPORTED for ret, _ in values))
            if device.pcie_counters or not unsupported:
                return None  # a counter GPU failed this tick: do not mix in the other source
            device.pcie_counters = False  # no byte counters on this GPU: the throughput API from now on
        # nvmlDeviceGetPcieThroughput reports KB/s over a 20 ms window; NVML's KB is 1024 bytes.
        tx = self.query(device, "pcie_throughput", pynvml.nvmlDeviceGetPcieThroughput, h,
                         pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = self.query(device, "pcie_throughput", pynvml.nvmlDeviceGetPcieThroughput, h,
                         pynvml.NVML_PCIE_UTIL_RX_BYTES)
        if tx is None or rx is None:
            return None
        return PcieReading(False, tx * 1024.0, rx * 1024.0)

    def _processes(self, device: NvmlDevice) -> list[RawProcess]:
        h = device.handle
        compute = self.query(device, "processes", running_processes, h, "compute")
        graphics = self.query(device, "graphics_processes", running_processes, h, "graphics")
        # Listed none: both lists read (or not supported, hence empty for good), and empty.
        listed_none = (not compute and not graphics
                       and (compute is not None or "processes" in device.unsupported)
                       and (graphics is not None or "graphics_processes" in device.unsupported))
        device.ticks_listing_none = min(device.ticks_listing_none + 1, 2) if listed_none else 0
        compute = compute or []
        if not graphics:
            return compute
        seen = {p.pid for p in compute}
        # A process with both a compute and a graphics context is listed twice by NVML: count it once.
        return compute + [p for p in graphics if p.pid not in seen]

    def _process_utilization(self, device: NvmlDevice) -> dict[int, tuple[tuple[int, float], ...]] | None:
        if device.identity.mig_enabled:
            return None  # not available per MIG instance
        if device.ticks_listing_none >= 2 and device.process_samples_read:
            # Samples count only for the processes listed (busy_time.ProcessBusyTime), so a GPU that
            # listed none this tick and the one before is not asked: an idle GPU costs one call less
            # a tick. The call of the first tick with none moved the cursor past the samples of the
            # processes listed until then; a process listed later gets its samples from there, all
            # taken while it held the GPU, as they would have been had every tick asked. Until one
            # call has worked it is made: whether the GPU keeps such samples at all (None) or none
            # yet ({}) is not known.
            return {}
        samples = self.query(device, "process_utilization", new_process_samples, device)
        if samples is not None:
            device.process_samples_read = True
        return samples

    # ---------------------------------------------------------------- Xid events

    def xid_event_set(self, devices: list[NvmlDevice]) -> Any | None:
        """An event set registered for Xid events on every GPU that supports them, or None."""
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.info("Xid events unavailable: %s", describe(err))
            return None
        registered = 0
        for device in devices:
            if device.handle is None:
                continue
            try:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(device.handle)
                if supported & pynvml.nvmlEventTypeXidCriticalError:
                    pynvml.nvmlDeviceRegisterEvents(
                        device.handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
                    registered += 1
            except pynvml.NVMLError as err:
                log.info("GPU %d: Xid events unavailable: %s", device.identity.index, describe(err))
        if not registered:
            self.free_event_set(event_set)
            return None
        return event_set

    def wait_xid(self, event_set: Any, devices: list[NvmlDevice], timeout_ms: int) -> tuple[int, int] | None:
        """Block up to timeout_ms for one Xid event; returns (gpu index, xid) or None on timeout."""
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        except pynvml.NVMLError_Uninitialized as err:  # NVML was shut down under the waiting thread
            raise NvmlUnavailable("NVML was shut down") from err
        if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return None
        address = _handle_address(data.device)
        for device in devices:
            if device.handle is not None and _handle_address(device.handle) == address:
                return device.identity.index, int(data.eventData)
        return -1, int(data.eventData)  # an Xid not tied to a known GPU (e.g. GPU-less event)

    def free_event_set(self, event_set: Any) -> None:
        try:
            pynvml.nvmlEventSetFree(event_set)
        except pynvml.NVMLError as err:
            log.debug("nvmlEventSetFree failed: %s", describe(err))




# -------------------------------------------------------------------- helpers over pynvml


def _handle_address(handle: Any) -> int | None:

    return ctypes.cast(handle, ctypes.c_void_p).value

