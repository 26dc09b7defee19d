"""The PromQL of `gpuscope report --by cause`: GPU-hours per cause of lost step time, from the series each
agent exports of the latest analysed capture of every GPU (gpuscope_diagnosis_*).

At each step a held GPU (at least one process) counts under every cause its diagnosis names, if that
diagnosis is fresh: its capture started at most ``horizon`` before the step. A GPU whose latest
diagnosis is older, or that has none, counts as "not diagnosed" for the step: an old finding is never
carried forward silently. A cause is a finding kind (gpuscope_diagnosis_finding_share's ``finding``),
or, for a diagnosis without a share for its own verdict (healthy, inconclusive, unreadable), the
verdict. One step may count under several findings (a step can wait on input and on a sync both),
so the rows of one GPU overlap.

Per GPU and cause, one expression per column (``CauseQueries.per_gpu``); the report sums them over
the range by a subquery, or, with ``recorded``, reads the recording rules that evaluate the same
expressions every minute with the horizon fixed at ``RECORDED_HORIZON_S``. By pod, namespace or user,
a GPU's several owners and several causes cannot be joined in one PromQL match (many to many), so
the report asks for the causes seen in the range first and writes one arm per cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuscope.report.promql import BUSY_RULE, GPU, MIN_BUSY_RANGE_S, OWNERS, RECORDED_STEP_S, held_rule

CAUSE = "cause"
NOT_DIAGNOSED = "not diagnosed"
DEFAULT_HORIZON_S = 86400
RECORDED_HORIZON_S = 86400  # the horizon of the recording rules (gpuscope-recording-rules.yml)
CAUSE_OWNERS = ("pod", "namespace", "user", "node")  # what a second --by may be
COLUMNS = ("held", "busy", "attributed", "gain")
# The recording rules (group gpuscope-diagnosis), per GPU and cause.
CAUSE_RULES = {
    "held": "gpuscope:gpu_cause_held:present1m",
    "busy": "gpuscope:gpu_cause_busy_seconds:rate1m",
    "attributed": "gpuscope:gpu_cause_attributed:share1m",
    "gain": "gpuscope:gpu_cause_gain:share1m",
    "age": "gpuscope:gpu_cause_diagnosis_age_seconds:1m",
}
TOGETHER_RULE = "gpuscope:gpu_diagnosis_gain_together:share1m"
_GPU = ", ".join(GPU)
_LABEL_VALUE = re.compile(r"[A-Za-z0-9_.:\- ]{1,128}")


def _minute(selector: str) -> str:
    """A recorded series at a step of a subquery: its sample of the minute ending at the step. Not an
    instant selector, which finds no sample at most steps on a server whose lookback is shorter than
    the rules' interval, nor where two rule groups evaluate at different phases of the minute."""
    return f"last_over_time({selector}[{RECORDED_STEP_S}s])"


def is_cause_name(value: str) -> bool:
    return _LABEL_VALUE.fullmatch(value) is not None


def quoted(value: str) -> str:
    """``value`` as a PromQL string; a label value outside the agent's vocabulary is refused rather than
    escaped, as it would name no cause the report knows how to print."""
    if not is_cause_name(value):
        raise ValueError(f"unexpected cause label value {value[:80]!r}")
    return f'"{value}"'


def _as_cause(selector: str, label: str) -> str:
    return f'max by ({_GPU}, {CAUSE}) (label_replace({selector}, "{CAUSE}", "$1", "{label}", "(.+)"))'


@dataclass(frozen=True)
class CausePerGpu:
    """Per (GPU, cause), at the evaluation time: the raw expressions (what the recording rules record).

    ``only``: one cause, for the arms of a report by owner (one series per GPU, so that it can be
    joined to the GPU's several owners); None: every cause.
    """

    horizon_s: int
    busy_range_s: int
    only: str | None = None
    matchers: str = ""  # label matchers every selector carries (a dashboard's job and instance)

    def _metric(self, metric: str, *matchers: str) -> str:
        given = [m for m in (*matchers, self.matchers) if m]
        return f"{metric}{{{', '.join(given)}}}" if given else metric

    def _selector(self, metric: str, label: str) -> str:
        return self._metric(metric, *([] if self.only is None else [f"{label}={quoted(self.only)}"]))

    @property
    def held(self) -> str:
        return f"group by ({_GPU}) ({self._metric('gpu_process_info')})"

    @property
    def fresh(self) -> str:
        """Per GPU, the start of its latest capture's diagnosis when within the horizon (else absent)."""
        return (f"(max by ({_GPU}) ({self._metric('gpuscope_diagnosis_timestamp_seconds')}) "
                f"> time() - {self.horizon_s})")

    @property
    def diagnosed(self) -> str:
        return f"({self.held} and on ({_GPU}) {self.fresh})"

    @property
    def shares(self) -> str:
        return _as_cause(self._selector("gpuscope_diagnosis_finding_share", "finding"), "finding")

    @property
    def gains(self) -> str:
        return _as_cause(self._selector("gpuscope_diagnosis_gain_share", "finding"), "finding")

    @property
    def verdicts(self) -> str:
        return _as_cause(self._selector("gpuscope_diagnosis_verdict", "verdict"), "verdict")

    def cause_held(self) -> str:
        """1 per (GPU, cause) while held under that cause."""
        arms = [f"(group by ({_GPU}, {CAUSE}) ({self.shares}) and on ({_GPU}) {self.diagnosed})",
                # A verdict counts as its own cause where the diagnosis gave no share under its name.
                f"(group by ({_GPU}, {CAUSE}) ({self.verdicts}) and on ({_GPU}) {self.diagnosed}"
                f" unless on ({_GPU}, {CAUSE}) {self.shares})"]
        if self.only in (None, NOT_DIAGNOSED):
            arms.append(f'label_replace({self.held} unless on ({_GPU}) {self.fresh}, "{CAUSE}", '
                        f'"{NOT_DIAGNOSED}", "", "")')
        return "(" + " or ".join(arms) + ")"

    def busy(self) -> str:
        """The GPU's busy seconds per second while held under the cause."""
        rate = f"sum by ({_GPU}) (rate({self._metric('gpu_busy_seconds_total')}[{self.busy_range_s}s]))"
        return f"({self.cause_held()} * on ({_GPU}) group_left () {rate})"

    def attributed(self) -> str:
        """The finding's share of the step time, while held and freshly diagnosed."""
        return f"({self.shares} and on ({_GPU}) {self.diagnosed})"

    def gain(self) -> str:
        """The share of the step time the finding's fix would win back, where it was estimated."""
        return f"({self.gains} and on ({_GPU}) {self.diagnosed})"

    def age(self) -> str:
        """Seconds since the start of the capture behind the diagnosis used."""
        return f"({self.cause_held()} * on ({_GPU}) group_left () (time() - {self.fresh}))"

    def together(self) -> str:
        """The share all estimated fixes together would win back, while held and freshly diagnosed."""
        together = self._metric("gpuscope_diagnosis_gain_together_share")
        return f"(max by ({_GPU}) ({together}) and on ({_GPU}) {self.diagnosed})"

    def column(self, name: str) -> str:
        return {"held": self.cause_held, "busy": self.busy, "attributed": self.attributed,
                "gain": self.gain, "age": self.age}[name]()


@dataclass(frozen=True)
class CauseQueries:
    """The queries of a report by cause (and ``owner``, or None) over ``range_s`` ending at evaluation."""

    owner: str | None
    range_s: int
    step_s: int
    horizon_s: int = DEFAULT_HORIZON_S
    recorded: bool = False

    def __post_init__(self) -> None:
        if self.owner is not None and self.owner not in CAUSE_OWNERS:
            raise ValueError(f"--by cause combines with one of {', '.join(CAUSE_OWNERS)}, not {self.owner}")
        if self.recorded and self.horizon_s != RECORDED_HORIZON_S:
            raise ValueError(f"--recorded reads rules whose horizon is {RECORDED_HORIZON_S // 3600}h; "
                             f"--horizon cannot change it")

    @property
    def owner_labels(self) -> tuple[str, ...]:
        return OWNERS[self.owner] if self.owner is not None else ()

    @property
    def by_owner(self) -> bool:
        """Whether a GPU may have several owners at once (so each cause needs an arm of its own)."""
        return self.owner in ("pod", "namespace", "user")

    @property
    def _step(self) -> int:
        return RECORDED_STEP_S if self.recorded else self.step_s

    @property
    def _busy_range(self) -> int:
        return max(self._step, MIN_BUSY_RANGE_S)

    def _per_gpu(self, only: str | None = None) -> CausePerGpu:
        return CausePerGpu(self.horizon_s, self._busy_range, only)

    def _sum_labels(self) -> str:
        return ", ".join((CAUSE, *self.owner_labels))

    def causes_seen(self) -> str:
        """Every cause a diagnosis named in the range (findings and verdicts), for the arms by owner."""
        if self.recorded:
            return f"group by ({CAUSE}) (last_over_time({CAUSE_RULES['held']}[{self.range_s}s]))"
        arms = [f'label_replace(last_over_time({metric}[{self.range_s}s]), "{CAUSE}", "$1", "{label}", '
                f'"(.+)")'
                for metric, label in (("gpuscope_diagnosis_finding_share", "finding"),
                                      ("gpuscope_diagnosis_verdict", "verdict"))]
        return f"group by ({CAUSE}) ({' or '.join(arms)})"

    def _owner_arm(self, column: str, cause: str) -> str:
        """One cause's per-step series by (GPU, owner)."""
        if self.recorded:
            rule = CAUSE_RULES["held" if column == "busy" else column]
            per_gpu = _minute(f"{rule}{{{CAUSE}={quoted(cause)}}}")
            owners = _minute(held_rule(self.owner or ""))
        else:
            per_gpu = self._per_gpu(cause).column("held" if column == "busy" else column)
            owners = f"group by ({_GPU}, {', '.join(self.owner_labels)}) (gpu_process_info)"
        if column == "busy":  # the owner's own processes' busy time
            busy = (_minute(BUSY_RULE) if self.recorded else
                    f"rate(gpu_process_busy_seconds_total[{self._busy_range}s])")
            owners = f"sum by ({_GPU}, {', '.join(self.owner_labels)}) ({busy})"
        return f"({owners} * on ({_GPU}) group_left ({CAUSE}) {per_gpu})"

    def _over_range(self, per_step: str, over: str) -> str:
        """``over``_over_time of a per-step expression (a subquery) or of a recorded series."""
        if self.recorded and per_step in (*CAUSE_RULES.values(), TOGETHER_RULE):
            return f"{over}_over_time({per_step}[{self.range_s}s])"
        return f"{over}_over_time(({per_step})[{self.range_s}s:{self._step}s])"

    def column(self, name: str, causes: list[str]) -> str | None:
        """Seconds (held, busy, attributed, gain) per cause and owner; None when no cause to ask for."""
        if self.by_owner:
            if not causes:
                return None
            per_step = " or ".join(self._owner_arm(name, cause) for cause in causes)
        else:
            per_step = CAUSE_RULES[name] if self.recorded else self._per_gpu().column(name)
        return f"sum by ({self._sum_labels()}) ({self._over_range(per_step, 'sum')}) * {self._step}"

    def ages(self, oldest: bool, causes: list[str]) -> str | None:
        """The oldest (or newest) age of the diagnoses used, per cause and owner, in seconds."""
        over, outer = ("max", "max") if oldest else ("min", "min")
        if self.by_owner:
            if not causes:
                return None
            per_step = " or ".join(self._owner_arm("age", cause) for cause in causes)
        else:
            per_step = CAUSE_RULES["age"] if self.recorded else self._per_gpu().age()
        return f"{outer} by ({self._sum_labels()}) ({self._over_range(per_step, over)})"

    def held_total(self) -> str:
        """GPU-hours held per owner (or fleet-wide), whatever the diagnosis: each held GPU once."""
        labels = ", ".join(self.owner_labels)
        if self.recorded and self.by_owner:  # the series the arms join the causes to
            per_step = held_rule(self.owner or "")
            return f"sum by ({labels}) (count_over_time({per_step}[{self.range_s}s])) * {RECORDED_STEP_S}"
        if self.recorded:  # the GPUs of the cause rules' own evaluations (each rule group has its phase)
            held = f"group by ({_GPU}) ({_minute(CAUSE_RULES['held'])})"
            return f"sum by ({labels}) ({self._over_range(held, 'count')}) * {RECORDED_STEP_S}"
        held = f"group by ({', '.join(dict.fromkeys((*GPU, *self.owner_labels)))}) (gpu_process_info)"
        return f"sum by ({labels}) ({self._over_range(held, 'count')}) * {self._step}"

    def together(self) -> str:
        """Seconds all estimated fixes together would win back, per owner (or fleet-wide)."""
        labels = ", ".join(self.owner_labels)
        per_gpu = TOGETHER_RULE if self.recorded else self._per_gpu().together()
        if self.by_owner:
            if self.recorded:
                owners, per_gpu = _minute(held_rule(self.owner or "")), _minute(per_gpu)
            else:
                owners = f"group by ({_GPU}, {labels}) (gpu_process_info)"
            per_step = f"({owners} * on ({_GPU}) group_left () {per_gpu})"
        else:
            per_step = per_gpu
        return f"sum by ({labels}) ({self._over_range(per_step, 'sum')}) * {self._step}"

    def any_diagnosis(self) -> str:
        """How many GPUs exported a diagnosis timestamp in the range (0 or absent: none did)."""
        return f"count(last_over_time(gpuscope_diagnosis_timestamp_seconds[{self.range_s}s]))"
