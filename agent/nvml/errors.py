"""The NVML boundary's errors, and how an NVML error is put into words."""

from __future__ import annotations

import pynvml


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



def describe(err: pynvml.NVMLError) -> str:
    try:
        return str(err)
    except Exception:  # pynvml's __str__ calls into the library, which may be gone
        return f"NVML error {getattr(err, 'value', '?')}"
