"""GPM (GPU Performance Monitoring, Hopper and newer): activity ratios between two samples of the
GPU's counters, taken a tick apart, of the whole GPU or of one GPU instance of a GPU in MIG mode.

NVML computes each metric from two samples at least 100 ms apart; the boundary keeps the previous
tick's sample per GPU (and per GPU instance) and swaps the two buffers after each tick.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Mapping
from typing import Any

import pynvml

from gpuscope.nvml.ctypes_layout import element_format
from gpuscope.nvml.device import GpmState, NvmlDevice

# Nvml.query: one isolated reading, None when unsupported or failed.
Query = Callable[..., Any]

MIN_SPACING_S = 0.1  # NVML needs two GPM samples at least 100 ms apart
# DeviceReadings field -> GPM metric, for a whole GPU
DEVICE_METRICS = {
    "sm_active_ratio": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy_ratio": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_active_ratio": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_active_ratio": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "fp16_active_ratio": pynvml.NVML_GPM_METRIC_FP16_UTIL,
    "fp32_active_ratio": pynvml.NVML_GPM_METRIC_FP32_UTIL,
    "fp64_active_ratio": pynvml.NVML_GPM_METRIC_FP64_UTIL,
}
# MigDeviceReadings field -> GPM metric, for one GPU instance. Graphics activity (any context active
# on the instance) stands in for the utilization samples NVML does not keep per instance.
MIG_METRICS = {
    "graphics_active_ratio": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "sm_active_ratio": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "tensor_active_ratio": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_active_ratio": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}

# nvmlGpmMetricsGet's results: (nvmlReturn, value) of metrics[0 .. n-1], read from the request's bytes
# (the request is kept per sample state and reused: its inputs do not change).
_RESULT_ELEMENT = element_format(pynvml.c_nvmlGpmMetric_t, "nvmlReturn", "value")
_METRICS_OFFSET: int = pynvml.c_nvmlGpmMetricsGet_t.metrics.offset
_RESULTS = {
    count: None if _RESULT_ELEMENT is None
    else struct.Struct(f"={_METRICS_OFFSET}x" + _RESULT_ELEMENT * count)
    for count in {len(DEVICE_METRICS), len(MIG_METRICS)}
}


def supported(query: Query, device: NvmlDevice) -> bool:
    """Whether the GPU has GPM (asked once; the answer is remembered as "gpm" unsupported)."""
    if device.gpm_supported is None:
        support = query(device, "gpm", pynvml.nvmlGpmQueryDeviceSupport, device.handle)
        if support is None:  # failed this time (asked again next tick), or not supported
            return False
        device.gpm_supported = bool(support.isSupportedDevice)
    return device.gpm_supported


def device_metrics(query: Query, now: float, device: NvmlDevice) -> tuple[dict[str, float], float] | None:
    """The whole GPU's metrics between the previous tick's sample and this one, with the seconds
    between the two samples; None on the first tick, in MIG mode and without GPM."""
    if device.identity.mig_enabled or not supported(query, device):
        return None
    return _between_samples(query, now, device, device.gpm, "gpm", DEVICE_METRICS,
                            pynvml.nvmlGpmSampleGet, device.handle)


def instance_metrics(query: Query, now: float, device: NvmlDevice,
                     gpu_instance: int) -> tuple[dict[str, float], float] | None:
    """One GPU instance's metrics (nvmlGpmMigSampleGet), as ``device_metrics`` for a whole GPU."""
    if not supported(query, device):
        return None
    state = device.mig_gpm.get(gpu_instance)
    if state is None:
        state = device.mig_gpm[gpu_instance] = GpmState()
    return _between_samples(query, now, device, state, "gpm_mig", MIG_METRICS,
                            pynvml.nvmlGpmMigSampleGet, device.handle, gpu_instance)


def free(state: GpmState) -> None:
    """Give a sample state's buffers back to NVML (they are allocated outside Python's heap)."""
    for sample in state.samples or ():
        with contextlib.suppress(pynvml.NVMLError):  # NVML shut down meanwhile: nothing to give back
            pynvml.nvmlGpmSampleFree(sample)
    state.samples = None
    state.previous_at = None


def _between_samples(query: Query, now: float, device: NvmlDevice, state: GpmState, reading: str,  # noqa: PLR0917
                     metrics: Mapping[str, int], sample_get: Callable[..., Any],
                     *where: Any) -> tuple[dict[str, float], float] | None:
    if state.samples is None:
        samples = query(device, reading, lambda: [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()])
        if samples is None:
            return None
        state.samples = samples
    if state.previous_at is not None and now - state.previous_at < MIN_SPACING_S:
        return None  # too soon after the last sample for NVML to compute rates
    previous, current = state.samples
    if query(device, reading, sample_get, *where, current) is None:
        return None
    result: tuple[dict[str, float], float] | None = None
    if state.previous_at is not None:
        values = query(device, reading, _metrics, state, metrics, previous, current)
        if values is not None:
            result = values, now - state.previous_at
    state.samples = [current, previous]
    state.previous_at = now
    return result


def _metrics(state: GpmState, metrics: Mapping[str, int], previous: Any, current: Any) -> dict[str, float]:
    request = state.request
    count = len(metrics)
    if request is None:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = count
        slots = request.metrics
        for i, metric_id in enumerate(metrics.values()):
            slots[i].metricId = metric_id
        state.request = request
    request.sample1 = previous
    request.sample2 = current
    pynvml.nvmlGpmMetricsGet(request)
    layout = _RESULTS.get(count)
    if layout is not None and type(request) is pynvml.c_nvmlGpmMetricsGet_t:
        results = layout.unpack_from(request)
    else:
        slots = request.metrics
        results = tuple(x for i in range(count) for x in (slots[i].nvmlReturn, slots[i].value))
    out = {}
    for i, name in enumerate(metrics):
        if results[2 * i] == pynvml.NVML_SUCCESS:
            out[name] = max(0.0, min(1.0, results[2 * i + 1] / 100.0))
    return out
