"""Which alert explains which: a firing alert inhibits the lesser alerts on the same GPU.

One idle notebook holding two processes on a GPU meets three conditions at once: it is held idle,
shared by two processes, and runs a job at low utilization. Only the first names the cause; the
others follow from it. As Alertmanager's ``inhibit_rules`` do, an alert of a rule in ``INHIBITS`` that
is firing mutes the alerts of the rules it lists on the same target: the same GPU, or the same MIG
GPU instance. The muted alerts keep their state (they fire again, with their own evidence, once the
greater alert resolves), but the agent's outputs speak of the greater one only: the log, the event
log, Alertmanager, the metrics, the captures and the status page (which lists the muted ones under
it, dimmed). docs/alerts.md ("Inhibition") gives the order, and deploy/alertmanager/alertmanager.yml
the same rules for the alerts Prometheus evaluates.

The order:

- ``GpuHeldIdle`` (processes hold memory and run nothing) inhibits the utilization rules
  (``GpuLowUtilization``, ``GpuFrequentIdleDips``, ``GpuUtilizationSkew``) and
  ``GpuSharedByProcesses``: the idle holders are why the GPU is idle and why it has company.
- ``GpuAllocatedUnused`` (a pod was given the GPU and never opened it) inhibits the utilization rules.

Nothing inhibits ``GpuXidError``, ``GpuThrottled`` or ``GpuBusyButStalled``: each speaks of something
the others do not explain.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

UTILIZATION_RULES = ("GpuLowUtilization", "GpuFrequentIdleDips", "GpuUtilizationSkew")

# inhibiting rule -> the rules whose alerts on the same target it mutes while it fires
INHIBITS: Mapping[str, tuple[str, ...]] = {
    "GpuHeldIdle": (*UTILIZATION_RULES, "GpuSharedByProcesses"),
    "GpuAllocatedUnused": UTILIZATION_RULES,
}

# The labels that must be equal for an inhibition, as Alertmanager compares them: what the two
# alerts are on (a GPU of a node; a MIG GPU instance of it, empty for the whole GPU).
EQUAL_LABELS = ("gpu", "gpu_instance")

# (GPU index, GPU instance id or "") : what an alert is on, as far as inhibition goes
Target = tuple[int, str]


def target(gpu: int, labels: Mapping[str, str]) -> Target:
    """What an alert with these labels is on, for inhibition."""
    return gpu, labels.get("gpu_instance", "")


def inhibitors_of(rule: str) -> tuple[str, ...]:
    """The rules that inhibit ``rule``, in INHIBITS' order."""
    return tuple(name for name, muted in INHIBITS.items() if rule in muted)


class Inhibition:
    """The firing alerts of the inhibiting rules on one tick, asked about each alert."""

    def __init__(self, firing: Iterable[tuple[str, Target]]) -> None:
        # target -> the inhibiting rules firing on it, in INHIBITS' order
        self._firing: dict[Target, list[str]] = {}
        order = list(INHIBITS)
        for rule, where in firing:
            if rule in INHIBITS:
                names = self._firing.setdefault(where, [])
                if rule not in names:
                    names.append(rule)
                    names.sort(key=order.index)

    def inhibited_by(self, rule: str, where: Target) -> str:
        """The rule whose firing alert mutes ``rule`` on this target; "" when none does."""
        for name in self._firing.get(where, ()):
            if rule in INHIBITS[name]:
                return name
        return ""
