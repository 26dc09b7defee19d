"""What every alert rule is made of: its configuration model, and the base class of its logic.

A rule answers one question each tick: on which GPUs does my condition hold now? It returns a
``Condition`` (the evidence) per such GPU and carries no timers: the engine's state machine owns
``for`` and ``clear_for``. ``active`` (the GPUs where the rule is pending or firing) lets a rule
apply hysteresis: it starts on the threshold and stops only past threshold +/- hysteresis, so a
value hovering at the threshold does not flap. Labels are constant per rule (they are part of an
alert's identity downstream); the details that change go to ``values`` and ``summary``.

Windows that the history covers for less than 80 % are not judged (the agent's first seconds),
and a GPU counts as running a job over a window only when it had a compute process during at
least 80 % of it (so a job's first minutes, or the minutes after it ended, are not "low").

A rule's defaults are stated once, in its configuration model; the rule reads them from there.

A GPU in MIG mode has no utilization of its own (NVML keeps none per MIG device): the rules that
judge utilization, and those that judge who holds a GPU, judge each of its MIG devices instead
(``evaluate_instances``), by the device's busy share from its busy-seconds counter (GPM), its memory
and its pods. Such an alert is keyed by ``InstanceKey`` (one per MIG device, apart from the GPU's),
carries the labels that name the device (``instance_labels``) and says so in its summary
("GPU 2 MIG instance 3g.40gb (GPU instance 1, compute instance 0) was busy ...").

A summary starts with "GPU <n> " (the engine's log line relies on it) and is true of the numbers it
shows in every state: past the threshold it says so ("62.0% over 2m (below 80%)"); held by the
hysteresis it says that the alert holds, and until when ("84.9% ...: no longer below 80%, but the
alert holds until it reaches 85%"). ``value_text``/``percent`` show a value next to the thresholds
it is compared with so that rounding never puts it on or across one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, ClassVar, Generic, TypeVar

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field

from gpuscope.alerts.history import InstanceOccupancy, NodeHistory, Window
from gpuscope.alerts.model import Condition, InstanceKey, Severity
from gpuscope.common.config_types import Section
from gpuscope.common.durations import format_duration, parse_duration
from gpuscope.snapshot import MigReading, PodContainer, ProcessReading

BUSY_FRACTION = 0.8  # a window "has a job" when a compute process ran during this much of it
MAX_WINDOW_SECONDS = 3600.0  # bounds the history kept per GPU
MAX_WINDOW_POINTS = 7200  # ... and at a short sample interval, the points per window
MAX_FOR_SECONDS = 86400.0


def _window_range(seconds: float) -> float:
    if not 0 < seconds <= MAX_WINDOW_SECONDS:
        raise ValueError(f"a window must be longer than 0 and at most 1h, got {format_duration(seconds)}")
    return seconds


def _for_range(seconds: float) -> float:
    if seconds > MAX_FOR_SECONDS:
        raise ValueError(f"must be at most 24h, got {format_duration(seconds)}")
    return seconds


WindowDuration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_window_range)]
ForDuration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_for_range)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0)]


def window_field(default: float) -> Any:
    return Field(default, description="Span of history the condition is judged over (at least the sample "
                                      "interval, at most 1h).")


def for_field(default: float) -> Any:
    return Field(default, alias="for", description="How long the condition must hold before the alert fires.")


def clear_for_field(default: float) -> Any:
    return Field(default, description="How long the condition must be false before a firing alert resolves.")


def require_clearable(hysteresis: float, bound: float, bound_key: str) -> None:
    """A hysteresis as wide as the threshold it widens would keep a firing alert from ever clearing."""
    if hysteresis >= bound:
        raise ValueError(f"hysteresis must be below {bound_key} (else the alert could never clear)")


def require_reachable(threshold: float, hysteresis: float) -> None:
    """A rule that fires below a ratio clears at threshold + hysteresis, which a ratio must reach."""
    if threshold + hysteresis > 1.0:
        raise ValueError("threshold + hysteresis must be at most 1 (else the alert could never clear)")


def bound_text(bound: float, *, scale: float = 100.0) -> str:
    """A threshold as a summary shows it: 0.8 -> "80", 0.35000000000000003 -> "35", 6.0 -> "6"."""
    return f"{round(bound * scale, 3):g}"


def value_text(value: float, *bounds: float, scale: float = 100.0, decimals: int = 1) -> str:
    """A measured value as a summary shows it next to ``bounds``: with ``decimals`` decimals, or up
    to two more where fewer would make it look equal to a bound, or on its other side (0.7996 next
    to 0.8 is "79.96", not "80.0"). What the summary says of the value and a bound then holds of the
    numbers it shows too. Where even that is not enough (a float a hair below the threshold), it is
    shown as the nearest number on its side of the bound ("79.999")."""
    x = value * scale
    if not math.isfinite(x):
        return f"{x}"
    marks = [(float(bound_text(b, scale=scale)), _sign(value - b)) for b in bounds]
    for d in range(decimals, decimals + 3):
        shown = round(x, d)
        if all(_sign(shown - b) == s for b, s in marks):
            return f"{shown:.{d}f}"
    unit = 10.0 ** -d
    for b, s in marks:  # a hair from the bound: the nearest number shown on the right side of it
        if _sign(shown - b) != s:
            shown = round(b + s * unit, d)
    return f"{shown:.{d}f}"


def percent(value: float, *bounds: float) -> str:
    """A ratio as a percentage for a summary (``value_text``): 0.849 -> "84.9%"."""
    return value_text(value, *bounds) + "%"


def percent_bound(bound: float) -> str:
    """A ratio threshold as a percentage for a summary: 0.8 -> "80%"."""
    return bound_text(bound) + "%"


def band_edge(threshold: float, hysteresis: float) -> float:
    """``threshold + hysteresis`` without the float noise (0.8 + 0.05 is 0.8500000000000001): the
    value at which an active alert stops holding is the one its summary and the docs name."""
    return round(threshold + hysteresis, 9)


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def elapsed_text(seconds: float) -> str:
    """A time something has lasted, to the minute past one: 45s, 12m, 2h5m (rounded down)."""
    whole = max(0, int(seconds + 1e-6))
    if whole < 60:
        return f"{whole}s"
    hours, minutes = divmod(whole // 60, 60)
    if not hours:
        return f"{minutes}m"
    return f"{hours}h{minutes}m" if minutes else f"{hours}h"


def listing(items: Sequence[str], *, most: int = 3, more: str = "more") -> str:
    """"a", "a and b", "a, b and c", "a, b, c and 2 more": at most ``most`` shown."""
    shown = list(items[:most])
    if len(items) > most:
        shown.append(f"{len(items) - most} {more}")
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def pods_text(pods: Iterable[PodContainer]) -> str:
    """Pod containers as a summary names them: "pod research/nb-0 (container lab)", "pods a/x
    (containers c, d) and b/y (container e)"."""
    by_pod: dict[tuple[str, str], list[str]] = {}
    for pod in sorted(pods):
        by_pod.setdefault((pod.namespace, pod.pod), []).append(pod.container)
    named = [f"{namespace}/{name} (container{'s' if len(containers) > 1 else ''} {', '.join(containers)})"
             for (namespace, name), containers in by_pod.items()]
    return f"pod{'s' if len(named) > 1 else ''} {listing(named)}"


def instance_text(gpu: int, device: MigReading) -> str:
    """A MIG device as a summary names it, first: "GPU 2 MIG instance 3g.40gb (GPU instance 1, compute
    instance 0)"."""
    return (f"GPU {gpu} MIG instance {device.profile or '?'} (GPU instance {device.gpu_instance}, "
            f"compute instance {device.compute_instance})")


def instance_labels(device: MigReading) -> dict[str, str]:
    """The labels of an alert on a MIG device (MIG_LABELS): its GPU and compute instance, profile and
    UUID, as the gpu_mig_* series name it."""
    return {"gpu_instance": str(device.gpu_instance), "compute_instance": str(device.compute_instance),
            "mig_profile": device.profile, "mig_uuid": device.uuid}


def slurm_jobs_text(processes: Iterable[ProcessReading]) -> str:
    """The Slurm job steps of ``processes`` as a summary names them, in Slurm's own notation:
    "Slurm job 4242.0 (user alice)", "Slurm jobs 4242.0 (user alice) and 4243.batch"; "" outside Slurm."""
    steps: dict[str, str | None] = {}
    for process in processes:
        job = process.slurm_job
        if job is None or not process.host_visible:
            continue
        name = job.notation
        if steps.get(name) is None:
            steps[name] = process.user
    if not steps:
        return ""
    named = [f"{name} (user {user})" if user else name for name, user in steps.items()]
    return f"Slurm job{'s' if len(named) > 1 else ''} {listing(named, more='more jobs')}"


class RuleConfig(Section):
    """The keys of every rule; each rule's model adds its ``window`` (unless it reads only the latest
    tick), ``for``, ``clear_for`` and thresholds, with their defaults."""

    model_config = ConfigDict(populate_by_name=True)  # "for" is a Python keyword: also as for_

    enabled: bool = True
    severity: Severity = "warning"
    for_: ForDuration = for_field(0.0)
    clear_for: ForDuration = clear_for_field(0.0)


ConfigT = TypeVar("ConfigT", bound=RuleConfig)


class Rule(Generic[ConfigT]):
    """Base of every rule: its name (the alert's name), its configuration model, whether its firing
    takes a profiler capture unless ``capture.rules`` says otherwise, and its condition."""

    name: ClassVar[str]
    config_model: ClassVar[type[RuleConfig]]
    captures_by_default: ClassVar[bool]
    include_down: ClassVar[bool] = False  # evaluated on GPUs that are down this tick (Xid only)
    # Judges its window from the history's marks and occupancy (NodeHistory.span, .occupancy), not
    # from every tick: its window, however long, does not size the per-tick ring.
    span_window: ClassVar[bool] = False

    def __init__(self, config: ConfigT) -> None:
        self.config = config
        self.severity: Severity = config.severity
        self.for_seconds: float = config.for_
        self.clear_for_seconds: float = config.clear_for
        self.window_seconds: float | None = getattr(config, "window", None)  # None: the latest tick only

    @classmethod
    def configured(cls, **values: Any) -> Rule[Any]:
        """The rule with these settings (by key: ``window``, ``for_``, thresholds) over its defaults."""
        config: Any = cls.config_model.model_validate(values)
        return cls(config)

    # Also judges the MIG devices of GPUs in MIG mode (evaluate_instances).
    judges_instances: ClassVar[bool] = False

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        raise NotImplementedError

    def evaluate_instances(self, history: NodeHistory,
                           active: frozenset[InstanceKey]) -> dict[InstanceKey, Condition]:
        """The MIG devices where the condition holds (``judges_instances`` rules); ``active``: those
        where the rule is pending or firing. The GPUs themselves are ``evaluate``'s."""
        return {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rule) and type(other) is type(self) and other.config == self.config

    __hash__ = None  # type: ignore[assignment]  # equal by configuration, which holds lists

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def _windows(self, history: NodeHistory) -> Iterable[tuple[int, Window]]:
        """(gpu, window) for the GPUs up now whose window is covered by history."""
        assert self.window_seconds is not None
        for gpu in sorted(history.up):
            window = history.window(gpu, self.window_seconds)
            if window is not None:
                yield gpu, window

    def _busy_means(self, history: NodeHistory) -> Iterable[tuple[int, Window, float]]:
        """(gpu, window, mean utilization) for the GPUs that ran a job throughout the window."""
        for gpu, window in self._windows(history):
            fraction, mean = window.busy_utilization()
            if mean is not None and fraction >= BUSY_FRACTION:
                yield gpu, window, mean

    def _instances(self, history: NodeHistory) -> Iterable[tuple[int, InstanceOccupancy]]:
        """(gpu, MIG device) for the MIG devices of the GPUs up now, in GPU and device index order;
        none of a GPU whose MIG devices could not be listed this tick (as last listed, their busy
        counters stand still: not evidence of an idle device)."""
        unknown = history.mig_unknown
        for gpu in sorted(history.up):
            if unknown and gpu in unknown:
                continue
            devices = history.instances(gpu)
            if devices:
                yield from ((gpu, d) for d in sorted(devices.values(), key=lambda d: d.reading.index))

    @property
    def _over(self) -> str:
        return format_duration(self.window_seconds or 0.0)
