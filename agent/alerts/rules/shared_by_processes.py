"""GpuSharedByProcesses: more compute processes on a GPU than allowed (MPS servers aside).

On a GPU in MIG mode, processes on different MIG devices do not share anything the rule is about:
each MIG device is judged instead, by the compute processes on it.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, InstanceKey
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    clear_for_field,
    for_field,
    instance_labels,
    instance_text,
)


class SharedByProcessesConfig(RuleConfig):
    for_: ForDuration = for_field(30.0)
    clear_for: ForDuration = clear_for_field(30.0)
    max_processes: int = Field(1, ge=1, le=1024, description="Fires above this many compute processes.")
    allow: list[Annotated[str, Field(min_length=1)]] = Field(
        ["nvidia-cuda-mps-server", "nvidia-cuda-mps-control"],
        description="Process names that do not count (e.g. the MPS server).")


class SharedByProcessesRule(Rule[SharedByProcessesConfig]):
    name: ClassVar[str] = "GpuSharedByProcesses"
    config_model: ClassVar[type[SharedByProcessesConfig]] = SharedByProcessesConfig
    captures_by_default: ClassVar[bool] = False  # who shares a GPU is in the metrics, not in a trace
    judges_instances: ClassVar[bool] = True

    def __init__(self, config: SharedByProcessesConfig) -> None:
        super().__init__(config)
        self.allow = frozenset(config.allow)

    def allowed(self, name: str | None) -> bool:
        """In the allow-list; a 15-character name also matches as Linux's truncated comm name."""
        if name is None:
            return False
        return name in self.allow or (len(name) == 15 and any(a.startswith(name) for a in self.allow))

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        max_processes = self.config.max_processes
        out = {}
        for gpu in sorted(history.up):
            point = history.latest(gpu)
            if point is None or len(point.compute_processes) <= max_processes or history.instances(gpu):
                continue  # the common case; or a GPU in MIG mode: its MIG devices are judged
            names = [n for n in point.compute_processes if not self.allowed(n)]
            if len(names) > max_processes:
                out[gpu] = self._condition(gpu, f"GPU {gpu}", names, {})
        return out

    def evaluate_instances(self, history: NodeHistory,
                           active: frozenset[InstanceKey]) -> dict[InstanceKey, Condition]:
        max_processes = self.config.max_processes
        out = {}
        for gpu, device in self._instances(history):
            if len(device.processes) <= max_processes:
                continue
            names = [p.name for p in device.processes if p.kind == "compute" and not self.allowed(p.name)]
            if len(names) > max_processes:
                mig = device.reading
                out[InstanceKey(gpu, mig.uuid)] = self._condition(gpu, instance_text(gpu, mig), names,
                                                                   instance_labels(mig))
        return out

    def _condition(self, gpu: int, where: str, names: list[str | None], labels: dict[str, str]) -> Condition:
        max_processes = self.config.max_processes
        shown = ", ".join(sorted(n or "?" for n in names))
        return Condition(
            gpu, {"compute_processes": float(len(names)), "max_processes": float(max_processes)},
            f"{where} is shared by {len(names)} compute processes ({shown}), more than the {max_processes} "
            "allowed", labels)
