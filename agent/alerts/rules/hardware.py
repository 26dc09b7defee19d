"""What the hardware-health rules share: the GPU's latest reading, and counter increases over a window.

The health readings (row remapping, ECC, PCIe and NVLink errors) are read every
``nvml.health_interval`` and held between reads; the history keeps none of them per tick, so these
rules read the latest reading (``Occupancy.reading``) and, for the error counters, keep a small record
of their own (``CounterIncreases``): the counter's value at each evaluation where it changed. An
increase over a window is then what PromQL's ``increase()`` gives over the same range, counted from
the first value the agent saw: errors from before the agent started do not fire, and a counter that
goes down (the driver reloaded) starts again from its new value, as a Prometheus counter reset does.

NVML reports hardware health per physical GPU: a GPU in MIG mode has none per MIG device, so these
alerts are on the GPU, whose MIG devices all share its memory and links (their summaries say so).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import ClassVar, TypeVar

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    clear_for_field,
    for_field,
    window_field,
)
from gpuscope.common.durations import format_duration
from gpuscope.snapshot import GpuReading

# Changes kept per counter: ample for a counter rising at every evaluation of a 1h window at 1 s.
_MAX_CHANGES = 4096


def latest_reading(history: NodeHistory, gpu: int) -> GpuReading | None:
    """The GPU's reading at the latest tick; None for a GPU never seen."""
    occupancy = history.occupancy(gpu)
    return occupancy.reading if occupancy is not None else None


def mig_note(reading: GpuReading) -> str:
    """The end of a hardware alert's summary on a GPU in MIG mode: its MIG devices share the fault."""
    devices = reading.mig_devices
    if not devices:
        return ""
    return f" (its {len(devices)} MIG device{'s' if len(devices) > 1 else ''} share it)"


def counted_text(n: int, what: str) -> str:
    """A count and what it counts: "1 replay error", "3 fatal errors"."""
    return f"{n} {what}{'' if n == 1 else 's'}"


class _Counter:
    __slots__ = ("changes", "raw", "total")

    def __init__(self, t: float, value: int) -> None:
        self.raw = value  # the counter as last read
        self.total = 0  # increases since first seen (resets counted from their new value)
        self.changes: deque[tuple[float, int]] = deque([(t, 0)], maxlen=_MAX_CHANGES)


class CounterIncreases:
    """Per GPU (by UUID) and counter name: how much the counter rose over the last ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._counters: dict[tuple[str, str], _Counter] = {}

    def increase(self, uuid: str, name: str, value: int | None, now: float) -> int | None:
        """The counter's increase over the window ending ``now``, after recording ``value`` (None: not
        read; the record stands as it was). None for a counter never read."""
        key = (uuid, name)
        counter = self._counters.get(key)
        if counter is None:
            if value is None:
                return None
            counter = self._counters[key] = _Counter(now, value)
        elif value is not None and value != counter.raw:
            counter.total += value - counter.raw if value > counter.raw else value
            counter.raw = value
            counter.changes.append((now, counter.total))
        changes = counter.changes
        cutoff = now - self.seconds + 1e-9
        while len(changes) > 1 and changes[1][0] <= cutoff:  # keep one change at or before the window
            changes.popleft()
        return counter.total - changes[0][1]

    def increases(self, uuid: str, prefix: str, values: Mapping[str, int] | None,
                  names: Iterable[str], now: float) -> dict[str, int]:
        """``increase`` for each of ``names`` in a counter by type (``values``), as {name: increase}."""
        out = {}
        for name in names:
            found = self.increase(uuid, f"{prefix}{name}", None if values is None else values.get(name), now)
            if found is not None:
                out[name] = found
        return out

    def keep(self, uuids: Iterable[str]) -> None:
        """Forget the counters of GPUs no longer on the node."""
        present = set(uuids)
        for key in [k for k in self._counters if k[0] not in present]:
            del self._counters[key]


class CounterRuleConfig(RuleConfig):
    """An error-counter rule's settings: an error keeps the alert up for the window it stays in, as
    PromQL's ``increase()`` over the same range does; it fires at once and clears at once."""

    window: WindowDuration = window_field(600.0)
    for_: ForDuration = for_field(0.0)
    clear_for: ForDuration = clear_for_field(0.0)


CounterConfigT = TypeVar("CounterConfigT", bound=CounterRuleConfig)


class CounterRule(Rule[CounterConfigT]):
    """A rule judged on how much a GPU's error counters rose over its window, from its own record of
    the counters' changes (``CounterIncreases``): the history keeps neither points nor marks for it.
    A subclass says, in ``judge``, what in the increases fires."""

    captures_by_default: ClassVar[bool] = False  # hardware: a profiler trace cannot show it

    def __init__(self, config: CounterConfigT) -> None:
        super().__init__(config)
        self.window_seconds = None
        self.counted_seconds = config.window
        self.over_text = format_duration(config.window)
        self.counters = CounterIncreases(self.counted_seconds)

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        self.counters.keep(history.uuid(gpu) for gpu in history.present)
        for gpu in sorted(history.up):
            reading = latest_reading(history, gpu)
            if reading is None:
                continue
            condition = self.judge(gpu, reading, history.now)
            if condition is not None:
                out[gpu] = condition
        return out

    def judge(self, gpu: int, reading: GpuReading, now: float) -> Condition | None:
        raise NotImplementedError
