"""The per-process series' optional labels and cap, shared by the configuration and the exporter."""

from __future__ import annotations

from typing import Literal, get_args

# The labels ``processes.labels`` chooses from, in export order; gpu and uuid always lead.
ProcessLabel = Literal["pid", "process", "user", "container_id", "pod", "namespace", "container"]
PROCESS_LABEL_CHOICES: tuple[ProcessLabel, ...] = get_args(ProcessLabel)
DEFAULT_MAX_PER_GPU = 64  # processes exported per GPU; MPS and time-sliced GPUs can hold hundreds
