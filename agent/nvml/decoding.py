"""Decoding what pynvml returns: the per-tick sample arrays, process lists and counters, into plain
values.

pynvml's structures read each field through a Python __getattribute__ (about 0.5 µs a field); the
per-sample results (some 30 samples of 3 fields per GPU per tick) are decoded here instead with
one struct.iter_unpack over their bytes, at the offsets ctypes gives the very same types. Where a
type is not laid out as expected (another pynvml), the layout is None and fields are read as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from gpuscope.nvml.ctypes_layout import layout, unpack, unpack_array
from gpuscope.nvml.device import NvmlDevice
from gpuscope.nvml.readings import ProcessKind, RawProcess

_NO_INSTANCE = 0xFFFFFFFF  # a process's GPU/compute instance id off MIG


def sample_value(value_type: int, value: Any) -> float:
    if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(value.dVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(value.ullVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(value.ulVal)
    if value_type == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return float(value.sllVal)
    return float(value.uiVal)


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
# (nvmlReturn, value.ullVal): the PCIe byte counters, read every tick
PCIE_FIELD_LAYOUT = layout(pynvml.c_nvmlFieldValue_t, "nvmlReturn", "value.ullVal")
_FIELD_VALUE_LAYOUT = layout(pynvml.c_nvmlFieldValue_t, "valueType", "nvmlReturn", "value.ullVal")


def new_utilization_samples(device: NvmlDevice) -> tuple[tuple[int, float], ...]:
    """The driver's utilization samples newer than the device's cursor, which moves past them."""
    cursor = device.sample_cursor
    try:
        value_type, samples = pynvml.nvmlDeviceGetSamples(
            device.handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, cursor)
    except pynvml.NVMLError_NotFound:
        return ()  # nothing new since the cursor (also what an idle GPU says)
    rows = unpack(_SAMPLE_LAYOUTS.get(value_type, _SAMPLE_UINT_LAYOUT), pynvml.c_nvmlSample_t, samples)
    if rows is None:
        rows = [(int(s.timeStamp), sample_value(value_type, s.sampleValue)) for s in samples]
    # The cursor is opaque: only ever compare it with the driver's own timestamps. (An integer value
    # divides as its float does: value / 100.0 is sample_value()'s float(value) / 100.0.)
    # Sorted: the integration into busy time and the idle-dip count read them in time order, which
    # NVML does not promise for its ring buffer.
    out = tuple(sorted([(ts, value / 100.0) for ts, value in rows if ts > cursor]))
    if out:
        device.sample_cursor = out[-1][0]
    return out


def new_process_samples(device: NvmlDevice) -> dict[int, tuple[tuple[int, float], ...]]:
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


def clock_event_reasons(handle: Any) -> int:
    try:
        return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except pynvml.NVMLError_FunctionNotFound:
        # Drivers before 535 only know the older name of the same bitmask.
        return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def running_processes(handle: Any, kind: ProcessKind) -> list[RawProcess]:
    if kind == "compute":
        v3, v2 = pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetComputeRunningProcesses_v2
    else:
        v3, v2 = pynvml.nvmlDeviceGetGraphicsRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2
    try:
        procs = v3(handle)
    except pynvml.NVMLLibraryMismatchError:
        procs = v2(handle)  # drivers older than 510 have no _v3
    return [RawProcess(int(p.pid), kind, None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                       _instance(getattr(p, "gpuInstanceId", _NO_INSTANCE)),
                       _instance(getattr(p, "computeInstanceId", _NO_INSTANCE)))
            for p in procs]


def _instance(value: Any) -> int | None:
    return None if value is None or int(value) == _NO_INSTANCE else int(value)


def field_values(values: Any) -> list[float | None]:
    """The values of an nvmlDeviceGetFieldValues answer, in request order: None for each field that
    the driver did not answer with success (each field carries its own status)."""
    rows = unpack_array(_FIELD_VALUE_LAYOUT, pynvml.c_nvmlFieldValue_t, values)
    if rows is None:
        return [sample_value(v.valueType, v.value) if v.nvmlReturn == pynvml.NVML_SUCCESS else None
                for v in values]
    ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    return [None if ret != pynvml.NVML_SUCCESS
            else float(value) if value_type == ull
            else sample_value(value_type, values[i].value)  # another member of the union: by name
            for i, (value_type, ret, value) in enumerate(rows)]


def field_array(request: tuple[tuple[int, int], ...]) -> Any:
    """A field-values array with these (fieldId, scopeId) pairs set, for ``fill_field_values``."""
    array = (pynvml.c_nvmlFieldValue_t * len(request))()
    for slot, (field_id, scope) in zip(array, request, strict=True):
        slot.fieldId, slot.scopeId = field_id, scope
    return array


def fill_field_values(handle: Any, array: Any) -> Any:
    """nvmlDeviceGetFieldValues into an array made once by ``field_array``: the call pynvml's wrapper
    makes, without the new array type, array and ids it makes and sets for each call (for a request
    asked every tick). The driver writes each field's status and value; the ids stay."""
    function = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
    pynvml._nvmlCheckReturn(function(handle, ctypes.c_int32(len(array)), ctypes.byref(array)))
    return array
