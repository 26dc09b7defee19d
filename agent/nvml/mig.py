"""MIG devices of a GPU in MIG mode: listed by index on the parent, each read through its own handle.

What NVML gives per MIG device: its GPU and compute instance ids, UUID, name (with the profile, as
``… MIG 1g.10gb``) and memory; per GPU instance, GPM samples on Hopper and newer. It keeps no
utilization samples, rates or per-process utilization per instance, and power and energy exist for
the parent only. The list is read again every ``nvml.health_interval`` (an administrator may create
or destroy instances at any time) and at once when a MIG device's handle stops answering.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pynvml

from gpuscope.nvml import gpm
from gpuscope.nvml.device import MigDevice, NvmlDevice
from gpuscope.nvml.readings import MigDeviceReadings, MigIdentity

log = logging.getLogger(__name__)

Query = Callable[..., Any]  # Nvml.query
# "… MIG 3g.40gb"; a compute instance smaller than its GPU instance is named "… MIG 1c.3g.40gb": its
# GPU instance's profile is what mig_profile holds (one per GPU instance, as the GPU instance id).
_PROFILE = re.compile(r"\bMIG (?:\d+c\.)?(\S+)\s*$")


def list_devices(query: Query, device: NvmlDevice) -> list[MigDevice] | None:
    """The MIG devices present now; None when they cannot be listed (counted as a failed reading)."""
    found: list[MigDevice] | None = query(device, "mig_devices", _list, device.handle)
    return found


def _list(parent: Any) -> list[MigDevice]:
    found = []
    for index in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(parent))):
        try:
            handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
        except pynvml.NVMLError_NotFound:
            continue  # no MIG device at this index
        name = str(pynvml.nvmlDeviceGetName(handle))
        match = _PROFILE.search(name)
        found.append(MigDevice(handle, MigIdentity(
            index=index,
            gpu_instance=int(pynvml.nvmlDeviceGetGpuInstanceId(handle)),
            compute_instance=int(pynvml.nvmlDeviceGetComputeInstanceId(handle)),
            uuid=str(pynvml.nvmlDeviceGetUUID(handle)),
            profile=match.group(1) if match else "",
        )))
    return found


def read_devices(query: Query, now: float, device: NvmlDevice, *,
                 relist: bool) -> tuple[MigDeviceReadings, ...]:
    """Each MIG device's readings this tick (listing them first when due). When listing fails, the
    devices as last listed are read: their series do not vanish for a tick."""
    if relist or device.mig_relist or device.mig_devices is None:
        listed = list_devices(query, device)
        if listed is not None:
            _replace_devices(device, listed)
            device.mig_relist = False
        elif device.mig_devices is None:
            return ()  # never listed yet
    activity: dict[int, tuple[dict[str, float], float] | None] = {}
    out = []
    for mig in device.mig_devices or ():
        ident = mig.identity
        memory = query(device, "mig_memory", _memory, mig.handle)
        if memory is None:
            device.mig_relist = True  # a handle that stopped answering: list them again next tick
        if ident.gpu_instance not in activity:  # one GPM sample per GPU instance, shared by its CIs
            activity[ident.gpu_instance] = gpm.instance_metrics(query, now, device, ident.gpu_instance)
        found = activity[ident.gpu_instance]
        ratios, interval = found if found is not None else ({}, None)
        used, total = (None, None) if memory is None or memory is _NOT_SUPPORTED else memory
        out.append(MigDeviceReadings(
            identity=ident,
            memory_used_bytes=used,
            memory_total_bytes=total,
            gpm_interval_seconds=interval if ratios else None,
            **ratios,
        ))
    return tuple(out)


_NOT_SUPPORTED = (None, None)  # a MIG device that keeps no memory figures (not a failure: no relisting)


def _memory(handle: Any) -> tuple[int | None, int | None]:
    """(used, total) bytes of one MIG device."""
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError_NotSupported:
        return _NOT_SUPPORTED  # this device's, not a reading the whole GPU lacks
    return int(memory.used), int(memory.total)


def _replace_devices(device: NvmlDevice, listed: list[MigDevice]) -> None:
    if device.mig_devices is not None and _ids(listed) != _ids(device.mig_devices):
        log.info("GPU %d: MIG devices now %s", device.identity.index,
                 ", ".join(f"{m.identity.profile} (GPU instance {m.identity.gpu_instance}, compute "
                           f"instance {m.identity.compute_instance})" for m in listed) or "none")
    device.mig_devices = listed
    # A GPU instance gone, or made anew under the same id (other MIG devices): its GPM samples go, so
    # that no interval spans two instances.
    members = _members(listed)
    for instance in list(device.mig_gpm):
        if members.get(instance) != device.mig_members.get(instance):
            gpm.free(device.mig_gpm.pop(instance))
    device.mig_members = members


def _members(devices: list[MigDevice]) -> dict[int, frozenset[str]]:
    out: dict[int, set[str]] = {}
    for m in devices:
        out.setdefault(m.identity.gpu_instance, set()).add(m.identity.uuid)
    return {instance: frozenset(uuids) for instance, uuids in out.items()}


def _ids(devices: list[MigDevice]) -> list[tuple[int, int, str]]:
    return [(m.identity.gpu_instance, m.identity.compute_instance, m.identity.uuid) for m in devices]
