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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Generic, TypeVar

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field

from gpuscope.alerts.history import NodeHistory, Window
from gpuscope.alerts.model import Condition, Severity
from gpuscope.common.config_types import Section
from gpuscope.common.durations import format_duration, parse_duration

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

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        raise NotImplementedError

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

    @property
    def _over(self) -> str:
        return format_duration(self.window_seconds or 0.0)
