"""Inhibition on the node: a firing greater alert mutes the lesser ones on its GPU in every output."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from snapshots import GIB, make_gpu, make_process, make_snapshot

from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.inhibition import EQUAL_LABELS, INHIBITS, Inhibition, inhibitors_of, target
from gpuscope.alerts.model import Transition
from gpuscope.alerts.rules import RULE_TYPES
from gpuscope.alerts.rules.held_idle import HeldIdleRule
from gpuscope.alerts.rules.low_utilization import LowUtilizationRule
from gpuscope.alerts.rules.shared_by_processes import SharedByProcessesRule
from gpuscope.exporters.alerts import AlertCollector
from gpuscope.snapshot import GpuReading, ProcessReading

WALL0 = 1_700_000_000.0
# An idle notebook: two processes holding 3 and 2 GiB, running nothing.
NOTEBOOK = (make_process(4242, name="ipykernel", memory_used_bytes=3 * GIB),
            make_process(4243, name="ipykernel", memory_used_bytes=2 * GIB))


def rules() -> list[Any]:
    return [LowUtilizationRule.configured(window=5.0, for_=5.0, clear_for=2.0),
            SharedByProcessesRule.configured(for_=5.0, clear_for=2.0),
            HeldIdleRule.configured(window=20.0, for_=0.0, clear_for=2.0, min_memory=GIB)]


def gpu(index: int, util: float, processes: tuple[ProcessReading, ...]) -> GpuReading:
    return make_gpu(index, utilization_ratio=util, processes=processes, sm_active_ratio=None,
                    idle_dips_total=0, clock_event_reasons=frozenset(), xid_errors={})


def drive(engine: AlertEngine, seconds: int, gpus: Callable[[float], list[GpuReading]], start: float = 0.0,
          ) -> list[Transition]:
    out: list[Transition] = []
    for i in range(seconds):
        t = start + i
        out += engine.observe(make_snapshot(gpus=gpus(t), monotonic=t, timestamp=WALL0 + t,
                                            interval_seconds=1.0))
    return out


def brief(transitions: Sequence[Transition]) -> list[tuple[str, int, str | None, str, str]]:
    return [(t.name, t.gpu, t.previous, t.state, t.inhibited_by) for t in transitions]


def idle_notebook(t: float) -> list[GpuReading]:
    # GPU 0 holds the idle notebook; GPU 1 runs a job at 50% (low utilization, not held idle).
    return [gpu(0, 0.001, NOTEBOOK), gpu(1, 0.5, (make_process(5000, name="train"),))]


def test_an_idle_notebook_is_one_alert_not_three(caplog: pytest.LogCaptureFixture) -> None:
    engine = AlertEngine(rules(), hostname="node-a")
    with caplog.at_level(logging.INFO, logger="gpuscope.alerts.engine"):
        early = drive(engine, 19, idle_notebook)
        # The lesser alerts fire first: their windows are shorter than GpuHeldIdle's.
        assert ("GpuLowUtilization", 0, "pending", "firing", "") in brief(early)
        assert ("GpuSharedByProcesses", 0, "pending", "firing", "") in brief(early)
        later = drive(engine, 6, idle_notebook, start=19)
    # GpuHeldIdle fires, and mutes the two on GPU 0: told once each, after the greater alert.
    assert brief(later) == [("GpuHeldIdle", 0, None, "firing", ""),
                            ("GpuLowUtilization", 0, "firing", "inhibited", "GpuHeldIdle"),
                            ("GpuSharedByProcesses", 0, "firing", "inhibited", "GpuHeldIdle")]
    # GPU 1's low utilization has no greater alert: untouched.
    by_gpu = {(a.name, a.gpu): a for a in engine.alerts()}
    assert by_gpu[("GpuLowUtilization", 1)].inhibited_by == ""
    assert by_gpu[("GpuLowUtilization", 0)].inhibited_by == "GpuHeldIdle"
    assert by_gpu[("GpuLowUtilization", 0)].state == "firing"  # its own state machine goes on
    assert by_gpu[("GpuSharedByProcesses", 0)].to_json()["inhibited_by"] == "GpuHeldIdle"
    assert by_gpu[("GpuHeldIdle", 0)].inhibited_by == ""
    lines = [r.getMessage() for r in caplog.records if "inhibited on" in r.getMessage()]
    assert len(lines) == 2 and all("GpuHeldIdle fires there and explains it" in line for line in lines)
    # The metric of firing alerts lists the greater alert only on GPU 0.
    firing = {(s.labels["alertname"], s.labels["gpu"]) for family in AlertCollector(engine).collect()
              if family.name == "gpuscope_alert_firing" for s in family.samples}
    assert firing == {("GpuHeldIdle", "0"), ("GpuLowUtilization", "1")}
    assert engine.transition_counts()[("GpuLowUtilization", "inhibited")] == 1


def test_muted_from_its_start_nothing_is_reported_until_the_greater_alert_resolves() -> None:
    # GpuHeldIdle fires before the lesser alert's condition first holds.
    held = [gpu(0, 0.001, NOTEBOOK)]
    engine_rules = [LowUtilizationRule.configured(window=10.0, for_=20.0, clear_for=2.0),
                    HeldIdleRule.configured(window=5.0, for_=0.0, clear_for=2.0, min_memory=GIB)]
    engine = AlertEngine(engine_rules, hostname="node-a")
    transitions = drive(engine, 40, lambda t: held)
    assert brief(transitions) == [("GpuHeldIdle", 0, None, "firing", "")]
    (low,) = [a for a in engine.alerts() if a.name == "GpuLowUtilization"]
    assert (low.state, low.inhibited_by) == ("firing", "GpuHeldIdle")
    # The notebook frees most of its memory: no longer held, still a low-utilization job.
    light = [gpu(0, 0.001, (make_process(4242, name="ipykernel", memory_used_bytes=GIB // 4),))]
    after = drive(engine, 4, lambda t: light, start=40)
    # The muted alert is reported as it stands now (firing), as a first report, once GpuHeldIdle resolves.
    assert brief(after) == [("GpuLowUtilization", 0, None, "firing", ""),
                            ("GpuHeldIdle", 0, "firing", "resolved", "")]


def test_an_inhibited_alert_comes_back_when_the_greater_one_resolves_and_its_end_is_not_told() -> None:
    engine = AlertEngine(rules(), hostname="node-a")
    drive(engine, 25, idle_notebook)
    # One holder leaves and the other drops below 1 GiB: GpuHeldIdle resolves, the GPU still idles.
    light = (make_process(4242, name="ipykernel", memory_used_bytes=GIB // 2),)
    back = drive(engine, 3, lambda t: [gpu(0, 0.001, light), gpu(1, 0.5, (make_process(5000),))], start=25)
    assert brief(back) == [("GpuLowUtilization", 0, "inhibited", "firing", ""),
                           ("GpuHeldIdle", 0, "firing", "resolved", "")]
    assert ("GpuSharedByProcesses", 0, "inhibited", "resolved", "") not in brief(back)
    # Re-muted, then a lesser alert's condition ends while muted (the second holder leaves; the GPU
    # stays held idle): its end is not told, as its inhibition was the last word on it.
    again = drive(engine, 25, idle_notebook, start=28)
    assert ("GpuSharedByProcesses", 0, None, "firing", "") not in brief(again)
    one_left = drive(engine, 6, lambda t: [gpu(0, 0.001, NOTEBOOK[:1]), gpu(1, 0.5, (make_process(5000),))],
                     start=53)
    assert brief(one_left) == []
    assert [a.name for a in engine.alerts() if a.gpu == 0] == ["GpuLowUtilization", "GpuHeldIdle"]


def test_the_order_names_real_rules_and_the_targets_follow_mig_instances() -> None:
    for greater, lesser in INHIBITS.items():
        assert greater in RULE_TYPES and set(lesser) <= set(RULE_TYPES), (greater, lesser)
        assert greater not in lesser
    assert inhibitors_of("GpuLowUtilization") == ("GpuHeldIdle", "GpuAllocatedUnused")
    assert inhibitors_of("GpuXidError") == ()
    assert EQUAL_LABELS == ("gpu", "gpu_instance")
    inhibition = Inhibition([("GpuHeldIdle", target(0, {"gpu_instance": "1", "mig_uuid": "MIG-a"})),
                             ("GpuLowUtilization", target(2, {}))])
    assert inhibition.inhibited_by("GpuLowUtilization", target(0, {"gpu_instance": "1"})) == "GpuHeldIdle"
    assert inhibition.inhibited_by("GpuLowUtilization", target(0, {})) == ""  # the whole GPU: not the same
    assert inhibition.inhibited_by("GpuLowUtilization", target(0, {"gpu_instance": "2"})) == ""
    assert inhibition.inhibited_by("GpuXidError", target(0, {"gpu_instance": "1"})) == ""
    assert inhibition.inhibited_by("GpuFrequentIdleDips", target(2, {})) == ""  # not an inhibiting rule
