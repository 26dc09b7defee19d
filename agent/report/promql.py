"""The report's PromQL: one instant query per column, each evaluated at the end of the range.

Owners are label sets: a pod is (namespace, pod), a GPU (instance, gpu, uuid). Counters are read
with increase() per series before any sum, so agent restarts (counter resets) and processes that come
and go are counted right. What has no counter (a GPU held, an alert starting) is sampled every
``step`` by a subquery, each step standing for ``step`` seconds. With ``recorded``, the per-step parts
come from the recording rules in deploy/prometheus/gpuscope-recording-rules.yml (evaluated every
minute), which makes a week's report cheap on a large fleet.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU = ("instance", "gpu", "uuid")
OWNERS: dict[str, tuple[str, ...]] = {
    "pod": ("namespace", "pod"),
    "namespace": ("namespace",),
    "user": ("user",),
    "node": ("instance",),
    "gpu": GPU,
}
IDLE_BELOW = 0.05  # a GPU busy less than this fraction of a step is idle
# The least range a busy rate is read over: rate() needs two samples, and a range as short as the
# scrape interval usually holds one, so a step under a minute reads the busy time of the last minute.
MIN_BUSY_RANGE_S = 60
RECORDED_STEP_S = 60  # the recording rules' evaluation interval

# The recording rules' series (deploy/prometheus/gpuscope-recording-rules.yml). Busy time and energy
# add up, so one series per (GPU, namespace, pod, user) serves every grouping; held time and alert
# onsets do not (two users time-sharing a GPU hold it once for their shared empty pod), so each
# grouping has its own, and the reports by node and by GPU read the per-GPU ones.
BUSY_RULE = "gpuscope:gpu_owner_busy_seconds:rate1m"
ENERGY_RULE = "gpuscope:gpu_owner_energy_joules:rate1m"
_LEVEL = {"pod": "gpu_pod", "namespace": "gpu_namespace", "user": "gpu_user", "node": "gpu", "gpu": "gpu"}


def held_rule(by: str) -> str:
    return f"gpuscope:{_LEVEL[by]}_held:present1m"


def held_idle_rule(by: str) -> str:
    return f"gpuscope:{_LEVEL[by]}_held_idle:present1m"


def alerts_rule(by: str) -> str:
    return f"gpuscope:{_LEVEL[by]}_alert_onsets:count1m"


def _labels(*groups: tuple[str, ...]) -> str:
    seen: list[str] = []
    for group in groups:
        seen += [label for label in group if label not in seen]
    return ", ".join(seen)


@dataclass(frozen=True)
class Queries:
    """The queries of a report by ``by`` over ``range_s`` seconds ending at the evaluation time."""

    by: str
    range_s: int
    step_s: int
    recorded: bool = False
    by_gpu_too: bool = False  # sum by the GPU's labels as well as the owner's (time-sliced GPUs' shares)

    @property
    def owner_labels(self) -> tuple[str, ...]:
        return OWNERS[self.by]

    @property
    def per_gpu(self) -> bool:
        """By node or GPU, busy time and energy are the GPU's own counters, not its processes'."""
        return self.by in ("node", "gpu")

    def _range(self) -> str:
        return f"{self.range_s}s"

    def _subquery(self) -> str:
        return f"[{self.range_s}s:{self.step_s}s]"

    def _sum(self, expr: str) -> str:
        labels = _labels(GPU, self.owner_labels) if self.by_gpu_too else _labels(self.owner_labels)
        return f"sum by ({labels}) (\n  {expr}\n)"

    def held_inner(self) -> str:
        """1 per (GPU, owner) while the owner has at least one process on the GPU."""
        return f"group by ({_labels(GPU, self.owner_labels)}) (gpu_process_info)"

    def idle_gpus(self) -> str:
        """The GPUs busy less than IDLE_BELOW of the step ending now (of the last minute, for a step
        under a minute)."""
        return f"rate(gpu_busy_seconds_total[{max(self.step_s, MIN_BUSY_RANGE_S)}s]) < {IDLE_BELOW:g}"

    def alert_onsets(self) -> str:
        """Per GPU, how many of its alerts started firing in the step ending now."""
        firing = f"group by ({_labels(GPU)}, alertname) (gpuscope_alert_firing"
        return (f"count by ({_labels(GPU)}) ({firing}) unless {firing} offset {self.step_s}s))")

    def held_seconds(self) -> str:
        if self.recorded:
            rule = held_rule(self.by)
            return f"{self._sum(f'count_over_time({rule}[{self._range()}])')} * {RECORDED_STEP_S}"
        return f"{self._sum(f'count_over_time(({self.held_inner()}){self._subquery()})')} * {self.step_s}"

    def held_idle_seconds(self) -> str:
        if self.recorded:
            rule = held_idle_rule(self.by)
            return f"{self._sum(f'count_over_time({rule}[{self._range()}])')} * {RECORDED_STEP_S}"
        inner = f"{self.held_inner()}\n  and on ({_labels(GPU)})\n  ({self.idle_gpus()})"
        return f"{self._sum(f'count_over_time(({inner}){self._subquery()})')} * {self.step_s}"

    def busy_seconds(self) -> str:
        if self.per_gpu:
            return self._sum(f"increase(gpu_busy_seconds_total[{self._range()}])")
        if self.recorded:
            return f"{self._sum(f'sum_over_time({BUSY_RULE}[{self._range()}])')} * {RECORDED_STEP_S}"
        return self._sum(f"increase(gpu_process_busy_seconds_total[{self._range()}])")

    def energy_joules(self) -> str:
        if self.per_gpu:
            return self._sum(f"increase(gpu_energy_joules_total[{self._range()}])")
        if self.recorded:
            return f"{self._sum(f'sum_over_time({ENERGY_RULE}[{self._range()}])')} * {RECORDED_STEP_S}"
        return self._sum(f"increase(gpu_process_energy_joules_total[{self._range()}])")

    def alerts_fired(self) -> str:
        if self.recorded:
            rule = alerts_rule(self.by)
            return self._sum(f"sum_over_time({rule}[{self._range()}])")
        if self.per_gpu:  # every alert of the GPU, held or not
            return self._sum(f"sum_over_time(({self.alert_onsets()}){self._subquery()})")
        inner = f"{self.held_inner()}\n  * on ({_labels(GPU)}) group_left ()\n  {self.alert_onsets()}"
        return self._sum(f"sum_over_time(({inner}){self._subquery()})")

    def idle_energy_joules(self) -> str:
        """The energy no process was given, fleet-wide."""
        return f"sum(increase(gpu_idle_energy_joules_total[{self._range()}]))"

    def pods_of_gpus(self) -> str:
        """Per GPU, the pods the kubelet allocated it to at any time in the range: several on a GPU
        time-sliced between pods, whose processes carry no pod labels."""
        return f"group by ({_labels(GPU, OWNERS['pod'])}) (last_over_time(gpu_pod_info[{self._range()}]))"

    def captures(self) -> str:
        """Captures with a stored trace, per node (the series name no GPU, pod or capture id)."""
        return f'sum by (instance) (increase(gpuscope_captures_total{{outcome="captured"}}[{self._range()}]))'

    def columns(self) -> dict[str, str]:
        """The per-owner queries, by column."""
        return {
            "held": self.held_seconds(),
            "busy": self.busy_seconds(),
            "held_idle": self.held_idle_seconds(),
            "energy": self.energy_joules(),
            "alerts": self.alerts_fired(),
        }
