"""The NVML boundary: the only module of the agent that imports ``pynvml``.

It turns NVML's C-shaped API into plain typed readings: one call per (device, reading), each isolated,
with "not supported" remembered per device (so the agent stops asking) and kept distinct from an
error, which is counted per reading and logged once until the reading works again. Units are
converted here to base units (bytes, watts, joules, hertz, ratios). Above this module nothing knows
NVML: the sampler works on ``DeviceReadings`` and the tests of everything else use plain values.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpuscope.nvml.ctypes_layout import element_format, fields, layout, unpack, unpack_array
from gpuscope.nvml.readings import DeviceIdentity, DeviceReadings, PcieReading, ProcessKind, RawProcess

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
_GPM_MIN_SPACING_S = 0.1  # NVML needs two GPM samples at least 100 ms apart
# DeviceReadings field -> GPM metric
_GPM_METRICS = {
    "sm_active_ratio": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy_ratio": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_active_ratio": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_active_ratio": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}


class NvmlError(Exception):
    """Base of the boundary's errors."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this node (no driver, no library, no permission)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    @property
    def hint(self) -> str:
        return (
            f"NVML is not available ({self.reason}). Is the NVIDIA driver installed and loaded "
            "(libnvidia-ml.so.1, /dev/nvidia*)? In a container, run it with NVIDIA_VISIBLE_DEVICES=all "
            "and NVIDIA_DRIVER_CAPABILITIES=utility. gpuscope keeps serving gpuscope_nvml_up 0 and retries."
        )


class NvmlEnumerationError(NvmlUnavailable):
    """NVML is up but cannot list the GPUs (``nvmlDeviceGetCount`` failed): a driver still settling,
    or in trouble. The caller shuts NVML down and tries again later, as when it cannot start."""

    @property
    def hint(self) -> str:
        return (f"NVML cannot list the GPUs ({self.reason}); gpuscope serves gpuscope_nvml_up 0 and "
                "retries")


class GpuLostError(NvmlError):
    """The GPU fell off the bus or needs a reset; its other readings are not attempted this tick."""


class NvmlDevice:
    """A GPU's handle plus what the boundary remembers about it between ticks."""

    def __init__(self, handle: Any, identity: DeviceIdentity) -> None:
        self.handle = handle
        self.identity = identity
        self.unsupported: set[str] = set()
        self.sample_cursor = 0
        self.process_cursor = 0
        # Whether a samples call has succeeded yet: until then the driver's whole buffer is new to us.
        self.samples_read = False
        self.process_samples_read = False
        # Ticks in a row whose process lists were read and empty, counted up to 2 (see
        # _process_utilization).
        self.ticks_listing_none = 0
        self.pcie_counters: bool | None = None  # None until probed
        self.gpm_samples: list[Any] | None = None  # [previous, current] buffers, allocated on first use
        self.gpm_previous_at: float | None = None
        self.gpm_request: Any = None  # the nvmlGpmMetricsGet request, metric ids filled in once


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
                raise NvmlUnavailable(_describe(err)) from err
            raise NvmlUnavailable(f"nvmlInit failed: {_describe(err)}") from err
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as err:  # shutting down anyway; nothing to recover
                log.debug("nvmlShutdown failed: %s", _describe(err))

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
            raise NvmlEnumerationError(f"nvmlDeviceGetCount failed: {_describe(err)}") from err
        found = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as err:
                log.warning("GPU %d: cannot get a handle: %s", index, _describe(err))
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

    def read(self, device: NvmlDevice, *, energy: bool = True, samples: bool = True) -> DeviceReadings:
        """All of one GPU's readings for this tick. The energy counter only with ``energy``, the
        utilization samples only with ``samples`` (the first read takes them regardless): on some
        drivers these two cost more than all the others. Raises GpuLostError if the GPU is gone."""
        try:
            return self._read(device, energy, samples)
        except GpuLostError:
            # GPM counters across the time the GPU was lost mean nothing: the next GPM sample after it
            # comes back starts afresh instead of closing an interval that spans the loss.
            device.gpm_previous_at = None
            raise

    def _read(self, device: NvmlDevice, read_energy: bool, read_samples: bool) -> DeviceReadings:
        if device.handle is None or not device.identity.uuid:
            try:
                self.refresh_identity(device)
            except pynvml.NVMLError as err:
                raise GpuLostError(_describe(err)) from err
        h = device.handle
        r = DeviceReadings()
        query = self._query
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
        limit = query(device, "power_limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        r.power_limit_watts = None if limit is None else limit / 1000.0
        if read_energy:
            energy = query(device, "energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
            r.energy_counter_joules = None if energy is None else energy / 1000.0
        temp = query(device, "temperature", pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        r.temperature_celsius = None if temp is None else float(temp)
        sm = query(device, "sm_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        r.sm_clock_hertz = None if sm is None else sm * 1e6
        memclk = query(device, "memory_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
        r.memory_clock_hertz = None if memclk is None else memclk * 1e6
        r.clock_event_mask = query(device, "clock_events", _clock_event_reasons, h)
        r.pcie = self._pcie(device)
        r.ecc_uncorrected_errors_total = query(device, "ecc", _uncorrected_ecc_errors, h)
        gpm = self._gpm(device)
        if gpm is not None and gpm[0]:
            for name, value in gpm[0].items():
                setattr(r, name, value)
            r.gpm_interval_seconds = gpm[1]
        r.nvml_processes = self._processes(device)
        first_process_samples = not device.process_samples_read
        r.new_process_samples = self._process_utilization(device)
        r.process_samples_from_history = first_process_samples and device.process_samples_read
        return r

    def _query(self, device: NvmlDevice, reading: str, call: Callable[..., T], *args: Any) -> T | None:
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
                raise GpuLostError(_describe(err)) from err
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
                        index, reading, _describe(err))

    def _utilization_samples(self, device: NvmlDevice, read: bool) -> tuple[tuple[int, float], ...] | None:
        """The new samples; None when this GPU keeps none (unsupported, or MIG), () when the call
        failed this tick (the failure is counted) or was not made (``read`` false: the driver keeps
        them for the next read)."""
        if device.identity.mig_enabled:
            return None  # not per MIG instance
        if not read:
            return None if "utilization_samples" in device.unsupported else ()
        samples = self._query(device, "utilization_samples", _new_utilization_samples, device)
        if samples is None:
            return None if "utilization_samples" in device.unsupported else ()
        device.samples_read = True
        return samples

    def _pcie(self, device: NvmlDevice) -> PcieReading | None:
        h = device.handle
        if device.pcie_counters is not False:
            array = self._query(device, "pcie_counters", pynvml.nvmlDeviceGetFieldValues, h, _PCIE_FIELDS)
            # (nvmlReturn, value.ullVal) of the TX then the RX field
            values = None if array is None else (
                unpack_array(_FIELD_VALUE_LAYOUT, pynvml.c_nvmlFieldValue_t, array)
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
        tx = self._query(device, "pcie_throughput", pynvml.nvmlDeviceGetPcieThroughput, h,
                         pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._query(device, "pcie_throughput", pynvml.nvmlDeviceGetPcieThroughput, h,
                         pynvml.NVML_PCIE_UTIL_RX_BYTES)
        if tx is None or rx is None:
            return None
        return PcieReading(False, tx * 1024.0, rx * 1024.0)

    def _gpm(self, device: NvmlDevice) -> tuple[dict[str, float], float] | None:
        """GPM metrics between the previous tick's sample and this one (Hopper and newer), with the
        seconds between the two samples."""
        if device.identity.mig_enabled or "gpm" in device.unsupported:
            return None
        h = device.handle
        if device.gpm_samples is None:
            support = self._query(device, "gpm", pynvml.nvmlGpmQueryDeviceSupport, h)
            if support is None:
                return None
            if not support.isSupportedDevice:
                device.unsupported.add("gpm")
                return None
            samples = self._query(device, "gpm", lambda: [pynvml.nvmlGpmSampleAlloc(),
                                                          pynvml.nvmlGpmSampleAlloc()])
            if samples is None:
                return None
            device.gpm_samples = samples
        now = self._clock()
        if device.gpm_previous_at is not None and now - device.gpm_previous_at < _GPM_MIN_SPACING_S:
            return None  # too soon after the last sample for NVML to compute rates
        previous, current = device.gpm_samples
        got = self._query(device, "gpm", pynvml.nvmlGpmSampleGet, h, current)
        if got is None:
            return None
        result: tuple[dict[str, float], float] | None = None
        if device.gpm_previous_at is not None:
            metrics = self._query(device, "gpm", _gpm_metrics, device, previous, current)
            if metrics is not None:
                result = metrics, now - device.gpm_previous_at
        device.gpm_samples = [current, previous]
        device.gpm_previous_at = now
        return result

    def _processes(self, device: NvmlDevice) -> list[RawProcess]:
        h = device.handle
        compute = self._query(device, "processes", _running_processes, h, "compute")
        graphics = self._query(device, "graphics_processes", _running_processes, h, "graphics")
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
        samples = self._query(device, "process_utilization", _new_process_samples, device)
        if samples is not None:
            device.process_samples_read = True
        return samples

    # ---------------------------------------------------------------- Xid events

    def xid_event_set(self, devices: list[NvmlDevice]) -> Any | None:
        """An event set registered for Xid events on every GPU that supports them, or None."""
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.info("Xid events unavailable: %s", _describe(err))
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
                log.info("GPU %d: Xid events unavailable: %s", device.identity.index, _describe(err))
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
            log.debug("nvmlEventSetFree failed: %s", _describe(err))


# -------------------------------------------------------------------- helpers over pynvml


def _describe(err: pynvml.NVMLError) -> str:
    try:
        return str(err)
    except Exception:  # pynvml's __str__ calls into the library, which may be gone
        return f"NVML error {getattr(err, 'value', '?')}"


def _handle_address(handle: Any) -> int | None:

    return ctypes.cast(handle, ctypes.c_void_p).value


def _sample_value(value_type: int, value: Any) -> float:
    if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(value.dVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(value.ullVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(value.ulVal)
    if value_type == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return float(value.sllVal)
    return float(value.uiVal)


# ------------------------------------------------------------------ decoding pynvml's arrays
#
# pynvml's structures read each field through a Python __getattribute__ (about 0.5 µs a field); the
# per-sample results (some 30 samples of 3 fields per GPU per tick) are decoded here instead with
# one struct.iter_unpack over their bytes, at the offsets ctypes gives the very same types. Where a
# type is not laid out as expected (another pynvml), the layout is None and fields are read as before.

_SAMPLE_UNION_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
}  # anything else: uiVal, as _sample_value reads it
_SAMPLE_LAYOUTS = {
    value_type: layout(pynvml.c_nvmlSample_t, "timeStamp", f"sampleValue.{member}")
    for value_type, member in _SAMPLE_UNION_MEMBER.items()
}
_SAMPLE_UINT_LAYOUT = layout(pynvml.c_nvmlSample_t, "timeStamp", "sampleValue.uiVal")
_PROCESS_SAMPLE_LAYOUT = layout(pynvml.c_nvmlProcessUtilizationSample_t, "pid", "timeStamp", "smUtil")
_MEMORY_LAYOUT = layout(pynvml.c_nvmlMemory_v2_t, "total", "reserved", "used")
_UTILIZATION_LAYOUT = layout(pynvml.c_nvmlUtilization_t, "gpu", "memory")
_FIELD_VALUE_LAYOUT = layout(pynvml.c_nvmlFieldValue_t, "nvmlReturn", "value.ullVal")


def _new_utilization_samples(device: NvmlDevice) -> tuple[tuple[int, float], ...]:
    """The driver's utilization samples newer than the device's cursor, which moves past them."""
    cursor = device.sample_cursor
    try:
        value_type, samples = pynvml.nvmlDeviceGetSamples(
            device.handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, cursor)
    except pynvml.NVMLError_NotFound:
        return ()  # nothing new since the cursor (also what an idle GPU says)
    rows = unpack(_SAMPLE_LAYOUTS.get(value_type, _SAMPLE_UINT_LAYOUT), pynvml.c_nvmlSample_t, samples)
    if rows is None:
        rows = [(int(s.timeStamp), _sample_value(value_type, s.sampleValue)) for s in samples]
    # The cursor is opaque: only ever compare it with the driver's own timestamps. (An integer value
    # divides as its float does: value / 100.0 is _sample_value()'s float(value) / 100.0.)
    # Sorted: the integration into busy time and the idle-dip count read them in time order, which
    # NVML does not promise for its ring buffer.
    out = tuple(sorted([(ts, value / 100.0) for ts, value in rows if ts > cursor]))
    if out:
        device.sample_cursor = out[-1][0]
    return out


def _new_process_samples(device: NvmlDevice) -> dict[int, tuple[tuple[int, float], ...]]:
    """The driver's per-process samples newer than the device's cursor, by pid: (driver µs, SM
    utilization ratio) in time order. The cursor moves past them."""
    cursor = device.process_cursor
    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(device.handle, cursor)
    except pynvml.NVMLError_NotFound:
        return {}  # no process ran kernels since the cursor
    except pynvml.NVMLError as err:
        if err.value != pynvml.NVML_SUCCESS:
            raise
        # The size probe answered success with no samples (NVIDIA's mock library does), which
        # pynvml's wrapper raises as an error: none to read, as NOT_FOUND says.
        return {}
    rows = unpack(_PROCESS_SAMPLE_LAYOUT, pynvml.c_nvmlProcessUtilizationSample_t, samples)
    if rows is None:
        rows = [(int(s.pid), int(s.timeStamp), s.smUtil) for s in samples]
    by_pid: dict[int, list[tuple[int, float]]] = {}
    newest = cursor
    for pid, timestamp, sm in rows:  # some 30 rows per GPU and tick: kept lean
        if timestamp > cursor:
            if pid in by_pid:
                by_pid[pid].append((timestamp, sm / 100.0))
            else:
                by_pid[pid] = [(timestamp, sm / 100.0)]
            if timestamp > newest:  # noqa: PLR1730 - max() costs a call per row
                newest = timestamp
    device.process_cursor = newest
    # Sorted: the integration into busy time reads them in time order, which NVML does not promise.
    return {pid: tuple(sorted(rows_of_pid)) for pid, rows_of_pid in by_pid.items()}


def _clock_event_reasons(handle: Any) -> int:
    try:
        return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except pynvml.NVMLError_FunctionNotFound:
        # Drivers before 535 only know the older name of the same bitmask.
        return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _uncorrected_ecc_errors(handle: Any) -> int:
    return int(pynvml.nvmlDeviceGetTotalEccErrors(
        handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))


def _running_processes(handle: Any, kind: ProcessKind) -> list[RawProcess]:
    if kind == "compute":
        v3, v2 = pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetComputeRunningProcesses_v2
    else:
        v3, v2 = pynvml.nvmlDeviceGetGraphicsRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2
    try:
        procs = v3(handle)
    except pynvml.NVMLLibraryMismatchError:
        procs = v2(handle)  # drivers older than 510 have no _v3
    return [RawProcess(int(p.pid), kind, None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in procs]


# nvmlGpmMetricsGet's results for our metrics: (nvmlReturn, value) of metrics[0 .. n-1], read from
# the request's bytes (the request is kept per device and reused: its inputs do not change).
_GPM_RESULT_ELEMENT = element_format(pynvml.c_nvmlGpmMetric_t, "nvmlReturn", "value")
_GPM_METRICS_OFFSET: int = pynvml.c_nvmlGpmMetricsGet_t.metrics.offset
_GPM_RESULTS = (
    None if _GPM_RESULT_ELEMENT is None
    else struct.Struct(f"={_GPM_METRICS_OFFSET}x" + _GPM_RESULT_ELEMENT * len(_GPM_METRICS))
)


def _gpm_metrics(device: NvmlDevice, previous: Any, current: Any) -> dict[str, float]:
    request = device.gpm_request
    if request is None:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_METRICS)
        metrics = request.metrics
        for i, metric_id in enumerate(_GPM_METRICS.values()):
            metrics[i].metricId = metric_id
        device.gpm_request = request
    request.sample1 = previous
    request.sample2 = current
    pynvml.nvmlGpmMetricsGet(request)
    if _GPM_RESULTS is not None and type(request) is pynvml.c_nvmlGpmMetricsGet_t:
        results = _GPM_RESULTS.unpack_from(request)
    else:
        metrics = request.metrics
        results = tuple(x for i in range(len(_GPM_METRICS))
                        for x in (metrics[i].nvmlReturn, metrics[i].value))
    out = {}
    for i, name in enumerate(_GPM_METRICS):
        if results[2 * i] == pynvml.NVML_SUCCESS:
            out[name] = max(0.0, min(1.0, results[2 * i + 1] / 100.0))
    return out
