"""The fake library's stateful objects: event sets (Xid delivery) and GPM samples.

Both hand out opaque pointers that pynvml passes back later; they are mapped back to Python
objects by address.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpuscope.simulate.fake_nvml_base import (
    ARGUMENT_VERSION_MISMATCH,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    OK,
    TIMEOUT,
    UNINITIALIZED,
    LibState,
    Packer,
    Return,
    address,
    api,
    device_api,
    set_pointer,
    value_of,
)
from gpuscope.simulate.model import GpuModel

_POLL_S = 0.02  # a blocked EventSetWait re-reads the (possibly manual) scenario clock this often
_MiB = 1024 * 1024
_GPM_METRICS = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: "sm_active",
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_active",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_active",
    pynvml.NVML_GPM_METRIC_FP16_UTIL: "fp16_active",
    pynvml.NVML_GPM_METRIC_FP32_UTIL: "fp32_active",
    pynvml.NVML_GPM_METRIC_FP64_UTIL: "fp64_active",
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: "graphics_active",
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: "pcie_tx",
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: "pcie_rx",
}
_NO_INSTANCE = 0xFFFFFFFF
_GPM_REQUEST = Packer(pynvml.c_nvmlGpmMetricsGet_t, "version", "numMetrics", "sample1", "sample2")
_GPM_METRIC_ID = Packer(pynvml.c_nvmlGpmMetric_t, "metricId")
_GPM_METRIC_RESULT = Packer(pynvml.c_nvmlGpmMetric_t, "nvmlReturn", "value")


def _where(pointer: Any) -> int:
    """The address a pointer field holds: an int when read as memory, else a ctypes pointer."""
    return pointer if isinstance(pointer, int) else (address(pointer) or 0)


@dataclass
class _Registration:
    mask: int
    since: float  # scenario time of registration: only later events are delivered


@dataclass
class _EventSet:
    scanned_until: float
    registrations: dict[int, _Registration] = field(default_factory=dict)  # GPU index -> what
    pending: list[tuple[float, int, int]] = field(default_factory=list)  # (time, GPU index, Xid)


@dataclass
class _GpmSample:
    gpu: int | None = None  # filled by nvmlGpmSampleGet
    taken_at: float = 0.0
    gpu_instance: int | None = None  # nvmlGpmMigSampleGet's GPU instance


class AsyncApi(LibState):
    """Event sets and GPM samples, mixed into FakeNvmlLib."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._event_sets: dict[int, _EventSet] = {}
        self._gpm_samples: dict[int, _GpmSample] = {}

    # ---------------------------------------------------------------- events

    def _supported_events(self, gpu: GpuModel) -> int:
        mask: int = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypePState
                     | pynvml.nvmlEventTypeClock)
        if gpu.spec.ecc.supported:
            mask |= pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
        return mask

    def _event_set(self, pointer: Any) -> _EventSet:
        event_set = self._event_sets.get(address(pointer) or 0)
        if event_set is None:
            raise Return(INVALID_ARGUMENT)
        return event_set

    @api
    def nvmlEventSetCreate(self, out: Any) -> int:
        where = self.opaque.new()
        self._event_sets[where] = _EventSet(scanned_until=self.clock())
        set_pointer(out._obj, where)
        return OK

    @device_api
    def nvmlDeviceGetSupportedEventTypes(self, gpu: GpuModel, t: float, mask: Any) -> int:
        mask._obj.value = self._supported_events(gpu)
        return OK

    @device_api
    def nvmlDeviceRegisterEvents(self, gpu: GpuModel, t: float, types: Any, event_set: Any) -> int:
        wanted = value_of(types)
        if wanted & ~self._supported_events(gpu):
            return NOT_SUPPORTED
        es = self._event_set(event_set)
        previous = es.registrations.get(gpu.index)
        es.registrations[gpu.index] = _Registration((previous.mask if previous else 0) | wanted, t)
        self.cond.notify_all()  # a thread blocked in nvmlEventSetWait may now have Xids to watch for
        return OK

    def _scan(self, es: _EventSet, now: float) -> None:
        """Queue the scheduled Xid events of registered GPUs that happened since the last scan."""
        if now <= es.scanned_until:
            return
        for index, reg in es.registrations.items():
            if reg.mask & pynvml.nvmlEventTypeXidCriticalError:
                lo = max(es.scanned_until, reg.since)
                es.pending.extend((at, index, code) for at, code in self.gpus[index].xids_between(lo, now))
        es.pending.sort()
        es.scanned_until = now

    def _may_deliver(self, es: _EventSet) -> bool:
        """Whether any GPU registered for Xid events in ``es`` has Xids in its scenario at all."""
        return any(reg.mask & pynvml.nvmlEventTypeXidCriticalError and self.gpus[index].spec.xid
                   for index, reg in es.registrations.items())

    @api
    def nvmlEventSetWait_v2(self, event_set: Any, data: Any, timeout_ms: Any) -> int:
        es = self._event_set(event_set)
        # The timeout is wall time, like the real call; the scenario clock may be manual, so poll it.
        deadline = time.monotonic() + value_of(timeout_ms) / 1000.0
        while True:
            freed = self._event_sets.get(address(event_set) or 0) is not es
            if self.closed or self.initialized <= 0 or freed:
                return UNINITIALIZED  # uninstalled, shut down or freed while waiting
            self._scan(es, self.clock())
            if es.pending:
                _at, index, code = es.pending.pop(0)
                d = data._obj
                d.device = ctypes.cast(self.handle_address(self.gpus[index]), pynvml.c_nvmlDevice_t)
                d.eventType, d.eventData = pynvml.nvmlEventTypeXidCriticalError, code
                d.gpuInstanceId = d.computeInstanceId = _NO_INSTANCE
                return OK
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TIMEOUT
            # Poll the scenario clock only while an Xid can come: with none scheduled for the registered
            # GPUs nothing is delivered until a registration, shutdown, uninstall or free, which all
            # notify, so block as the real call does instead of waking 50 times a second.
            self.cond.wait(min(remaining, _POLL_S) if self._may_deliver(es) else remaining)

    @api
    def nvmlEventSetFree(self, event_set: Any) -> int:
        where = address(event_set) or 0
        self._event_set(event_set)
        del self._event_sets[where]
        self.opaque.free(where)
        self.cond.notify_all()
        return OK

    # ---------------------------------------------------------------- GPM (Hopper and newer)

    def _gpm_sample(self, pointer: Any) -> _GpmSample:
        return self._gpm_sample_at(address(pointer) or 0)

    def _gpm_sample_at(self, where: int) -> _GpmSample:
        sample = self._gpm_samples.get(where)
        if sample is None:
            raise Return(INVALID_ARGUMENT)
        return sample

    @device_api
    def nvmlGpmQueryDeviceSupport(self, gpu: GpuModel, t: float, support: Any) -> int:
        s = support._obj
        if s.version != pynvml.NVML_GPM_SUPPORT_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        s.isSupportedDevice = int(gpu.spec.gpm.supported)
        return OK

    @api
    def nvmlGpmSampleAlloc(self, out: Any) -> int:
        where = self.opaque.new()
        self._gpm_samples[where] = _GpmSample()
        set_pointer(out._obj, where)
        return OK

    @api
    def nvmlGpmSampleFree(self, sample: Any) -> int:
        self._gpm_sample(sample)
        where = address(sample) or 0
        del self._gpm_samples[where]
        self.opaque.free(where)
        return OK

    @device_api
    def nvmlGpmSampleGet(self, gpu: GpuModel, t: float, sample: Any) -> int:
        if gpu.spec.mig == "enabled" or not gpu.spec.gpm.supported:
            return NOT_SUPPORTED
        s = self._gpm_sample(sample)
        s.gpu, s.taken_at, s.gpu_instance = gpu.index, t, None
        return OK

    @device_api
    def nvmlGpmMigSampleGet(self, gpu: GpuModel, t: float, gpu_instance: Any, sample: Any) -> int:
        """A sample of one GPU instance of a GPU in MIG mode (NVML numbers them from 1)."""
        if gpu.spec.mig != "enabled" or not gpu.spec.gpm.supported:
            return NOT_SUPPORTED
        instance = value_of(gpu_instance)
        if gpu.hardware.instance_device(instance) is None:
            return NOT_FOUND
        s = self._gpm_sample(sample)
        s.gpu, s.taken_at, s.gpu_instance = gpu.index, t, instance
        return OK

    @api
    def nvmlGpmMetricsGet(self, request: Any) -> int:
        r = request._obj
        version, num_metrics, sample1, sample2 = _GPM_REQUEST.read(r)  # the pointers as addresses
        if version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        first, second = self._gpm_sample_at(_where(sample1)), self._gpm_sample_at(_where(sample2))
        if (first.gpu is None or first.gpu != second.gpu or second.taken_at < first.taken_at
                or first.gpu_instance != second.gpu_instance):
            return INVALID_ARGUMENT
        metrics = r.metrics
        n = min(num_metrics, len(metrics))
        names = [_GPM_METRICS.get(_GPM_METRIC_ID.read_at(metrics, i)[0]) for i in range(n)]
        pcie = any(name is not None and name.startswith("pcie") for name in names)
        gpu = self.gpus[first.gpu]
        if first.gpu_instance is not None:
            device = gpu.hardware.instance_device(first.gpu_instance) or 0
            values = _instance_metrics(gpu, device, first.taken_at, second.taken_at)
            names = [name if name in values else None for name in names]
        else:
            values = gpu.gpm_average(first.taken_at, second.taken_at, pcie=pcie)
        for i, name in enumerate(names):
            if name is None:
                _GPM_METRIC_RESULT.set_at(metrics, i, NOT_SUPPORTED, 0.0)
                continue
            value = values[name]
            # PCIe metrics are MiB/s
            _GPM_METRIC_RESULT.set_at(metrics, i, OK, value / _MiB if name.startswith("pcie") else value)
        return OK


def _instance_metrics(gpu: GpuModel, index: int, t1: float, t2: float) -> dict[str, float]:
    """GPM percentages of one GPU instance: its activity pattern, times the GPU's GPM levels."""
    activity = gpu.hardware.mig_activity(index, t1, t2)
    gpm = gpu.spec.gpm
    return {"graphics_active": 100.0 * activity, "sm_active": 100.0 * gpm.sm_active * activity,
            "tensor_active": 100.0 * gpm.tensor_active * activity,
            "dram_active": 100.0 * gpm.dram_active * activity}
