"""What the NVML boundary keeps about one GPU between ticks: its handle, identity, cursors, what it
does not support, GPM sample buffers, its MIG devices and the last health readings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gpuscope.nvml.readings import DeviceIdentity, MigIdentity


@dataclass(slots=True)
class GpmState:
    """Two GPM sample buffers (the previous tick's and this one's) and when the previous was taken:
    of the whole GPU, or of one GPU instance of a GPU in MIG mode."""

    samples: list[Any] | None = None  # [previous, current], allocated on first use
    previous_at: float | None = None
    request: Any = None  # the nvmlGpmMetricsGet request, metric ids filled in once
    # The ratios last computed (a whole GPU's, read every nvml.gpm_interval): repeated between reads.
    ratios: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class MigDevice:
    handle: Any
    identity: MigIdentity


@dataclass(slots=True)
class HealthCache:
    """The last values of the readings taken every nvml.health_interval (or throttle_interval): each
    tick between two reads repeats them. A reading not (yet) had is absent from ``values``."""

    values: dict[str, Any] = field(default_factory=dict)
    nvlink_links: int | None = None  # links the GPU has (None until read; 0 without NVLink)
    nvlink_request: Any = None  # the data counters' field-values array (decoding.field_array)
    video_in_use: bool = False  # an encoder or decoder was busy at the last read: read every tick


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
        self.gpm_supported: bool | None = None  # None until asked
        self.gpm = GpmState()
        # MIG mode: the MIG devices as last listed (None: never listed), whether to list them again at
        # the next tick (a handle stopped answering), GPM state per GPU instance and the MIG devices
        # each GPU instance had when its state began.
        self.mig_devices: list[MigDevice] | None = None
        self.mig_relist = False
        self.mig_gpm: dict[int, GpmState] = {}
        self.mig_members: dict[int, frozenset[str]] = {}
        self.health = HealthCache()

    def switch_mig_mode(self, enabled: bool) -> None:
        """The GPU went in or out of MIG mode: what it did not support in the other mode may work now,
        and its MIG devices and GPM samples belong to the other mode."""
        self.identity = dataclasses.replace(self.identity, mig_enabled=enabled)
        self.unsupported.clear()
        self.samples_read = self.process_samples_read = False
        self.sample_cursor = self.process_cursor = 0
        self.mig_devices, self.mig_relist, self.mig_members = None, False, {}
        self.forget_gpm()
        self.mig_gpm.clear()
        self.gpm_supported = None

    def forget_gpm(self) -> None:
        """GPM counters across a time the GPU was lost mean nothing: the next sample starts afresh."""
        self.gpm.previous_at = None
        self.gpm.ratios = {}
        for state in self.mig_gpm.values():
            state.previous_at = None
