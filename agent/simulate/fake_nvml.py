"""A fake NVML C library, installed *under* pynvml so that its real wrappers run unchanged.

pynvml looks each C function up with ``getattr(nvmlLib, name)`` and calls it with ctypes arguments;
the methods here take those arguments exactly as the C function would (``byref(x)`` -> the target is
``arg._obj``; arrays; ``c_uint`` values; None for NULL; device handles as ``c_nvmlDevice_t``) and
return an ``nvmlReturn_t`` int. A function not defined here is a missing symbol: pynvml raises
FunctionNotFound. This module and its two helpers (fake_nvml_base.py: plumbing; fake_nvml_async.py:
events and GPM) are the only part of the simulator that touches pynvml.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpuscope.simulate.fake_nvml_base import (
    ARGUMENT_VERSION_MISMATCH,
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    OK,
    UNKNOWN,
    Packer,
    api,
    device_api,
    set_pointer,
    value_of,
)
from gpuscope.simulate.fake_nvml_hardware import HardwareApi
from gpuscope.simulate.hardware import GPU_INSTANCE_BASE
from gpuscope.simulate.model import GpuModel
from gpuscope.simulate.timeline import EPOCH_US

_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of a process on a non-MIG GPU
_PCI_SUBSYSTEM_ID = 0x16C110DE
# How the functions below write their results into pynvml's structures (see Packer).
_SAMPLE = Packer(pynvml.c_nvmlSample_t, "timeStamp", "sampleValue.uiVal")
_PROCESS_SAMPLE = Packer(pynvml.c_nvmlProcessUtilizationSample_t, "pid", "timeStamp", "smUtil", "memUtil",
                         zeroed=("encUtil", "decUtil"))
_MEMORY_V2_VERSION = Packer(pynvml.c_nvmlMemory_v2_t, "version")
_MEMORY_V2 = Packer(pynvml.c_nvmlMemory_v2_t, "total", "reserved", "free", "used")
_MEMORY = Packer(pynvml.c_nvmlMemory_t, "total", "free", "used")
_UTILIZATION = Packer(pynvml.c_nvmlUtilization_t, "gpu", "memory")
_FIELD_ID = Packer(pynvml.c_nvmlFieldValue_t, "fieldId", "scopeId")
_FIELD_VALUE = Packer(pynvml.c_nvmlFieldValue_t, "timestamp", "latencyUsec", "valueType", "nvmlReturn",
                      "value.ullVal")
_FIELD_TIME = Packer(pynvml.c_nvmlFieldValue_t, "timestamp", "latencyUsec")
_FIELD_RETURN = Packer(pynvml.c_nvmlFieldValue_t, "nvmlReturn")
_PROCESS_INFO = Packer(pynvml.c_nvmlProcessInfo_v3_t, "pid", "usedGpuMemory", "gpuInstanceId",
                       "computeInstanceId")


def _fill_text(buffer: Any, size: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > value_of(size):
        return INSUFFICIENT_SIZE
    buffer.value = data
    return OK


class FakeNvmlLib(HardwareApi):
    """The fake library. Thread-safe: one lock guards all state (a sampler and an event thread call)."""

    # ---------------------------------------------------------------- system

    @api
    def nvmlInitWithFlags(self, flags: Any) -> int:
        available_after = self.scenario.driver.available_after
        if available_after is None or self.clock() < available_after:
            return DRIVER_NOT_LOADED
        self.initialized += 1
        return OK

    @api
    def nvmlShutdown(self) -> int:
        self.initialized -= 1
        if self.initialized == 0:
            self.cond.notify_all()  # a thread blocked in nvmlEventSetWait returns UNINITIALIZED
        return OK

    @api
    def nvmlSystemGetDriverVersion(self, buffer: Any, size: Any) -> int:
        return _fill_text(buffer, size, self.scenario.driver.version)

    @api
    def nvmlSystemGetNVMLVersion(self, buffer: Any, size: Any) -> int:
        return _fill_text(buffer, size, self.scenario.driver.nvml_version)

    @api
    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        if self.clock() < self.scenario.driver.count_fails_until:
            return UNKNOWN
        count._obj.value = len(self.gpus)
        return OK

    @api
    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, handle: Any) -> int:
        i = value_of(index)
        if not 0 <= i < len(self.gpus):
            return INVALID_ARGUMENT
        if self.gpus[i].lost(self.clock()):
            return GPU_IS_LOST
        set_pointer(handle._obj, self.handle_address(self.gpus[i]))
        return OK

    # ---------------------------------------------------------------- identity

    @device_api
    def nvmlDeviceGetIndex(self, gpu: GpuModel, t: float, index: Any) -> int:
        index._obj.value = gpu.index
        return OK

    @device_api
    def nvmlDeviceGetUUID(self, gpu: GpuModel, t: float, buffer: Any, size: Any) -> int:
        return _fill_text(buffer, size, gpu.uuid)

    @device_api
    def nvmlDeviceGetName(self, gpu: GpuModel, t: float, buffer: Any, size: Any) -> int:
        return _fill_text(buffer, size, gpu.spec.name)

    @device_api
    def nvmlDeviceGetPciInfo_v3(self, gpu: GpuModel, t: float, info: Any) -> int:
        pci = info._obj
        domain, bus, rest = gpu.pci_bus_id.split(":")
        device = rest.split(".")[0]
        pci.busId = gpu.pci_bus_id.encode()
        pci.busIdLegacy = f"{int(domain, 16):04x}:{bus}:{rest}".encode()
        pci.domain, pci.bus, pci.device = int(domain, 16), int(bus, 16), int(device, 16)
        pci.pciDeviceId, pci.pciSubSystemId = gpu.spec.pci_device_id, _PCI_SUBSYSTEM_ID
        return OK

    @device_api
    def nvmlDeviceGetMigMode(self, gpu: GpuModel, t: float, current: Any, pending: Any) -> int:
        if gpu.spec.mig == "unsupported":
            return NOT_SUPPORTED
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.spec.mig == "enabled" else pynvml.NVML_DEVICE_MIG_DISABLE
        current._obj.value = pending._obj.value = mode
        return OK

    # ---------------------------------------------------------------- utilization

    @device_api
    def nvmlDeviceGetSamples(  # noqa: PLR0917 - the C function's positional signature
            self, gpu: GpuModel, t: float, sampling_type: Any, last_seen: Any, value_type: Any, count: Any,
            samples: Any) -> int:
        if gpu.spec.mig == "enabled" or value_of(sampling_type) != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            return NOT_SUPPORTED
        found = gpu.samples_after(value_of(last_seen), t)
        if not found:
            return NOT_FOUND
        value_type._obj.value = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        if samples is None:  # the size query
            count._obj.value = len(found)
            return OK
        # Samples may have arrived since the size query: fill the oldest that fit, the cursor gets the rest.
        n = min(count._obj.value, len(found), len(samples))
        _SAMPLE.fill(samples, found[:n])
        count._obj.value = n
        return OK

    @device_api
    def nvmlDeviceGetUtilizationRates(self, gpu: GpuModel, t: float, rates: Any) -> int:
        if gpu.spec.mig == "enabled":
            return NOT_SUPPORTED
        _UTILIZATION.set(rates._obj, *gpu.utilization_rates(t))
        return OK

    @device_api
    def nvmlDeviceGetProcessUtilization(self, gpu: GpuModel, t: float, samples: Any, count: Any,
                                        last_seen: Any) -> int:
        if gpu.spec.mig == "enabled":
            return NOT_SUPPORTED
        found = gpu.process_samples_after(value_of(last_seen), t)
        if not found:
            return NOT_FOUND
        if samples is None:
            count._obj.value = len(found)
            return INSUFFICIENT_SIZE
        n = min(count._obj.value, len(found), len(samples))
        _PROCESS_SAMPLE.fill(samples, found[:n])  # encUtil and decUtil 0
        count._obj.value = n
        return OK

    # ---------------------------------------------------------------- memory, power, thermals, clocks

    @device_api
    def nvmlDeviceGetMemoryInfo_v2(self, gpu: GpuModel, t: float, memory: Any) -> int:
        m = memory._obj
        if _MEMORY_V2_VERSION.read(m)[0] != pynvml.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        spec, used = gpu.spec.memory, gpu.memory_used(t)
        # v2: used excludes reserved
        _MEMORY_V2.set(m, spec.total, spec.reserved, spec.total - spec.reserved - used, used)
        return OK

    @device_api
    def nvmlDeviceGetMemoryInfo(self, gpu: GpuModel, t: float, memory: Any) -> int:
        spec, used = gpu.spec.memory, gpu.memory_used(t)
        _MEMORY.set(memory._obj, spec.total, spec.total - spec.reserved - used, spec.reserved + used)
        return OK

    @device_api
    def nvmlDeviceGetPowerUsage(self, gpu: GpuModel, t: float, milliwatts: Any) -> int:
        milliwatts._obj.value = round(gpu.power(t)[0] * 1000)
        return OK

    @device_api
    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: GpuModel, t: float, milliwatts: Any) -> int:
        milliwatts._obj.value = round(gpu.power_limit_w(t) * 1000)
        return OK

    @device_api
    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: GpuModel, t: float, millijoules: Any) -> int:
        millijoules._obj.value = gpu.energy_mj(t)
        return OK

    @device_api
    def nvmlDeviceGetTemperature(self, gpu: GpuModel, t: float, sensor: Any, celsius: Any) -> int:
        if value_of(sensor) != pynvml.NVML_TEMPERATURE_GPU:
            return INVALID_ARGUMENT
        celsius._obj.value = gpu.temperature_c(t)
        return OK

    @device_api
    def nvmlDeviceGetClockInfo(self, gpu: GpuModel, t: float, clock_type: Any, mhz: Any) -> int:
        kind = value_of(clock_type)
        if kind in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            mhz._obj.value = gpu.sm_clock_mhz(t)
        elif kind == pynvml.NVML_CLOCK_MEM:
            mhz._obj.value = gpu.mem_clock_mhz(t)
        elif kind == pynvml.NVML_CLOCK_VIDEO:
            mhz._obj.value = round(gpu.sm_clock_mhz(t) * 0.9)
        else:
            return INVALID_ARGUMENT
        return OK

    @device_api
    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: GpuModel, t: float, mask: Any) -> int:
        mask._obj.value = gpu.clock_event_mask(t)
        return OK

    # ---------------------------------------------------------------- PCIe and ECC

    @device_api
    def nvmlDeviceGetFieldValues(self, gpu: GpuModel, t: float, count: Any, values: Any) -> int:
        array = values._obj
        tx, rx = gpu.pcie_bytes(t)
        counters = {pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: tx, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: rx}
        timestamp = EPOCH_US + round(t * 1e6)
        for i in range(min(value_of(count), len(array))):
            field_id, scope = _FIELD_ID.read_at(array, i)
            value = (counters[field_id] if gpu.spec.pcie.counters else None) if field_id in counters else (
                self.health_field(gpu, t, field_id, scope))
            if value is not None:
                _FIELD_VALUE.set_at(array, i, timestamp, 0, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, OK,
                                    value)
            else:  # per-field status; the call itself succeeds, as the real one does
                _FIELD_TIME.set_at(array, i, timestamp, 0)
                _FIELD_RETURN.set_at(array, i, NOT_SUPPORTED)
        return OK

    @device_api
    def nvmlDeviceGetPcieThroughput(self, gpu: GpuModel, t: float, counter: Any, kb_per_s: Any) -> int:
        tx, rx = gpu.pcie_rates(t)
        which = value_of(counter)
        if which not in (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES):
            return INVALID_ARGUMENT
        kb_per_s._obj.value = round((tx if which == pynvml.NVML_PCIE_UTIL_TX_BYTES else rx) / 1024)
        return OK

    @device_api
    def nvmlDeviceGetTotalEccErrors(self, gpu: GpuModel, t: float, error_type: Any, counter_type: Any,
                                    count: Any) -> int:
        if not gpu.spec.ecc.supported:
            return NOT_SUPPORTED
        uncorrected = value_of(error_type) == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        count._obj.value = gpu.hardware.ecc_uncorrected(t) if uncorrected else gpu.spec.health.ecc_corrected
        return OK

    # ---------------------------------------------------------------- processes

    def _processes(self, gpu: GpuModel, t: float, kind: str, count: Any, infos: Any) -> int:
        procs = gpu.active_processes_of_kind(gpu.loop_time(t), kind)
        capacity = count._obj.value
        count._obj.value = len(procs)
        if infos is None or capacity < len(procs):
            return INSUFFICIENT_SIZE if procs else OK
        _PROCESS_INFO.fill(infos, [(p.pid, p.spec.memory, *_instance_ids(gpu, p.spec.mig_device))
                                   for p in procs])
        return OK

    @device_api
    def nvmlDeviceGetComputeRunningProcesses_v3(self, gpu: GpuModel, t: float, count: Any, infos: Any) -> int:
        return self._processes(gpu, t, "compute", count, infos)

    @device_api
    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, gpu: GpuModel, t: float, count: Any,
                                                 infos: Any) -> int:
        return self._processes(gpu, t, "graphics", count, infos)


def _instance_ids(gpu: GpuModel, mig_device: int | None) -> tuple[int, int]:
    """(gpuInstanceId, computeInstanceId) of a process: NVML's "none" off MIG."""
    if gpu.spec.mig != "enabled":
        return _NO_INSTANCE, _NO_INSTANCE
    ids = gpu.hardware.mig_ids
    return ids[mig_device or 0] if ids else (GPU_INSTANCE_BASE, 0)


def install_library(lib: FakeNvmlLib) -> None:
    """Make pynvml call ``lib``; refuses while another simulation's library is installed."""
    with pynvml.libLoadLock:
        current = pynvml.nvmlLib
        if isinstance(current, FakeNvmlLib) and current is not lib:
            raise RuntimeError("another Simulation is installed; uninstall it first")
        pynvml.nvmlLib = lib
        # pynvml caches each function looked up on the old library: forget them.
        pynvml._nvmlGetFunctionPointer_cache.clear()


def uninstall_library(lib: FakeNvmlLib) -> None:
    """Detach ``lib`` from pynvml (if still attached) and wake any thread blocked in it."""
    lib.close()
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is lib:
            pynvml.nvmlLib = None
            pynvml._nvmlLib_refcount = 0
        pynvml._nvmlGetFunctionPointer_cache.clear()
