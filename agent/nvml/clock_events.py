"""Names of NVML's clock-event (throttle) reasons, as exported in gpu_clock_event_active{reason}.

The bit values are NVML's ``nvmlClocksEventReason*`` constants (stable since driver 3.295); they are
repeated here so that exporters and rules need not know NVML.
"""

from __future__ import annotations

# bit -> label value. Order is the export order.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x0001: "gpu_idle",
    0x0002: "applications_clocks_setting",
    0x0004: "sw_power_cap",
    0x0008: "hw_slowdown",
    0x0010: "sync_boost",
    0x0020: "sw_thermal_slowdown",
    0x0040: "hw_thermal_slowdown",
    0x0080: "hw_power_brake_slowdown",
    0x0100: "display_clock_setting",
}

POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"})


def decode_clock_event_reasons(mask: int) -> frozenset[str]:
    """The names of the reasons whose bits are set in ``mask``; unknown bits are ignored."""
    return frozenset(name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit)
