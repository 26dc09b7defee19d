"""The capture policy, with a manual clock: rules, durations, one at a time, cooldown, hourly budget."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.model import Trigger
from gpuscope.capture.policy import CapturePolicy, Decision

ALERT = Trigger("alert", alertname="GpuLowUtilization")
WEBHOOK = Trigger("webhook", alertname="GpuLowUtilization")
USER = Trigger("user", user="alice")
FLEET = Trigger("fleet")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(wall: float = 0.0, **config: Any) -> tuple[CapturePolicy, Clock]:
    """A policy on a manual clock; ``wall``: the wall clock when the manual clock reads its start."""
    clock = Clock()
    start = clock.now
    return CapturePolicy(CaptureConfig.model_validate(config), clock=clock,
                         wall_clock=lambda: wall + clock.now - start), clock


def run(policy: CapturePolicy, trigger: Trigger, gpu: int | None = 0, **kw: Any) -> Decision:
    """Admit and immediately release (a capture that finished)."""
    decision = policy.admit(trigger, gpu, **kw)
    policy.release(decision)
    return decision


def test_an_alert_is_admitted_with_the_configured_duration() -> None:
    policy, _ = make(duration="3s")
    decision = policy.admit(ALERT, 0)
    assert decision.allowed and decision.code is None and decision.reason == ""
    assert decision.duration_s == 3.0 and decision.ticket > 0
    # An alert trigger cannot choose its length.
    policy.release(decision)
    assert policy.admit(Trigger("alert", alertname="GpuBusyButStalled"), 1, duration_s=25).duration_s == 3.0


def test_disabled_refuses_everything() -> None:
    policy, _ = make(enabled=False)
    for trigger in (ALERT, USER, WEBHOOK, FLEET):
        decision = policy.admit(trigger, 0)
        assert (decision.allowed, decision.code) == (False, "disabled")
        assert "capture.enabled: false" in decision.reason


def test_rules_decide_for_alert_and_webhook_triggers_only() -> None:
    policy, _ = make(rules={"GpuLowUtilization": False, "GpuThrottled": True})
    refused = policy.check(ALERT, 0)
    assert (refused.allowed, refused.code) == (False, "rule")
    assert refused.reason == ("alert GpuLowUtilization does not trigger captures "
                              "(capture.rules.GpuLowUtilization: false, or not an agent rule)")
    assert policy.check(WEBHOOK, 0).code == "rule"
    assert policy.check(Trigger("alert", alertname="GpuThrottled"), 0).allowed
    assert not policy.check(Trigger("alert", alertname="GpuXidError"), 0).allowed, "off by default"
    assert policy.check(Trigger("webhook", alertname="SomeoneElsesAlert"), 0).code == "rule"
    assert policy.check(Trigger("alert"), 0).reason == "the alert trigger names no alert"
    assert policy.check(USER, 0).allowed and policy.check(FLEET, 0).allowed


@pytest.mark.parametrize(("requested", "allowed", "expected"), [
    (None, True, 2.0),
    (0.5, True, 0.5),
    (30.0, True, 30.0),
    (30.5, False, "the requested duration 30.5s is longer than the maximum 30s (capture.max_duration)"),
    (3600.0, False, "the requested duration 60m is longer than the maximum 30s (capture.max_duration)"),
    (0.0, False, "a capture duration must be a positive number of seconds, got 0.0"),
    (-1.0, False, "a capture duration must be a positive number of seconds, got -1.0"),
    (float("nan"), False, "a capture duration must be a positive number of seconds, got nan"),
    (float("inf"), False, "a capture duration must be a positive number of seconds, got inf"),
])
def test_user_durations(requested: float | None, allowed: bool, expected: float | str) -> None:
    policy, _ = make()
    decision = policy.admit(USER, 0, duration_s=requested)
    assert decision.allowed is allowed
    if allowed:
        assert decision.duration_s == expected
    else:
        assert (decision.code, decision.reason, decision.ticket) == ("duration", expected, 0)
        assert not policy.busy(), "a refused request takes no slot"
        assert policy.budget_left() == 6, "... and no budget"


def test_a_lower_max_duration_is_enforced() -> None:
    policy, _ = make(max_duration="10s")
    assert policy.check(USER, 0, duration_s=10).allowed
    reason = policy.check(USER, 0, duration_s=11).reason
    assert reason.endswith("longer than the maximum 10s (capture.max_duration)")


def test_one_capture_at_a_time_per_node() -> None:
    policy, clock = make()
    first = policy.admit(ALERT, 0)
    assert first.allowed and policy.busy()
    clock.now += 1.5
    for trigger, gpu in ((ALERT, 1), (USER, 0), (USER, None), (FLEET, 3)):
        second = policy.admit(trigger, gpu)
        assert (second.allowed, second.code) == (False, "busy")
        assert second.reason == "busy node: the alert capture on GPU 0 is in flight (for 1.5s); one at a time"
    policy.release(second)  # releasing a refused decision does nothing
    assert policy.busy()
    policy.release(first)
    assert not policy.busy()
    policy.release(first)  # twice: no effect
    assert policy.admit(ALERT, 1).allowed


def test_a_stale_ticket_does_not_release_a_newer_capture() -> None:
    policy, _ = make()
    first = policy.admit(USER, 0)
    policy.release(first)
    second = policy.admit(USER, 1)
    policy.release(first)
    assert policy.busy()
    policy.release(second)
    assert not policy.busy()


def test_cooldown_per_gpu_for_alert_and_webhook_triggers() -> None:
    policy, clock = make(cooldown="15m", wall=WALL)
    assert run(policy, ALERT, 0).allowed
    clock.now += 60
    refused = policy.admit(ALERT, 0)
    assert (refused.allowed, refused.code) == (False, "cooldown")
    assert refused.reason == ("GPU 0 is cooling down: last alert capture 1m ago, cooldown 15m "
                              "(capture.cooldown); the next is allowed at 13:18:20 UTC (in 14m)")
    # As kept for later readers: no wait, which would be stale by then; the same time.
    assert refused.lasting_reason == ("GPU 0 is cooling down after an alert capture, cooldown 15m "
                                      "(capture.cooldown); the next is allowed at 13:18:20 UTC")
    assert (refused.allowed_in_s, refused.allowed_at) == (840.0, WALL + 900.0)
    assert policy.admit(WEBHOOK, 0).code == "cooldown"
    assert policy.cooldown_left(0) == 840.0 and policy.cooldown_left(1) == 0.0
    assert run(policy, ALERT, 1).allowed, "another GPU is not cooling down"
    clock.now += 839.5
    assert policy.check(ALERT, 0).reason.endswith("(in 1s)")
    clock.now += 0.5
    assert run(policy, ALERT, 0).allowed


def test_user_and_fleet_triggers_bypass_the_cooldown_and_leave_it_alone() -> None:
    policy, clock = make(cooldown="15m")
    assert run(policy, ALERT, 0).allowed
    clock.now += 10
    assert run(policy, USER, 0).allowed
    assert run(policy, FLEET, 0).allowed
    assert policy.cooldown_left(0) == 890.0, "the alert capture's cooldown, not restarted"
    clock.now = 1000.0 + 900.0
    assert policy.check(ALERT, 0).allowed


def test_a_user_capture_does_not_start_the_alert_cooldown() -> None:
    policy, _ = make(cooldown="15m")
    user = run(policy, USER, 0)
    assert user.allowed and policy.cooldown_left(0) == 0.0
    assert run(policy, ALERT, 0).allowed, "the alert right after a manual capture gets its own"
    assert run(policy, WEBHOOK, 1).allowed
    assert run(policy, FLEET, 1).allowed and policy.check(ALERT, 1).code == "cooldown"


def test_a_user_capture_is_told_what_it_cost_them() -> None:
    policy, clock = make(user_hourly_budget=2, wall=WALL)
    first = run(policy, USER, 0)
    assert first.notice == ("this capture uses 1 of the 2 on-demand captures per hour for requester 'alice' "
                            "(capture.user_hourly_budget): 1 left; alert captures have their own budget "
                            "(capture.hourly_budget) and cooldown, and are refused while it runs")
    clock.now += 600
    last = run(policy, USER, 0)
    assert "0 left; the next is allowed at 14:03:20 UTC (in 50m)" in last.notice
    assert policy.admit(ALERT, 1).notice == "", "an alert's capture is not told"


WALL = 1_764_335_000.0  # 2025-11-28 13:03:20 UTC, the wall clock at the manual clock's start


def test_a_persons_captures_and_the_alert_captures_have_budgets_of_their_own() -> None:
    """The README's tour: a capture of each of the demo's four GPUs, and two alerts that fire meanwhile.
    Neither kind of capture takes from the other's budget, and each person has their own."""
    policy, clock = make(hourly_budget=2, user_hourly_budget=4, cooldown=0, wall=WALL)
    for gpu in range(4):
        assert run(policy, USER, gpu).allowed
        clock.now += 30
    assert run(policy, ALERT, 1).allowed and run(policy, WEBHOOK, 3).allowed
    assert policy.budget_left() == 0 and policy.user_budget_left("alice") == 0
    assert run(policy, Trigger("user", user="bob"), 0).allowed, "bob's budget is his own"
    assert policy.user_budget_left("bob") == 3 and policy.user_budget_left(None) == 4
    refused = policy.admit(USER, 0)
    assert (refused.code, refused.allowed_in_s) == ("budget", 3600.0 - 120.0)
    assert refused.reason == ("hourly budget used: 4 on-demand captures by requester 'alice' in the last "
                              "hour (capture.user_hourly_budget: 4, raise it to allow more); the next is "
                              "allowed at 14:03:20 UTC (in 58m)")
    alert = policy.admit(ALERT, 0)
    assert (alert.code, alert.allowed_in_s) == ("budget", 3600.0)
    assert alert.reason == ("hourly budget used: 2 alert and webhook captures in the last hour "
                            "(capture.hourly_budget: 2, raise it to allow more); the next is allowed at "
                            "14:05:20 UTC (in 60m)")


def test_a_restored_ledger_from_the_store_starts_cooldowns_for_alert_captures_only() -> None:
    from gpuscope.capture.factory import restored_admissions

    class Ledgerless:
        def exists(self) -> bool:
            return False

    class Stored:
        def __init__(self, kind: str, gpu: int, start: float) -> None:
            self.trigger, self.gpu, self.start = Trigger(kind, alertname="A"), gpu, start  # type: ignore[arg-type]

    class Store:
        def list(self) -> list[Stored]:
            return [Stored("user", 0, 50.0), Stored("alert", 1, 40.0), Stored("webhook", 2, 30.0)]

    admissions = restored_admissions(Ledgerless(), Store())  # type: ignore[arg-type]
    assert admissions.started == [30.0, 40.0], "a person's capture is charged to their own budget"
    assert admissions.last_on_gpu == {1: 40.0, 2: 30.0}


def test_zero_cooldown() -> None:
    policy, _ = make(cooldown=0)
    assert run(policy, ALERT, 0).allowed
    assert run(policy, ALERT, 0).allowed


def test_hourly_budget_is_a_rolling_window_over_alert_and_webhook_triggers() -> None:
    policy, clock = make(hourly_budget=3, cooldown=0)
    starts = []
    for trigger in (ALERT, WEBHOOK, ALERT):
        starts.append(clock.now)
        assert run(policy, trigger, 0).allowed
        clock.now += 600
    assert policy.budget_left() == 0
    refused = policy.admit(WEBHOOK, 1)
    assert (refused.allowed, refused.code, refused.allowed_in_s) == (False, "budget", 1800.0)
    assert run(policy, USER, 1).allowed, "a person's request is not charged to the alert captures"
    clock.now = starts[0] + 3600  # the first capture leaves the window
    assert policy.budget_left() == 1
    assert run(policy, ALERT, 1).allowed
    assert policy.admit(ALERT, 2).code == "budget"


def test_refund_gives_back_budget_and_cooldown() -> None:
    policy, _ = make(hourly_budget=1)
    nothing_found = policy.admit(ALERT, 0)
    policy.release(nothing_found, refund=True)
    assert policy.budget_left() == 1 and policy.cooldown_left(0) == 0.0
    assert run(policy, ALERT, 0).allowed
    assert policy.budget_left() == 0 and policy.cooldown_left(0) == 900.0


def test_a_refunded_user_capture_leaves_the_alert_cooldown_as_it_was() -> None:
    policy, clock = make()
    assert run(policy, ALERT, 0).allowed
    clock.now += 100
    user = policy.admit(USER, 0)  # bypasses the cooldown ...
    assert policy.cooldown_left(0) == 800.0
    policy.release(user, refund=True)  # ... and found nothing to profile
    assert policy.cooldown_left(0) == 800.0 and policy.budget_left() == 5
    assert policy.user_budget_left("alice") == 12
    assert policy.check(ALERT, 0).code == "cooldown"


def test_a_refund_restores_the_earlier_cooldown() -> None:
    policy, clock = make(cooldown="15m")
    assert run(policy, ALERT, 0).allowed
    clock.now += 1000  # over
    again = policy.admit(WEBHOOK, 0)
    assert policy.cooldown_left(0) == 900.0
    policy.release(again, refund=True)
    assert policy.cooldown_left(0) == 0.0 and policy.check(ALERT, 0).allowed


def test_the_order_of_reasons() -> None:
    policy, _ = make(hourly_budget=1, rules={"GpuLowUtilization": False})
    held = policy.admit(Trigger("alert", alertname="GpuBusyButStalled"), 0)
    assert policy.check(ALERT, 0).code == "rule", "static reasons first"
    assert policy.check(USER, 0, duration_s=99).code == "duration"
    assert policy.check(USER, 0).code == "busy"
    policy.release(held)
    assert policy.check(Trigger("alert", alertname="GpuBusyButStalled"), 0).code == "cooldown"
    assert policy.check(Trigger("alert", alertname="GpuBusyButStalled"), 1).code == "budget"


def test_concurrent_admissions_admit_exactly_one() -> None:
    policy, _ = make(hourly_budget=100)
    barrier = threading.Barrier(16)
    results: list[Decision] = []
    lock = threading.Lock()

    def ask(gpu: int) -> None:
        barrier.wait()
        decision = policy.admit(USER, gpu)
        with lock:
            results.append(decision)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(d.allowed for d in results) == 1
    assert {d.code for d in results if not d.allowed} == {"busy"}
    assert policy.user_budget_left("alice") == 11 and policy.budget_left() == 100
