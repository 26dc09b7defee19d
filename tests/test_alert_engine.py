"""The alert engine's state machine on synthetic snapshots: for, clear_for, hysteresis, transitions."""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
from snapshots import gpu_uuid, make_gpu, make_process, make_snapshot

from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import AlertSource, Condition, Transition
from gpuscope.alerts.rules.base import Rule, RuleConfig
from gpuscope.alerts.rules.low_utilization import LowUtilizationRule
from gpuscope.snapshot import SlurmJob, Snapshot

WALL0 = 1_700_000_000.0


class BelowConfig(RuleConfig):
    threshold: float = 0.5
    hysteresis: float = 0.0


class Below(Rule[BelowConfig]):
    """Holds on GPUs whose latest utilization is below the threshold (+ hysteresis once active)."""

    name: ClassVar[str] = "TestBelow"
    config_model: ClassVar[type[BelowConfig]] = BelowConfig
    captures_by_default: ClassVar[bool] = False

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu in history.up:
            point = history.latest(gpu)
            assert point is not None and point.utilization is not None
            limit = self.config.threshold + (self.config.hysteresis if gpu in active else 0.0)
            if point.utilization < limit:
                u = point.utilization
                out[gpu] = Condition(gpu, {"utilization": u}, f"GPU {gpu} at {u}", {"kind": f"low-{u}"})
        return out


class Broken(Rule[RuleConfig]):
    name: ClassVar[str] = "TestBroken"
    config_model: ClassVar[type[RuleConfig]] = RuleConfig
    captures_by_default: ClassVar[bool] = False

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        raise RuntimeError("a bug in a rule")


def snap(t: float, *utils: float | None) -> Snapshot:
    """GPUs 0.. with these utilizations; None: the GPU is down; t: monotonic seconds."""
    gpus = [make_gpu(i, utilization_ratio=u, processes=(make_process(100 + i),)) if u is not None
            else make_gpu(i, up=False, utilization_ratio=None, processes=()) for i, u in enumerate(utils)]
    return make_snapshot(gpus=gpus, monotonic=t, timestamp=WALL0 + t)


def drive(engine: AlertEngine, timeline: Sequence[tuple[float | None, ...]], start: float = 0.0,
          ) -> list[Transition]:
    """One snapshot a second from ``start``; each entry holds the GPUs' utilizations."""
    out = []
    for i, utils in enumerate(timeline):
        out += engine.observe(snap(start + i, *utils))
    return out


def brief(transitions: list[Transition]) -> list[tuple[float, int, str | None, str]]:
    return [(t.at - WALL0, t.gpu, t.previous, t.state) for t in transitions]


def test_pending_then_firing_after_for_then_resolved_after_clear_for() -> None:
    engine = AlertEngine([Below.configured(for_=5.0, clear_for=3.0)], hostname="node-a")
    timeline = [(0.9, 0.9)] * 10 + [(0.9, 0.2)] * 10 + [(0.9, 0.9)] * 5
    transitions = drive(engine, timeline)
    assert brief(transitions) == [
        (10, 1, None, "pending"),  # the condition holds from 10 s
        (15, 1, "pending", "firing"),  # ... for 5 s
        (23, 1, "firing", "resolved"),  # false from 20 s, for 3 s
    ]
    first = transitions[0]
    assert first.name == "TestBelow" and first.uuid == gpu_uuid(1) and first.hostname == "node-a"
    assert first.severity == "warning" and first.values == {"utilization": 0.2}
    assert all(t.active_since == WALL0 + 10 for t in transitions)
    assert engine.alerts() == []
    assert engine.transition_counts() == {("TestBelow", "pending"): 1, ("TestBelow", "firing"): 1,
                                          ("TestBelow", "resolved"): 1}


def test_with_an_evaluation_interval_the_rules_are_judged_that_often() -> None:
    """Every tick feeds the history; the rules run every 5 s (from the first tick): a condition is seen
    at the first evaluation after it holds, and its for / clear_for are over at the first evaluation
    after they have run from there."""
    engine = AlertEngine([Below.configured(for_=5.0, clear_for=3.0)], hostname="node-a",
                         evaluation_interval_seconds=5.0)
    timeline = [(0.9, 0.9)] * 11 + [(0.9, 0.2)] * 10 + [(0.9, 0.9)] * 10
    assert brief(drive(engine, timeline)) == [
        (15, 1, None, "pending"),  # true from 11 s: seen at 15 s (every tick: pending at 11)
        (20, 1, "pending", "firing"),  # still true 5 s later (every tick: firing at 16)
        (30, 1, "firing", "resolved"),  # false from 21 s, seen at 25, for 3 s by 30 (every tick: 24)
    ]
    assert engine.history.latest(1) is not None and engine.history.latest(1).t == 30.0  # fed every tick


def test_an_xid_or_a_gpu_going_down_is_judged_at_its_tick_whatever_the_interval() -> None:
    from gpuscope.alerts.rules.xid_error import XidErrorRule

    engine = AlertEngine([XidErrorRule.configured(), Below.configured()], hostname="node-a",
                         evaluation_interval_seconds=5.0)
    drive(engine, [(0.9, 0.9)] * 3)  # evaluated at 0 s only
    xid = make_snapshot(gpus=[make_gpu(0, xid_errors={79: 1}), make_gpu(1, utilization_ratio=0.9)],
                        monotonic=3.0, timestamp=WALL0 + 3.0)
    assert brief(engine.observe(xid)) == [(3, 0, None, "firing")]
    assert engine.observe(snap(4.0, None, 0.2)) != []  # GPU 0 down: judged, so GPU 1's low utilization too
    assert [(a.name, a.gpu) for a in engine.alerts()] == [("GpuXidError", 0), ("TestBelow", 1)]
    assert engine.observe(snap(5.0, None, 0.2)) == []  # nothing changed, 1 s after: not judged


def test_alerts_reports_pending_and_firing_with_their_times() -> None:
    engine = AlertEngine([Below.configured(for_=5.0, clear_for=3.0)], hostname="node-a")
    source: AlertSource = engine  # what the outputs consume
    assert source.alerts() == [] and source.transition_counts() == {}
    drive(engine, [(0.2, 0.9)] * 3)
    (alert,) = engine.alerts()
    assert (alert.name, alert.gpu, alert.state, alert.active_since, alert.firing_since) == (
        "TestBelow", 0, "pending", WALL0, None)
    drive(engine, [(0.3, 0.9)] * 5, start=3)
    (alert,) = engine.alerts()
    assert (alert.state, alert.active_since, alert.firing_since) == ("firing", WALL0, WALL0 + 5)
    assert alert.values == {"utilization": 0.3}  # the latest evidence
    assert alert.hostname == "node-a" and alert.uuid == gpu_uuid(0)
    assert alert.to_json()["alertname"] == "TestBelow"
    # Firing, condition false for less than clear_for: still listed as firing, last evidence kept.
    drive(engine, [(0.9, 0.9)] * 2, start=8)
    (alert,) = engine.alerts()
    assert alert.state == "firing" and alert.values == {"utilization": 0.3}


def test_a_pending_alert_whose_condition_goes_false_returns_to_inactive() -> None:
    engine = AlertEngine([Below.configured(for_=5.0)], hostname="n")
    transitions = drive(engine, [(0.2,)] * 3 + [(0.9,)] * 3 + [(0.2,)] * 2)
    assert brief(transitions) == [(0, 0, None, "pending"), (3, 0, "pending", "inactive"),
                                  (6, 0, None, "pending")]  # a new episode starts from scratch
    (alert,) = engine.alerts()
    assert alert.active_since == WALL0 + 6


def test_a_true_condition_resets_the_clear_timer() -> None:
    engine = AlertEngine([Below.configured(for_=0.0, clear_for=3.0)], hostname="n")
    timeline = [(0.2,)] + [(0.9,)] * 2 + [(0.2,)] + [(0.9,)] * 2 + [(0.2,)] + [(0.9,)] * 4
    # False from 1 s (true again at 3 s), from 4 s (true again at 6 s), from 7 s: resolved at 10 s.
    assert brief(drive(engine, timeline)) == [(0, 0, None, "firing"), (10, 0, "firing", "resolved")]


def test_for_zero_fires_at_once_and_clear_for_zero_resolves_at_once() -> None:
    engine = AlertEngine([Below.configured()], hostname="n")
    assert brief(drive(engine, [(0.2,), (0.9,)])) == [(0, 0, None, "firing"), (1, 0, "firing", "resolved")]


def test_hysteresis_keeps_a_hovering_value_from_flapping() -> None:
    hovering = [(0.49,), (0.51,), (0.5,), (0.52,), (0.48,), (0.53,)] * 10  # around the 0.5 threshold
    flappy = AlertEngine([Below.configured(threshold=0.5, for_=2.0, clear_for=0.0)], hostname="n")
    assert len(drive(flappy, hovering)) > 20  # without hysteresis: pending/inactive every other tick
    steady = AlertEngine([Below.configured(threshold=0.5, hysteresis=0.05, for_=2.0, clear_for=0.0)],
                         hostname="n")
    transitions = drive(steady, hovering)
    assert brief(transitions) == [(0, 0, None, "pending"), (2, 0, "pending", "firing")]
    transitions = drive(steady, [(0.56,)], start=len(hovering))  # above threshold + hysteresis
    assert brief(transitions) == [(60, 0, "firing", "resolved")]


def test_low_utilization_hovering_at_its_threshold_fires_once() -> None:
    # Utilization wandering around 0.80: the 10 s mean crosses the threshold again and again but
    # never reaches 0.85.
    timeline = [(0.80 + 0.04 * math.sin(i * 0.7) + 0.025 * math.sin(i * 0.13),) for i in range(300)]
    means = [statistics.fmean(u for (u,) in timeline[i - 9:i + 1]) for i in range(9, 300)]
    assert min(means) < 0.78 and 0.82 < max(means) < 0.85

    def run(hysteresis: float) -> list[str]:
        rule = LowUtilizationRule.configured(window=10.0, for_=5.0, clear_for=0.0, hysteresis=hysteresis)
        return [t.state for t in drive(AlertEngine([rule], hostname="n"), timeline)]

    assert len(run(0.0)) > 10  # without hysteresis it flaps
    assert run(0.05) == ["pending", "firing"]


def test_transition_counts_accumulate_per_rule_and_state() -> None:
    engine = AlertEngine([Below.configured(for_=1.0)], hostname="n")
    drive(engine, [(0.2, 0.2), (0.9, 0.2), (0.2, 0.2), (0.2, 0.9)])
    # GPU 0: pending, inactive, pending, firing. GPU 1: pending, firing, resolved.
    assert engine.transition_counts() == {("TestBelow", "pending"): 3, ("TestBelow", "inactive"): 1,
                                          ("TestBelow", "firing"): 2, ("TestBelow", "resolved"): 1}


def test_listeners_get_every_transition_and_a_raising_one_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    engine = AlertEngine([Below.configured(for_=1.0)], hostname="n")
    seen: list[str] = []

    def bad(t: Transition) -> None:
        raise ValueError("listener bug")

    engine.add_listener(bad)
    engine.add_listener(lambda t: seen.append(f"{t.previous}->{t.state}"))
    with caplog.at_level(logging.ERROR, logger="gpuscope.alerts.engine"):
        transitions = drive(engine, [(0.2,), (0.2,)])
    assert seen == ["None->pending", "pending->firing"] and len(transitions) == 2
    assert sum("listener" in r.getMessage() for r in caplog.records) == 2
    assert engine.alerts()[0].state == "firing"  # the state advanced regardless


def test_a_raising_rule_is_logged_once_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    engine = AlertEngine([Broken.configured(), Below.configured()], hostname="n")
    with caplog.at_level(logging.ERROR, logger="gpuscope.alerts.engine"):
        transitions = drive(engine, [(0.2,)] * 5)
    assert brief(transitions) == [(0, 0, None, "firing")]
    assert sum("TestBroken failed" in r.getMessage() for r in caplog.records) == 1


def test_a_gpu_that_is_down_or_missing_keeps_its_alert_state() -> None:
    engine = AlertEngine([Below.configured(for_=2.0, clear_for=2.0)], hostname="n")
    assert [t.state for t in drive(engine, [(0.2, 0.9)] * 3)] == ["pending", "firing"]
    assert drive(engine, [(None, 0.9)] * 5, start=3) == []  # down: not judged, still firing
    assert [(a.gpu, a.state) for a in engine.alerts()] == [(0, "firing")]
    engine.observe(make_snapshot(gpus=[], nvml_up=False, monotonic=8, timestamp=WALL0 + 8))  # NVML gone
    assert [(a.gpu, a.state) for a in engine.alerts()] == [(0, "firing")]
    assert brief(drive(engine, [(0.9, 0.9)] * 3, start=9)) == [(11, 0, "firing", "resolved")]


def test_labels_stay_those_of_the_first_condition() -> None:
    engine = AlertEngine([Below.configured(for_=1.0)], hostname="n")
    transitions = drive(engine, [(0.2,), (0.3,)])
    assert [t.labels for t in transitions] == [{"kind": "low-0.2"}, {"kind": "low-0.2"}]
    (alert,) = engine.alerts()
    assert alert.labels == {"kind": "low-0.2"} and alert.values == {"utilization": 0.3}


def test_alerts_and_counts_are_copies_safe_to_read_from_another_thread() -> None:
    engine = AlertEngine([Below.configured(for_=1.0, clear_for=1.0)], hostname="n")
    stop = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            try:
                alerts, counts = engine.alerts(), engine.transition_counts()
                assert all(a.state in ("pending", "firing") for a in alerts) and all(counts.values())
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        drive(engine, [(0.2 if (i // 3) % 2 else 0.9,) * 8 for i in range(600)])
    finally:
        stop.set()
        reader.join()
    assert not errors
    listed: list[Any] = engine.alerts()
    listed.append(None)  # the caller's copy, not the engine's list
    assert len(engine.alerts()) == len(listed) - 1


def test_duplicate_rule_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        AlertEngine([Below.configured(), Below.configured()], hostname="n")


# ------------------------------------------------------------------------ transitions in the log


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "gpuscope.alerts.engine" and r.levelno == logging.INFO]


def test_every_transition_is_one_info_line_with_rule_gpu_and_summary(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = AlertEngine([Below.configured(for_=5.0, clear_for=3.0)], hostname="n")
    timeline = [(0.9, 0.9)] * 10 + [(0.9, 0.2)] * 10 + [(0.9, 0.9)] * 5
    with caplog.at_level(logging.INFO, logger="gpuscope.alerts.engine"):
        transitions = drive(engine, timeline)
    assert [t.state for t in transitions] == ["pending", "firing", "resolved"]
    # One line per transition, none on the 22 ticks in between.
    assert info_lines(caplog) == [
        "alert TestBelow pending: GPU 1 at 0.2 (fires if this holds for 5s)",
        "alert TestBelow firing: GPU 1 at 0.2",
        "alert TestBelow resolved on GPU 1: its condition has been false for 3s "
        "(last evidence: GPU 1 at 0.2)",
    ]


def test_a_pending_alert_that_goes_inactive_and_for_zero_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    pending = AlertEngine([Below.configured(for_=5.0)], hostname="n")
    at_once = AlertEngine([Below.configured()], hostname="n")
    with caplog.at_level(logging.INFO, logger="gpuscope.alerts.engine"):
        drive(pending, [(0.3,)] * 2 + [(0.9,)] * 3)
        drive(at_once, [(0.9, 0.1), (0.9, 0.9)])
    assert info_lines(caplog) == [
        "alert TestBelow pending: GPU 0 at 0.3 (fires if this holds for 5s)",
        "alert TestBelow inactive on GPU 0: its condition stopped holding within the 5s it must hold to "
        "fire (last evidence: GPU 0 at 0.3)",
        "alert TestBelow firing: GPU 1 at 0.1",  # for: 0, one transition
        "alert TestBelow resolved on GPU 1: its condition no longer holds (last evidence: GPU 1 at 0.1)",
    ]


class Terse(Below):
    """Like Below, with a summary that does not name its GPU."""

    name: ClassVar[str] = "TestTerse"

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        return {gpu: Condition(gpu, c.values, "utilization is low")
                for gpu, c in super().evaluate(history, active).items()}


def test_a_summary_that_does_not_name_its_gpu_gets_it_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gpuscope.alerts.engine"):
        drive(AlertEngine([Terse.configured()], hostname="n"), [(0.9, 0.9, 0.1)])
    assert info_lines(caplog) == ["alert TestTerse firing: GPU 2: utilization is low"]


def test_a_clearing_alert_says_so_and_quotes_its_last_evidence() -> None:
    engine = AlertEngine([Below.configured(clear_for=3.0)], hostname="n")
    drive(engine, [(0.3,)])
    assert engine.alerts()[0].summary == "GPU 0 at 0.3" and not engine.alerts()[0].clearing
    drive(engine, [(0.9,)] * 3, start=1)  # false at 1, 2 and 3 s: resolves at 4 s
    (alert,) = engine.alerts()
    assert alert.state == "firing" and alert.values == {"utilization": 0.3}
    assert alert.clearing and alert.to_json()["clearing"] is True
    assert alert.summary == ("clearing: its condition no longer holds (2s of the 3s that resolve the alert); "
                             "last evidence: GPU 0 at 0.3")
    drive(engine, [(0.4,)], start=4)  # true again: the current evidence, no longer clearing
    assert engine.alerts()[0].summary == "GPU 0 at 0.4" and not engine.alerts()[0].clearing


def test_long_span_windows_keep_marks_not_every_tick() -> None:
    """GpuHeldIdle and GpuAllocatedUnused judge 10-minute windows from marks: the per-tick ring stays
    sized by the other rules' windows (2 minutes), so their history costs 60 marks per GPU, not 600
    points."""
    from gpuscope.alerts.rules import RulesConfig, build_rules

    engine = AlertEngine(build_rules(RulesConfig()), hostname="n")
    history = engine.history
    assert history.longest_window_seconds == 120.0 and history.span_windows == (600.0, 600.0)
    assert (history.maxlen(1.0), history.mark_step(1.0), history.marks(1.0)) == (137, 10.0, 65)
    assert history.marks(0.1) == 65 and history.maxlen(0.1) == 1325  # marks do not grow at a short interval
    for t in range(700):
        engine.observe(make_snapshot(gpus=[make_gpu(0)], monotonic=float(t), timestamp=WALL0 + t))
    assert len(history._gpus[0].marks) == 65 and len(history._gpus[0].points) == 137


def test_an_alert_on_a_gpu_running_slurm_jobs_names_them_in_its_summary() -> None:
    engine = AlertEngine([Below.configured()], hostname="node-a")
    job = SlurmJob("4242", "0", uid=1000)
    processes = (make_process(101, slurm_job=job, user="alice"),
                 make_process(102, slurm_job=job, user="alice"),
                 make_process(103, slurm_job=SlurmJob("4243", "batch"), user=None),
                 make_process(104, slurm_job=SlurmJob("9", "7"), host_visible=False))
    gpus = [make_gpu(0, utilization_ratio=0.2, processes=processes),
            make_gpu(1, utilization_ratio=0.2, processes=(make_process(201),))]
    (first, second) = engine.observe(make_snapshot(gpus=gpus, monotonic=0.0, timestamp=WALL0))
    assert first.summary == "GPU 0 at 0.2; Slurm jobs 4242.0 (user alice) and 4243.batch on it"
    assert second.summary == "GPU 1 at 0.2"  # outside Slurm: as the rule wrote it
    assert [a.summary for a in engine.alerts()] == [first.summary, second.summary]
