"""The hardware health readings: throttle (violation) time, row remapping, ECC, PCIe replays and
errors, memory temperature, and NVLink (links, data counters, errors); and the settings that change
as seldom: the enforced power limit and the memory clock; and the video engines' utilization.

These change slowly, and some cost far more than a tick's other calls (a violation counter is a few
hundred microseconds to a millisecond of CPU per call on a recent driver), so the sampler asks for
them on their own intervals: the throttle counters every ``nvml.throttle_interval``, the others every
``nvml.health_interval``, and a tick in between repeats the last values (``HealthCache``). Only the
NVLink data counters, which rate() turns into bandwidth, are read every tick, and only on a GPU with
links; and the video engines while one is in use (see ``read_video``). Most of the health readings
come from one nvmlDeviceGetFieldValues call, each field with its own status.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pynvml

from gpuscope.nvml.decoding import field_array, field_values, fill_field_values
from gpuscope.nvml.device import NvmlDevice
from gpuscope.nvml.errors import GpuLostError, describe

Query = Callable[..., Any]  # Nvml.query

# NVLink fields summed over all links: scopeId UINT_MAX. A bare field id (scope 0) reads link 0 alone.
ALL_LINKS = 0xFFFFFFFF

# reason label -> NVML perf policy of nvmlDeviceGetViolationStatus
THROTTLE_REASONS: Mapping[str, int] = {
    "power": pynvml.NVML_PERF_POLICY_POWER,
    "thermal": pynvml.NVML_PERF_POLICY_THERMAL,
    "sync_boost": pynvml.NVML_PERF_POLICY_SYNC_BOOST,
    "board_limit": pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
    "low_utilization": pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
    "reliability": pynvml.NVML_PERF_POLICY_RELIABILITY,
}
# type label -> PCIe error counter field
PCIE_ERROR_FIELDS: Mapping[str, int] = {
    "correctable": pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS,
    "non_fatal": pynvml.NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR,
    "fatal": pynvml.NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR,
    "receiver": pynvml.NVML_FI_DEV_PCIE_COUNT_RECEIVER_ERROR,
    "bad_tlp": pynvml.NVML_FI_DEV_PCIE_COUNT_BAD_TLP,
    "bad_dllp": pynvml.NVML_FI_DEV_PCIE_COUNT_BAD_DLLP,
    "lcrc": pynvml.NVML_FI_DEV_PCIE_COUNT_LCRC_ERROR,
    "naks_received": pynvml.NVML_FI_DEV_PCIE_COUNT_NAKS_RECEIVED,
    "naks_sent": pynvml.NVML_FI_DEV_PCIE_COUNT_NAKS_SENT,
    "unsupported_request": pynvml.NVML_FI_DEV_PCIE_COUNT_UNSUPPORTED_REQ,
}
# type label -> (total field, nvmlDeviceGetNvLinkErrorCounter's counter for one link)
NVLINK_ERRORS: Mapping[str, tuple[int, int]] = {
    "crc_flit": (pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    "crc_data": (pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
    "replay": (pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    "recovery": (pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
}
_REMAP_FIELDS = (pynvml.NVML_FI_DEV_REMAPPED_COR, pynvml.NVML_FI_DEV_REMAPPED_UNC,
                 pynvml.NVML_FI_DEV_REMAPPED_PENDING, pynvml.NVML_FI_DEV_REMAPPED_FAILURE)
# One request for the health fields, in this order: (fieldId, scopeId) pairs.
_HEALTH_FIELDS = (
    (pynvml.NVML_FI_DEV_MEMORY_TEMP, 0),
    (pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 0),
    *((field_id, 0) for field_id in PCIE_ERROR_FIELDS.values()),
    *((field_id, 0) for field_id in _REMAP_FIELDS),
    (pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0),
    *((total, ALL_LINKS) for total, _ in NVLINK_ERRORS.values()),
)
_NVLINK_DATA = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
_KIB = 1024.0  # the NVLink data counters count KiB


def read_throttle(query: Query, device: NvmlDevice) -> None:
    """The violation counters, into the device's health cache (seconds, cumulative since the driver
    loaded). A reason the GPU does not count is left out; none at all: no reading."""
    seconds = {}
    for reason, policy in THROTTLE_REASONS.items():
        violation = query(device, f"clock_throttle_{reason}", pynvml.nvmlDeviceGetViolationStatus,
                          device.handle, policy)
        if violation is not None:
            seconds[reason] = int(violation.violationTime) / 1e9  # nanoseconds
    _put(device.health.values, "clock_throttle_seconds_total", seconds or None)


def read_health(query: Query, device: NvmlDevice, *, per_link: bool) -> None:
    """The health readings but the throttle counters, into the device's health cache."""
    h, values = device.handle, device.health.values
    answer = query(device, "health_fields", pynvml.nvmlDeviceGetFieldValues, h, _HEALTH_FIELDS)
    fields: list[float | None] = [None] * len(_HEALTH_FIELDS) if answer is None else field_values(answer)
    temperature, replays, *rest = fields
    pcie_errors, rest = rest[:len(PCIE_ERROR_FIELDS)], rest[len(PCIE_ERROR_FIELDS):]
    remap, (link_count, *link_errors) = rest[:4], rest[4:]
    _put(values, "memory_temperature_celsius", temperature)
    if replays is None:  # some drivers answer the replay counter through its own call only
        replays = query(device, "pcie_replays", pynvml.nvmlDeviceGetPcieReplayCounter, h)
    _put(values, "pcie_replays_total", None if replays is None else int(replays))
    errors = {kind: int(v) for kind, v in zip(PCIE_ERROR_FIELDS, pcie_errors, strict=True) if v is not None}
    _put(values, "pcie_errors_total", errors or None)
    if all(v is None for v in remap):
        rows = query(device, "remapped_rows", pynvml.nvmlDeviceGetRemappedRows, h)
        remap = [None] * 4 if rows is None else list(rows)
    correctable, uncorrectable, pending, failed = remap
    _put(values, "remapped_rows_correctable_total", None if correctable is None else int(correctable))
    _put(values, "remapped_rows_uncorrectable_total", None if uncorrectable is None else int(uncorrectable))
    _put(values, "row_remap_pending", None if pending is None else bool(pending))
    _put(values, "row_remap_failed", None if failed is None else bool(failed))
    corrected = query(device, "ecc_corrected", pynvml.nvmlDeviceGetTotalEccErrors, h,
                      pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
    _put(values, "ecc_corrected_errors_total", None if corrected is None else int(corrected))
    _read_nvlink(query, device, link_count, link_errors, per_link)


def read_settings(query: Query, device: NvmlDevice) -> None:
    """What changes as seldom as the health readings and is read with them, into the device's health
    cache: the enforced power limit and the memory clock, which an administrator (or the driver's
    P-state) changes rarely (the power draw, SM clock and clock event reasons that follow them are
    read every tick), and the uncorrected ECC count (an uncorrected error also raises an Xid event,
    48, 63 or 64, which is counted as it comes)."""
    h, values = device.handle, device.health.values
    limit = query(device, "power_limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
    _put(values, "power_limit_watts", None if limit is None else limit / 1000.0)
    clock = query(device, "memory_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
    _put(values, "memory_clock_hertz", None if clock is None else clock * 1e6)
    uncorrected = query(device, "ecc", pynvml.nvmlDeviceGetTotalEccErrors, h,
                        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    _put(values, "ecc_uncorrected_errors_total", None if uncorrected is None else int(uncorrected))


def read_video(query: Query, device: NvmlDevice) -> None:
    """The encoder's and decoder's utilization, into the device's health cache: read with the health
    readings, and every tick while either was in use at its last read. A GPU of a training node never
    uses them (two calls a tick saved); one that transcodes is followed tick by tick, and an engine
    that starts is seen at the next health read."""
    values = device.health.values
    for reading, call in (("encoder_utilization", pynvml.nvmlDeviceGetEncoderUtilization),
                          ("decoder_utilization", pynvml.nvmlDeviceGetDecoderUtilization)):
        answer = query(device, reading, call, device.handle)  # [percent, sampling period µs]
        _put(values, f"{reading}_ratio", None if answer is None else answer[0] / 100.0)
    device.health.video_in_use = bool(values.get("encoder_utilization_ratio")
                                      or values.get("decoder_utilization_ratio"))


def _read_nvlink(query: Query, device: NvmlDevice, link_count: float | None,
                 link_errors: list[float | None], per_link: bool) -> None:
    values = device.health.values
    links = device.health.nvlink_links
    if links is None or link_count is not None:
        links = int(link_count) if link_count is not None else _probe_links(device.handle)
        device.health.nvlink_links = links  # None: not known yet (asked again at the next health read)
    if not links:
        return  # no NVLink: its readings stay absent
    # Each of these reads every link in one reading: a link that answers NOT_SUPPORTED is left out,
    # any other failure fails the whole reading for this time (a partial sum would read as a reset).
    active = query(device, "nvlink_state", _active_links, device.handle, links)
    _put(values, "nvlink_active_links", active)
    errors = {kind: int(v) for kind, v in zip(NVLINK_ERRORS, link_errors, strict=True) if v is not None}
    by_link: dict[int, dict[str, int]] | None = None
    if per_link or not errors:
        by_link = query(device, "nvlink_errors", _link_errors, device.handle, links)
        if not errors and by_link:  # no totals from the driver: the sum over the links
            for counts in by_link.values():
                for kind, count in counts.items():
                    errors[kind] = errors.get(kind, 0) + count
    _put(values, "nvlink_errors_total", errors or None)
    _put(values, "nvlink_link_errors_total", by_link if per_link and by_link else None)


def _active_links(handle: Any, links: int) -> int:
    """Links whose state is up; a link whose state is not supported counts as not up."""
    up = 0
    for link in range(links):
        try:
            up += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
        except pynvml.NVMLError_NotSupported:
            continue
    return up


def _link_errors(handle: Any, links: int) -> dict[int, dict[str, int]]:
    """Each link's error counters by type; those NOT_SUPPORTED left out."""
    by_link: dict[int, dict[str, int]] = {}
    for link in range(links):
        for kind, (_, counter) in NVLINK_ERRORS.items():
            try:
                count = pynvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)
            except pynvml.NVMLError_NotSupported:
                continue
            by_link.setdefault(link, {})[kind] = int(count)
    return by_link


def _probe_links(handle: Any) -> int | None:
    """Links the GPU has, where the link-count field is not answered: the links whose state can be
    read (a GPU without NVLink answers NOT_SUPPORTED for link 0). None when a state read failed
    otherwise: not known this time."""
    links = 0
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED):
                raise GpuLostError(describe(err)) from err  # not "no links": asked again once it is back
            if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT,
                             pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                break  # past the last link, or no NVLink at all
            return None
        links += 1
    return links


def nvlink_data_request(links: int, per_link: bool) -> tuple[tuple[int, int], ...]:
    """The field request for the NVLink data counters: summed over the links, then per link."""
    request = [(field_id, ALL_LINKS) for field_id in _NVLINK_DATA]
    if per_link:
        request += [(field_id, link) for link in range(links) for field_id in _NVLINK_DATA]
    return tuple(request)


def read_nvlink_data(query: Query, device: NvmlDevice, per_link: bool,
                     ) -> tuple[float | None, float | None, dict[int, dict[str, float]] | None]:
    """This tick's NVLink data counters in bytes: (transmitted, received) summed over the links, and
    per link with ``per_link``. All None on a GPU without NVLink (or before its links are known)."""
    links = device.health.nvlink_links
    if not links or "nvlink_data" in device.unsupported:
        return None, None, None
    request = device.health.nvlink_request
    if request is None or len(request) != (2 + 2 * links if per_link else 2):
        request = device.health.nvlink_request = field_array(nvlink_data_request(links, per_link))
    answer = query(device, "nvlink_data", fill_field_values, device.handle, request)
    if answer is None:
        return None, None, None
    values = field_values(answer)
    tx, rx = (None if v is None else v * _KIB for v in values[:2])
    by_link: dict[int, dict[str, float]] | None = None
    if per_link:
        by_link = {}
        for link in range(links):
            link_tx, link_rx = values[2 + 2 * link], values[3 + 2 * link]
            if link_tx is not None and link_rx is not None:
                by_link[link] = {"transmit_bytes": link_tx * _KIB, "receive_bytes": link_rx * _KIB}
    return tx, rx, by_link or None


def _put(values: dict[str, Any], name: str, value: Any) -> None:
    """A reading read this time replaces the cached one; one that failed this time keeps it absent."""
    if value is None:
        values.pop(name, None)
    else:
        values[name] = value
