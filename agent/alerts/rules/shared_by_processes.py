"""GpuSharedByProcesses: more compute processes on a GPU than allowed (MPS servers aside)."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition
from gpuscope.alerts.rules.base import ForDuration, Rule, RuleConfig, clear_for_field, for_field


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
            if point is None or len(point.compute_processes) <= max_processes:
                continue
            names = [n for n in point.compute_processes if not self.allowed(n)]
            if len(names) > max_processes:
                shown = ", ".join(sorted(n or "?" for n in names))
                out[gpu] = Condition(
                    gpu, {"compute_processes": float(len(names)), "max_processes": float(max_processes)},
                    f"GPU {gpu} is shared by {len(names)} compute processes ({shown}), more than the "
                    f"{max_processes} allowed")
        return out
