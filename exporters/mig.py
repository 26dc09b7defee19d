"""The per-MIG-device families (gpu_mig_*) of GPUs in MIG mode.

Each MIG device (a compute instance of a GPU instance) is one series set, labelled with its parent GPU
(gpu, uuid), its ids (gpu_instance, compute_instance), its profile (mig_profile, e.g. 1g.10gb) and its
own UUID (mig_uuid). NVML keeps no utilization samples per instance: busy time comes from GPM's
graphics activity, on Hopper and newer.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuscope.exporters.families import GaugeMetricFamily, Metric, new_family
from gpuscope.snapshot import GpuReading

MIG_LABELS = ("gpu", "uuid", "gpu_instance", "compute_instance", "mig_profile", "mig_uuid")
_POD_LABELS = ("pod", "namespace", "container")

# (MigReading attribute, family name without _total, counter?, unit, help)
_READINGS: tuple[tuple[str, str, bool, str, str], ...] = (
    ("memory_used_bytes", "gpu_mig_memory_used_bytes", False, "bytes",
     "Device memory used on the MIG device, in bytes."),
    ("memory_total_bytes", "gpu_mig_memory_total_bytes", False, "bytes",
     "Device memory of the MIG device, in bytes."),
    ("sm_active_ratio", "gpu_mig_sm_active_ratio", False, "ratio",
     "Fraction of time (0-1) at least one warp was resident on an SM of the GPU instance, averaged over "
     "its SMs."),
    ("tensor_active_ratio", "gpu_mig_tensor_active_ratio", False, "ratio",
     "Fraction of time (0-1) the tensor cores of the GPU instance were active, averaged over its SMs."),
    ("dram_active_ratio", "gpu_mig_dram_active_ratio", False, "ratio",
     "Fraction of time (0-1) the GPU instance's memory interface was busy sending or receiving data."),
    ("busy_seconds_total", "gpu_mig_busy_seconds", True, "seconds",
     "Time during which a context was active on the GPU instance since the agent started, in seconds "
     "(GPM's graphics activity times the interval it covers); rate() of it is the busy fraction."),
)
_HELP_INFO = "A MIG device of the GPU (value always 1), with its instance ids, profile and UUID."
_HELP_POD = ("A pod container the kubelet allocated the MIG device to (value always 1); join on gpu, uuid "
             "and gpu_instance to attribute the instance's series to pods.")


def mig_families(gpus: Iterable[GpuReading]) -> list[Metric]:
    info = GaugeMetricFamily("gpu_mig_info", _HELP_INFO, labels=MIG_LABELS)
    values = [(attr, new_family(counter, name, help_text, MIG_LABELS, unit))
              for attr, name, counter, unit, help_text in _READINGS]
    pods = GaugeMetricFamily("gpu_mig_pod_info", _HELP_POD, labels=(*MIG_LABELS, *_POD_LABELS))
    for gpu in gpus:
        for mig in gpu.mig_devices:
            labels = (str(gpu.index), gpu.uuid, str(mig.gpu_instance), str(mig.compute_instance), mig.profile,
                      mig.uuid)
            info.add_metric(labels, 1)
            for pod in mig.pods:  # allocations hold while the GPU is unreadable, as gpu_pod_info's
                pods.add_metric((*labels, pod.pod, pod.namespace, pod.container), 1)
            if not gpu.up:
                continue
            for attr, family in values:
                value = getattr(mig, attr)
                if value is not None:
                    family.add_metric(labels, value)
    return [info, *(family for _, family in values), pods]

