"""The fake library's hardware-health, NVLink and MIG functions, mixed into FakeNvmlLib.

Health counters are the scenario's (``health:``), throttle time integrates the GPU's clock event
reasons, NVLink follows ``nvlink:`` (no links: NOT_SUPPORTED, as on a PCIe card), and a GPU in MIG
mode lists its ``mig_devices`` by index, each with a handle of its own that answers its ids, UUID,
name (``<GPU name> MIG <profile>``) and memory, and NOT_SUPPORTED for the rest, as NVML does.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpuscope.simulate.fake_nvml_async import AsyncApi
from gpuscope.simulate.fake_nvml_base import (
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    OK,
    Packer,
    device_api,
    set_pointer,
    value_of,
)
from gpuscope.simulate.hardware import GPU_INSTANCE_BASE
from gpuscope.simulate.model import GpuModel
from gpuscope.simulate.scenario import NVLINK_ERROR_TYPES, PCIE_ERROR_TYPES
from gpuscope.simulate.timeline import EPOCH_US

MAX_MIG_DEVICES = 7
ALL_LINKS = 0xFFFFFFFF
_VIOLATION = Packer(pynvml.c_nvmlViolationTime_t, "referenceTime", "violationTime")
_MEMORY = Packer(pynvml.c_nvmlMemory_t, "total", "free", "used")
_PCIE_ERROR_FIELDS = dict(zip((
    pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS, pynvml.NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR,
    pynvml.NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR, pynvml.NVML_FI_DEV_PCIE_COUNT_RECEIVER_ERROR,
    pynvml.NVML_FI_DEV_PCIE_COUNT_BAD_TLP, pynvml.NVML_FI_DEV_PCIE_COUNT_BAD_DLLP,
    pynvml.NVML_FI_DEV_PCIE_COUNT_LCRC_ERROR, pynvml.NVML_FI_DEV_PCIE_COUNT_NAKS_RECEIVED,
    pynvml.NVML_FI_DEV_PCIE_COUNT_NAKS_SENT, pynvml.NVML_FI_DEV_PCIE_COUNT_UNSUPPORTED_REQ), PCIE_ERROR_TYPES,
    strict=True))
_NVLINK_ERROR_FIELDS = dict(zip((
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL),
    NVLINK_ERROR_TYPES, strict=True))
_NVLINK_DATA_FIELDS = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                       pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
_NVLINK_COUNTERS = {pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
                    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
                    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
                    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery"}


class HardwareApi(AsyncApi):
    # ---------------------------------------------------------------- health

    @device_api
    def nvmlDeviceGetViolationStatus(self, gpu: GpuModel, t: float, policy: Any, violation: Any) -> int:
        nanoseconds = gpu.hardware.violation_ns(value_of(policy), t)
        if nanoseconds is None:
            return NOT_SUPPORTED
        _VIOLATION.set(violation._obj, EPOCH_US + round(t * 1e6), nanoseconds)
        return OK

    @device_api
    def nvmlDeviceGetRemappedRows(self, gpu: GpuModel, t: float, corr: Any, unc: Any, pending: Any,  # noqa: PLR0917
                                  failure: Any) -> int:
        h = gpu.spec.health
        corr._obj.value, unc._obj.value = h.remapped_rows_correctable, h.remapped_rows_uncorrectable
        pending._obj.value, failure._obj.value = int(h.row_remap_pending), int(h.row_remap_failed)
        return OK

    @device_api
    def nvmlDeviceGetPcieReplayCounter(self, gpu: GpuModel, t: float, value: Any) -> int:
        value._obj.value = gpu.hardware.pcie_replays(t)
        return OK

    @device_api
    def nvmlDeviceGetEncoderUtilization(self, gpu: GpuModel, t: float, util: Any, period: Any) -> int:
        if not gpu.spec.health.encoder:
            return NOT_SUPPORTED
        util._obj.value, period._obj.value = 0, 167_000
        return OK

    @device_api
    def nvmlDeviceGetDecoderUtilization(self, gpu: GpuModel, t: float, util: Any, period: Any) -> int:
        util._obj.value, period._obj.value = 0, 167_000
        return OK

    def health_field(self, gpu: GpuModel, t: float, field_id: int, scope: int) -> int | None:
        """A health or NVLink field's value, None where the GPU has none (NOT_SUPPORTED)."""
        h, hardware = gpu.spec.health, gpu.hardware
        links = gpu.spec.nvlink.links
        if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            return round(gpu.temperature_c(t) + h.memory_temperature_offset_c)
        if field_id == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
            return hardware.pcie_replays(t)
        if field_id in _PCIE_ERROR_FIELDS:
            return hardware.pcie_errors(_PCIE_ERROR_FIELDS[field_id], t)
        remapped = {pynvml.NVML_FI_DEV_REMAPPED_COR: h.remapped_rows_correctable,
                    pynvml.NVML_FI_DEV_REMAPPED_UNC: h.remapped_rows_uncorrectable,
                    pynvml.NVML_FI_DEV_REMAPPED_PENDING: int(h.row_remap_pending),
                    pynvml.NVML_FI_DEV_REMAPPED_FAILURE: int(h.row_remap_failed)}
        if field_id in remapped:
            return remapped[field_id]
        if not links:
            return None
        if field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
            return links
        if field_id in _NVLINK_ERROR_FIELDS:
            return hardware.nvlink_errors(None, t).get(_NVLINK_ERROR_FIELDS[field_id], 0)
        if field_id in _NVLINK_DATA_FIELDS:
            if scope != ALL_LINKS and scope >= links:
                return None
            # scopeId is the link; UINT_MAX sums them. A bare field id is scope 0: link 0 alone.
            tx, rx = hardware.nvlink_kib(t, None if scope == ALL_LINKS else scope)
            return tx if field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else rx
        return None

    # ---------------------------------------------------------------- NVLink

    @device_api
    def nvmlDeviceGetNvLinkState(self, gpu: GpuModel, t: float, link: Any, active: Any) -> int:
        links = gpu.spec.nvlink.links
        if not links:
            return NOT_SUPPORTED
        if not 0 <= value_of(link) < links:
            return INVALID_ARGUMENT
        active._obj.value = int(value_of(link) in gpu.hardware.up_links)
        return OK

    @device_api
    def nvmlDeviceGetNvLinkErrorCounter(self, gpu: GpuModel, t: float, link: Any, counter: Any,
                                        value: Any) -> int:
        links = gpu.spec.nvlink.links
        if not links:
            return NOT_SUPPORTED
        kind = _NVLINK_COUNTERS.get(value_of(counter))
        if not 0 <= value_of(link) < links or kind is None:
            return INVALID_ARGUMENT
        value._obj.value = gpu.hardware.nvlink_errors(value_of(link), t).get(kind, 0)
        return OK

    # ---------------------------------------------------------------- MIG

    @device_api
    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: GpuModel, t: float, count: Any) -> int:
        if gpu.spec.mig != "enabled":
            return NOT_SUPPORTED
        count._obj.value = MAX_MIG_DEVICES
        return OK

    @device_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu: GpuModel, t: float, index: Any, handle: Any) -> int:
        if gpu.spec.mig != "enabled":
            return NOT_SUPPORTED
        i = value_of(index)
        if not 0 <= i < MAX_MIG_DEVICES:
            return INVALID_ARGUMENT
        if i >= len(gpu.spec.mig_devices):
            return NOT_FOUND
        set_pointer(handle._obj, self.mig_handles[(gpu.index, i)])
        return OK

    @device_api
    def nvmlDeviceGetGpuInstanceId(self, gpu: GpuModel, t: float, out: Any) -> int:
        return INVALID_ARGUMENT  # a GPU's handle, not a MIG device's (those answer below)

    @device_api
    def nvmlDeviceGetComputeInstanceId(self, gpu: GpuModel, t: float, out: Any) -> int:
        return INVALID_ARGUMENT

    # Functions called with a MIG device's handle: (parent GPU, MIG device index, the C arguments).

    def mig_nvmlDeviceGetGpuInstanceId(self, gpu: GpuModel, index: int, out: Any) -> int:
        out._obj.value = gpu.hardware.mig_ids[index][0]
        return OK

    def mig_nvmlDeviceGetComputeInstanceId(self, gpu: GpuModel, index: int, out: Any) -> int:
        out._obj.value = gpu.hardware.mig_ids[index][1]
        return OK

    def mig_nvmlDeviceGetUUID(self, gpu: GpuModel, index: int, buffer: Any, size: Any) -> int:
        return _fill(buffer, size, mig_uuid(gpu, index))

    def mig_nvmlDeviceGetName(self, gpu: GpuModel, index: int, buffer: Any, size: Any) -> int:
        return _fill(buffer, size, f"{gpu.spec.name} MIG {gpu.spec.mig_devices[index].profile}")

    def mig_nvmlDeviceGetMemoryInfo(self, gpu: GpuModel, index: int, memory: Any) -> int:
        hardware = gpu.hardware
        total = gpu.spec.mig_devices[hardware.instance_device(hardware.mig_ids[index][0]) or 0].memory_total
        used = min(total, gpu.hardware.mig_memory_used(index, gpu.loop_time(self.clock())))
        _MEMORY.set(memory._obj, total, total - used, used)
        return OK


def mig_uuid(gpu: GpuModel, index: int) -> str:
    """The simulated MIG device's UUID: its parent's, with the instance in the last group."""
    return f"MIG-{gpu.uuid.removeprefix('GPU-')[:-4]}{index + GPU_INSTANCE_BASE:04x}"


def _fill(buffer: Any, size: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > value_of(size):
        return pynvml.NVML_ERROR_INSUFFICIENT_SIZE  # type: ignore[no-any-return]
    buffer.value = data
    return OK
